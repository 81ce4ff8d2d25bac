"""checks (host only): output_buffers (allocation when absent, refusal of a wrong buffer before any launch) and
RunMemo."""
import pytest
import torch

from attnforge import checks


def test_allocates_out_and_lse_only_when_asked():
    out, lse = checks.output_buffers(None, None, False, (3, 4, 8), torch.float16, torch.device("cpu"), "o", "l")
    assert out.shape == (3, 4, 8) and out.dtype == torch.float16 and lse is None
    out, lse = checks.output_buffers(None, None, True, (3, 4, 8), torch.float16, torch.device("cpu"), "o", "l")
    assert lse.shape == (3, 4) and lse.dtype == torch.float32


def test_given_buffers_are_checked():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="out: expected a CUDA tensor"):
        checks.output_buffers(torch.empty(3, 4, 8), None, False, (3, 4, 8), torch.float32, cpu, "o", "l")
    with pytest.raises(ValueError, match="lse: expected a CUDA tensor"):
        checks.output_buffers(None, torch.empty(3, 4), True, (3, 4, 8), torch.float32, cpu, "o", "l")


def test_tracked_inputs_are_named_and_refused_only_in_grad_mode():
    """check_untracked names the tracked tensor, a pair's element by its index, and says how to fix the call;
    untracked tensors, None and non-tensors pass (their own checks follow), and so does anything under no_grad."""
    plain, tracked = torch.zeros(2), torch.zeros(2, requires_grad=True)
    checks.check_untracked("f", ("q", plain), ("kv", (plain, plain)), ("out", None), ("n", 3))
    with pytest.raises(ValueError, match=r"^f: kv\[1\]: expected a tensor autograd does not track \(attnforge has "
                                         r"no backward pass\), got kv\[1\].requires_grad=True with grad mode on\. "
                                         r"Call it under torch.inference_mode\(\) or torch.no_grad\(\), or pass "
                                         r"kv\[1\].detach\(\)"):
        checks.check_untracked("f", ("q", plain), ("kv", [plain, tracked]))
    with pytest.raises(ValueError, match=r"^g: q: expected"):
        checks.check_untracked("g", ("q", tracked * 2))  # (a non-leaf too)
    with torch.no_grad():
        checks.check_untracked("f", ("q", tracked), ("kv", (tracked, tracked)))


def test_overlaps_itself_matches_the_addresses_of_random_views():
    """checks.overlaps_itself against the brute force (every element's offset, distinct or not) on random strided
    views: never a false 'no' (an output some rows share would race), and exact on the layouts torch makes
    (contiguous, padded rows, permuted dims, expanded dims, slices)."""
    import itertools
    import random
    base = torch.zeros(4096)

    def shares(t):
        offs = [sum(i * st for i, st in zip(idx, t.stride())) for idx in itertools.product(*map(range, t.shape))]
        return len(set(offs)) < len(offs)

    rng = random.Random(0)
    shared = 0
    for _ in range(400):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        strides = [rng.choice([0, 1, 2, 3, 4, 5, 8, 12, 16, 40]) for _ in shape]
        t = base.as_strided(shape, strides)
        if shares(t):
            shared += 1
            assert checks.overlaps_itself(t), (shape, strides)
    assert shared >= 50  # (98 of the 400 views share an address)
    made = [torch.zeros(3, 8, 128), torch.zeros(3, 8, 136)[..., :128], torch.zeros(8, 3, 128).transpose(0, 1),
            torch.zeros(1, 8, 128).expand(3, 8, 128), torch.zeros(6, 8, 128)[::2], torch.zeros(0, 8, 128),
            torch.zeros(3, 1, 128).expand(3, 1, 128)]
    assert [checks.overlaps_itself(t) for t in made] == [False, False, False, True, False, False, False]
    assert [checks.overlaps_itself(t) for t in made] == [shares(t) for t in made]


def test_a_callers_workspace_is_carved_by_bytes_where_contiguous_and_aligned():
    """workspace_floats: any dtype and shape, contiguous and 16-byte aligned, viewed as `need` bytes of floats at its
    own address; a misaligned slice, a strided view or too few bytes are refused with what to pass instead."""
    buf = torch.zeros(4, 64)  # (float32, 2-D: its bytes count)
    ws = checks.workspace_floats(buf, 512, "BatchDecode")
    assert ws.dtype == torch.float32 and ws.numel() == 128 and ws.data_ptr() == buf.data_ptr()
    flat = buf.view(-1).view(torch.uint8)
    assert checks.workspace_floats(flat[16:], 512, "BatchMLADecode").data_ptr() == buf.data_ptr() + 16
    with pytest.raises(ValueError, match=r"BatchDecode\(workspace=...\): expected a contiguous tensor at a 16-byte "
                                         r"aligned address .*got data_ptr % 16 = 4, .*slicing it at multiples of 16"):
        checks.workspace_floats(flat[4:], 512, "BatchDecode")
    with pytest.raises(ValueError, match=r"got data_ptr % 16 = 0, strides \(64, 2\)"):
        checks.workspace_floats(buf[:, ::2], 64, "BatchDecode")
    with pytest.raises(ValueError, match=r"expected at least 2048 bytes, got 1024. Allocate "
                                         r"BatchMLADecode.workspace_bytes"):
        checks.workspace_floats(buf, 2048, "BatchMLADecode")


@pytest.mark.parametrize("kw,expected", [
    ({"persistent": "no"}, r"persistent=...\): expected None, True or False, got 'no'"),
    ({"pingpong": "yes"}, r"pingpong=...\): expected True or False, got 'yes'"),
    ({"use_cuda_graph": 1}, r"use_cuda_graph=...\): expected True or False, got 1"),
    ({"split_kv": None}, r"split_kv=...\): expected True or False, got None"),
    ({"max_batch_size": 0}, r"max_batch_size=...\): expected an int >= 1, got 0"),
    ({"max_num_pages": 1.5}, r"max_num_pages=...\): expected an int >= 1, got 1.5"),
    ({"max_work_items": "8"}, r"max_work_items=...\): expected an int >= 1, got '8'"),
    ({"max_tiles": True}, r"max_tiles=...\): expected an int >= 1, got True")])
def test_prefill_switches_and_capacities_are_checked_at_construction(kw, expected):
    """A truthy string turned an option on ("no" meant persistent), and a capacity of 0 or 1.5 waited for the
    first graph-mode plan to fail: both now fail at construction; numpy ints and None where allowed pass."""
    import numpy as np
    from attnforge import AttentionSpec, BatchPrefill
    spec = AttentionSpec(family="prefill", causal=True)
    with pytest.raises(ValueError, match="BatchPrefill\\(" + expected):
        BatchPrefill(spec, device="cpu", **kw)
    BatchPrefill(spec, device="cpu", persistent=None, tma=False, max_batch_size=np.int64(8), use_cuda_graph=False)


@pytest.mark.parametrize("kw,expected", [({"use_cuda_graph": "no"}, r"use_cuda_graph=...\): expected True or False"),
                                         ({"max_num_pages": 0}, r"max_num_pages=...\): expected an int >= 1, got 0"),
                                         ({"max_batch_size": 2.0}, r"max_batch_size=...\): expected an int >= 1")])
def test_decode_switches_and_capacities_are_checked_before_any_device_work(kw, expected):
    from attnforge import AttentionSpec, BatchDecode, BatchMLADecode
    with pytest.raises(ValueError, match=r"BatchDecode\(" + expected):
        BatchDecode(AttentionSpec(), device="cpu", **kw)
    with pytest.raises(ValueError, match=r"BatchMLADecode\(" + expected):
        BatchMLADecode(num_qo_heads=16, device="cpu", **kw)


def test_aligned_rows():
    """Kernels copy and store rows as 16-byte vectors: padded rows or an offset start are refused."""
    t = torch.zeros(6, 4, 128, dtype=torch.bfloat16)
    checks.check_aligned_rows("q", t)
    checks.check_aligned_rows("q", t[2:])  # 2 rows of 1 KB in: still aligned
    offset = torch.zeros(6 * 4 * 128 + 4, dtype=torch.bfloat16)[4:].view(6, 4, 128)
    with pytest.raises(ValueError, match=r"k: expected 16-byte aligned rows .*got data_ptr % 16 = 8"):
        checks.check_aligned_rows("k", offset)
    padded = torch.zeros(6, 4, 132, dtype=torch.bfloat16)[..., :128]
    with pytest.raises(ValueError, match=r"out: expected 16-byte aligned rows .*strides \(528, 132, 1\)"):
        checks.check_aligned_rows("out", padded)


def test_decode_pdl_flag_must_be_a_bool():
    from attnforge import AttentionSpec, BatchDecode
    with pytest.raises(ValueError, match=r"pdl=...\): expected True or False"):
        BatchDecode(AttentionSpec(), pdl="yes")  # refused before any device work


def test_float_out_flags_must_be_bools_and_only_where_a_kernel_writes_float_rows():
    from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
    with pytest.raises(ValueError, match=r"BatchDecode\(float_out=...\): expected True or False, got 'yes'"):
        BatchDecode(AttentionSpec(), float_out="yes")  # refused before any device work
    with pytest.raises(ValueError, match=r"BatchPrefill\(float_out=...\): expected True or False, got 1"):
        BatchPrefill(AttentionSpec(family="prefill"), float_out=1, device="cpu")

    class Subclass(BatchDecode):  # another family through BatchDecode's constructor (as MLA's wrapper)
        FAMILY = "mla_decode"
    with pytest.raises(ValueError, match=r"Subclass\(float_out=True\): expected float_out on BatchDecode only"):
        Subclass(AttentionSpec(family="mla_decode", num_qo_heads=16), float_out=True)
    with pytest.raises(TypeError):
        BatchMLADecode(num_qo_heads=16, float_out=True)  # (not one of its arguments: MLA writes 16-bit rows)


def test_mla_decode_pdl_flag_must_be_a_bool():
    from attnforge import BatchMLADecode
    with pytest.raises(ValueError, match=r"pdl=...\): expected True or False"):
        BatchMLADecode(num_qo_heads=16, pdl=1)  # refused before any device work


def test_cuda_device_pins_the_current_index(monkeypatch):
    """checks.cuda_device: "cuda" and None mean the current CUDA device by its index (a wrapper built with
    device="cuda" rejected tensors on cuda:0 as on another device: forty-third session), an explicit index
    stays as given, and so does "cpu" where host_ok allows it; BatchPrefill resolves through it (BatchDecode
    too: its buffers need a GPU, tests/test_decode_gpu.py::test_wrappers_built_for_cuda_take_tensors_on_cuda_0)."""
    from attnforge import AttentionSpec, BatchPrefill
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert checks.cuda_device("cuda") == torch.device("cuda", 3)
    assert checks.cuda_device(None) == torch.device("cuda", 3)
    assert checks.cuda_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert checks.cuda_device("cuda:1") == torch.device("cuda", 1)
    assert checks.cuda_device("cpu", host_ok=True) == torch.device("cpu")
    assert BatchPrefill(AttentionSpec(family="prefill"), device="cuda").device == torch.device("cuda", 3)


def test_a_wrapper_without_its_gpu_says_so_before_torch_does(monkeypatch):
    """No usable CUDA device (a CPU build of torch raises an AssertionError of its own at the wrappers' first
    device call), an index past the GPUs torch sees (an invalid ordinal at the first allocation), and "cpu" for
    a wrapper that allocates on the GPU at construction: each is named with its fix, before any device call.
    BatchPrefill, which allocates nothing until it plans, is still built there (its argument checks run first)."""
    from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
    from attnforge.kvcache import VirtualKVCache

    def no_device_call(*_, **__):
        raise AssertionError("a device call before the check")
    monkeypatch.setattr(torch.cuda, "current_device", no_device_call)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device_call)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for make, who in ((lambda: BatchDecode(AttentionSpec()), "BatchDecode"),
                      (lambda: BatchMLADecode(num_qo_heads=16), "BatchMLADecode"),
                      (lambda: BatchPrefill(AttentionSpec(family="prefill")), "BatchPrefill"),
                      (lambda: VirtualKVCache(num_layers=1, max_batch=2, max_len=64, num_kv_heads=8, head_dim=128),
                       "VirtualKVCache")):
        with pytest.raises(RuntimeError, match=f"^{who}: expected a CUDA GPU, got .*Install a CUDA build"):
            make()
    # BatchPrefill is built without a GPU for "cpu" or a named GPU (nothing allocated until it plans)
    assert BatchPrefill(AttentionSpec(family="prefill"), device="cpu").device == torch.device("cpu")
    assert BatchPrefill(AttentionSpec(family="prefill"), device="cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="^BatchDecode: expected a CUDA GPU"):
        BatchDecode(AttentionSpec(), device="cuda:0")
    with pytest.raises(ValueError, match=r"BatchDecode\(device=...\): expected a CUDA device .* got 'cpu'.*"
                                         r"pass device='cuda' or 'cuda:N'"):
        BatchDecode(AttentionSpec(), device="cpu")
    with pytest.raises(ValueError, match=r"VirtualKVCache\(device=...\): expected a CUDA device"):
        VirtualKVCache(num_layers=1, max_batch=2, max_len=64, num_kv_heads=8, head_dim=128, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"BatchMLADecode\(device=...\): expected cuda:0 to cuda:1, got 'cuda:2'"):
        BatchMLADecode(num_qo_heads=16, device="cuda:2")
    assert checks.cuda_device("cuda:1", "BatchDecode") == torch.device("cuda", 1)


def test_a_prefill_built_for_a_missing_gpu_says_so_at_its_first_gpu_step(monkeypatch):
    """BatchPrefill on a named "cuda:N" is built without a GPU (its argument checks run there), but its first step
    that needs the GPU (the SM count a split or persistent plan asks, a mask's tile lists, the plan's upload, graph
    mode's buffers) names the missing GPU, not torch's `AssertionError: Torch not compiled with CUDA enabled`. Bad
    arguments still get their own error first."""
    from attnforge import AttentionSpec, BatchPrefill, mods

    def no_device_call(*_, **__):
        raise AssertionError("a device call before the check")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device_call)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = AttentionSpec(family="prefill")
    no_gpu = "^BatchPrefill: expected a CUDA GPU, got .*Install a CUDA build"
    masked = AttentionSpec(family="prefill", score_mod=mods.sliding_window(64))  # its tiles listed on the GPU
    for s, kw in ((spec, {}), (spec, {"split_kv": False}), (spec, {"split_kv": False, "persistent": False}),
                  (masked, {})):
        w = BatchPrefill(s, device="cuda:1", **kw)
        with pytest.raises(RuntimeError, match=no_gpu):
            w.plan([0, 4, 9], [0, 9, 300])
        with pytest.raises(ValueError, match=r"qo_indptr: expected a non-decreasing"):  # checks come first
            w.plan([0, 5, 3], [0, 9, 9])
    with pytest.raises(RuntimeError, match=no_gpu):
        BatchPrefill(spec, device="cuda:1", use_cuda_graph=True, max_batch_size=4)
    host_only = BatchPrefill(spec, device="cpu")  # host-only plans (tests, host-cost timing) stay
    host_only._num_sms = 132
    host_only.plan([0, 4, 9], [0, 9, 300])
    assert host_only._plan["num_work"] > 0


def test_run_memo_derives_again_for_any_change_a_check_reads():
    memo, calls = checks.RunMemo(), []

    def derive(t):
        calls.append(t)
        if t.dtype != torch.float32:
            raise ValueError("bad dtype")
        return t.data_ptr()

    a = torch.zeros(4, 8)
    assert memo.get("x", (a,), lambda: derive(a)) == a.data_ptr()
    assert memo.get("x", (a,), lambda: derive(a)) == a.data_ptr() and len(calls) == 1  # the same tensor: kept
    assert memo.get("x", (torch.zeros(4, 8).copy_(a)[:],), lambda: derive(a)) and len(calls) == 2  # new address
    # the same address with another shape, strides or dtype is checked again, and a failure is not kept
    for other in (a[:2], a.t(), a.view(8, 4), a.view(torch.int32)):
        before = len(calls)
        try:
            memo.get("x", (other,), lambda: derive(other))
        except ValueError:
            pass
        assert len(calls) == before + 1, other.shape
    with pytest.raises(ValueError, match="bad dtype"):
        memo.get("x", (a.view(torch.int32),), lambda: derive(a.view(torch.int32)))
    assert memo.get("y", (a, None), lambda: derive(a)) == a.data_ptr()  # None is a key (an absent cache half)
    assert memo.get("y", (a, None), lambda: derive(a)) and len(calls) == 8


def test_run_memo_passes_non_tensors_to_the_check_every_time():
    memo, seen = checks.RunMemo(), []
    for _ in range(2):
        with pytest.raises(ValueError, match="expected a torch.Tensor, got list"):
            memo.get("x", ([1, 2],), lambda: (seen.append(1), checks.check_cuda("x", [1, 2]))[1])
    assert len(seen) == 2


def test_run_memo_keeps_plain_values_only_per_role():
    memo = checks.RunMemo()
    made = []
    assert memo.once("params", lambda: made.append(1) or "T") == "T"
    assert memo.once("params", lambda: made.append(1) or "U") == "T" and made == [1]
    assert memo.once("lib", lambda: 7) == 7  # another role: its own entry


def test_run_memo_failure_is_not_chained_to_a_key_error():
    """A failed make() (a kernel load out of memory, seen in the sixty-sixth session's fuzz under memcheck) shows
    its own error, not 'During handling of KeyError: lib'; and the next call tries again."""
    memo = checks.RunMemo()

    def fail():
        raise RuntimeError("load failed")
    for role in ("lib", "lib"):
        with pytest.raises(RuntimeError, match="load failed") as err:
            memo.once(role, fail)
        assert err.value.__context__ is None and err.value.__cause__ is None
    assert memo.once("lib", lambda: 3) == 3
    with pytest.raises(RuntimeError) as err:  # (get() had it right already)
        memo.get("x", (torch.zeros(1),), fail)
    assert err.value.__context__ is None


def test_run_memo_keeps_each_layers_cache(monkeypatch):
    memo, calls = checks.RunMemo(), []
    layers = [torch.zeros(2, 3) for _ in range(40)]
    for _ in range(3):  # three steps of 40 layers: each cache is checked once
        for t in layers:
            assert memo.get("kv", (t,), lambda: calls.append(1) or t.data_ptr()) == t.data_ptr()
    assert len(calls) == 40
    monkeypatch.setattr(checks.RunMemo, "MAX_ENTRIES", 4)  # a full table starts over, still right
    small = checks.RunMemo()
    for _ in range(2):
        for t in layers[:6]:
            assert small.get("kv", (t,), lambda: t.data_ptr()) == t.data_ptr()
    assert len(small._inputs) <= 4


def test_run_memo_new_plan_drops_plan_values_only():
    memo, calls = checks.RunMemo(), []
    t = torch.zeros(2, 3)
    memo.get("kv", (t,), lambda: calls.append(1), 16)
    assert memo.once("params", lambda: "A") == "A"
    memo.new_plan()
    assert memo.once("params", lambda: "B") == "B"  # made again for the new plan
    memo.get("kv", (t,), lambda: calls.append(1), 16)  # the same input and page size: still checked
    memo.get("kv", (t,), lambda: calls.append(1), 64)  # another page size: checked again
    assert len(calls) == 2


def _wrappers():
    """Each wrapper that takes a spec, as a function of it (the other arguments valid where a check reads them)."""
    import attnforge
    from attnforge.cascade import CascadeDecode
    from attnforge.sparse import QuestDecode, QuestHeadDecode
    return {"BatchDecode": (attnforge.BatchDecode, "decode"),
            "BatchMLADecode": (attnforge.BatchMLADecode, "mla_decode"),
            "BatchPrefill": (attnforge.BatchPrefill, "prefill"), "CascadeDecode": (CascadeDecode, "decode"),
            "QuestDecode": (lambda spec: QuestDecode(spec, None, 64, 16), "decode"),
            "QuestHeadDecode": (lambda spec: QuestHeadDecode(spec, None, 64, 16), "decode")}


@pytest.mark.parametrize("name", sorted(_wrappers()))
def test_each_wrapper_names_a_spec_that_is_not_one_or_of_another_family(name):
    """A wrapper given an int, a string or the AttentionSpec class says what it wanted (was an AttributeError on
    .family, naming nothing), and a spec of another family is refused by that family."""
    from attnforge import AttentionSpec
    make, family = _wrappers()[name]
    for bad, shown in ((5, "int 5"), ("decode", "str 'decode'"), (AttentionSpec, "type")):
        with pytest.raises(TypeError, match=rf"{name}\(spec=...\): expected an AttentionSpec\(family='{family}'.*"
                                            rf"got {shown}.*attnforge.AttentionSpec\(family='{family}'"):
            make(bad)
    other = AttentionSpec(family="prefill" if family != "prefill" else "decode", num_qo_heads=16, num_kv_heads=16)
    with pytest.raises(ValueError, match=rf"{name} spec.family: expected '{family}', got '{other.family}'"):
        make(other)


@pytest.mark.parametrize("workspace", [1 << 20, "auto", True, [0] * 16])
def test_a_workspace_that_is_not_a_tensor_is_named(workspace):
    """(It was read for its .device: an AttributeError naming nothing.)"""
    import attnforge
    for cls, spec in ((attnforge.BatchDecode, attnforge.AttentionSpec()),
                      (attnforge.BatchMLADecode, attnforge.AttentionSpec(family="mla_decode", num_qo_heads=16,
                                                                         num_kv_heads=1, head_dim_qk=576,
                                                                         head_dim_vo=512))):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(workspace=...\): expected None or a CUDA tensor.*"
                                            rf"Leave it out"):
            cls(spec, workspace)

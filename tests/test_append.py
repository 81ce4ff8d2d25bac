"""attnforge.append on the CPU: its checks (every bad input refused before a launch, CPU tensors included)
and the torch formulation in attnforge.reference, against a token-by-token loop. The kernel itself:
tests/test_append_gpu.py; its compile: tests/jit/test_build.py."""
import pytest
import torch

import attnforge
from attnforge import reference
from attnforge.append import AppendSpec

FP8 = torch.float8_e4m3fn


def table(lengths, page, num_pages, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lengths]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.randperm(num_pages, generator=g)[: int(indptr[-1])].int()
    batch = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return indptr, indices, batch, pos


def loop_append(k, v, batch, pos, kc, vc, indices, indptr, layout, k_scale=1.0, v_scale=1.0):
    """One token at a time, as the docstring says."""
    page = kc.shape[1] if layout == "NHD" else kc.shape[2]
    for i in range(k.shape[0]):
        b, p = int(batch[i]), int(pos[i])
        pid, off = int(indices[int(indptr[b]) + p // page]), p % page
        for cache, x, s in ((kc, k[i], k_scale), (vc, v[i], v_scale)):
            row = reference.quantize_rows(x, s, cache.dtype)
            if layout == "NHD":
                cache[pid, off] = row
            else:
                cache[pid, :, off] = row


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 7, 16])
def test_reference_append_matches_a_token_loop(layout, page):
    lengths, hkv, d = [5, 0, 23, 1], 2, 16
    num_pages = sum(-(-n // page) for n in lengths) + 3
    indptr, indices, batch, pos = table(lengths, page, num_pages)
    shape = (num_pages, 2, page, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, page, d)
    cache = torch.randn(shape).bfloat16()
    original = cache.clone()
    k, v = torch.randn(len(batch), hkv, d).bfloat16(), torch.randn(len(batch), hkv, d).bfloat16()
    want = cache.clone()
    loop_append(k, v, batch, pos, want[:, 0], want[:, 1], indices, indptr, layout)
    reference.append_paged_kv(k, v, batch, pos, cache, indices, indptr, layout)
    assert torch.equal(cache, want) and not torch.equal(cache, original)  # (the loop did write)


def test_reference_quantizes_by_division_and_saturates():
    x = torch.tensor([0.1, -3.0, 1000.0, -1e6, 448.0, 0.0]).bfloat16()
    q = reference.quantize_rows(x, 0.5, FP8)
    assert q.dtype == FP8
    assert q.float().tolist()[2:] == [448.0, -448.0, 448.0, 0.0]  # saturated, not NaN
    assert q[1].float().item() == -6.0 and abs(q[0].float().item() - 0.2) < 0.02
    assert reference.quantize_rows(x, 1.0, torch.bfloat16) is x


def test_reference_slots_skip_negative_ones_and_mla_writes_both_parts():
    page, hkv, d = 4, 1, 8
    cache = torch.zeros(3, 2, page, hkv, d)
    k, v = torch.arange(3 * d, dtype=torch.float32).view(3, 1, d), -torch.ones(3, 1, d)
    reference.append_kv_slots(k, v, torch.tensor([5, -1, 11]), cache)
    assert torch.equal(cache[1, 0, 1, 0], k[0, 0]) and torch.equal(cache[2, 0, 3, 0], k[2, 0])
    assert cache[:, 0].abs().sum() == k[0].sum() + k[2].sum() and cache[:, 1].sum() == -2 * d
    indptr, indices, batch, pos = table([3, 2], 2, 4)
    ckv, kpe = torch.randn(5, 512), torch.randn(5, 64)
    unified = torch.zeros(4, 2, 576)
    reference.append_paged_mla(ckv, kpe, batch, pos, unified, None, indices, indptr)
    pair = (torch.zeros(4, 2, 512), torch.zeros(4, 2, 64))
    reference.append_paged_mla(ckv, kpe, batch, pos, pair[0], pair[1], indices, indptr)
    assert torch.equal(unified, torch.cat(pair, -1))
    first = int(indices[0])
    assert torch.equal(unified[first, 0], torch.cat([ckv[0], kpe[0]]))


def test_spec_takes_each_type_into_its_own_cache_or_fp8():
    assert not AppendSpec(torch.float16, torch.float16).quantizes and AppendSpec(torch.bfloat16, FP8).quantizes
    assert AppendSpec(FP8, FP8).name == "append_kv_fp8e4m3_to_fp8e4m3"
    for src, cache, msg in ((torch.float32, torch.float32, "src_dtype"), (torch.bfloat16, torch.float16, "cache dtype"),
                            (FP8, torch.bfloat16, "cache dtype")):
        with pytest.raises(ValueError, match=msg):
            AppendSpec(src, cache)
    assert "append_kv_kernel" in AppendSpec(torch.bfloat16, FP8).module().source


def cpu_case(n=4, hkv=2, d=16, page=4, dtype=torch.bfloat16):
    indptr, indices, batch, pos = table([n], page, 4)
    cache = torch.zeros(4, 2, page, hkv, d, dtype=dtype)
    k = torch.randn(n, hkv, d).to(torch.bfloat16)
    return dict(k=k, v=k.clone(), batch_indices=batch, positions=pos, kv_cache=cache, kv_indices=indices,
                kv_indptr=indptr)


@pytest.mark.parametrize("change, msg", [
    (dict(kv_layout="NDH"), "kv_layout"),
    (dict(kv_cache=torch.zeros(4, 3, 4, 2, 16)), "kv_cache.shape"),
    (dict(kv_cache=(torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 8))), "equal 4-D shapes"),
    (dict(kv_cache=(torch.zeros(4, 4, 2, 16).bfloat16(), torch.zeros(4, 4, 2, 16).half())), "kv_cache\\[1\\].dtype"),
    (dict(k=torch.zeros(4, 2, 8).bfloat16()), "k.shape"),
    (dict(v=torch.zeros(3, 2, 16).bfloat16()), "v.shape"),
    (dict(k="k"), "k: expected a torch.Tensor"),
    (dict(batch_indices=torch.zeros(4, dtype=torch.float32)), "batch_indices.dtype"),
    (dict(positions=torch.zeros(5, dtype=torch.int32)), "positions.shape"),
    (dict(kv_indptr=torch.zeros(0, dtype=torch.int32)), "kv_indptr.shape"),
    (dict(kv_indices=torch.zeros(2, 2, dtype=torch.int32)), "kv_indices.shape"),
    (dict(k=torch.zeros(4, 2, 16).half()), "k cache dtype"),
    (dict(k=torch.zeros(4, 2, 16)), "k.dtype"),
    (dict(k_scale=2.0), "k_scale: expected 1.0"),
    (dict(kv_cache=torch.zeros(4, 2, 4, 2, 16, dtype=FP8), v_scale=-1.0), "v_scale: expected a finite float > 0"),
    (dict(kv_cache=torch.zeros(4, 2, 4, 2, 16, dtype=FP8), k_scale=float("nan")), "k_scale"),
    (dict(kv_cache=torch.zeros(4, 2, 4, 2, 16, dtype=FP8), k_scale=1e39), "k_scale: expected a finite float > 0, "
     r"got 1e\+39"),  # (past float32: the kernel would divide by inf)
    (dict(k=torch.zeros(4, 2, 20).bfloat16()[..., :16]), "k: expected rows of contiguous elements"),
    (dict(k=torch.zeros(4, 2, 16).bfloat16().transpose(1, 2).contiguous().transpose(1, 2)), "k: expected rows"),
    (dict(kv_cache=torch.zeros(4, 2, 4, 2, 20).bfloat16()[..., :16]), "k cache: expected rows"),
    (dict(kv_cache=torch.zeros(4, 2, 4, 2, 12).bfloat16(), k=torch.zeros(4, 2, 12).bfloat16(),
          v=torch.zeros(4, 2, 12).bfloat16()), "head dim: expected a multiple of 8"),
])
def test_bad_inputs_are_refused_before_the_launch(change, msg):
    args = cpu_case()
    args.update(change)
    with pytest.raises(ValueError, match=msg):
        attnforge.append_paged_kv_cache(**args)


def test_valid_cpu_tensors_reach_the_device_check():
    with pytest.raises(ValueError, match="k: expected a CUDA tensor"):
        attnforge.append_paged_kv_cache(**cpu_case())
    c = cpu_case()
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        attnforge.append_kv_by_slots(c["k"], c["v"], torch.zeros(3, dtype=torch.int32), c["kv_cache"])
    with pytest.raises(ValueError, match="k: expected a CUDA tensor"):
        attnforge.append_kv_by_slots(c["k"], c["v"], torch.zeros(4, dtype=torch.int64), c["kv_cache"])


@pytest.mark.parametrize("change, msg", [
    (dict(ckv_cache=torch.zeros(4, 2, 500)), "ckv_cache.shape"),
    (dict(kpe_cache=torch.zeros(4, 2, 64)), "ckv_cache.shape"),  # a pair needs a 512-wide ckv cache
    (dict(ckv_cache=torch.zeros(4, 2, 512), kpe_cache=torch.zeros(4, 3, 64)), "kpe_cache.shape"),
    (dict(ckv_cache=torch.zeros(4, 2, 512), kpe_cache=torch.zeros(4, 2, 64).half()), "kpe_cache.dtype"),
    (dict(kpe=torch.zeros(2, 32).bfloat16()), "kpe.shape"),
    (dict(kv_scale=3.0), "kv_scale: expected 1.0"),
    (dict(ckv_cache=torch.zeros(4, 2, 576).half()), "ckv cache dtype"),
    (dict(ckv=torch.zeros(2, 512)), "ckv.dtype"),
])
def test_mla_bad_inputs(change, msg):
    indptr, indices, batch, pos = table([2], 2, 4)
    args = dict(ckv=torch.zeros(2, 512).bfloat16(), kpe=torch.zeros(2, 64).bfloat16(), batch_indices=batch,
                positions=pos, ckv_cache=torch.zeros(4, 2, 576).bfloat16(), kpe_cache=None, kv_indices=indices,
                kv_indptr=indptr)
    args.update(change)
    with pytest.raises(ValueError, match=msg):
        attnforge.append_paged_mla_kv_cache(**args)


def test_a_repeated_call_launches_its_first_params_without_the_checks(monkeypatch):
    """An engine appends from the same buffers into the same cache every layer: the second call with an equal
    signature launches the packed params again and skips the checks; another scale, a bool scale (refused),
    another tensor or check_indices=True take the full path."""
    from attnforge import append
    from helpers import stub_launches
    rec = stub_launches(monkeypatch)
    monkeypatch.setattr(append, "_LAUNCHES", {})
    checked = []
    real = append._kv_streams
    monkeypatch.setattr(append, "_kv_streams", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    args = cpu_case()
    attnforge.append_paged_kv_cache(**args)
    attnforge.append_paged_kv_cache(**args)
    assert len(checked) == 1 and len(rec.launches) == 2
    assert bytes(rec.launches[0][2]) == bytes(rec.launches[1][2]) and rec.launches[0][1] == rec.launches[1][1]
    attnforge.append_paged_kv_cache(**{**args, "k": args["k"].clone()})  # another address: checked, launched
    assert len(checked) == 2 and bytes(rec.launches[2][2]) != bytes(rec.launches[0][2])
    with pytest.raises(ValueError, match="k_scale"):
        attnforge.append_paged_kv_cache(**args, k_scale=True)
    with pytest.raises(ValueError, match="k_scale: expected 1.0"):
        attnforge.append_paged_kv_cache(**args, k_scale=2.0)
    assert len(rec.launches) == 3


def test_slots_and_mla_calls_repeat_too(monkeypatch):
    from attnforge import append
    from helpers import stub_launches
    rec = stub_launches(monkeypatch)
    monkeypatch.setattr(append, "_LAUNCHES", {})
    c = cpu_case()
    slots = torch.tensor([0, 3, -1, 5])
    for _ in range(2):
        attnforge.append_kv_by_slots(c["k"], c["v"], slots, c["kv_cache"])
    indptr, indices, batch, pos = table([2], 2, 4)
    mla = dict(ckv=torch.zeros(2, 512).bfloat16(), kpe=torch.zeros(2, 64).bfloat16(), batch_indices=batch,
               positions=pos, ckv_cache=torch.zeros(4, 2, 576).bfloat16(), kpe_cache=None, kv_indices=indices,
               kv_indptr=indptr)
    for _ in range(2):
        attnforge.append_paged_mla_kv_cache(**mla)
    assert len(append._LAUNCHES) == 2 and len(rec.launches) == 4
    assert bytes(rec.launches[0][2]) == bytes(rec.launches[1][2])
    assert bytes(rec.launches[2][2]) == bytes(rec.launches[3][2])


def test_append_kernels_fit_the_occupancy_their_sizes_assume():
    """Each append kernel compiled for sm_90a (cached by the variant-matrix build): no local memory, one unit a
    thread at six CTAs an SM and the wide kernel at five (its launch bounds: ptxas alone fits four, which
    measured 2-3% slower), the two the size rule's comment and its switch point are measured with."""
    from attnforge.jit import build_many
    from attnforge.jit.cubin import kernel_resources
    from attnforge.presets import PRESETS
    specs = [s for s in PRESETS["append"]() if s.name in (
        "append_kv_bf16_to_bf16", "append_kv_fp16_to_fp8e4m3", "append_kv_fp8e4m3_to_fp8e4m3")]
    assert len(specs) == 3
    for spec, path in zip(specs, build_many([s.module() for s in specs], ("9.0a",))):
        res = kernel_resources(path.read_bytes())
        for name, ctas in (("append_kv_kernel", 6), ("append_kv_kernel_wide", 5)):
            assert res[name].frame_bytes == 0, f"{spec.name}: {name} spills"
            assert res[name].ctas_by_registers(256) >= ctas, f"{spec.name}: {name} {res[name].registers} registers"


def test_params_carry_the_divisors_and_which_rows_are_dense(monkeypatch):
    """What the kernels divide by comes packed as fast_div's (mul, shift) pairs, and dense_rows marks the streams
    whose heads lie back to back (bit 2 * dst + stream), so a unit's offset skips the head division: an NHD cache
    and contiguous tokens are dense, an HND cache's rows and a strided source are not, one head always is."""
    from attnforge import append, intdiv
    from helpers import stub_launches
    rec = stub_launches(monkeypatch)
    monkeypatch.setattr(append, "_LAUNCHES", {})
    c = cpu_case(n=4, hkv=2, d=16, page=4)
    attnforge.append_paged_kv_cache(**c)
    p = rec.launches[-1][2]
    assert p.dense_rows == 0b1111
    units = 2 * (16 + 16) // 8
    for name, d in (("chunks0", 2), ("chunks1", 2), ("page", 4), ("per_token1", units),
                    ("per_token_wide", -(-units // append.UNITS_PER_THREAD))):
        assert (getattr(p, f"{name}_mul"), getattr(p, f"{name}_shift")) == intdiv.divisor(d), name
    attnforge.append_paged_kv_cache(**{**c, "kv_cache": torch.zeros(4, 2, 2, 4, 16).bfloat16()}, kv_layout="HND")
    assert rec.launches[-1][2].dense_rows == 0b0011
    wide_k = torch.randn(4, 2, 32).bfloat16()
    attnforge.append_paged_kv_cache(**{**c, "k": wide_k[:, :, :16]})  # rows 32 apart, heads 32 apart: k not dense
    assert rec.launches[-1][2].dense_rows == 0b1110
    one = cpu_case(n=4, hkv=1, d=16, page=4)
    attnforge.append_paged_kv_cache(**{**one, "kv_cache": torch.zeros(4, 2, 1, 4, 16).bfloat16()}, kv_layout="HND")
    assert rec.launches[-1][2].dense_rows == 0b1111  # one head: its offset is the column whatever the strides

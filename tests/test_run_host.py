"""run() of the decode and MLA wrappers on a machine without a GPU: the driver, the device checks and the
library are stubbed, and the launched params struct is read back. Each run must carry its own tensors'
addresses and strides over the plan's fixed fields (checks.RunMemo, codegen.ParamsTemplate), and a new plan
must rebuild the fixed ones."""
import math

import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, BatchMLADecode
from helpers import count_calls, stub_launches


@pytest.fixture
def recorder(monkeypatch):
    return stub_launches(monkeypatch)


def host_wrapper(cls, spec):
    w = cls.host_only(spec)
    w.pdl, w.launch_after_own_kernel = True, False
    w._partial_o, w._partial_lse, w._merge_count = torch.zeros(64), torch.zeros(16), torch.zeros(4, dtype=torch.int32)
    return w


def assert_plan_fields(w, p):
    """The fields plan() fixes in every stream kernel: its copied buffers and the partial states."""
    from attnforge.decode import PLAN_BUFFERS
    assert [getattr(p, n) for n in PLAN_BUFFERS] == [w._dev_ptr(n) for n in PLAN_BUFFERS]
    assert (p.partial_o, p.partial_lse) == (w._partial_o.data_ptr(), w._partial_lse.data_ptr())
    assert p.v_scale == 1.0 and p.sm_scale == pytest.approx(w._plan["sm_scale"])


def plan(w, pages, page_size):
    w.plan(np.array([0, pages], np.int32), np.arange(pages, dtype=np.int32), np.array([5], np.int32),
           page_size=page_size)
    w._upload.dev = torch.zeros(1 << 16, dtype=torch.int32)  # (the host-only upload has no device copy)


def test_decode_runs_carry_their_own_tensors_over_the_plans_fields(recorder):
    w = host_wrapper(BatchDecode, AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    plan(w, 4, 16)
    q, caches = torch.randn(1, 32, 128).bfloat16(), [torch.randn(6, 2, 16, 8, 128).bfloat16() for _ in range(2)]
    for cache in (caches[0], caches[1], caches[0]):
        out = w.run(q, cache)
        p = recorder.launches[-1][2]
        assert (p.q, p.k_cache, p.v_cache, p.out) == (q.data_ptr(), cache[:, 0].data_ptr(), cache[:, 1].data_ptr(),
                                                       out.data_ptr())
        strides = (p.q_stride_b, p.stride_page, p.stride_token, p.stride_head)
        assert strides == (32 * 128, 2 * 16 * 8 * 128, 8 * 128, 128)
        assert (p.page_size, p.num_qo_heads, p.merge_count) == (16, 32, w._merge_count.data_ptr())
        assert p.sm_scale == pytest.approx(1 / math.sqrt(128))
        assert_plan_fields(w, p)
    k, v = caches[1][:, 0], caches[1][:, 1]
    p = (w.run(q, (k, v)), recorder.launches[-1][2])[1]
    assert (p.k_cache, p.v_cache) == (k.data_ptr(), v.data_ptr())
    plan(w, 2, 32)  # a new plan: its own fixed fields; the 16-token caches no longer pass
    with pytest.raises(ValueError, match="k_cache.shape"):
        w.run(q, caches[0])
    cache32 = torch.randn(3, 2, 32, 8, 128).bfloat16()
    w.run(q, cache32)
    p = recorder.launches[-1][2]
    assert (p.page_size, p.k_cache, p.stride_token) == (32, cache32.data_ptr(), 8 * 128)
    assert_plan_fields(w, p)  # (the new plan's buffers)
    with pytest.raises(ValueError, match="q.dtype"):  # a checked input changed in place of another: checked again
        w.run(q.half(), cache32)


@pytest.mark.parametrize("unified", [False, True])
def test_mla_runs_carry_their_own_tensors_over_the_plans_fields(recorder, unified):
    w = host_wrapper(BatchMLADecode, AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1,
                                                   head_dim_qk=576, head_dim_vo=512, pipeline="normal",
                                                   ))
    plan(w, 2, 64)
    q_nope, q_pe = torch.randn(1, 16, 512).bfloat16(), torch.randn(1, 16, 64).bfloat16()
    kv = [torch.randn(3, 64, 576).bfloat16() for _ in range(2)]
    for cache in (kv[0], kv[1]):
        caches = (cache,) if unified else (cache[..., :512], cache[..., 512:])
        out = w.run(q_nope, q_pe, *caches)
        p = next(params for name, _, params in reversed(recorder.launches) if name == "mla_decode_kernel")
        assert (p.q_nope, p.q_pe, p.out, p.ckv_cache) == (q_nope.data_ptr(), q_pe.data_ptr(), out.data_ptr(),
                                                          cache.data_ptr())
        assert p.kpe_cache == cache.data_ptr() + 512 * 2 and (p.ckv_stride_page, p.ckv_stride_token) == (64 * 576, 576)
        assert (p.page_size, p.q_len, p.partial_scale) == (64, 1, w._partial_scale_ptr())
        assert_plan_fields(w, p)
    with pytest.raises(ValueError, match="page ids <"):
        w.run(q_nope, q_pe, *((kv[0][:1],) if unified else (kv[0][:1, :, :512], kv[0][:1, :, 512:])))


def test_repeated_inputs_skip_the_checks_and_a_new_plan_keeps_them(recorder, monkeypatch):
    """The fast path (the reason for RunMemo): a cache and a q seen before, under the same batch and page size,
    are not checked again, across plans too; each layer's cache is checked once."""
    from attnforge import paged
    calls = count_calls(monkeypatch, paged, "split_cache")
    w = host_wrapper(BatchDecode, AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    q, layers = torch.randn(1, 32, 128).bfloat16(), [torch.randn(6, 2, 16, 8, 128).bfloat16() for _ in range(4)]
    for step in range(3):
        plan(w, 4, 16)
        for cache in layers:
            w.run(q, cache)
    assert calls["n"] == len(layers)
    assert len(recorder.launches) == 3 * len(layers)


@pytest.mark.parametrize("cls", [BatchDecode, BatchMLADecode])
def test_graph_mode_plans_name_only_pages_of_the_captured_caches(recorder, monkeypatch, cls):
    """A replay reads the cache its run captured, with no run() to check page ids: in a graph-mode wrapper, a plan
    naming a page past the fewest pages a captured run read is refused (eager runs do not bound it)."""
    mla = cls is BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         pipeline="normal") if mla else AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    w = host_wrapper(cls, spec)
    w.use_cuda_graph = True
    page = 64 if mla else 16
    shapes = [(1, 16, 512), (1, 16, 64)] if mla else [(1, 32, 128)]
    q = [torch.randn(s).bfloat16() for s in shapes]
    cache_shape = (64, 576) if mla else (2, 16, 8, 128)

    def cache(pages):
        return torch.randn(pages, *cache_shape).bfloat16()

    def plan_pages(ids):
        w.plan(np.array([0, len(ids)], np.int32), np.array(ids, np.int32), np.array([5], np.int32), page_size=page)
        w._upload.dev = torch.zeros(1 << 16, dtype=torch.int32)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    plan_pages([0, 1])
    w.run(*q, cache(4))  # eager: no bound
    plan_pages([6, 7])
    capturing["now"] = True
    for pages in (10, 8, 9):  # each layer's cache: the fewest pages bound the plans
        w.run(*q, cache(pages))
    plan_pages([7, 3])
    with pytest.raises(ValueError, match=r"page ids < 8 \(the pages of the cache a captured graph reads\)"):
        plan_pages([8, 0])


@pytest.mark.parametrize("cls", [BatchDecode, BatchMLADecode])
def test_given_out_and_lse_are_checked_once_per_layout(recorder, monkeypatch, cls):
    """A caller's out and lse buffers are checked at their first run and again only when their address, shape,
    strides, dtype or device differ (a view at the same address in another dtype is refused)."""
    from attnforge import checks
    calls = count_calls(monkeypatch, checks, "check_out")
    mla = cls is BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         pipeline="normal") if mla else AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    w = host_wrapper(cls, spec)
    plan(w, 2, 64 if mla else 16)
    heads, d = (16, 512) if mla else (32, 128)
    shapes = [(1, 16, 512), (1, 16, 64), (3, 64, 576)] if mla else [(1, 32, 128), (6, 2, 16, 8, 128)]
    inputs = [torch.randn(s).bfloat16() for s in shapes]
    out, lse = torch.empty(1, heads, d).bfloat16(), torch.empty(1, heads)
    for _ in range(3):
        assert w.run(*inputs, out=out, lse=lse, return_lse=True)[0] is out
    assert calls["n"] == 1
    with pytest.raises(ValueError, match="out.dtype"):
        w.run(*inputs, out=out.view(torch.float16))
    with pytest.raises(ValueError, match="lse.shape"):
        w.run(*inputs, out=out, lse=lse[:, :-1], return_lse=True)
    w.run(*inputs, out=out)
    assert calls["n"] == 2


def test_a_modifiers_runtime_values_reach_each_launch(recorder):
    """A modifier's captured scalar and tensor are kernel parameters, set by each run over the plan's template."""
    from attnforge import mods
    scale, slopes = torch.tensor(0.5), torch.rand(32)
    mod = mods.compile_mod(score_mod=lambda s, b, h, q_idx, kv_idx: s * scale + slopes[h] * (kv_idx - q_idx))
    w = host_wrapper(BatchDecode, AttentionSpec(num_qo_heads=32, num_kv_heads=8, score_mod=mod))
    q, cache = torch.randn(1, 32, 128).bfloat16(), torch.randn(6, 2, 16, 8, 128).bfloat16()
    for pages in (4, 5):  # two plans: each template takes the values again
        plan(w, pages, 16)
        for _ in range(2):
            w.run(q, cache)
            p = recorder.launches[-1][2]
            assert (p.mod_s0, p.mod_t0, p.mod_t0_size0) == (0.5, slopes.data_ptr(), 32)
            assert_plan_fields(w, p)


def test_check_inputs_refuses_modifier_tensors_on_another_device(recorder):
    """check_inputs (run()'s checks, which Quest calls before its scoring launches) also checks the tensors a
    modifier's kernels read by address, here sink logits: on another device, refused before any launch."""
    from attnforge import mods
    q, cache = torch.randn(1, 32, 128).bfloat16(), torch.randn(6, 2, 16, 8, 128).bfloat16()
    for device, refused in (("meta", True), ("cpu", False)):
        sink = mods.attention_sink(torch.zeros(32, device=device))
        spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, score_mod=sink)
        w = host_wrapper(BatchDecode, spec)
        plan(w, 4, 16)
        if refused:
            with pytest.raises(ValueError, match="attention sink logits: expected a tensor on cpu, got meta"):
                w.check_inputs(q, cache)
            with pytest.raises(ValueError, match="attention sink logits"):
                w.run(q, cache)
            assert not recorder.launches
        else:
            w.run(q, cache)
            assert recorder.launches[-1][2].mod_sink == spec.score_mod.sink.data_ptr()

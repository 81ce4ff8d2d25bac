"""The decode kernels over K/V that are not paged (attnforge/dense_decode.py), on a machine without a GPU: the
wrappers are host-only and each launch's params are read back. attention()'s one-query calls and causal verify
steps (ATTNFORGE_ATTENTION_DECODE=1) reach the kernel with K and V in place (a sliced static cache too), as an HND
cache of one page a request; masks, other shapes and the knob's default stay on the prefill kernels.
BatchDecode.run_narrowed packs what run() packs; single_decode reads one request as one page."""
import math

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchDecode, dense, dense_decode
from helpers import count_calls, stub_host_prefill
from test_prefill_run_host import fake_map


def host_decode(spec: AttentionSpec, device, batch: int, q_len: int = 1) -> BatchDecode:
    w = BatchDecode.host_only(spec, max_batch_size=batch, max_num_pages=batch, max_q_len=q_len)
    w.pdl, w.launch_after_own_kernel = True, False
    w._partial_o, w._partial_lse, w._merge_count = torch.zeros(64), torch.zeros(16), torch.zeros(4, dtype=torch.int32)
    return w


@pytest.fixture
def recorder(monkeypatch):
    rec = stub_host_prefill(monkeypatch, fake_map)
    monkeypatch.setattr(dense_decode, "make_wrapper", host_decode)
    monkeypatch.setattr(dense, "_CALLS", {})
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "1")
    return rec


def static_cache(batch=2, hkv=2, max_len=300, d=128, seed=0):
    """A model's preallocated K and V [B, Hkv, max_len, D]: a step reads the first Lk positions of each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, hkv, max_len, d, generator=g).bfloat16() for _ in range(2)]


def one_query(batch=2, hq=8, d=128, seed=1):
    return torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_a_sliced_static_cache_reaches_the_decode_kernel_in_place(recorder):
    kc, vc = static_cache()
    k, v, q = kc[:, :, :100], vc[:, :, :100], one_query()
    out, lse = dense.attention(q, k, v, enable_gqa=True, return_lse=True)
    call = dense.dense_call(q, k, v, None, True)
    assert isinstance(call, dense_decode.DecodeCall)
    w = call.wrapper
    name, _, p = recorder.launches[-1]
    assert name == "batch_decode_kernel"
    assert w.spec.family == "decode" and w.spec.kv_layout == "HND" and w.spec.group_size == 4
    assert (out.shape, lse.shape) == ((2, 8, 1, 128), (2, 8, 1))
    assert (p.q, p.k_cache, p.v_cache, p.out, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                         lse.data_ptr())
    # one page a request: page b is request b's [Hkv, Lk, D] block, read with the cache's own strides
    assert (p.stride_page, p.stride_head, p.stride_token) == (2 * 300 * 128, 300 * 128, 128)
    assert (p.q_stride_b, p.q_stride_h, p.out_stride_b, p.out_stride_h) == (8 * 128, 128, 8 * 128, 128)
    assert p.page_size == 100 and p.sm_scale == pytest.approx(1 / math.sqrt(128))
    assert (w._plan["batch"], w._plan["page_size"], w._plan["max_page"]) == (2, 100, 1)
    region = w._device_region  # (host memory: the host-only upload's copy is a memmove)
    assert (region("kv_indptr").tolist(), region("kv_len").tolist(), region("kv_indices")[:2].tolist()) == \
        ([0, 1, 2], [100, 100], [0, 1])


def test_one_query_calls_plan_once_per_signature_and_scale(recorder, monkeypatch):
    plans = count_calls(monkeypatch, BatchDecode, "plan")
    kc, vc = static_cache()
    q = one_query()
    for _ in range(3):
        dense.attention(q, kc[:, :, :100], vc[:, :, :100], enable_gqa=True)
    assert plans["n"] == 1
    dense.attention(q, kc[:, :, :100], vc[:, :, :100], enable_gqa=True, scale=0.25)
    assert plans["n"] == 2 and recorder.launches[-1][2].sm_scale == 0.25
    dense.attention(q, kc[:, :, :101], vc[:, :, :101], enable_gqa=True, scale=0.25)  # another Lk: its own plan
    assert plans["n"] == 3 and recorder.launches[-1][2].page_size == 101
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "0")
    dense.attention(q, kc[:, :, :100], vc[:, :, :100], enable_gqa=True, scale=0.25)
    assert recorder.launches[-1][0] != "batch_decode_kernel" and plans["n"] == 3
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "1")  # the decode call of that signature was kept
    dense.attention(q, kc[:, :, :100], vc[:, :, :100], enable_gqa=True, scale=0.25)
    assert recorder.launches[-1][0] == "batch_decode_kernel" and plans["n"] == 3


def test_other_shapes_and_the_default_stay_on_the_prefill_kernels(recorder, monkeypatch):
    kc, vc = static_cache()
    q = one_query()
    k, v = kc[:, :, :64].contiguous(), vc[:, :, :64].contiguous()
    for q_, k_, v_ in ((torch.cat([q, q], dim=2), k, v),  # two queries a request
                       (q, k[:, :, :0], v[:, :, :0])):  # no keys: zeros and -inf, as the prefill path gives
        dense.attention(q_, k_, v_, enable_gqa=True)
        assert isinstance(dense.dense_call(q_, k_, v_, None, True), dense.DenseCall)
    q192 = torch.randn(2, 8, 1, 192).bfloat16()  # keys wider than values: the prefill kernels' form
    k192, v128 = torch.randn(2, 2, 64, 192).bfloat16(), torch.randn(2, 2, 64, 128).bfloat16()
    assert isinstance(dense.dense_call(q192, k192, v128, None, True), dense.DenseCall)
    monkeypatch.delenv("ATTNFORGE_ATTENTION_DECODE")
    assert isinstance(dense.dense_call(q, k, v, None, True), dense.DenseCall)
    dense.attention(q, k, v, enable_gqa=True)
    assert recorder.launches[-1][0] != "batch_decode_kernel"


def test_tensors_the_kernel_cannot_read_in_place_are_copied(recorder):
    kc, vc = static_cache()
    q = one_query()
    buf = torch.randn(q.numel() + 1).bfloat16()
    shifted = buf[1:].view(q.shape)  # not 16-byte aligned
    k, v = kc[:, :, :100], vc[:, :, :100].contiguous()  # readable in place, but with other strides than each other
    dense.attention(shifted, k, v, enable_gqa=True)
    p = recorder.launches[-1][2]
    assert p.q != shifted.data_ptr() and p.q % 16 == 0
    assert p.k_cache not in (k.data_ptr(), kc.data_ptr()) and p.v_cache != v.data_ptr()
    assert (p.stride_page, p.stride_head, p.stride_token) == (2 * 100 * 128, 100 * 128, 128)
    dense.attention(q, kc[:, :, :100], vc[:, :, :100], enable_gqa=True)  # equal strides: no copy
    assert recorder.launches[-1][2].k_cache == kc.data_ptr()


def test_a_modifiers_tensors_reach_the_decode_launch(recorder):
    kc, vc = static_cache()
    q = one_query()
    b1, b2 = torch.randn(8), torch.randn(8)
    for bias in (b1, b2):
        dense.attention(q, kc[:, :, :50], vc[:, :, :50], score_mod=lambda s, b, h, qi, ki: s + bias[h],
                        enable_gqa=True)
        p = recorder.launches[-1][2]
        assert recorder.launches[-1][0] == "batch_decode_kernel" and p.mod_t0 == bias.data_ptr()
    keep = torch.ones(2, 50, dtype=torch.bool)  # a padding mask: the prefill kernels skip the tiles it hides
    dense.attention(q, kc[:, :, :50], vc[:, :, :50], mask_mod=lambda b, h, qi, ki: keep[b, ki], enable_gqa=True)
    call = next(c for c in dense._CALLS.values() if c.mod is not None and c.mod.mask_root is not None)
    assert isinstance(call, dense.DenseCall) and recorder.launches[-1][0] != "batch_decode_kernel"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_reads_one_request_in_place_as_one_page(recorder, monkeypatch, layout):
    from attnforge import prefill
    monkeypatch.setattr(prefill, "_WRAPPERS", {})
    q = torch.randn(8, 128).bfloat16()
    shape = (100, 2, 128) if layout == "NHD" else (2, 100, 128)
    k, v = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    out, lse = attnforge.single_decode(q, k, v, kv_layout=layout, return_lse=True, sm_scale=0.5)
    name, _, p = recorder.launches[-1]
    assert name == "batch_decode_kernel" and (out.shape, lse.shape) == ((8, 128), (8,))
    assert (p.q, p.k_cache, p.v_cache, p.out, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                         lse.data_ptr())
    token, head = (2 * 128, 128) if layout == "NHD" else (128, 100 * 128)
    assert (p.stride_token, p.stride_head, p.page_size, p.sm_scale) == (token, head, 100, 0.5)
    out = attnforge.single_decode(q, k[:37] if layout == "NHD" else k[:, :37], v[:37] if layout == "NHD" else v[:, :37],
                                  kv_layout=layout, sm_scale=0.5)  # a new length: the same wrapper, a new plan
    assert out.shape == (8, 128) and recorder.launches[-1][2].page_size == 37 and len(prefill._WRAPPERS) == 1
    empty = k[:0] if layout == "NHD" else k[:, :0]
    out, lse = attnforge.single_decode(q, empty, empty, kv_layout=layout, return_lse=True)  # no keys: no page read
    w = next(iter(prefill._WRAPPERS.values()))
    assert out.shape == (8, 128) and w._device_region("kv_len").tolist() == [0] and w._plan["max_page"] < 0


def test_single_decode_refuses_bad_shapes_before_any_launch(recorder):
    q, k = torch.randn(8, 128).bfloat16(), torch.randn(100, 2, 128).bfloat16()
    for args, match in (((q[None], k, k), r"single_decode q: expected a 2-D tensor \[num_qo_heads, head_dim\]"),
                        ((q, k[0], k[0]), r"single_decode k: expected a 3-D tensor \[kv_len, num_kv_heads"),
                        ((q, k, k[:, :, :64]), r"single_decode v.shape: expected k's shape \[100, 2, 128\]"),
                        ((q, k.half(), k.half()), r"kv_dtype")):
        with pytest.raises(ValueError, match=match):
            attnforge.single_decode(*args)
    assert recorder.launches == []


def test_causal_calls_of_a_few_queries_run_the_verify_step(recorder):
    """Up to 8 queries a request under the mask q_idx >= kv_idx (or is_causal with Lq == Lk) run the decode kernels'
    verify step (its own causal rule): q as rows b * Lq + t, the rows back in SDPA's layout; other masks (those
    and-ed with it too: the prefill kernels skip the tiles they hide), no mask and more queries stay on prefill."""
    from torch.nn.attention.flex_attention import and_masks
    kc, vc = static_cache()
    k, v = kc[:, :, :100], vc[:, :, :100]
    q = torch.randn(2, 8, 4, 128).bfloat16()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    out, lse = dense.attention(q, k, v, mask_mod=causal, enable_gqa=True, return_lse=True)
    name, _, p = recorder.launches[-1]
    call = next(c for c in dense._CALLS.values() if c.mod is not None)
    assert isinstance(call, dense_decode.DecodeCall) and name == "batch_decode_kernel"
    assert (p.q_len, p.page_size, p.k_cache, p.q_stride_b, p.q_stride_h) == (4, 100, k.data_ptr(), 8 * 128, 128)
    assert p.q != q.data_ptr() and call.wrapper.max_q_len == 4
    assert (out.shape, lse.shape, out.is_contiguous(), lse.is_contiguous()) == ((2, 8, 4, 128), (2, 8, 4), True, True)
    kept = {"and_masks of it alone": and_masks(causal), "kv <= q": lambda b, h, q_idx, kv_idx: kv_idx <= q_idx}
    for what, mask in kept.items():
        dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
        assert recorder.launches[-1][0] == "batch_decode_kernel", what
    square = torch.randn(2, 8, 4, 128).bfloat16()
    dense.attention(square, k[:, :, :4], v[:, :, :4], is_causal=True, enable_gqa=True)
    assert recorder.launches[-1][0] == "batch_decode_kernel"
    stays = {"no mask": (q, None), "a mask without the causal rule": (q, lambda b, h, q_idx, kv_idx: kv_idx > 3),
             "the rule or-ed": (q, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (kv_idx > 3)),
             "the rule and-ed": (q, and_masks(causal, lambda b, h, q_idx, kv_idx: kv_idx > 3)),
             "one query, a mask": (q[:, :, :1], lambda b, h, q_idx, kv_idx: kv_idx > 3),
             "nine queries": (torch.randn(2, 8, 9, 128).bfloat16(), causal)}
    for what, (q_, mask) in stays.items():
        dense.attention(q_, k, v, mask_mod=mask, enable_gqa=True)
        assert recorder.launches[-1][0] != "batch_decode_kernel", what


def test_narrowed_runs_launch_what_run_launches(recorder):
    """BatchDecode.run_narrowed (the route's launch: the plan's template narrowed by q, K and V) packs the bytes
    run() packs for the same tensors, but for the output's own pointers; a new stride set under the same addresses
    gets its own template, and a new plan starts them over."""
    import ctypes
    spec = AttentionSpec(family="decode", num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, kv_layout="HND",
                         score_mod=attnforge.mods.compile_mod(score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5))
    w = host_decode(spec, "cpu", 2, 4)
    kc, vc = static_cache()
    k, v = kc[:, :, :100], vc[:, :, :100]
    q = torch.randn(8, 8, 128).bfloat16()  # 2 requests x 4 tokens
    for lk in (100, 60):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        w.plan(np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32), np.full(2, lk, np.int32), page_size=lk,
               q_len=4)
        for _ in range(2):
            out, lse = w.run(q, (k, v), return_lse=True)
            want = recorder.launches[-1][2]
            got_out, got_lse = w.run_narrowed(q, k, v, return_lse=True)
            got = recorder.launches[-1][2]
            assert (got.out, got.lse) == (got_out.data_ptr(), got_lse.data_ptr())
            assert (got_out.shape, got_lse.shape) == (out.shape, lse.shape)
            got.out, got.lse = want.out, want.lse
            assert bytes(got) == bytes(want)
        assert len(w._memo.once("narrowed templates", dict)) == 1
    contiguous = (k.contiguous(), v.contiguous())
    w.run_narrowed(q, *contiguous)
    assert len(w._memo.once("narrowed templates", dict)) == 2 and recorder.launches[-1][2].stride_head == 60 * 128
    with pytest.raises(ValueError, match="q.shape"):  # a new tensor set is checked before its launch
        w.run_narrowed(q[:4], k, v)


def test_the_input_fuzz_one_query_call_takes_the_decode_route(monkeypatch):
    """The input fuzz's `attention-one-query` API must exercise the decode route (not a mask's prefill path)."""
    from input_fuzz_apis import Env
    from input_fuzz_more_apis import one_query_build, one_query_invoke
    from test_input_fuzz import cpu_wrapper
    rec = stub_host_prefill(monkeypatch, fake_map)
    monkeypatch.setattr(dense, "_CALLS", {})
    env = Env(False, torch.device("cpu"), cpu_wrapper)
    one_query_invoke(env, dict(one_query_build(env)))
    assert [name for name, _, _ in rec.launches] == ["batch_decode_kernel"]


def test_a_verify_steps_rows_go_in_as_b_times_lq_plus_t_and_come_back_in_sdpas_layout(recorder, monkeypatch):
    """The verify kernels take request b's token t at row b * Lq + t; attention() hands q over in that order and
    puts each output row (and LSE) back at [b, h, t]: a stand-in run returns rows that name their own index."""
    seen = {}

    def rows_naming_themselves(self, rows, k, v, return_lse=False):
        seen["rows"] = rows.clone()
        n, h, d = rows.shape
        out = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, h, d) * 10 + \
            torch.arange(h, dtype=torch.float32)[None, :, None]
        return out.bfloat16(), (out[:, :, 0].clone() if return_lse else None)  # (exact in bf16: below 256)
    monkeypatch.setattr(BatchDecode, "run_narrowed", rows_naming_themselves)
    kc, vc = static_cache()
    q = torch.randn(2, 8, 3, 128).bfloat16()
    out, lse = dense.attention(q, kc[:, :, :50], vc[:, :, :50], mask_mod=lambda b, h, qi, ki: qi >= ki,
                               enable_gqa=True, return_lse=True)
    for b in range(2):
        for t in range(3):
            assert torch.equal(seen["rows"][b * 3 + t], q[b, :, t])
            for h in (0, 5):
                assert out[b, h, t, 0].item() == (b * 3 + t) * 10 + h and lse[b, h, t].item() == (b * 3 + t) * 10 + h

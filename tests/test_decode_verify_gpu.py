"""BatchDecode with several query tokens a request (speculative decoding's verify step): token t of q_len
sits at position kv_len - q_len + t and sees the keys up to it (causal among the drafts, end-aligned)."""
import dataclasses
import math

import numpy as np
import pytest
import torch

import attnforge.decode
import attnforge.mods as m
from attnforge import AttentionSpec, BatchDecode, BatchPrefill, reference, scheduler
from helpers import assert_attention_close, assert_lse_close, make_paged_case, poison

pytestmark = pytest.mark.gpu
LENGTHS = [8, 9, 1000, 17, 64, 65, 300, 8]  # each >= 8: every request holds its own q_len tokens


def verify_case(spec, lengths, page_size, q_len, seed=0, max_q_len=None, out_rows_extra=0, k_scale=1.0,
                v_scale=1.0, keep_pipeline=None, **wrapper_kw):
    """Plans and runs q_len tokens a request against the reference; returns (wrapper, out). keep_pipeline (a
    pytest monkeypatch): the spec's pipeline as given, not the one picked for the item's rows."""
    if keep_pipeline is not None:
        keep_pipeline.setattr(attnforge.decode, "spec_for_rows", lambda s, q, head_splits=None: s)
    _, cache, (indptr, indices, last), per_req = make_paged_case(spec, lengths, page_size, seed)
    dt = torch.bfloat16 if spec.q_dtype == "bf16" else torch.float16
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lengths) * q_len, spec.num_qo_heads, spec.head_dim_qk, generator=g).to(dt).cuda()
    w = BatchDecode(spec, max_q_len=max_q_len or q_len, **wrapper_kw)
    if keep_pipeline is not None:
        assert w.kernel.spec.pipeline == spec.pipeline
    w.plan(indptr, indices, last, page_size=page_size, q_len=q_len, k_scale=k_scale, v_scale=v_scale)
    # out is a view of a larger poisoned buffer: rows past the batch's must stay untouched
    big = poison((len(lengths) * q_len + out_rows_extra, spec.num_qo_heads, spec.head_dim_vo), dt)
    out, lse = w.run(q, cache, out=big[:len(lengths) * q_len], return_lse=True)
    torch.cuda.synchronize()
    assert torch.isnan(big[len(lengths) * q_len:]).all(), "a padding row was written"
    mod = spec.score_mod
    kw = dict(causal=True, window_left=spec.window_left, logits_soft_cap=spec.logits_soft_cap,
              sm_scale=(1 / math.sqrt(spec.head_dim_qk)) * k_scale)
    if mod is not None:
        kw.update(score_mod=mod.torch_score if mod.score_root is not None else None,
                  mask_mod=mod.torch_mask if mod.mask_root is not None else None)
    refs, lows, lses = [], [], []
    for b, (k, v) in enumerate(per_req):
        qs = q[b * q_len:(b + 1) * q_len]
        r, rl = reference.attention(qs, k, v * v_scale, batch_index=b, **kw)
        lo, _ = reference.attention(qs.float(), k.to(dt).float(), (v * v_scale).to(dt).float(), dtype=torch.float32,
                                    batch_index=b, **kw)
        refs.append(r)
        lows.append(lo)
        lses.append(rl)
    ref, low, ref_lse = torch.cat(refs), torch.cat(lows), torch.cat(lses)
    assert_attention_close(out, ref, low.to(dt), f"{spec.name} q_len {q_len} page {page_size}")
    assert_lse_close(lse, ref_lse, spec.name)
    return w, out


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("q_len,pipeline", [(2, "transposed"), (4, "transposed"), (4, "normal"), (8, "normal"),
                                            (1, "normal")])
def test_draft_tokens_against_the_reference(page_size, q_len, pipeline, monkeypatch):
    verify_case(AttentionSpec(num_qo_heads=32, num_kv_heads=8, pipeline=pipeline), LENGTHS, page_size, q_len,
                keep_pipeline=monkeypatch)


@pytest.mark.parametrize("hq,hkv,q_len,pipeline", [(32, 32, 4, "transposed"), (32, 32, 8, "transposed"),
                                                   (32, 4, 8, "normal"), (32, 2, 4, "normal"), (12, 4, 3, "normal"),
                                                   (12, 4, 3, "transposed")])
def test_head_layouts_and_odd_token_counts(hq, hkv, q_len, pipeline, monkeypatch):
    verify_case(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, pipeline=pipeline), LENGTHS, 16, q_len, seed=3,
                keep_pipeline=monkeypatch)


@pytest.mark.parametrize("group,q_len", [(3, 8), (5, 5), (5, 6), (6, 4), (6, 5)])
def test_fp8_items_over_two_m16_tiles_hold_their_planned_ctas(group, q_len):
    """fp8 verify items of 24-30 rows (normal pipeline): ptxas alone took 183 registers where 3 CTAs an SM were
    planned (a second wave, the GPU fuzz's OccupancyWarning); held to 168 they fit, and stay exact. (On a Hopper GPU
    conftest raises the warning as an error.)"""
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype="fp8_e4m3")
    w, _ = verify_case(spec, LENGTHS, 16, q_len, seed=group + q_len, k_scale=0.5, v_scale=2.0)
    assert (w.kernel.spec.pipeline, w.kernel.register_bound_ctas) == ("normal", 3)


@pytest.mark.parametrize("group,q_len,page_size", [(7, 7, 16), (9, 6, 7), (8, 7, 1)])
def test_fp8_items_taking_48_kb_of_dynamic_shared_memory_launch(group, q_len, page_size):
    """fp8 verify items of 49-60 rows (normal pipeline widened in registers) take exactly 48 KB of dynamic shared
    memory beside the kernel's static flag: past the driver's default limit, so the loader must raise the opt-in
    attribute (the GPU fuzz's g8 q7 and suite verify_fp8_widen's g7 q7 failed to launch before it did)."""
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype="fp8_e4m3")
    w, _ = verify_case(spec, LENGTHS, page_size, q_len, seed=group * q_len, k_scale=0.5, v_scale=2.0,
                       whole_items=False)
    ran = w.planned_kernel[0]  # (the kernel the plan launched: the 48 KB one, not a whole-item twin)
    assert (ran.spec.pipeline, ran.normal_widen_in_registers, ran.smem_bytes) == ("normal", True, 48 * 1024)


@pytest.mark.parametrize("hq,hkv,d,q_len,page_size,splits,merge_launch", [
    (24, 8, 128, 8, 7, 3, False), (64, 8, 128, 4, 16, 2, False), (64, 8, 64, 8, 1, 4, True),
    (32, 1, 128, 3, 16, 8, False), (128, 8, 64, 4, 7, 4, True), (48, 8, 128, 5, 16, 2, False),
    (64, 8, 128, 8, 16, 8, False)])
def test_fp8_items_split_by_head_splits_take_the_pipeline_for_their_rows(hq, hkv, d, q_len, page_size, splits,
                                                                          merge_launch):
    """fp8 verify steps past the transposed kernel's 16 rows an item, with head_splits that bring each item
    back to 16 or fewer: the wrapper takes the pipeline 'auto' picks for the item's rows (transposed up to 8 at
    d128, up to 16 at d64; the normal pipeline, widened in registers, past them), and each item's rows, its KV
    head's pages read by every split, and the merges of long requests' chunks (in the kernel, or by the second
    launch) stay exact."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, kv_dtype="fp8_e4m3")
    w, _ = verify_case(spec, LENGTHS, page_size, q_len, seed=hq + q_len, k_scale=0.5, v_scale=2.0,
                       merge_launch=merge_launch, head_splits=splits)
    k, rows = w.kernel, hq // hkv // splits * q_len
    pipeline = "transposed" if rows <= (8 if d == 128 else 16) else "normal"
    assert (k.spec.pipeline, k.head_splits, k.item_rows) == (pipeline, splits, rows)


@pytest.mark.parametrize("group,q_len,page_size,merge_launch", [
    (8, 4, 16, False), (4, 8, 7, True), (3, 8, 1, False), (8, 8, 16, False), (16, 4, 7, True), (5, 5, 16, False),
    (4, 1, 7, False), (8, 2, 1, False)])
def test_fp8_normal_pipeline_widened_in_registers(group, q_len, page_size, merge_launch, monkeypatch):
    """DecodeKernel.normal_widen_in_registers: the normal pipeline's fp8 K and V read from the swizzled fp8 stage
    and widened after ldmatrix (fp16 MMAs, O's dims regrouped by publish()), at one to four m16 tiles of rows,
    odd pages, and both merge paths of long requests' chunks, against the reference."""
    make = BatchDecode._make_kernel
    monkeypatch.setattr(BatchDecode, "_make_kernel",
                        lambda self, *a: dataclasses.replace(make(self, *a), normal_widen_in_registers=True))
    spec = AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype="fp8_e4m3", pipeline="normal")
    w, _ = verify_case(spec, LENGTHS, page_size, q_len, seed=group + 10 * q_len, k_scale=0.5, v_scale=2.0,
                       merge_launch=merge_launch, whole_items=False)
    assert w.kernel.normal_widen_in_registers and w.planned_kernel[0].normal_widen_in_registers


@pytest.mark.parametrize("kv_dtype,q_len,expected", [("bf16", 2, "transposed"), ("bf16", 4, "normal"),
                                                     ("fp8_e4m3", 2, "transposed"), ("fp8_e4m3", 4, "normal")])
def test_the_wrapper_picks_the_pipeline_for_the_items_rows(kv_dtype, q_len, expected):
    w, _ = verify_case(AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_dtype=kv_dtype), LENGTHS, 16, q_len, seed=4)
    assert w.kernel.spec.pipeline == w.spec.pipeline == expected


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("pipeline", ["transposed", "normal"])
def test_fewer_tokens_than_planned_for_and_fp8(kv_dtype, pipeline, monkeypatch):
    # a wrapper built for 4 tokens runs plans of 1..4: rows of tokens past q_len are padding, never written
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, pipeline=pipeline, kv_dtype=kv_dtype)
    for q_len in (1, 3, 4):
        verify_case(spec, LENGTHS, 16, q_len, seed=q_len, max_q_len=4, out_rows_extra=5, keep_pipeline=monkeypatch,
                    **({"k_scale": 0.5, "v_scale": 2.0} if kv_dtype == "fp8_e4m3" else {}))


@pytest.mark.parametrize("pipeline,kv_dtype,q_len", [("transposed", "bf16", 4), ("transposed", "fp8_e4m3", 4),
                                                     ("normal", "bf16", 4), ("normal", "fp8_e4m3", 4),
                                                     ("normal", "bf16", 8)])
def test_requests_of_fewer_keys_than_tokens(pipeline, kv_dtype, q_len, monkeypatch):
    # kv_len < q_len: the first q_len - kv_len tokens sit at negative positions and see no key, so their rows
    # are zeros with LSE -inf (the reference's rule, as MLA's and prefill's); the later ones see the keys up to
    # theirs. Beside an empty request and a long one split over CTAs
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, pipeline=pipeline, kv_dtype=kv_dtype)
    lengths = [1, 2, 3, 0, 30000, q_len - 1, 1]
    w, out = verify_case(spec, lengths, 7, q_len, seed=11, keep_pipeline=monkeypatch,
                         **({"k_scale": 0.5, "v_scale": 2.0} if kv_dtype == "fp8_e4m3" else {}))
    assert w._plan["work"].total > w._plan["work"].span, "the long request must be split"
    for b, keys in enumerate(lengths):
        keyless = max(0, q_len - keys)  # tokens before the request's first key
        assert torch.all(out[b * q_len:b * q_len + keyless] == 0), (b, keys)
        if 0 < keys < q_len:  # the first token that sees a key does not give a zero row
            assert out[b * q_len + q_len - keys].float().abs().max() > 0, (b, keys)


@pytest.mark.parametrize("merge_launch", [False, True])
@pytest.mark.parametrize("pipeline", ["transposed", "normal"])
def test_long_requests_split_and_merged(merge_launch, pipeline, monkeypatch):
    # one long request over many CTAs: its chunks' partial states merged in-kernel or by the second
    # launch; the last chunk may hold keys only the later draft tokens see
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, pipeline=pipeline)
    w, _ = verify_case(spec, [40001, 8, 3000], 16, 4, seed=5, merge_launch=merge_launch, keep_pipeline=monkeypatch)
    assert w._plan["merge_launch"] == merge_launch
    assert w._plan["work"].total > w._plan["work"].span, "the long request must be split"


@pytest.mark.parametrize("mod", ["softcap_window", "alibi", "mask"])
def test_modifiers_see_each_draft_tokens_position(mod):
    slopes = torch.rand(32, device="cuda")
    spec = {"softcap_window": AttentionSpec(num_qo_heads=32, num_kv_heads=8, logits_soft_cap=20.0, window_left=50),
            "alibi": AttentionSpec(num_qo_heads=32, num_kv_heads=8, score_mod=m.alibi(slopes)),
            # a mask of the query's position: the key three before each draft token is hidden from it
            "mask": AttentionSpec(num_qo_heads=32, num_kv_heads=8, score_mod=m.compile_mod(
                mask_mod=lambda b, h, q_idx, kv_idx: kv_idx != q_idx - 3))}[mod]
    verify_case(spec, LENGTHS, 7, 4, seed=9)


def test_equals_the_prefill_of_the_same_tokens():
    # the same verify step through BatchPrefill (its end-aligned causal rows): the two kernels agree
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    lengths, q_len = [4, 700, 3000, 33], 4
    _, cache, (indptr, indices, last), _ = make_paged_case(spec, lengths, 16, seed=2)
    q = torch.randn(len(lengths) * q_len, 32, 128, device="cuda").bfloat16()
    d = BatchDecode(spec, max_q_len=q_len)
    d.plan(indptr, indices, last, page_size=16, q_len=q_len)
    p = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True))
    p.plan(np.arange(len(lengths) + 1) * q_len, indptr, indices, last, page_size=16)
    a = d.run(q, cache, out=poison(q.shape, q.dtype))
    b = p.run(q, cache, out=poison(q.shape, q.dtype))
    assert (a.float() - b.float()).abs().max().item() < 2e-2


def test_cuda_graph_replays_after_replans():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    lengths = [50, 2000, 9, 700]
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=4, max_q_len=4)
    _, cache, (indptr, indices, last), _ = make_paged_case(spec, [3000] * 4, 16, seed=1)
    w.plan(indptr, indices, last, page_size=16, q_len=4)
    q = torch.randn(16, 32, 128, device="cuda").bfloat16()
    out = poison(q.shape, q.dtype)
    w.run(q, cache, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out)
    pages = [-(-L // 16) for L in lengths]
    indptr2 = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last2 = np.array([L - (n - 1) * 16 for L, n in zip(lengths, pages)], dtype=np.int32)
    w.plan(indptr2, indices[:indptr2[-1]], last2, page_size=16, q_len=4)
    out.fill_(math.nan)
    graph.replay()
    eager = BatchDecode(spec, max_q_len=4)
    eager.plan(indptr2, indices[:indptr2[-1]], last2, page_size=16, q_len=4)
    torch.testing.assert_close(out.float(), eager.run(q, cache).float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="q_len"):  # a captured graph keeps its q_len
        w.plan(indptr2, indices[:indptr2[-1]], last2, page_size=16, q_len=2)


def test_bad_q_len_and_query_rows_raise_before_launch():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    _, cache, (indptr, indices, last), _ = make_paged_case(spec, [100, 200], 16)
    w = BatchDecode(spec, max_q_len=4)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="q_len"):
            w.plan(indptr, indices, last, page_size=16, q_len=bad)
    w.plan(indptr, indices, last, page_size=16, q_len=4)
    with pytest.raises(ValueError, match=r"batch \* q_len"):
        w.run(torch.randn(2, 32, 128, device="cuda").bfloat16(), cache)
    # the wrapper runs the normal pipeline for its 16-row items; the caller's spec keeps its own
    assert (w.spec.pipeline, w.kernel.spec.pipeline, spec.pipeline) == ("normal", "normal", "transposed")


@pytest.mark.parametrize("kw,q_len", [({"head_dim_qk": 64}, 4), ({"head_dim_qk": 256}, 4), ({"head_dim_qk": 256}, 2),
                                      ({"num_kv_heads": 1}, 4), ({"num_kv_heads": 1}, 8), ({"kv_layout": "HND"}, 4),
                                      ({"q_dtype": "fp16"}, 3), ({"head_dim_qk": 64, "kv_dtype": "fp8_e4m3"}, 2),
                                      ({"head_dim_qk": 64, "kv_dtype": "fp8_e4m3"}, 4)])
def test_head_dims_mqa_layouts_and_fp16(kw, q_len):  # (fp8 d64: one and two n8 tiles widened in registers)
    # MQA 32/1: 16-head items (head_splits 2) x 4 tokens fill the kernel's 64 rows; 8 tokens split further
    spec = AttentionSpec(num_qo_heads=32, **{"num_kv_heads": 8, **kw})
    w, _ = verify_case(spec, LENGTHS, 16, q_len, seed=6)
    assert w.kernel.item_rows <= 64 and w.kernel.max_q_len == q_len


@pytest.mark.parametrize("hq,q_len,max_q_len,page_size,graph", [(32, 4, 4, 16, False), (32, 3, 3, 7, False),
                                                                (64, 2, 2, 1, False), (32, 3, 4, 16, False),
                                                                (32, 4, 4, 16, True), (32, 2, 2, 7, False),
                                                                (16, 2, 2, 16, True)])
def test_about_one_equal_item_a_cta_runs_the_four_cta_kernel(hq, q_len, max_q_len, page_size, graph):
    """Equal requests of 8 KV heads, 4 items an SM: the plan takes the verify whole-item kernel (4-16 rows, 32-token
    tiles of two warps, 4 CTAs an SM: kernels.decode.verify_four_cta_tiling; the normal pipeline's m16 tile also
    for a transposed spec's 4-8 rows), one whole item a CTA, also with fewer tokens than the kernel's max_q_len
    (padding rows) and in CUDA-graph mode with whole_items=True."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kw = dict(use_cuda_graph=True, whole_items=True, max_batch_size=sms // 2) if graph else {}
    w, _ = verify_case(AttentionSpec(num_qo_heads=hq, num_kv_heads=8), [300 + q_len] * (sms // 2), page_size, q_len,
                       seed=5, max_q_len=max_q_len, out_rows_extra=3, **kw)
    kernel, ctas = w.planned_kernel
    assert kernel is w._wholes[-1].kernel and kernel.ctas_per_sm == 4 and ctas == 4 * sms
    assert (kernel.tile_kv, kernel.num_stages, kernel.num_warps) == (32, 3, 2)
    assert w._plan["work"].num_spans == sms // 2 * 8  # one whole item a span


@pytest.mark.parametrize("hq,hkv,kv_dtype,q_len,max_q_len,page_size,chunks,graph", [
    (32, 8, "bf16", 8, 8, 16, 1, False), (32, 8, "bf16", 4, 4, 7, 1, False), (32, 8, "bf16", 2, 2, 1, 1, False),
    (32, 8, "fp8_e4m3", 4, 4, 16, 1, False), (32, 8, "bf16", 7, 8, 16, 1, False), (32, 8, "bf16", 8, 8, 7, 2, False),
    (32, 8, "bf16", 8, 8, 16, 8, False), (128, 8, "bf16", 4, 4, 7, 4, False), (32, 32, "bf16", 2, 2, 16, 1, False),
    (32, 8, "bf16", 4, 4, 16, 1, True)])
def test_about_one_equal_item_an_sm_runs_the_one_cta_kernel(hq, hkv, kv_dtype, q_len, max_q_len, page_size, chunks,
                                                            graph):
    """Equal requests, about one item an SM: the plan takes the one-CTA-an-SM verify kernel (128-token tiles of 8
    warps: kernels.decode.verify_one_cta_tiling) on the normal pipeline's m16 tiles (16, 32 and 64 rows), the
    transposed n8 tile (8 and 2 rows) and fp8's two n8 tiles, one whole item a CTA; fewer items cut into 2-8 equal
    chunks each (the m16 tiles); also with fewer tokens than max_q_len (padding rows) and in CUDA-graph mode with
    whole_items=True."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // hkv // chunks
    kw = dict(use_cuda_graph=True, whole_items=True, max_batch_size=batch) if graph else {}
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype)
    w, _ = verify_case(spec, [700 * chunks + q_len] * batch, page_size, q_len, seed=9, max_q_len=max_q_len,
                       out_rows_extra=2, **kw)
    kernel, ctas = w.planned_kernel
    assert kernel is w._wholes[0].kernel and kernel.ctas_per_sm == 1 and ctas == sms
    assert (kernel.tile_kv, kernel.num_stages, kernel.num_warps) == (128, 3, 8)
    assert scheduler.aligned_chunks(w._plan["work"]) == chunks

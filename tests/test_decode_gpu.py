import dataclasses
import math

import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, scheduler
from helpers import (assert_attention_close, assert_lse_close, chain_on_own_outputs, decode_reference, make_paged_case,
                     poison, poison_unused_slots, random_page_table, replays_after_replans)

pytestmark = pytest.mark.gpu
LENGTHS = [0, 1, 15, 16, 17, 1000, 63, 64, 65]


def run_case(spec, lengths, page_size, seed=0, sm_scale=None, k_scale=1.0, v_scale=1.0, nan_unheld=False,
             **wrapper_kw):
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, lengths, page_size, seed)
    if nan_unheld:  # the reference rows were gathered before
        poison_unused_slots(cache, indptr, indices, last, page_size, spec.kv_layout)
    w = BatchDecode(spec, **wrapper_kw)
    w.plan(indptr, indices, last, page_size=page_size, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    out = poison((len(lengths), spec.num_qo_heads, spec.head_dim_vo), w.out_dtype)  # (float32 with float_out)
    out, lse = w.run(q, cache, out=out, return_lse=True)
    torch.cuda.synchronize()
    eff_scale = (sm_scale or 1 / math.sqrt(spec.head_dim_qk)) * k_scale
    ref, ref_lse = decode_reference(spec, q, per_req, sm_scale=eff_scale, v_scale=v_scale)
    low, _ = decode_reference(spec, q.float(), [(k.to(q.dtype).float(), v.to(q.dtype).float())
                                                for k, v in per_req], sm_scale=eff_scale,
                              v_scale=v_scale, dtype=torch.float32)
    assert_attention_close(out, ref, low.to(q.dtype), f"{spec.name} page{page_size}")
    assert_lse_close(lse, ref_lse, spec.name)
    empty = [i for i, L in enumerate(lengths) if L == 0]
    if empty:
        assert torch.all(out[empty] == 0) and torch.all(lse[empty] == -math.inf)
    return w, out


@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_pages_layouts_pipelines(page_size, layout, pipeline):
    run_case(AttentionSpec(kv_layout=layout, pipeline=pipeline), LENGTHS, page_size)


def test_wrappers_built_for_cuda_take_tensors_on_cuda_0():
    """device="cuda" (no index) is the current device by its index: decode and prefill wrappers built
    with it run on tensors of cuda:0 (they were refused as on another device) and agree with the
    reference."""
    w, _ = run_case(AttentionSpec(), [1, 300], 16, device="cuda")
    assert w.device == torch.device("cuda", torch.cuda.current_device())
    from attnforge import BatchPrefill
    p = BatchPrefill(AttentionSpec(family="prefill", causal=True), device="cuda")
    q, k, v = (torch.randn(33, h, 128, device="cuda:0").bfloat16() for h in (32, 8, 8))
    p.plan(np.array([0, 33]), np.array([0, 33]))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                                           v.transpose(0, 1).float(), is_causal=True,
                                                           enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(p.run(q, (k, v), out=poison(q.shape, q.dtype)).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("kernel", ["default", "normal", "fp8", "whole-items", "merge-launch"])
def test_pdl_launches_chained_on_their_own_outputs(use_cuda_graph, kernel):
    """BatchDecode (PDL by default) three times in a row, each call's queries the previous call's output:
    a call must read its queries (and the cache) only after the call before it completed; eagerly and
    replayed in a CUDA graph, where the calls run back to back (the graph caught queries loaded ahead of
    the wait through ld.global.nc, twenty-fifth session: common.cuh, load_after_wait)."""
    spec = AttentionSpec(pipeline="normal" if kernel == "normal" else "auto",
                         kv_dtype="fp8_e4m3" if kernel == "fp8" else "bf16")
    # whole items: one near-equal (request, KV head) item per SM, which plans the one-CTA-per-SM kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lengths = [1000, 17, 4000, 1, 0, 300] if kernel != "whole-items" else [3000 - i for i in range(sms // 8)]
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, lengths, 16, seed=11)
    w = BatchDecode(spec, use_cuda_graph=use_cuda_graph, max_batch_size=len(lengths),
                    whole_items=True if kernel == "whole-items" else None,
                    merge_launch=True if kernel == "merge-launch" else None)  # (its merge writes the next's q)
    assert w.pdl
    w.plan(indptr, indices, last, page_size=16)
    assert scheduler.is_whole_item_plan(w._plan["work"]) == (kernel == "whole-items")
    assert w._plan["merge_launch"] == (kernel == "merge-launch")
    outs = chain_on_own_outputs(lambda src, out: w.run(src, cache, out=out), q, use_cuda_graph)
    expect = q
    for o in outs:  # the reference chained on the kernel's own outputs: each call checked alone
        ref, _ = decode_reference(spec, expect, per_req)
        low, _ = decode_reference(spec, expect.float(), [(k.to(q.dtype).float(), v.to(q.dtype).float())
                                                          for k, v in per_req], dtype=torch.float32)
        assert_attention_close(o, ref, low.to(q.dtype), f"pdl chain, graph={use_cuda_graph}")
        expect = o


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp8_warp_bands_match_the_cta_barrier_kernel_bitwise(page_size, head_dim, monkeypatch):
    """fp8 widened in registers: each warp copying and waiting for its own band of the tile (the default,
    DecodeKernel.warp_rows) computes exactly what the kernel with CTA-wide copies and barriers computes."""
    spec = AttentionSpec(kv_dtype="fp8_e4m3", head_dim_qk=head_dim, head_dim_vo=head_dim)
    w, banded = run_case(spec, LENGTHS, page_size, seed=5, whole_items=False)
    assert w.planned_kernel[0].warp_rows and w.planned_kernel[0].spec.pipeline == "transposed"
    make = BatchDecode._make_kernel
    monkeypatch.setattr(BatchDecode, "_make_kernel",
                        lambda self, *a: dataclasses.replace(make(self, *a), warp_rows=False))
    w0, barrier = run_case(spec, LENGTHS, page_size, seed=5, whole_items=False)
    assert not w0.planned_kernel[0].warp_rows
    assert torch.equal(banded, barrier)


@pytest.mark.parametrize("qk_chains", [1, 4])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_s_accumulated_in_one_or_four_mma_chains(qk_chains, kv_dtype, monkeypatch):
    """The transposed kernel with S^T's k steps in one or four accumulators (the default: two)."""
    make = BatchDecode._make_kernel
    monkeypatch.setattr(BatchDecode, "_make_kernel",
                        lambda self, *a: dataclasses.replace(make(self, *a), qk_chains=qk_chains))
    w, _ = run_case(AttentionSpec(kv_dtype=kv_dtype), LENGTHS, 16, seed=qk_chains, whole_items=False)
    assert w.planned_kernel[0].qk_chains == qk_chains


@pytest.mark.parametrize("snap", [scheduler.CHUNK_FIXED_COST, 288])
@pytest.mark.parametrize("pipeline,kv_dtype", [("transposed", "bf16"), ("normal", "bf16"), ("transposed", "fp8_e4m3")])
def test_snapped_span_boundaries(snap, pipeline, kv_dtype, monkeypatch):
    """Span boundaries moved to the ends of the items they fall in (scheduler.span_cuts): the walk and the
    merge must cut alike. Unequal short items, so the planner snaps (scheduler.snap_pays), some still split."""
    monkeypatch.setattr(BatchDecode, "span_snap", snap)
    lengths = np.random.default_rng(snap).integers(1, 700, 96).tolist() + [0, 1, 17]
    w, _ = run_case(AttentionSpec(pipeline=pipeline, kv_dtype=kv_dtype), lengths, 16, seed=snap, ctas_per_sm=1)
    work = w._plan["work"]
    raw = np.minimum(np.arange(work.num_spans + 1) * work.span, work.total)
    assert work.snap == snap and (scheduler.span_cuts(work) != raw).any()  # the kernel ran moved cuts
    assert any(scheduler.split_slots(work, r, h) for r in range(len(lengths)) for h in range(8))  # and merged


@pytest.mark.parametrize("page_size,layout,kv_dtype", [(16, "NHD", "bf16"), (7, "HND", "bf16"),
                                                     (64, "NHD", "fp8_e4m3")])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_slots_no_request_holds_may_hold_nan(page_size, layout, kv_dtype, pipeline):
    """An engine's cache is uninitialised memory: NaN in every slot no request holds (a last page's
    tail, pages past the table) must not reach the output, whichever tile a request ends in."""
    run_case(AttentionSpec(kv_layout=layout, kv_dtype=kv_dtype, pipeline=pipeline), LENGTHS + [65536], page_size,
             seed=page_size, nan_unheld=True)


# the transposed pipeline takes groups up to 16 (its refusal of larger groups is tested below)
HEAD_CASES = [(d, h, p) for d in (64, 128, 256) for h in ((8, 8), (32, 8), (64, 8), (32, 2), (64, 1))
              for p in ("normal", "transposed") if p == "normal" or h[0] // h[1] <= 16]


@pytest.mark.parametrize("head_dim,heads,pipeline", HEAD_CASES)
def test_head_dims_and_groups(head_dim, heads, pipeline):
    hq, hkv = heads
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim, pipeline=pipeline)
    run_case(spec, [1, 300, 17, 2048], 16, seed=head_dim + hq)


@pytest.mark.parametrize("heads,pipeline", [((32, 8), "transposed"), ((128, 8), "transposed"), ((96, 8), "transposed"),
                                            ((32, 2), "transposed"), ((32, 2), "normal"), ((32, 8), "normal")])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_single_token_requests_return_their_value_row_exactly(heads, pipeline, dtype):
    """A request of one token weighs it exactly 1 (the running max is its own score): every query head's
    row is the token's V row, bit for bit, in every head tile, beside split requests and alone. (Groups
    9-16 on the transposed pipeline read a bf16 ulp off here while nvcc zeroed their second head tile's
    running max, forty-fifth session; the error rule of run_case, 2x torch's, let it pass.)"""
    hq, hkv = heads
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, pipeline=pipeline, q_dtype=dtype, kv_dtype=dtype)
    for lengths in ([0, 1126, 1, 1, 385], [1] * 6):
        q, cache, (indptr, indices, last), per_req = make_paged_case(spec, lengths, 16, seed=7)
        w = BatchDecode(spec)
        w.plan(indptr, indices, last, page_size=16)
        out = w.run(q, cache, out=poison(q.shape, q.dtype)).cpu()
        for b in (b for b, n in enumerate(lengths) if n == 1):
            value_rows = per_req[b][1][0].repeat_interleave(hq // hkv, dim=0).to(q.dtype).cpu()  # [Hq, D]
            wrong = (out[b] != value_rows).any(dim=1).nonzero().flatten().tolist()
            assert not wrong, f"{spec.name} {lengths}: request {b}'s rows of heads {wrong} are not its V row"


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_long_request_split_across_ctas(pipeline):
    run_case(AttentionSpec(pipeline=pipeline), [65536, 3, 1000], 16, seed=3)


def test_a_callers_workspace_shared_by_two_wrappers():
    """One buffer of another dtype, sliced at 16-byte multiples for two wrappers (as engines share a workspace):
    each wrapper's long, split request agrees with the reference and with its own default workspace bitwise; a
    slice at another offset is refused before anything runs (the partial states' 16-byte stores would fault)."""
    spec = AttentionSpec()
    need = BatchDecode(spec)._workspace_need()
    per = -(-need // 16) * 16
    buf = torch.full((2 * per // 4 + 1,), float("nan"), device="cuda")  # (float32: views by bytes)
    flat = buf.view(torch.uint8)
    mine, _ = run_case(spec, [65536, 3, 1000], 16, seed=3, workspace=flat[per:2 * per])
    first, out0 = run_case(spec, [65536, 3, 1000], 16, seed=3, workspace=flat[:per])
    _, default = run_case(spec, [65536, 3, 1000], 16, seed=3)
    assert torch.equal(out0, default)
    assert mine._partial_o.data_ptr() == buf.data_ptr() + per and first._partial_o.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match=r"BatchDecode\(workspace=...\): expected a contiguous tensor at a 16-byte "
                                         r"aligned address .*got data_ptr % 16 = 4"):
        BatchDecode(spec, workspace=flat[4:4 + per])
    with pytest.raises(ValueError, match=r"expected at least \d+ bytes, got 16"):
        BatchDecode(spec, workspace=flat[:16])


# Equal requests plan spans aligned to their items (scheduler.ALIGN_SLACK): each item cut into
# CTAs // items chunks of ~700 positions, one chunk a span (items padded to whole spans when the cost
# is no multiple of the chunk count: shave); odd page size, GQA, MQA (head splits), MHA
@pytest.mark.parametrize("shave", [0, 37])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 1), (8, 8)])
def test_equal_requests_plan_spans_on_item_boundaries(hq, hkv, shave):
    from attnforge import scheduler
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv)
    probe = BatchDecode(spec)
    items = 5 * probe._stream_items()
    per_item = probe.num_ctas // items
    w, _ = run_case(spec, [700 * per_item - scheduler.CHUNK_FIXED_COST - shave] * 5, 7, seed=hq + hkv + shave)
    work = w._plan["work"]
    plain = scheduler.plan_stream(work.kv_begin, work.kv_end, work.num_kv_heads, w.num_ctas)
    if 700 - plain.span < scheduler.ALIGN_SLACK:  # (on the H200, 396 CTAs: every case here)
        assert plain.span < work.span <= 700 and work.num_spans == items * per_item
        assert work.total == items * per_item * work.span


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_fp8_kv_with_scales(dtype, pipeline):
    spec = AttentionSpec(q_dtype=dtype, kv_dtype="fp8_e4m3", pipeline=pipeline)
    run_case(spec, [1, 100, 4000], 16, k_scale=0.5, v_scale=1.5)


@pytest.mark.parametrize("hq,hkv,head_dim,page_size", [(32, 2, 128, 16), (96, 8, 128, 7), (32, 1, 128, 7),
                                                      (128, 2, 128, 1), (32, 2, 256, 7), (96, 8, 64, 16),
                                                      (32, 1, 64, 7)])
def test_fp8_kv_in_two_head_tiles_on_the_transposed_pipeline(hq, hkv, head_dim, page_size):
    """fp8 groups of 9-16, and multiples of 16 as items of 16 heads: two n8 head tiles, each K and V fragment
    widened once for both (a group of 12 pads its second tile); MQA's items of one KV head read its tokens side by
    side. 'auto' picks this at d64 and d256; at d128 the normal pipeline widened in registers (one m16 tile, the
    115th session's default), run here too."""
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim, head_dim_vo=head_dim, kv_dtype="fp8_e4m3")
    auto = AttentionSpec(**kw)
    assert auto.pipeline == ("normal" if head_dim == 128 else "transposed")
    for spec in dict.fromkeys([AttentionSpec(**kw, pipeline="transposed"), auto]):  # (d64, d256: one spec)
        w, _ = run_case(spec, LENGTHS + [9000], page_size, seed=page_size + hq, k_scale=0.5, v_scale=1.5)
        assert w.kernel.item_heads == min(hq // hkv, 16) and w.kernel.widens_in_registers
        assert w.kernel.spec.pipeline == spec.pipeline


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_fp8_kv_other_head_dims(head_dim, pipeline):
    """The normal pipeline widens fp8 tiles in shared memory; the transposed one widens them in registers
    (two stages, 2 CTAs per SM); page size 7 and lengths off the 64-token tile and split across CTAs."""
    spec = AttentionSpec(kv_dtype="fp8_e4m3", head_dim_qk=head_dim, pipeline=pipeline)
    run_case(spec, [1, 300, 17, 20000], 7, seed=head_dim, k_scale=0.5, v_scale=1.5)


@pytest.mark.parametrize("hq,hkv,page_size", [(32, 8, 7), (32, 2, 1), (8, 8, 16), (40, 8, 3)])
def test_fp8_kv_at_d64_widened_in_registers(hq, hkv, page_size):
    """fp8 at d64 on the transposed pipeline widens in registers as at d128 (64-byte rows, swizzled by row pairs:
    kv_tile.cuh's fp8_swizzle); one n8 head tile (groups 1, 4, 5) and two (16), pages 1-16, split requests."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=64, kv_dtype="fp8_e4m3",
                         pipeline="transposed")
    w, _ = run_case(spec, LENGTHS + [20000], page_size, seed=hq + page_size, k_scale=0.5, v_scale=1.5)
    assert w.kernel.widens_in_registers


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_mqa_at_d256_on_eight_warps(kv_dtype):
    """64 query heads per KV head at d256 (normal pipeline): the default tiling's eight warps, four head
    tiles of two warps each; page 7, a request split across CTAs (partial rows of 64 heads merged)."""
    spec = AttentionSpec(num_qo_heads=64, num_kv_heads=1, head_dim_qk=256, kv_dtype=kv_dtype, pipeline="normal")
    run_case(spec, [1, 300, 17, 20000], 7, seed=5, k_scale=0.5, v_scale=1.5)


@pytest.mark.parametrize("hq,hkv", [(24, 8), (21, 3)])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_groups_of_3_mod_4_merge_split_items(hq, hkv, kv_dtype, pipeline):
    """Groups 3 and 7: a chunk's lse row starts up to 3 floats into its aligned block, so it spans one
    block more than group // 4 + 1 (kernels.decode.merge_lse_blocks). With one block too few the merge
    read a head's lse from stale shared memory (max error ~1; found by tests/test_fuzz_gpu.py)."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype, pipeline=pipeline)
    w, _ = run_case(spec, [20000, 5, 300, 2047], 16, seed=hq, k_scale=0.5, v_scale=1.5)
    assert any(scheduler.split_slots(w._plan["work"], 0, h) for h in range(hkv))  # the long request merged


# (query heads, kv heads, head_dim, pipeline): the in-kernel merge of a split item streams its chunks
# through a ring of kMergeSlots slots in two halves, up to 4 vectors a thread, in passes where the
# group has more vectors; one long request per KV head cut into ~200 chunks turns the ring many
# times (MQA 32/1: items of 16 heads, 4 vectors a thread; 64/1 at d256: 4 passes), group 5 (160
# vectors at 128 threads) takes a second pass of 32 threads
@pytest.mark.parametrize("hq,hkv,head_dim,pipeline", [(32, 1, 128, "normal"), (40, 8, 128, "transposed"),
                                                      (64, 1, 256, "normal"), (32, 32, 64, "transposed")])
def test_merge_of_many_chunks_in_passes_and_rounds(hq, hkv, head_dim, pipeline):
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim, pipeline=pipeline)
    lengths = [60000, 5] if hkv == 1 else [3000, 5]  # ~200 chunks of one item (MQA), fewer per head else
    run_case(spec, lengths, 16, seed=hq + head_dim)


# Small stages where the merge takes fewer vectors a thread so that two ring slots fit (merge_shape):
# MQA 32/1 at d64 in one item of 32 heads, 32-token tiles in two stages (16 KB: 2 vectors a thread)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_merge_with_fewer_vectors_a_thread_in_small_stages(kv_dtype):
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=1, head_dim_qk=64, kv_dtype=kv_dtype, pipeline="normal")
    w, _ = run_case(spec, [20000, 5, 300], 16, seed=41, tile_kv=32, num_stages=2, num_warps=4, head_splits=1)
    assert w.kernel.merge_shape[0] < 4 and w.kernel.merge_shape[1] >= 2


# MQA-sized groups run as items of 16 query heads (head_splits per KV head, kernels.decode): item h
# holds query heads 16h.., reads KV head h / splits; page 7 and a request split across many CTAs.
# Splits below 16 heads an item (8 or 4: a head tile partly empty), on both pipelines.
@pytest.mark.parametrize("hq,hkv,splits,pipeline", [
    (32, 1, None, "normal"), (48, 2, None, "normal"), (64, 1, None, "normal"), (64, 1, 2, "normal"),
    (32, 1, 1, "normal"), (32, 1, 4, "normal"), (32, 2, 2, "normal"), (32, 4, 2, "transposed")])
def test_head_splits(hq, hkv, splits, pipeline):
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, pipeline=pipeline)
    w, _ = run_case(spec, [1, 300, 17, 20000], 7, seed=hq + hkv, head_splits=splits)
    assert w.kernel.head_splits == (splits or hq // hkv // 16)


def test_head_splits_keep_each_query_heads_modifiers():
    """Per-head ALiBi slopes and attention sinks follow the query head, not the work item: MQA 32/1 in
    two items, the long request split (the sink joins after the merge)."""
    import attnforge.mods as m
    from attnforge import reference
    slopes = torch.linspace(0.01, 0.5, 32, device="cuda")

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) * 1e-3

    mod = m.attention_sink(torch.linspace(-1.0, 2.0, 32, device="cuda"), score_mod=alibi_score)
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=1, pipeline="normal", score_mod=mod)
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, [30000, 300], 16, seed=11)
    w = BatchDecode(spec)
    assert w.kernel.head_splits == 2
    w.plan(indptr, indices, last, page_size=16)
    out, lse = w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True)
    torch.cuda.synchronize()
    for b, (k, v) in enumerate(per_req):
        kw = dict(score_mod=mod.torch_score, sink=mod.sink, batch_index=b)
        ref, ref_lse = reference.attention(q[b:b + 1], k, v, **kw)
        low, _ = reference.attention(q[b:b + 1].float(), k.float(), v.float(), dtype=torch.float32, **kw)
        assert_attention_close(out[b:b + 1], ref, low.to(q.dtype), f"alibi + sink, MQA, request {b}")
        assert_lse_close(lse[b:b + 1], ref_lse, "alibi + sink, MQA")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
@pytest.mark.parametrize("stages", [2, 3])
def test_two_warps_on_32_token_tiles(kv_dtype, pipeline, stages):
    """The d256 tilings of benchmarks/bench_decode_tilings.py: 32-token tiles, two warps (one 16-token
    sub-block each), 2-4 CTAs per SM; page 7, lengths off the tile, a request split across CTAs."""
    spec = AttentionSpec(kv_dtype=kv_dtype, head_dim_qk=256, pipeline=pipeline)
    run_case(spec, [1, 300, 17, 20000], 7, seed=stages, k_scale=0.5, v_scale=1.5,
             tile_kv=32, num_warps=2, num_stages=stages)


@pytest.mark.parametrize("kv_dtype,head_dim", [("bf16", 128), ("fp8_e4m3", 128), ("bf16", 64)])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_more_tile_rows_a_warp_than_lanes(kv_dtype, head_dim, pipeline):
    """128-token tiles on two warps: each warp copies 64 rows, so each lane resolves two of them (the copy
    path's page lookups once a row, kv_tile.cuh: RowOffsets' second slot); pages of 1 and 7, cut tiles."""
    spec = AttentionSpec(kv_dtype=kv_dtype, head_dim_qk=head_dim, pipeline=pipeline)
    for page_size in (1, 7):
        run_case(spec, [1, 129, 300, 5000], page_size, seed=page_size, nan_unheld=True, tile_kv=128, num_warps=2,
                 num_stages=2)


@pytest.mark.parametrize("magnitude", [1e-3, 30.0, 1000.0])
def test_fp8_kv_bf16_queries_of_any_magnitude(magnitude):
    """The register-widening fp8 kernel runs fp16 MMAs and stages bf16 queries as fp16 * 2^-8: tiny
    and large queries (a peaked softmax at 1000) must still match the float64 reference."""
    spec = AttentionSpec(q_dtype="bf16", kv_dtype="fp8_e4m3", pipeline="transposed")
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, [1, 100, 700], 16, seed=11)
    q = (q.float() * magnitude).to(q.dtype)
    w = BatchDecode(spec)
    w.plan(indptr, indices, last, page_size=16)
    out = w.run(q, cache, out=poison(q.shape, q.dtype))
    ref, _ = decode_reference(spec, q, per_req)
    low, _ = decode_reference(spec, q.float(), per_req, dtype=torch.float32)
    assert_attention_close(out, ref, low.to(q.dtype), f"fp8 kv, |q| ~ {magnitude}")


# float_out (float32 rows for a caller's merge): the stream kernel with its in-kernel merges on both pipelines,
# fp8 K/V, the merge launch, and the one-CTA-an-SM whole-item kernel ((hq, hkv), kv dtype, pipeline, lengths,
# wrapper arguments; None lengths: one near-equal request a KV head's SM)
FLOAT_OUT_CASES = [((32, 8), "bf16", "transposed", LENGTHS, {}), ((32, 2), "fp16", "normal", [5000, 17, 1, 0], {}),
                   ((32, 8), "fp8_e4m3", "transposed", [3000, 0, 64, 129], {}),
                   ((32, 8), "bf16", "transposed", [20000, 3, 1], {"merge_launch": True}),
                   ((32, 8), "bf16", "auto", None, {"whole_items": True})]


@pytest.mark.parametrize("heads,kv_dtype,pipeline,lengths,kw", FLOAT_OUT_CASES)
def test_float_out_rows_round_to_the_16bit_rows(heads, kv_dtype, pipeline, lengths, kw):
    """BatchDecode(float_out=True) writes the rows the 16-bit kernel rounds: rounded to q's type they equal its
    rows within one unit in the last place (the same arithmetic; ptxas may contract other FMAs), and their RMS
    error against float64 is below the 16-bit rows' (no output rounding)."""
    q_dtype = "fp16" if kv_dtype == "fp16" else "bf16"
    spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], q_dtype=q_dtype, pipeline=pipeline,
                         kv_dtype=q_dtype if kv_dtype == "fp16" else kv_dtype)
    if lengths is None:
        lengths = [1000 - (i % 5) for i in range(torch.cuda.get_device_properties(0).multi_processor_count
                                                 // heads[1])]
    scales = {"k_scale": 0.5, "v_scale": 1.5} if kv_dtype == "fp8_e4m3" else {}
    w16, out16 = run_case(spec, lengths, 7, seed=len(lengths), **scales, **kw)
    w32, out32 = run_case(spec, lengths, 7, seed=len(lengths), **scales, float_out=True, **kw)
    assert out32.dtype == torch.float32 and w32.out_dtype == torch.float32 and w16.out_dtype == out16.dtype
    k16, k32 = w16.planned_kernel[0], w32.planned_kernel[0]
    assert k32.float_out and "_outf32_" in k32.module().name and k32 == dataclasses.replace(k16, float_out=True)
    if kw.get("whole_items"):
        assert k16 is w16._whole, "the case plans no whole items: widen its batch"
    if kw.get("merge_launch"):
        assert w32._plan["merge_launch"]
    rounded = out32.to(out16.dtype)
    ulp = torch.finfo(out16.dtype).eps * out16.float().abs().clamp_min(torch.finfo(out16.dtype).tiny)
    gap = (rounded.float() - out16.float()).abs()
    assert (gap <= ulp).all(), f"{spec.name}: float rows rounded differ from the 16-bit rows by {gap.max():.3e}"
    q, _, _, per = make_paged_case(spec, lengths, 7, len(lengths))
    eff = spec.head_dim_qk ** -0.5 * scales.get("k_scale", 1.0)
    ref, _ = decode_reference(spec, q, per, sm_scale=eff, v_scale=scales.get("v_scale", 1.0))
    rms32, rms16 = (((out.double() - ref) ** 2).mean().sqrt().item() for out in (out32, out16))
    assert rms32 < rms16, f"{spec.name}: float32 rows' RMS error {rms32:.3e}, the 16-bit rows' {rms16:.3e}"


def test_fp16_and_out_dtype():
    run_case(AttentionSpec(q_dtype="fp16"), LENGTHS, 16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("pipeline,merge_launch", [("normal", None), ("transposed", None), ("transposed", True)])
def test_outputs_at_any_alignment_match_aligned_outputs_bitwise(dtype, pipeline, merge_launch):
    """Rows leave the kernel as one 8- or 16-byte store where the address allows (store_floats), else a
    store an element. An out whose rows start anywhere (an odd element offset; a row stride of 129) gets
    the aligned run's values bitwise, on whole items, items merged in the kernel and by the merge launch,
    and nothing outside the view is written."""
    spec = AttentionSpec(pipeline=pipeline, q_dtype=dtype)
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, [1, 300, 9000, 17], 16, 3)
    w = BatchDecode(spec, merge_launch=merge_launch)
    w.plan(indptr, indices, last, page_size=16)
    assert any(scheduler.split_slots(w._plan["work"], 2, h) for h in range(8))  # the long request merged
    assert w._plan["merge_launch"] == bool(merge_launch)
    dt = q.dtype
    shape = (4, spec.num_qo_heads, spec.head_dim_vo)
    aligned = w.run(q, cache, out=poison(shape, dt)).clone()
    assert not aligned.isnan().any()
    flat = poison((aligned.numel() + 1,), dt)
    wide = poison((4, spec.num_qo_heads, spec.head_dim_vo + 1), dt)
    for name, buf, view in (("offset by one element", flat, flat[1:].view(shape)),
                            ("row stride 129", wide, wide[..., :spec.head_dim_vo])):
        assert view.data_ptr() % 8 or view.stride(1) % 4
        w.run(q, cache, out=view)
        torch.cuda.synchronize()
        assert torch.equal(view, aligned), name
        outside = buf[:1] if buf is flat else buf[..., spec.head_dim_vo:]
        assert outside.isnan().all(), f"{name}: a store outside the view"


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_softcap_and_window(pipeline):
    run_case(AttentionSpec(logits_soft_cap=5.0, pipeline=pipeline), [1, 777, 5000], 16, sm_scale=0.5)
    run_case(AttentionSpec(window_left=100, pipeline=pipeline), [1, 50, 101, 102, 5000], 7)


def test_block_table_form_equals_csr():
    spec = AttentionSpec()
    lengths = [5, 40, 0, 100]
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, lengths, 16)
    a = BatchDecode(spec)
    a.plan(indptr, indices, last, page_size=16)
    table = np.zeros((4, 8), dtype=np.int32)
    for b in range(4):
        table[b, : indptr[b + 1] - indptr[b]] = indices[indptr[b]:indptr[b + 1]]
    bw = BatchDecode(spec)
    bw.plan(seq_lens=lengths, block_table=table, page_size=16)
    assert torch.equal(a.run(q, cache), bw.run(q, cache))
    k, v = cache[:, 0].contiguous(), cache[:, 1].contiguous()  # (K, V) pair form
    assert torch.equal(a.run(q, cache), a.run(q, (k, v)))


def test_deterministic_bitwise():
    spec = AttentionSpec()
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, [70000, 5, 3000], 16, seed=9)
    w = BatchDecode(spec)
    w.plan(indptr, indices, last, page_size=16)
    a, b = w.run(q, cache).clone(), w.run(q, cache).clone()
    w.plan(indptr, indices, last, page_size=16)
    assert torch.equal(a, b) and torch.equal(a, w.run(q, cache))


# (32/2 with merge_launch: split items merged by the second launch, batch_decode_merge_kernel, in every replay)
@pytest.mark.parametrize("pipeline,hkv,merge_launch", [("normal", 8, None), ("transposed", 8, None),
                                                       ("normal", 2, True)])
def test_cuda_graph_replay_after_replans(pipeline, hkv, merge_launch):
    spec = AttentionSpec(pipeline=pipeline, num_kv_heads=hkv)
    batch, page_size, pages = 8, 16, 8192
    rng = np.random.default_rng(0)
    cache = torch.randn(pages, 2, page_size, spec.num_kv_heads, 128, device="cuda").bfloat16()
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    out = torch.empty_like(q)
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=batch, max_num_pages=pages, merge_launch=merge_launch)

    def replan():
        _, indptr, indices, last = random_page_table(rng, batch, page_size, pages, 6000, (20000, 60000))
        w.plan(indptr, indices, last, page_size=page_size)
        assert w._plan["merge_launch"] is bool(merge_launch)
        return indptr, indices, last

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(math.nan)

    from attnforge import reference
    for i, (indptr, indices, last) in replays_after_replans(lambda: w.run(q, cache, out=out), replan, refresh, 50):
        if i % 10 == 0 or i == 49:  # full check on a sample; every replay must be finite
            per = reference.gather_paged(cache[:, 0].float(), cache[:, 1].float(), "NHD", indptr, indices,
                                         last, page_size)
            ref, _ = decode_reference(spec, q, per)
            assert (out.double() - ref).abs().max().item() < 2e-2, f"replay {i}"
        assert torch.isfinite(out).all(), f"replay {i}"


# ~one (near-)equal item per SM: the one-CTA-per-SM kernel that reads items whole (whole_item_tiling)
@pytest.mark.parametrize("page_size,layout,q_dtype,hkv,kv_dtype", [
    (16, "NHD", "bf16", 8, "bf16"), (7, "HND", "fp16", 8, "fp16"), (1, "NHD", "bf16", 8, "bf16"),
    (7, "NHD", "bf16", 2, "bf16"), (7, "NHD", "bf16", 2, "fp8_e4m3")])
def test_whole_item_kernel_matches_the_reference(page_size, layout, q_dtype, hkv, kv_dtype):
    # 32/2: the normal pipeline's one m16 tile with 16-bit KV, the transposed one's two n8 tiles with fp8
    spec = AttentionSpec(kv_layout=layout, q_dtype=q_dtype, num_kv_heads=hkv, kv_dtype=kv_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // hkv  # x KV heads: 128 or 132 items on the H200's 132 SMs
    lengths = [1000 - (i % 5) for i in range(batch)]  # near-equal, no multiple of the 128-token tile
    scales = {"k_scale": 0.5, "v_scale": 1.5} if kv_dtype == "fp8_e4m3" else {}
    w, _ = run_case(spec, lengths, page_size, seed=page_size, **scales)
    if not scheduler.in_whole_item_band(batch * hkv, w._whole_ctas):
        pytest.skip(f"{batch * hkv} items on {sms} SMs: outside the whole-item band")
    assert w.planned_kernel == (w._whole, sms) and w._whole.tile_kv == 128


def shuffled_page_table(rng, lens, page_size: int, pages: int):
    """(kv_indptr, kv_indices, kv_last_page_len) of requests of `lens` tokens on pages drawn at random from `pages`."""
    lens = np.asarray(lens, dtype=np.int64)
    pages_per = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    indices = rng.permutation(pages)[: indptr[-1]].astype(np.int32)
    return indptr, indices, (lens - (pages_per - 1) * page_size).astype(np.int32)


# ~one (near-)equal item per CTA of a 4-CTA-an-SM grid (one token, a group filling one head tile, 16-bit d128:
# kernels.decode.four_cta_tiling): 32-token tiles of two warps, each item read whole by one CTA
@pytest.mark.parametrize("page_size,layout,q_dtype,hkv,hq,pipeline", [
    (16, "NHD", "bf16", 8, 32, "auto"), (7, "HND", "fp16", 8, 32, "auto"), (1, "NHD", "bf16", 4, 32, "auto"),
    (16, "NHD", "bf16", 8, 128, "auto"), (7, "HND", "fp16", 8, 96, "auto"), (1, "HND", "bf16", 8, 24, "auto"),
    (7, "NHD", "bf16", 8, 32, "normal")])
def test_four_cta_whole_item_kernel_matches_the_reference(page_size, layout, q_dtype, hkv, hq, pipeline):
    spec = AttentionSpec(kv_layout=layout, q_dtype=q_dtype, num_kv_heads=hkv, num_qo_heads=hq,  # > 8: normal
                         pipeline=pipeline)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = 4 * sms // hkv  # x KV heads: 512 or 528 items on the H200's 528 CTAs
    lengths = [700 - (i % 5) for i in range(batch)]  # near-equal, no multiple of the 32-token tile
    w, _ = run_case(spec, lengths, page_size, seed=page_size)
    four = w._wholes[-1]  # (a normal spec has no one-CTA-an-SM whole-item kernel: one entry)
    if not scheduler.in_whole_item_band(batch * hkv, four.ctas):
        pytest.skip(f"{batch * hkv} items on {four.ctas} CTAs: outside the band")
    assert w.planned_kernel == (four.kernel, 4 * sms) and four.kernel.tile_kv == 32
    assert scheduler.is_whole_item_plan(w._plan["work"])


def test_four_cta_whole_item_kernel_under_cuda_graphs_after_replans():
    """whole_items=True under a graph, a first plan of ~4 x SMs equal items: the captured 4-CTA kernel replays
    near-equal plans (whole items) and unequal ones (a plain stream over its grid, items split and merged)."""
    spec = AttentionSpec()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, page_size, pages = 4 * sms // 8, 16, 8192
    rng = np.random.default_rng(4)
    cache = torch.randn(pages, 2, page_size, 8, 128, device="cuda").bfloat16()
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    out = torch.empty_like(q)
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=batch, max_num_pages=pages, whole_items=True)
    kinds = []

    def replan():
        equal = len(kinds) % 2 == 0
        lens = np.full(batch, int(rng.integers(400, 1200))) - rng.integers(0, 16, batch) if equal else \
            rng.integers(1, 800, batch)
        indptr, indices, last = shuffled_page_table(rng, lens, page_size, pages)
        w.plan(indptr, indices, last, page_size=page_size)
        kinds.append(scheduler.is_whole_item_plan(w._plan["work"]))
        return indptr, indices, last

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(math.nan)

    from attnforge import reference
    for i, (indptr, indices, last) in replays_after_replans(lambda: w.run(q, cache, out=out), replan, refresh, 8):
        assert w.planned_kernel == (w._wholes[1].kernel, 4 * sms)
        per = reference.gather_paged(cache[:, 0].float(), cache[:, 1].float(), "NHD", indptr, indices, last, page_size)
        ref, _ = decode_reference(spec, q, per)
        assert (out.double() - ref).abs().max().item() < 2e-2, f"replay {i}"
    assert any(kinds) and not all(kinds)  # both kinds of plan replayed


# equal items cut into k equal chunks, about one a CTA, on the whole-item kernels that take such plans
# (kernels.decode.whole_item_tiling: fp8 on 16 warps, the normal pipeline's 16-head tile, MQA as one item of
# every query head); k = 1 reads fp8 items whole
# (groups 11 and 12 on the normal pipeline's one 16-head tile: a group of 3 mod 4 reads its lse rows across
# 16-byte blocks in the merge, kernels.decode.merge_lse_blocks)
@pytest.mark.parametrize("hq,hkv,kv_dtype,chunks,page_size", [(32, 8, "fp8_e4m3", 1, 16), (32, 8, "fp8_e4m3", 2, 7),
                                                              (32, 2, "bf16", 16, 1), (32, 1, "bf16", 8, 16),
                                                              (64, 1, "bf16", 4, 7), (88, 8, "bf16", 2, 7),
                                                              (96, 8, "bf16", 4, 16), (32, 2, "bf16", 66, 16),
                                                              (32, 1, "bf16", 33, 7), (8, 2, "fp8_e4m3", 33, 16),
                                                              (32, 1, "bf16", 132, 16), (64, 1, "bf16", 66, 7),
                                                              (32, 2, "fp8_e4m3", 66, 16), (32, 2, "fp8_e4m3", 4, 7)])
def test_whole_item_kernel_on_chunked_plans(hq, hkv, kv_dtype, chunks, page_size):
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // (hkv * chunks)  # whole-item items (MQA: one a request) x chunks: 128 to 132 CTAs on the H200
    lengths = [300 * chunks + 37 - (i % 5) for i in range(batch)]  # near-equal, cuts inside the tiles
    w, _ = run_case(spec, lengths, page_size, seed=chunks)
    if not scheduler.in_whole_item_band(batch * hkv, sms, w._whole_max_chunks(w._wholes[0].tiling)):
        pytest.skip(f"{batch * hkv} items on {sms} SMs: outside the whole-item band")
    assert w.planned_kernel == (w._whole, sms) and scheduler.aligned_chunks(w._plan["work"]) == chunks
    assert w._plan["stream_items"] == hkv  # MQA's whole-item kernel: every query head in one item
    # MQA past its tail merge's cap (132 and 66 chunks): merged by the second launch
    assert w._plan["merge_launch"] is (w._whole.item_heads * chunks > scheduler.MERGE_LAUNCH_ROWS)


# split items merged by a second launch (batch_decode_merge_kernel), forced on: long requests cut into many
# chunks beside empty, single-token and short ones, odd pages, fp16 / fp8, MQA, d256, the whole-item kernel's
# chunked plans (32/2 B1)
@pytest.mark.parametrize("hq,hkv,lengths,page_size,extra", [
    (32, 1, [20000, 1, 0, 3000], 16, {}), (32, 8, [50000, 17, 1000], 7, {"q_dtype": "fp16"}),
    (32, 8, LENGTHS + [9000], 1, {}), (32, 8, [30000, 30000], 16, {"kv_dtype": "fp8_e4m3"}),
    (32, 2, [40000], 16, {}), (16, 2, [20000, 5], 16, {"head_dim_qk": 256, "head_dim_vo": 256}),
    (64, 1, [33333, 2], 3, {"pipeline": "normal"}),
    # d64: two 16-thread lanes a warp, whose chunk counts differ by one where lanes do not divide the chunks
    (32, 8, [30000, 5, 2100], 7, {"head_dim_qk": 64, "head_dim_vo": 64}),
    (32, 1, [20000, 1, 0, 3000], 16, {"head_dim_qk": 64, "head_dim_vo": 64, "kv_dtype": "fp8_e4m3"})])
def test_merge_launch_matches_the_reference(hq, hkv, lengths, page_size, extra):
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, **extra)
    w, _ = run_case(spec, lengths, page_size, seed=len(lengths), merge_launch=True)
    assert w._plan["merge_launch"]
    rows = scheduler.expand(w._plan["work"])
    assert (rows[:, 5] >= 0).any(), "no split item: the merge launch had nothing to merge"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_merge_launch_by_rule_for_a_long_mqa_request(head_dim):
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=1, head_dim_qk=head_dim, head_dim_vo=head_dim)
    w, _ = run_case(spec, [131072], 16, seed=5)
    assert w._plan["merge_launch"]  # 2 items x ~200 chunks x 16 heads: past scheduler.MERGE_LAUNCH_ROWS


@pytest.mark.parametrize("hkv,kv_dtype", [(8, "bf16"), (1, "bf16"), (8, "fp8_e4m3")])
def test_whole_item_kernel_under_cuda_graphs_after_replans(hkv, kv_dtype):
    """whole_items=True under a graph: the captured one-CTA-per-SM kernel replays near-equal plans
    (whole items, or for MQA and fp8 equal chunks of them) and unequal ones (a plain stream over its grid,
    items split and merged)."""
    spec = AttentionSpec(num_kv_heads=hkv, kv_dtype=kv_dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, page_size, pages = sms // 8, 16, 8192
    rng = np.random.default_rng(3)
    cache = torch.randn(pages, 2, page_size, hkv, 128, device="cuda")
    cache = (cache * 2).to(torch.float8_e4m3fn) if kv_dtype == "fp8_e4m3" else cache.bfloat16()
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    out = torch.empty_like(q)
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=batch, max_num_pages=pages, whole_items=True)
    kinds = []

    def replan():
        lens = rng.integers(1, 3000, batch) if len(kinds) % 2 else np.full(batch, int(rng.integers(100, 3000)))
        if len(kinds) % 2 == 0:
            lens = lens - rng.integers(0, 16, batch)  # near-equal: last pages filled differently
        indptr, indices, last = shuffled_page_table(rng, lens, page_size, pages)
        w.plan(indptr, indices, last, page_size=page_size)
        kinds.append(scheduler.aligned_chunks(w._plan["work"]) > 0)
        return indptr, indices, last

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(math.nan)

    from attnforge import reference
    for i, (indptr, indices, last) in replays_after_replans(lambda: w.run(q, cache, out=out), replan, refresh, 12):
        assert w.planned_kernel == (w._whole, sms)
        per = reference.gather_paged(cache[:, 0].float(), cache[:, 1].float(), "NHD", indptr, indices, last, page_size)
        ref, _ = decode_reference(spec, q, per)
        assert (out.double() - ref).abs().max().item() < 2e-2, f"replay {i}"
    assert any(kinds) and not all(kinds)  # both kinds of plan replayed


def test_bad_inputs_raise_before_launch():
    spec = AttentionSpec()
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, [10, 20], 16)
    w = BatchDecode(spec)
    with pytest.raises(RuntimeError, match="call plan"):
        w.run(q, cache)
    w.plan(indptr, indices, last, page_size=16)
    with pytest.raises(ValueError, match="q.dtype"):
        w.run(q.half(), cache)
    with pytest.raises(ValueError, match="q.shape"):
        w.run(q[:, :16], cache)
    with pytest.raises(ValueError, match="q.shape"):
        w.run(q[:1], cache)
    with pytest.raises(ValueError, match="k_cache.dtype"):
        w.run(q, cache.half())
    with pytest.raises(ValueError, match="k_cache.shape"):
        w.run(q, cache[:, :, :8])  # page size differs from the plan
    with pytest.raises(ValueError, match="CUDA tensor"):
        w.run(q.cpu(), cache)
    small = cache[: int(indices.max())]  # fewer pages than the table references
    with pytest.raises(ValueError, match="page ids <"):
        w.run(q, small)
    with pytest.raises(ValueError, match="non-decreasing"):
        w.plan([0, 2, 1], indices[:1], [1, 1], page_size=16)
    with pytest.raises(ValueError, match="page_size=16"):
        w.plan(indptr, indices, [17, 1], page_size=16)
    g = BatchDecode(spec, use_cuda_graph=True, max_batch_size=1, max_num_pages=4)
    with pytest.raises(ValueError, match="max_batch_size=1"):
        g.plan(indptr, indices, last, page_size=16)
    with pytest.raises(ValueError, match="max_num_pages=4"):
        g.plan([0, 5], list(range(5)), [1], page_size=16)
    g1 = BatchDecode(spec, use_cuda_graph=True, max_batch_size=2)
    g1.plan(indptr, indices, last, page_size=16)
    with pytest.raises(ValueError, match="as captured"):
        g1.plan(indptr, indices, last, page_size=16, sm_scale=0.5)
    with pytest.raises(ValueError, match="up to 16 query rows"):
        BatchDecode(AttentionSpec(num_qo_heads=48, num_kv_heads=2, pipeline="transposed"))  # 24 heads an item


def test_runs_recheck_what_differs_from_the_last_checked_inputs():
    """run() skips the checks (and the params packing) for inputs whose address, shape, strides, dtype and device
    equal the last run's (checks.RunMemo): a view at the same address with fewer pages, another dtype or another
    cache must still be checked, and alternating inputs give what a fresh wrapper gives them, bitwise."""
    spec = AttentionSpec()
    w, _ = run_case(spec, [10, 300], 16)  # (checked against the reference)
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, [10, 300], 16)
    for _ in range(2):  # the second run takes the memo's path
        w.run(q, cache)
    for bad, match in ((lambda: w.run(q, cache[: int(indices.max())]), "page ids <"),
                       (lambda: w.run(q, cache.half()), "k_cache.dtype"), (lambda: w.run(q.half(), cache), "q.dtype"),
                       (lambda: w.run(q[:1], cache), "q.shape"), (lambda: w.run(q.cpu(), cache), "CUDA tensor"),
                       (lambda: w.run(q, cache, out=torch.empty_like(q)[:1]), "out.shape")):
        with pytest.raises(ValueError, match=match):
            bad()
    # a plan whose page ids pass the end of a cache that an earlier plan's runs took
    top = int(indices.max())
    few = np.array([0, 1], dtype=np.int32), np.array([0], dtype=np.int32), np.array([5], dtype=np.int32)
    w.plan(*few, page_size=16)
    w.run(q[:1], cache[:top])
    w.plan(np.array([0, 1], dtype=np.int32), np.array([top], dtype=np.int32), few[2], page_size=16)
    with pytest.raises(ValueError, match="page ids <"):
        w.run(q[:1], cache[:top])
    w.plan(indptr, indices, last, page_size=16)
    other, q2 = torch.randn_like(cache), torch.randn_like(q)
    for qq, kv in ((q2, other), (q, (cache[:, 0], cache[:, 1])), (q2, cache), (q2, (other[:, 0], other[:, 1])),
                   (q, cache)):
        fresh = BatchDecode(spec)
        fresh.plan(indptr, indices, last, page_size=16)
        out = poison(q.shape, q.dtype)
        assert torch.equal(w.run(qq, kv, out=out), fresh.run(qq, kv))

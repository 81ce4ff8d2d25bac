"""DecodeKernel's launch shape (CPU): how many CTAs the persistent grid puts on an SM, and where the
kernel asks ptxas to honour that: where registers bind, and where a register rule planned the shape
(tests/jit/test_build.py checks the compiled registers agree)."""
import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from attnforge import AttentionSpec
from attnforge.kernels.decode import DecodeKernel, merge_lse_blocks, spec_for_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("kw,ctas,bound", [
    ({}, 3, 0),                                                   # d128 GQA-4: shared memory allows 3
    ({"kv_dtype": "fp8_e4m3"}, 4, 4),                             # 2 fp8 stages: 6 by shared memory, 4 by registers
    ({"kv_dtype": "fp8_e4m3", "head_dim_qk": 256}, 2, 2),         # 2 stages at d256: 3 by shared memory, 2 by registers
    ({"head_dim_qk": 64, "num_qo_heads": 8, "num_kv_heads": 8}, 4, 4),  # 6 by shared memory, 4 by registers
    ({"num_qo_heads": 64, "num_kv_heads": 4, "pipeline": "transposed"}, 2, 2),  # two head tiles of O^T
    ({"head_dim_qk": 256, "num_qo_heads": 16, "num_kv_heads": 2}, 3, 3),  # 32-token tiles of two warps: 72 KB
    ({"head_dim_qk": 256, "num_qo_heads": 64, "num_kv_heads": 1, "pipeline": "normal"}, 1, 1),  # MQA: 64 tokens, 8 warps
    ({"num_qo_heads": 56, "num_kv_heads": 8, "pipeline": "normal"}, 3, 3),  # an m16 tile of 7 rows: held to 168
    ({"num_qo_heads": 40, "num_kv_heads": 8, "pipeline": "normal"}, 3, 3),  # registers (ptxas alone: 212-216)
    ({"num_qo_heads": 48, "num_kv_heads": 8, "pipeline": "normal"}, 3, 0),  # 6 rows fit 168 by themselves
    ({"num_qo_heads": 56, "num_kv_heads": 8, "pipeline": "normal", "head_dim_qk": 64}, 4, 4),  # d64: 128 registers
])
def test_ctas_per_sm_respects_shared_memory_and_registers(kw, ctas, bound):
    k = DecodeKernel(AttentionSpec(**kw))
    assert (k.ctas_per_sm, k.register_bound_ctas) == (ctas, bound)
    bounds = f"__launch_bounds__(kThreads, {bound})" if bound else "__launch_bounds__(kThreads)"
    assert bounds + " batch_decode_kernel" in k.module().source


def test_fp8_verify_items_over_two_m16_tiles_are_held_to_the_ctas_shared_memory_plans():
    """fp8 verify items of 17-32 rows at d128 (normal pipeline) are held to 168 registers, so 3 CTAs fit where
    shared memory plans 3 (ptxas alone took 183 at groups 3, 5, 6: a silent second wave); past 32 rows shared
    memory plans 2, and the bound follows it. bf16 KV at the same rows needs no bound, nor one-token fp8."""
    from bench_verify_fp8_rows import CASES  # (the benchmark times exactly the shapes the fix changed)

    def kernel(group, tokens, kv="fp8_e4m3"):
        spec = spec_for_rows(AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype=kv), tokens)
        return DecodeKernel(spec, max_q_len=tokens)
    for _, group, tokens in CASES:
        k = kernel(group, tokens)
        assert (k.spec.pipeline, k.item_rows, k.registers_needed) == ("normal", group * tokens, 168)
        assert (k.ctas_per_sm, k.register_bound_ctas) == (3, 3)
        assert "__launch_bounds__(kThreads, 3) batch_decode_kernel" in k.module().source
        assert kernel(group, tokens, "bf16").register_bound_ctas == 0
    # 40 rows: 3 CTAs since the fp8 tile is widened in registers past 16 rows (2 by shared memory before)
    assert (kernel(8, 5).ctas_per_sm, kernel(8, 5).register_bound_ctas) == (3, 3)
    assert (kernel(4, 1).spec.pipeline, kernel(4, 1).ctas_per_sm) == ("transposed", 4)  # one token: unchanged


def test_shared_memory_counts_the_static_flag_and_the_allocation_unit():
    # 32-token fp8 tiles at d256 on three stages: 56 KB of dynamic shared memory, 4 x (56 KB + 1 KB reserved) is
    # the SM's 228 KB exactly, and the kernel's static last_chunk_flag (in a 128-byte unit) leaves room for 3
    k = DecodeKernel(AttentionSpec(head_dim_qk=256, kv_dtype="fp8_e4m3", pipeline="transposed"), tile_kv=32, stages=3,
                     num_warps=2)
    assert k.smem_bytes == 56 * 1024 and 4 * (k.smem_bytes + 1024) == 228 * 1024 and k.ctas_per_sm == 3
    assert "__shared__ int last_chunk_flag;" in k.module().source


def test_wide_heads_take_small_tiles_of_two_warps():
    k = DecodeKernel(AttentionSpec(head_dim_qk=256), tile_kv=32, stages=2, num_warps=2)
    assert (k.threads, k.smem_bytes, k.ctas_per_sm) == (64, 72 * 1024, 3)  # 256 registers x 64 threads fit 4
    assert DecodeKernel(AttentionSpec(head_dim_qk=256), tile_kv=64).ctas_per_sm == 1  # 64-token tiles: 136 KB
    assert (DecodeKernel(AttentionSpec(head_dim_qk=256)).tile_kv, DecodeKernel(AttentionSpec(head_dim_qk=256)).num_warps) == (32, 2)
    with pytest.raises(ValueError, match="tile_kv: expected 32, 64, 128 or 256"):
        DecodeKernel(AttentionSpec(), tile_kv=16)
    for stages in (2.5, "3", True, 9):  # (a float would otherwise reach the template as "2.5")
        with pytest.raises(ValueError, match=r"stages \(num_stages\): expected an int in 2..8, got"):
            DecodeKernel(AttentionSpec(), stages=stages)
    with pytest.raises(ValueError, match="one 16-token sub-block per warp"):
        DecodeKernel(AttentionSpec(), tile_kv=32, num_warps=4)
    with pytest.raises(ValueError, match=r"64 query rows \(heads x tokens\) per work item need 4 warps, got 2"):
        DecodeKernel(AttentionSpec(num_qo_heads=64, num_kv_heads=1, pipeline="normal"), tile_kv=32, num_warps=2,
                     head_splits=1)


@pytest.mark.parametrize("spec_kw,tiling", [({"kv_dtype": "fp8_e4m3"}, (256, 2, 8)),
                                            ({"kv_dtype": "fp8_e4m3"}, (128, 2, 16)),
                                            ({"head_dim_qk": 64, "head_dim_vo": 64}, (256, 2, 16)),
                                            ({"kv_dtype": "fp8_e4m3", "pipeline": "normal"}, (256, 2, 16))])
def test_256_token_tiles_and_16_warps_only_as_the_fp8_whole_item_tiling(spec_kw, tiling):
    """The template would take other shapes of 256 tokens or 16 warps, but only fp8 KV widened in registers
    at d128 in that pair was measured and GPU-tested (FP8_WHOLE_ITEM_TILING): the rest is refused."""
    with pytest.raises(ValueError, match="tile_kv=256 and num_warps=16 go together.*None for the defaults"):
        DecodeKernel(AttentionSpec(**spec_kw), *tiling)
    k = DecodeKernel(AttentionSpec(kv_dtype="fp8_e4m3"), 256, 2, 16)
    assert (k.threads, k.ctas_per_sm, k.smem_bytes) == (512, 1, 4096 + 2 * 2 * 256 * 128)


def test_fewer_stages_do_not_promise_more_ctas_than_registers_hold():
    k = DecodeKernel(AttentionSpec(kv_dtype="fp8_e4m3", pipeline="transposed"), stages=2)
    assert k.smem_bytes * 6 < 228 * 1024 and k.ctas_per_sm == 4  # 6 fit by shared memory


def test_trace_stamps_only_when_asked():
    """The debug trace (benchmarks/trace_decode.py) renders its stamps only with trace=True."""
    import dataclasses
    m = DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=8)).module()
    assert "af_trace" not in m.source and "#define AF_STAMP(k, i) do { } while (0)" in m.source
    traced = dataclasses.replace(m, context={**m.context, "trace": True}).source
    assert "__device__ unsigned long long af_trace" in traced and traced.count("AF_STAMP(trace_k") == 6


def test_merge_ring_streams_a_pass_of_each_chunk():
    """A split item's merge streams the chunks' partial states through a ring of slots in the idle
    K/V stages, in two halves: a slot holds a pass of the group's vectors (up to 4 a thread, 4 dims
    each) and the 16-byte blocks around the chunk's lse row (the template takes both counts and
    checks that the ring fits)."""
    mqa = DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1), head_splits=1)
    # 32 heads x 32 vectors, 4 a thread over 128 threads: 8 KB + 9 lse blocks a slot in 2 x 2 x 64 x 128 x 2 bytes
    assert mqa.pipe_bytes == 2 * 2 * 64 * 128 * 2 and mqa.merge_shape == (4, 65536 // ((512 + 9) * 16) // 2 * 2) == (4, 6)
    assert DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1)).merge_shape == (4, 6)  # items of 16 heads
    assert DecodeKernel(AttentionSpec()).merge_shape == (1, 65536 // ((128 + 2) * 16) // 2 * 2) == (1, 30)  # GQA 4
    assert DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=4)).merge_shape == (2, 14)  # 256 vectors
    assert DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=32)).merge_shape == (1, 32)  # MHA: capped
    assert DecodeKernel(AttentionSpec(num_qo_heads=64, num_kv_heads=1, head_dim_qk=256)).merge_shape == \
        (4, 131072 // ((1024 + 17) * 16) // 2 * 2) == (4, 6)  # 4096 vectors: 4 passes of 4 a thread over 256 threads
    # small stages: fewer vectors a thread, so that two slots fit (four a thread would leave none)
    small = DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1, head_dim_qk=64, pipeline="normal"),
                         tile_kv=32, stages=2, num_warps=4, head_splits=1)
    assert small.pipe_bytes == 16384 and small.merge_shape == (2, 2)
    assert "kMergeV = 4;" in mqa.module().source and "kMergeSlots = 6;" in mqa.module().source


def merge_ring_bytes(k: DecodeKernel) -> tuple[int, int]:
    """(the ring's bytes, the end of merge_item's reads in bytes) in a kernel's stage area: a pass of the item's
    rows x head_dim / 4 float4 vectors, v a thread, and a chunk's lse blocks a slot; merge_item reads a float4
    of each slot at v' * pass_threads + threadIdx.x (v' < v), where a pass holds fewer vectors than threads
    only for the threads that hold them (before, every thread read: fp8 at d64 widened in registers then read
    96 bytes past shared memory at a group of 5, memcheck, seventy-fifth session)."""
    v, slots = k.merge_shape
    vecs = k.item_rows * k.spec.head_dim_vo // 4
    pass_threads = min(k.threads, vecs // v)
    slot_vecs = v * pass_threads + merge_lse_blocks(k.item_rows)
    # the last slot's reads end after its v-th vector's pass_threads readers
    return slots * slot_vecs * 16, ((slots - 1) * slot_vecs + v * pass_threads) * 16


@pytest.mark.parametrize("hq,hkv", [(1, 1), (32, 8), (32, 1), (64, 1), (48, 8), (40, 8)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_merge_ring_fits_every_launch_shape(hq, hkv, head_dim, kv_dtype):
    """Every tiling a user may ask for (tile, stages, warps, head splits, pipeline) gets a merge ring of
    two or more slots inside its stages: four vectors a thread once left a 16 KB pipeline no slot pair,
    and the kernel would not have compiled; and merge_item's reads of the last slot stay in the stages too."""
    shapes = 0
    for pipeline in ("normal", "transposed"):
        for kw in ({}, {"tile_kv": 32, "stages": 2}, {"tile_kv": 32, "stages": 2, "num_warps": 8},
                   {"tile_kv": 64, "stages": 2, "num_warps": 8}, {"tile_kv": 128, "stages": 2}):
            for head_splits in (None, 1):
                try:
                    k = DecodeKernel(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim,
                                                   kv_dtype=kv_dtype, pipeline=pipeline), head_splits=head_splits, **kw)
                except ValueError:
                    continue  # a shape the kernel refuses up front (with its own message)
                shapes += 1
                v, slots = k.merge_shape
                assert v in (1, 2, 4) and slots >= 2 and slots % 2 == 0
                ring, reads_end = merge_ring_bytes(k)
                assert ring <= k.pipe_bytes and reads_end <= k.pipe_bytes, k.name
    assert shapes > 0


def test_merge_item_guards_the_reads_of_threads_past_a_pass():
    """fp8 at d64 widened in registers, a group of 5 (memcheck, seventy-fifth session): had every thread read each
    slot, the last slot's reads would end past the stage area; the template skips the threads past a pass."""
    k = DecodeKernel(AttentionSpec(num_qo_heads=40, num_kv_heads=8, head_dim_qk=64, kv_dtype="fp8_e4m3",
                                   pipeline="transposed"))
    v, slots = k.merge_shape
    pass_threads = min(k.threads, k.item_rows * k.spec.head_dim_vo // 4 // v)
    slot_vecs = v * pass_threads + merge_lse_blocks(k.item_rows)
    every_thread_end = ((slots - 1) * slot_vecs + (v - 1) * pass_threads + k.threads) * 16
    assert pass_threads < k.threads and every_thread_end > k.pipe_bytes >= merge_ring_bytes(k)[1]
    assert "if constexpr (kPassThreads < kThreads)" in k.module().source


def test_merge_reads_stay_in_the_stages_of_every_default_and_whole_item_kernel():
    """The same for every kernel a wrapper builds by default: head dims, KV dtypes, pipelines, groups of 1-16 and
    MQA, 1-8 tokens a request (the pipeline spec_for_rows picks), the default tiling and each whole-item one."""
    from attnforge.kernels.decode import MAX_Q_LEN, spec_for_rows, whole_item_kernels
    kernels = 0
    for d, kv, pipeline, (hq, hkv), q in itertools.product(
            (64, 128, 256), ("bf16", "fp8_e4m3"), ("auto", "normal", "transposed"),
            [(8 * g, 8) for g in range(1, 17)] + [(32, 1), (64, 1)], range(1, MAX_Q_LEN + 1)):
        try:
            spec = spec_for_rows(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, kv_dtype=kv,
                                               pipeline=pipeline), q)
            built = [DecodeKernel(spec, max_q_len=q), *whole_item_kernels(spec, q)]
        except ValueError:
            continue  # rows past what the kernel takes (refused up front)
        for k in built:
            kernels += 1
            ring, reads_end = merge_ring_bytes(k)
            assert ring <= k.pipe_bytes and reads_end <= k.pipe_bytes, k.name
    assert kernels > 2000


def test_mqa_groups_split_into_items_of_16_heads():
    """MQA-sized groups on the normal pipeline (d <= 128) run as items of 16 query heads: the kernel is
    built for 16 heads (one m16 tile, its shared memory and tiling), the stream has group/16 items per
    KV head; other shapes keep one item per KV head, and a split must divide the group."""
    from attnforge.kernels.decode import DecodeKernel, default_head_splits
    mqa = DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1))
    assert (mqa.head_splits, mqa.item_heads, mqa.tile_kv, mqa.num_warps) == (2, 16, 64, 4)
    assert mqa.module().context["group_size"] == 16 and mqa.module().name.startswith("decode_g32_d128")
    assert "_hs2_" in mqa.module().name
    g16 = DecodeKernel(AttentionSpec(num_qo_heads=16, num_kv_heads=1))
    assert mqa.smem_bytes == g16.smem_bytes  # the same 16-head item
    for spec, splits in [(AttentionSpec(num_qo_heads=64, num_kv_heads=1), 4), (AttentionSpec(), 1),
                         (AttentionSpec(num_qo_heads=64, num_kv_heads=1, head_dim_qk=256), 1),  # d256: 8 warps
                         (AttentionSpec(num_qo_heads=40, num_kv_heads=2), 1)]:  # 20 heads: not a multiple of 16
        assert default_head_splits(spec) == splits, spec
    assert DecodeKernel(AttentionSpec(num_qo_heads=64, num_kv_heads=1), head_splits=1).item_heads == 64
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match=f"head_splits: expected a divisor of the group size 32, got {bad!r}"):
            DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1), head_splits=bad)


def test_plan_streams_head_split_items():
    """plan() lays out KV heads x head_splits items per request (the kernel's p.num_kv_heads)."""
    from attnforge import BatchDecode
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=1), max_batch_size=4)
    assert w._stream_items() == 2
    w.plan(np.array([0, 13, 14]), np.arange(14), np.array([16, 5]), page_size=16)  # (unequal: a plain stream)
    work = w._plan["work"]
    assert work.num_kv_heads == 2 and work.total == 2 * (208 + 64) + 2 * (5 + 64)


def test_merge_lse_blocks_cover_every_row_they_copy():
    """The merge reads lse[(row & 3) + h] for h < g from the blocks it copied from row & ~3: every row
    (rows start at multiples of g) must end inside them. Groups of 3 mod 4 once copied a block too few
    (group 3: its third head's lse read stale shared memory; found by tests/test_fuzz_gpu.py)."""
    for g in range(1, 65):
        blocks = merge_lse_blocks(g)
        assert blocks >= g // 4 + 1  # never fewer than before: those kernels are unchanged
        assert all((row & 3) + g <= 4 * blocks for row in range(0, 64 * g, g)), g
    assert [merge_lse_blocks(g) for g in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16)] == [1, 1, 2, 2, 2, 2, 3, 3, 4, 5]
    src = DecodeKernel(AttentionSpec(num_qo_heads=24, num_kv_heads=8)).module().source
    assert "constexpr int kMergeLseBlocks = 2;" in src


@pytest.mark.parametrize("hq,hkv,head_dim", [(1, 1, 128), (3, 1, 64), (5, 1, 128), (32, 8, 128), (48, 8, 256),
                                             (32, 1, 128), (64, 1, 256), (24, 8, 128), (21, 3, 64)])
@pytest.mark.parametrize("num_ctas", [1, 131, 396])
def test_merge_lse_blocks_stay_in_the_workspace(hq, hkv, head_dim, num_ctas):
    """The merge copies each chunk's lse row as the aligned 16-byte blocks around it
    (kernels.decode.merge_lse_blocks): past the last slot's row that reads up to 5 floats beyond the
    partial states, which BatchDecode.workspace_bytes pads by 32 bytes; checked for odd groups (3 and
    7 among them) and odd CTA counts."""
    from attnforge import BatchDecode
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim)
    g = DecodeKernel(spec).item_heads  # the kernel's rows a slot (the wrapper's _rows_per_slot)
    slots = 2 * num_ctas
    lse_floats = BatchDecode.workspace_bytes(spec, num_ctas) // 4 - slots * g * head_dim  # as BatchDecode slices it
    assert all((row & ~3) + 4 * merge_lse_blocks(g) <= lse_floats for row in range(0, slots * g, g))


@pytest.mark.parametrize("chains", [1, 2, 4])
def test_s_chains_render_into_the_kernel_and_only_1_2_or_4(chains):
    src = DecodeKernel(AttentionSpec(), qk_chains=chains).module().source
    assert f"constexpr int kQkChains = {chains};" in src
    for bad in (0, 3, 8, 2.0):
        with pytest.raises(ValueError, match="qk_chains: expected 1, 2 or 4"):
            DecodeKernel(AttentionSpec(), qk_chains=bad)


def test_float_out_renders_float_rows_and_leaves_the_16bit_kernel_as_it_was():
    """DecodeKernel.float_out: the same kernel with TOut = float (its stores go through store_floats, which writes
    16 bytes of floats where the row is aligned); the 16-bit kernel's source is the twin's but for that type."""
    for spec in (AttentionSpec(), AttentionSpec(kv_dtype="fp8_e4m3", pipeline="normal", num_kv_heads=2)):
        plain, twin = DecodeKernel(spec).module(), DecodeKernel(spec, float_out=True).module()
        assert "using TOut = bf16;" in plain.source and "using TOut = float;" in twin.source
        assert twin.source.replace("using TOut = float;", "using TOut = bf16;") == plain.source
        assert twin.name == plain.name.replace("_outbf16_", "_outf32_") != plain.name
        assert twin.kernel_names == plain.kernel_names
    with pytest.raises(ValueError, match="float_out: expected True or False, got 1"):
        DecodeKernel(AttentionSpec(), float_out=1)


def test_warp_bands_render_only_where_each_warp_reads_its_own_band():
    fp8 = AttentionSpec(kv_dtype="fp8_e4m3")  # transposed, widened in registers, 4 warps of 16 tokens
    assert "constexpr bool kWarpRows = true && kRegWiden && kTransposed &&" in DecodeKernel(fp8).module().source
    off = DecodeKernel(fp8, warp_rows=False).module()
    assert "constexpr bool kWarpRows = false" in off.source and off.name.endswith("_xb_t64s2w4")
    with pytest.raises(ValueError, match="warp_rows: expected True or False"):
        DecodeKernel(fp8, warp_rows=1)


def test_normal_pipeline_fp8_widened_in_registers_with_no_16_bit_copy():
    """normal_widen_in_registers: fp8 on the normal pipeline read from the swizzled fp8 stage and widened after
    ldmatrix (the shared-memory pass and its 16-bit tile gone), the default on that pipeline at d128 (whose items
    of 8 rows or fewer take the transposed pipeline by default); elsewhere refused before a build."""
    spec = AttentionSpec(num_qo_heads=64, num_kv_heads=8, kv_dtype="fp8_e4m3", pipeline="normal")
    plain = DecodeKernel(spec, max_q_len=4, normal_widen_in_registers=False)
    rw = DecodeKernel(spec, max_q_len=4, normal_widen_in_registers=True)
    for q in (1, 2, 4):  # the default at every item size (4-64 rows measured faster)
        assert DecodeKernel(spec, max_q_len=q) == dataclasses.replace(rw, max_q_len=q), q
    for kw in (dict(kv_dtype="bf16"), dict(head_dim_qk=64, head_dim_vo=64), dict(head_dim_qk=256, head_dim_vo=256)):
        assert not DecodeKernel(dataclasses.replace(spec, **kw), max_q_len=4).normal_widen_in_registers, kw
    assert not plain.widens_in_registers and rw.widens_in_registers
    assert plain.pipe_bytes - rw.pipe_bytes == 2 * 64 * 128 * 2  # the widened K and V tile
    assert rw.smem_bytes == 32 * 128 * 2 + 2 * 32 * 132 * 4  # Q, then the merge scratch: larger than the stages
    assert rw.module().name == plain.module().name.replace("_normal_", "_normal_rw_")
    assert "(kTransposed || true)" in rw.module().source and "(kTransposed || false)" in plain.module().source
    assert (rw.ctas_per_sm, rw.register_bound_ctas) == (3, 3)  # 32 rows: held to 168 registers, as before
    for bad, why in ((dataclasses.replace(spec, kv_dtype="bf16"), "got bf16 KV"),
                     (dataclasses.replace(spec, pipeline="transposed", num_qo_heads=32), "pipeline 'transposed'"),
                     (dataclasses.replace(spec, head_dim_qk=64, head_dim_vo=64), "head_dim 64")):
        with pytest.raises(ValueError, match=f"normal_widen_in_registers: .*{why}"):
            DecodeKernel(bad, normal_widen_in_registers=True)
    with pytest.raises(ValueError, match="normal_widen_in_registers: expected True or False, got 1"):
        DecodeKernel(spec, normal_widen_in_registers=1)
    with pytest.raises(ValueError, match="tile_kv=256 and num_warps=16 go together, for fp8 KV on the transposed"):
        DecodeKernel(spec, tile_kv=256, num_warps=16, normal_widen_in_registers=True)  # measured transposed only


def test_transposed_pipeline_takes_up_to_two_head_tiles():
    """The transposed kernel takes items of up to 16 heads (two n8 head tiles of O^T a warp), multiples of 16 as
    items of 16 (head splits), and refuses other groups before any build, with the fix named; 'auto' picks it
    for 16-bit KV up to 8 only (one tile; two need 200 registers), for fp8 KV up to 16 and multiples of 16 at d64
    and d256 (at d128 the normal pipeline, widened in registers too, takes groups past 8: one m16 tile, 4 CTAs)."""
    for group in (9, 12, 16):
        kernel = DecodeKernel(AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, pipeline="transposed"))
        assert kernel.item_heads == group and kernel.registers_needed == 200
        kw = dict(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype="fp8_e4m3")
        fp8 = DecodeKernel(AttentionSpec(**kw, pipeline="transposed"))
        assert (fp8.registers_needed, fp8.ctas_per_sm, fp8.register_bound_ctas) == (168, 3, 3)  # held to 3 CTAs
        auto = DecodeKernel(AttentionSpec(**kw))
        assert (auto.spec.pipeline, auto.normal_widen_in_registers, auto.ctas_per_sm) == ("normal", True, 4)
        d64 = DecodeKernel(AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, head_dim_qk=64, kv_dtype="fp8_e4m3"))
        assert d64.spec.pipeline == "transposed" and (d64.registers_needed, d64.ctas_per_sm) == (128, 4)  # O halves
        assert AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8).pipeline == "normal"
    assert AttentionSpec(num_qo_heads=64, num_kv_heads=8).pipeline == "transposed"
    for group in (32, 64):  # items of 16 heads, on either pipeline
        for d, pipeline in ((64, "transposed"), (128, "normal")):
            kernel = DecodeKernel(AttentionSpec(num_qo_heads=group, num_kv_heads=1, head_dim_qk=d, kv_dtype="fp8_e4m3"))
            assert (kernel.spec.pipeline, kernel.head_splits, kernel.item_heads) == (pipeline, group // 16, 16), d
    for group, splits in ((17, 1), (24, 1), (32, 1)):
        with pytest.raises(ValueError, match=f"up to 16 query rows \\(heads x tokens\\) a work item, got {group} "
                                             r".*Use pipeline='normal' \(or 'auto', which picks it there\)"):
            DecodeKernel(AttentionSpec(num_qo_heads=2 * group, num_kv_heads=2, pipeline="transposed"),
                         head_splits=splits)


def test_several_query_tokens_a_request_size_the_kernel_by_rows():
    """max_q_len: a work item holds its heads for each token (token-major rows), so shared memory, the
    transposed pipeline's row tiles, the merge's lse blocks and the workspace follow heads x tokens."""
    from attnforge import BatchDecode
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)  # group 4, transposed by default
    one, four = DecodeKernel(spec), DecodeKernel(spec, max_q_len=4)
    assert (one.item_rows, four.item_rows) == (4, 16) and four.registers_needed == 200
    assert 'constexpr int kQLen = 4;' in four.module().source and four.module().name.endswith("q4_t64s2w4")
    assert four.module().name != one.module().name and "q1" not in one.module().name
    assert BatchDecode.workspace_bytes(spec, 10, 4) - 32 == 4 * (BatchDecode.workspace_bytes(spec, 10) - 32)
    with pytest.raises(ValueError,
                       match=r"up to 16 query rows \(heads x tokens\) a work item, got 32 "
                             r"\(32/8 heads x 8 tokens a request\)"):
        DecodeKernel(spec, max_q_len=8)
    assert DecodeKernel(dataclasses.replace(spec, pipeline="normal"), max_q_len=8).item_rows == 32
    with pytest.raises(ValueError, match=r"4 tokens x 32 query heads a work item is 128 rows, past the kernel's 64"):
        DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=1, pipeline="normal"), max_q_len=4, head_splits=1)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="max_q_len: expected an int in"):
            DecodeKernel(spec, max_q_len=bad)


def test_wrappers_check_max_q_len_before_touching_a_device():
    """BatchDecode takes 1-8 query tokens a request, BatchMLADecode 1-4 (each class's MAX_Q_LEN); anything else
    (a bool, a float, 0, past the limit) is refused by the constructor's first check, so no GPU is needed here."""
    from attnforge import BatchDecode, BatchMLADecode
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    for cls, spec, limit in ((BatchDecode, AttentionSpec(), 8), (BatchMLADecode, mla, 4)):
        assert cls.MAX_Q_LEN == limit
        for bad in (0, limit + 1, 2.0, True):
            with pytest.raises(ValueError, match=rf"max_q_len: expected an int in \[1, {limit}\], got {bad!r}\. "
                                                 r"Query tokens per request"):
                cls(spec, max_q_len=bad, device="cpu")


def test_plan_takes_q_len_up_to_the_wrappers_max():
    from attnforge import BatchDecode
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    w = BatchDecode.host_only(spec)
    assert w.max_q_len == 1 and w._whole is not None  # one token a request: the whole-item kernel stays
    w.plan([0, 2, 3], [0, 1, 2], [16, 5], page_size=16)
    assert w._plan["q_len"] == 1
    with pytest.raises(ValueError, match=r"plan\(q_len=...\): expected an int in \[1, max_q_len=1\], got 2"):
        w.plan([0, 2, 3], [0, 1, 2], [16, 5], page_size=16, q_len=2)


def test_the_default_pipeline_follows_an_items_rows_and_head_splits_keep_them_in_bounds():
    from attnforge.kernels.decode import default_head_splits, spec_for_rows
    gqa = AttentionSpec(num_qo_heads=32, num_kv_heads=8)  # group 4: 'auto' resolved to transposed
    assert spec_for_rows(gqa, 1) is gqa and spec_for_rows(gqa, 2) is gqa  # 8 rows: one n8 tile
    assert spec_for_rows(gqa, 4).pipeline == "normal" and spec_for_rows(gqa, 8).pipeline == "normal"
    fp8 = dataclasses.replace(gqa, kv_dtype="fp8_e4m3")  # widened in registers on the transposed pipeline
    # at d128 up to 8 rows (past them the normal pipeline, widened in registers too), elsewhere up to 16
    assert spec_for_rows(fp8, 2) is fp8 and spec_for_rows(fp8, 3).pipeline == "normal"
    fp8_d64 = dataclasses.replace(fp8, head_dim_qk=64, head_dim_vo=64)
    assert spec_for_rows(fp8_d64, 4) is fp8_d64 and spec_for_rows(fp8_d64, 5).pipeline == "normal"
    # explicit head_splits set the item's rows: fp8 at 8 tokens in items of 1 head (8 rows) stays transposed,
    # in items of 2 (16 rows) at d64 too
    assert spec_for_rows(fp8, 8, head_splits=4) is fp8 and spec_for_rows(fp8, 8, head_splits=2).pipeline == "normal"
    assert spec_for_rows(fp8_d64, 8, head_splits=2) is fp8_d64
    assert spec_for_rows(gqa, 4, head_splits=2) is gqa  # 16-bit: 8 rows, one n8 tile
    from attnforge import BatchDecode  # bad head_splits reach DecodeKernel's message, before any device work
    for bad in ("2", 3, 0, True):
        with pytest.raises(ValueError, match=r"DecodeKernel.head_splits: expected a divisor of the group size 4"):
            BatchDecode(fp8, max_q_len=8, head_splits=bad)
    kw16 = dict(num_qo_heads=32, num_kv_heads=2, kv_dtype="fp8_e4m3", head_dim_qk=64)
    fp8_16 = AttentionSpec(**kw16)  # 'auto' at d64: transposed, two n8 tiles
    assert fp8_16.pipeline == "transposed" and spec_for_rows(fp8_16, 1) is fp8_16
    assert spec_for_rows(fp8_16, 2).pipeline == "normal"  # 32 rows: past the transposed kernel's 16
    assert AttentionSpec(**dict(kw16, head_dim_qk=128)).pipeline == "normal"  # d128: one m16 tile
    fp8_mqa = AttentionSpec(num_qo_heads=32, num_kv_heads=1, kv_dtype="fp8_e4m3", head_dim_qk=64)  # items of 16
    assert spec_for_rows(fp8_mqa, 1) is fp8_mqa and spec_for_rows(fp8_mqa, 2).pipeline == "normal"
    assert default_head_splits(spec_for_rows(fp8_mqa, 2), 2) == 2
    normal = dataclasses.replace(gqa, pipeline="normal")
    assert spec_for_rows(normal, 2) is normal  # an explicit normal stays
    mqa = AttentionSpec(num_qo_heads=32, num_kv_heads=1)  # normal, 16-head items
    assert (default_head_splits(mqa), default_head_splits(mqa, 4), default_head_splits(mqa, 8)) == (2, 2, 4)
    assert DecodeKernel(mqa, max_q_len=8).item_rows == 64
    from attnforge import BatchDecode
    w = BatchDecode.host_only(gqa)
    assert w.kernel.spec.pipeline == "transposed"

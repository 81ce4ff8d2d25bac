"""BatchDecode.plan on the host, with the CUDA calls stubbed: what it writes for the kernel and which
earlier copy it waits for (two pinned staging buffers used in turn)."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, scheduler
from attnforge.decode import BatchDecode, fits_device_smem, grid_ctas
from attnforge.kernels.decode import MERGE_LSE_SLACK_BYTES, DecodeKernel
from attnforge.jit.upload import HostOnlyUpload
from helpers import csr_table as table


def host_wrapper() -> BatchDecode:
    return BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=16,
                                 max_num_pages=1 << 10)


def test_plan_waits_for_the_copy_two_plans_back_and_writes_what_it_was_given():
    w = host_wrapper()
    tables = [table([100, 17, 1000]), table([5, 4096]), table([1, 2, 3, 700])]
    for t in tables:
        w.plan(*t, page_size=16)
        indptr, indices, _ = t
        # the kernel's device buffer is a copy of the buffer just written: it holds this plan's table
        got = w._upload.dev  # on this stand-in the "device" buffer lives on the host
        off, _ = w._offsets["kv_indices"]
        assert np.array_equal(got[off:off + len(indices)].numpy(), indices)
        off, _ = w._offsets["kv_indptr"]
        assert np.array_equal(got[off:off + len(indptr)].numpy(), indptr)
    # plans 1 and 2 use buffers 0 and 1 and wait for nothing; plan 3 reuses buffer 0 and waits for
    # plan 1's copy only, before writing it
    assert w._upload.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 0)]


def test_growing_the_page_buffers_drains_the_old_copies_first():
    w = host_wrapper()
    w.plan(*table([100, 17]), page_size=16)
    w.plan(*table([5, 40]), page_size=16)
    old = w._upload
    big = table([16 * 1024, 16 * 1024])  # 2048 pages > max_num_pages=1024: the buffers grow
    w.plan(*big, page_size=16)
    assert w._upload is not old and old.log[-2:] == [("wait", 0), ("wait", 1)]
    off, _ = w._offsets["kv_indices"]
    assert np.array_equal(w._upload.dev[off:off + len(big[1])].numpy(), big[1])


def test_upload_refuses_to_copy_past_its_buffers():
    up = HostOnlyUpload(64)
    up.host()[:] = 7
    up.upload(64)
    assert (up.dev.numpy() == 7).all()
    with pytest.raises(ValueError, match=r"values \[0, 65\) exceed the 64-value buffers"):
        up.upload(65)


def test_grid_ctas_defaults_to_the_occupancy_and_takes_fewer():
    assert grid_ctas(132, 3) == 396 and grid_ctas(132, 3, 1) == 132 and grid_ctas(132, 2, 2) == 264
    for bad in (0, 4, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"ctas_per_sm: expected an int in \[1, 3\]"):
            grid_ctas(132, 3, bad)


def whole_wrapper(graph: bool = False, whole_items=None, **spec_kw) -> BatchDecode:
    w = BatchDecode.host_only(AttentionSpec(**{"num_qo_heads": 32, "num_kv_heads": 8, **spec_kw}), max_batch_size=16,
                              max_num_pages=1 << 13)
    w.use_cuda_graph, w.whole_items = graph, whole_items
    if whole_items is False:  # (as the constructor: no whole-item kernel at all)
        w._wholes = ()
    return w


def test_about_one_equal_item_per_sm_plans_the_whole_item_kernel():
    w = whole_wrapper()
    assert w._whole is not None and w._whole.ctas_per_sm == 1 and w._whole_ctas == 132
    w.plan(*table([4096] * 15 + [4090]), page_size=16)  # 128 near-equal items: one a CTA
    kernel, ctas = w.planned_kernel
    assert kernel is w._whole and ctas == 132 and w._plan["work"].num_spans == 128
    for lengths in ([4096] * 12, [65536] + [512] * 15):  # 96 items; unequal items
        w.plan(*table(lengths), page_size=16)
        assert w.planned_kernel == (w.kernel, w.num_ctas)


def test_about_four_equal_items_per_sm_plan_the_four_cta_kernel():
    """One token a request on the transposed pipeline (16-bit, d128) has a second whole-item kernel, of 4 CTAs
    an SM (kernels.decode.four_cta_tiling): 64 equal requests x 8 KV heads are 512 items on its 528 CTAs, one
    whole item each, where the default kernel's 396 CTAs would split them. A group of 4 runs it on the normal
    pipeline's m16 tile (measured faster there), other groups on their spec's. 128 items keep the
    one-CTA-an-SM kernel; 480 (B60: 10% of the CTAs idle) and unequal requests the default kernel. The
    workspace and the partial slots hold the largest grid."""
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    w = BatchDecode.host_only(spec)
    assert [(x.kernel.ctas_per_sm, x.ctas) for x in w._wholes] == [(1, 132), (4, 528)]
    assert w.spec.pipeline == w.kernel.spec.pipeline == w._whole.spec.pipeline == "transposed"
    four = w._wholes[1].kernel
    assert (four.tile_kv, four.num_stages, four.num_warps, four.spec.pipeline) == (32, 3, 2, "normal")
    assert BatchDecode.host_only(AttentionSpec(num_kv_heads=4))._wholes[1].kernel.spec.pipeline == "transposed"
    normal = BatchDecode.host_only(AttentionSpec(pipeline="normal"))  # asked for: the same 4-CTA kernel
    assert normal.kernel.spec.pipeline == "normal" and normal._wholes[-1].kernel == four
    assert four.head_splits == 1 and four.item_rows == 4 and w.partial_slot_rows() >= 528 * 4
    assert w._workspace_need() >= BatchDecode.workspace_bytes(spec, 528)
    w.plan(*table([4096] * 63 + [4090]), page_size=16)
    assert w.planned_kernel == (four, 528) and scheduler.is_whole_item_plan(w._plan["work"])
    w.plan(*table([4096] * 16), page_size=16)
    assert w.planned_kernel == (w._whole, 132)
    for lengths in ([4096] * 60, [8192] + [4096] * 63):
        w.plan(*table(lengths), page_size=16)
        assert w.planned_kernel == (w.kernel, w.num_ctas)
    graph = BatchDecode.host_only(spec)
    graph.use_cuda_graph, graph.whole_items = True, True  # the first plan's batch picks the kernel a graph keeps
    graph.plan(*table([4096] * 64), page_size=16)
    assert graph.planned_kernel == (four, 528)
    graph.plan(*table([8192] + [100] * 63), page_size=16)  # unequal: a plain stream over the captured grid
    work = graph._plan["work"]
    assert graph.planned_kernel == (four, 528) and work.span == -(-work.total // 528)


@pytest.mark.parametrize("spec_kw", [{}, {"pipeline": "normal"}, {"kv_dtype": "fp8_e4m3"}, {"num_kv_heads": 1},
                                     {"num_kv_heads": 2}, {"num_qo_heads": 128}, {"head_dim_qk": 256},
                                     {"head_dim_qk": 64}, {"num_kv_heads": 32},
                                     {"num_qo_heads": 128, "kv_dtype": "fp8_e4m3"},
                                     {"num_kv_heads": 1, "kv_dtype": "fp8_e4m3"}])
@pytest.mark.parametrize("max_q_len", [1, 2, 4, 8])
def test_workspace_and_slots_hold_every_kernel_a_plan_may_pick(spec_kw, max_q_len):
    """Each kernel a wrapper may launch (its default and its whole-item kernels, whatever their grids) writes
    partial states into the two slots of each of its CTAs: the slot rows and the workspace must hold the largest
    such grid (a wrapper sized for its default grid alone once overran the lse region on the H200)."""
    spec = AttentionSpec(**{"num_qo_heads": 32, "num_kv_heads": 8, **spec_kw})
    w = BatchDecode.host_only(spec, max_q_len=max_q_len)
    kernels = [(w.kernel, w.num_ctas)] + [(x.kernel, x.ctas) for x in w._wholes]
    rows = max(ctas * k.item_rows for k, ctas in kernels)
    assert w.partial_slot_rows() >= rows
    assert w._workspace_need() >= 2 * rows * (w.spec.head_dim_vo + 1) * 4 + MERGE_LSE_SLACK_BYTES


@pytest.mark.parametrize("hq,hkv,pipeline", [(128, 8, "normal"), (96, 8, "normal"), (64, 4, "normal"),
                                             (24, 8, "transposed")])
def test_one_head_tile_groups_plan_the_four_cta_kernel(hq, hkv, pipeline):
    """Groups of 9-16 on the normal pipeline (one m16 tile, every query head in one item: the verify step's
    item shape) and a group of 3 on the transposed one (3 of its n8 tile's rows) take the 4-CTA kernel too
    where equal items fill its grid."""
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv))
    four = w._wholes[-1]
    assert w.spec.pipeline == pipeline and (four.kernel.ctas_per_sm, four.ctas, four.kernel.item_rows) == \
        (4, 528, hq // hkv)
    w.plan(*table([4096] * (512 // hkv)), page_size=16)
    assert w.planned_kernel == (four.kernel, 528) and scheduler.is_whole_item_plan(w._plan["work"])


@pytest.mark.parametrize("spec_kw", [{"kv_dtype": "fp8_e4m3"}, {"pipeline": "normal", "num_kv_heads": 4},
                                     {"head_dim_qk": 64}, {"head_dim_qk": 256},
                                     {"num_qo_heads": 128, "pipeline": "transposed"}, "alibi",
                                     {"num_kv_heads": 32}, {"num_kv_heads": 16}, {"num_kv_heads": 1}])
def test_one_token_specs_without_the_measured_four_cta_tiling(spec_kw):
    """fp8 KV (4 CTAs an SM on its default already), a normal spec's group of 8 (not measured), d64 / d256,
    transposed groups past 8 (two n8 head tiles), groups of 1-2 (MHA, 32/16: items mostly padding rows, a tie
    or a loss on the H200), MQA-sized groups (an m16 tile of 16 heads spills there) and slopes read at run time:
    no 4-CTA kernel; 512 equal items stream on the default kernel."""
    from attnforge import mods
    from attnforge.kernels.decode import FOUR_CTA_M16_WHOLE_ITEM_TILING, FOUR_CTA_WHOLE_ITEM_TILING, four_cta_tiling
    if spec_kw == "alibi":
        spec_kw = {"score_mod": mods.alibi(torch.ones(32))}
    spec = AttentionSpec(**{"num_qo_heads": 32, "num_kv_heads": 8, **spec_kw})
    w = BatchDecode.host_only(spec)
    assert four_cta_tiling(w.spec) is None
    assert not {FOUR_CTA_WHOLE_ITEM_TILING, FOUR_CTA_M16_WHOLE_ITEM_TILING} & {x.tiling for x in w._wholes}
    w.plan(*table([4096] * (512 // w._stream_items())), page_size=16)
    assert w.planned_kernel == (w.kernel, w.num_ctas)


@pytest.mark.parametrize("hq,q_len,rows", [(32, 4, 16), (32, 3, 12), (64, 2, 16), (32, 2, 8), (16, 2, 4)])
def test_verify_steps_of_about_one_equal_item_a_cta_plan_the_four_cta_kernel(hq, q_len, rows):
    """Verify steps of 4-16 rows an item (16-bit, d128; items of 4-8 rows, the transposed pipeline's, on the
    normal pipeline's m16 tile) have a whole-item kernel of 4 CTAs an SM (kernels.decode.verify_four_cta_tiling):
    64 equal requests x 8 KV heads are 512 items on its 528 CTAs, one whole item each; 60 requests (480 items:
    10% of the CTAs idle), unequal requests and CUDA-graph mode (unless whole_items=True) keep the default kernel."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=8)
    w = BatchDecode.host_only(spec, max_q_len=q_len)
    assert w.spec.pipeline == ("transposed" if rows <= 8 else "normal")
    whole = w._wholes[-1].kernel  # (after the one-CTA-an-SM kernel where the spec has one)
    assert whole.item_rows == rows and whole.ctas_per_sm == 4 and w._wholes[-1].ctas == 528
    assert (whole.tile_kv, whole.num_stages, whole.num_warps) == (32, 3, 2) and whole.spec.pipeline == "normal"
    assert w.kernel.ctas_per_sm == 3 and w.partial_slot_rows() >= 528 * rows
    # the workspace the constructor allocates holds both slot regions for the larger grid (the first build sized
    # it for the default's 396 CTAs: the partial states took the lse region, an illegal access on the H200)
    assert w._workspace_need() >= 2 * w.partial_slot_rows() * (spec.head_dim_vo + 1) * 4 + MERGE_LSE_SLACK_BYTES
    w.plan(*table([4096] * 63 + [4090]), page_size=16, q_len=q_len)
    kernel, ctas = w.planned_kernel
    assert kernel is whole and ctas == 528 and w._plan["work"].num_spans == 512
    assert scheduler.aligned_chunks(w._plan["work"]) == 1  # each item whole, one a span
    for lengths in ([4096] * 60, [8192] + [4096] * 63):
        w.plan(*table(lengths), page_size=16, q_len=q_len)
        assert w.planned_kernel == (w.kernel, w.num_ctas)
    w.use_cuda_graph = True  # (no whole_items=True: a graph keeps its default kernel)
    w.plan(*table([4096] * 64), page_size=16, q_len=q_len)
    assert w.planned_kernel == (w.kernel, w.num_ctas)


@pytest.mark.parametrize("spec_kw,q_len", [({"kv_dtype": "fp8_e4m3"}, 4), ({"head_dim_qk": 64}, 4),
                                           ({"num_qo_heads": 8}, 2), ({}, 8), ({"num_qo_heads": 64}, 4), ("alibi", 4)])
def test_verify_steps_without_a_measured_four_cta_tiling(spec_kw, q_len):
    """fp8 KV (4 CTAs an SM on its default already), d64, 2 rows (MHA-sized q2: mostly padding), past 16 rows,
    ALiBi's slopes read at run time (as the one-token whole-item kernel excludes them): no 4-CTA kernel, while a
    soft-cap keeps it."""
    from attnforge import mods
    if spec_kw == "alibi":
        spec_kw = {"score_mod": mods.alibi(torch.ones(32))}
        soft = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8, score_mod=mods.softcap(30.0)),
                                     max_q_len=q_len)
        assert [x.kernel.ctas_per_sm for x in soft._wholes] == [1, 4]
    w = BatchDecode.host_only(AttentionSpec(**{"num_qo_heads": 32, "num_kv_heads": 8, **spec_kw}), max_q_len=q_len)
    assert all(x.kernel.ctas_per_sm == 1 for x in w._wholes)


@pytest.mark.parametrize("hq,hkv,kv_dtype,q_len,rows,pipeline,max_chunks", [
    (32, 8, "bf16", 8, 32, "normal", 8), (32, 8, "bf16", 4, 16, "normal", 8), (128, 8, "bf16", 4, 64, "normal", 4),
    (32, 8, "bf16", 2, 8, "transposed", 1), (32, 32, "bf16", 2, 2, "transposed", 1),
    (32, 8, "fp8_e4m3", 4, 16, "transposed", 1)])
def test_verify_steps_of_about_one_equal_item_an_sm_plan_the_one_cta_kernel(hq, hkv, kv_dtype, q_len, rows, pipeline,
                                                                            max_chunks):
    """Verify steps of about one equal item an SM (GQA 32/8 B16: 128 items on 132 SMs) take the one-CTA-an-SM
    kernel (kernels.decode.verify_one_cta_tiling: 128-token tiles of 8 warps, fp8's two n8 tiles too, where
    the default runs the normal pipeline), one whole item a CTA; the normal pipeline's m16 tiles also take fewer
    equal items cut into 2-8 equal chunks (4 at 64 rows); 13 requests (21% of the SMs idle), unequal requests and
    CUDA-graph mode (unless whole_items=True) keep the default kernel."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype)
    w = BatchDecode.host_only(spec, max_q_len=q_len)
    one = w._wholes[0]
    assert (one.kernel.tile_kv, one.kernel.num_stages, one.kernel.num_warps, one.ctas) == (128, 3, 8, 132)
    assert one.kernel.ctas_per_sm == 1 and one.kernel.item_rows == rows and one.kernel.spec.pipeline == pipeline
    assert one.tiling.max_chunks == max_chunks and w.kernel.ctas_per_sm in (2, 3, 4)
    # the default kernel: fp8's 16 rows (d128) on the normal pipeline, widened in registers
    assert w.kernel.spec.pipeline == ("normal" if rows > 8 else "transposed")
    batch = 128 // hkv
    w.plan(*table([8192] * (batch - 1) + [8180]), page_size=16, q_len=q_len)
    assert w.planned_kernel == (one.kernel, 132) and w._plan["work"].num_spans == 128
    assert scheduler.aligned_chunks(w._plan["work"]) == 1  # each item whole, one a span
    for chunks in (2, 4, 8, 16):
        if batch // chunks:
            w.plan(*table([8192 * chunks] * (batch // chunks)), page_size=16, q_len=q_len)
            taken = w.planned_kernel[0] is one.kernel
            assert taken is (chunks <= max_chunks), chunks
            assert not taken or scheduler.aligned_chunks(w._plan["work"]) == chunks
    for lengths in ([8192] * (batch * 13 // 16), [16384] + [8192] * (batch - 1)):
        w.plan(*table(lengths), page_size=16, q_len=q_len)
        assert w.planned_kernel == (w.kernel, w.num_ctas), lengths
    w.use_cuda_graph = True  # (no whole_items=True: a graph keeps its default kernel)
    w.plan(*table([8192] * batch), page_size=16, q_len=q_len)
    assert w.planned_kernel == (w.kernel, w.num_ctas)


@pytest.mark.parametrize("spec_kw,q_len", [({"kv_dtype": "fp8_e4m3"}, 8), ({"kv_dtype": "fp8_e4m3"}, 2),
                                           ({"head_dim_qk": 64}, 4), ({"num_qo_heads": 128}, 8),
                                           ({"num_kv_heads": 1}, 4), ("alibi", 4)])
def test_verify_steps_without_a_measured_one_cta_tiling(spec_kw, q_len):
    """fp8 on the normal pipeline (32 rows: +4.4%, widened through shared memory), fp8 items of 8 rows (+3.4%),
    d64 (+3.8%), items split by heads (GQA 128/8 q8) and MQA (not measured), ALiBi's slopes read at run time:
    no one-CTA-an-SM kernel, and 128 equal items stream on the default kernel."""
    from attnforge import mods
    from attnforge.kernels.decode import verify_one_cta_tiling
    if spec_kw == "alibi":
        spec_kw = {"score_mod": mods.alibi(torch.ones(32))}
    w = BatchDecode.host_only(AttentionSpec(**{"num_qo_heads": 32, "num_kv_heads": 8, **spec_kw}), max_q_len=q_len)
    assert verify_one_cta_tiling(w.spec, q_len) is None and all(x.kernel.ctas_per_sm > 1 for x in w._wholes)
    w.plan(*table([8192] * (128 // w._stream_items())), page_size=16, q_len=q_len)
    assert w.planned_kernel == (w.kernel, w.num_ctas)


@pytest.mark.parametrize("spec_kw", [{"kv_dtype": "fp8_e4m3", "pipeline": "normal"}, {"head_dim_qk": 64},
                                     {"pipeline": "normal"}, {"num_qo_heads": 128, "pipeline": "transposed"},
                                     {"num_qo_heads": 48, "num_kv_heads": 1}])  # 128/8: two n8 head tiles; MQA-48
def test_specs_without_a_measured_whole_item_tiling_keep_one_kernel(spec_kw):
    w = whole_wrapper(**spec_kw)  # (GQA 32/8 on the normal pipeline: its group of 4 pads a 16-head tile)
    assert all(x.kernel.ctas_per_sm == 4 for x in w._wholes)  # no one-CTA-an-SM kernel (a 4-CTA one may be)
    w.plan(*table([4096] * 16), page_size=16)
    assert w.planned_kernel == (w.kernel, w.num_ctas)


@pytest.mark.parametrize("hq,hkv,whole,mod", [(32, 2, True, None), (32, 32, True, None), (32, 4, True, None),
                                              (32, 1, True, None), (64, 1, True, None), (32, 8, True, "softcap"),
                                              (32, 8, True, "constant"), (32, 8, False, "alibi"),
                                              (32, 8, False, "scalar")])
def test_whole_item_tilings_by_head_layout(hq, hkv, whole, mod):
    """Measured winners: one 16-head tile on the normal pipeline, transposed groups up to 8, MQA 32/1 and
    64/1 as one item of every query head, with or without a score modifier; not an affine hook whose slope
    is read at run time (ALiBi's per-head tensor, a runtime scalar: +3% there against the default kernel),
    while a constant slope keeps the whole-item kernel."""
    from attnforge import mods
    mod = {None: None, "softcap": mods.softcap(30.0), "alibi": mods.alibi(torch.ones(hq)),
           "constant": mods.compile_mod(score_mod=lambda s, b, h, q, kv: s - 0.5 * (kv - q)),
           "scalar": mods.compile_mod(score_mod=lambda s, b, h, q, kv: s + torch.tensor(0.5) * (kv - q))}[mod]
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, score_mod=mod)
    w = BatchDecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 14)
    assert (w._whole is not None) is whole
    w.plan(*table([4096] * (128 // w._stream_items())), page_size=16)
    assert (w.planned_kernel[0] is w._whole) is whole


@pytest.mark.parametrize("hq,hkv,tile", [(32, 2, 128), (128, 8, 128), (96, 8, None), (32, 8, 256), (32, 1, None)])
def test_fp8_whole_item_tilings_by_head_tiles(hq, hkv, tile):
    """fp8 KV at d128: one n8 head tile ('auto': transposed) reads whole items on sixteen warps
    (FP8_WHOLE_ITEM_TILING), a group of 16 ('auto': normal, widened in registers) on the transposed kernel's two
    full n8 tiles in verify's eight-warp 128-token tiling; a group of 12 (+0.3% whole) and MQA's items of 16 heads
    (not measured whole) keep one kernel."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype="fp8_e4m3")
    w = BatchDecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 14)
    assert spec.pipeline == ("transposed" if hq // hkv <= 8 else "normal")
    assert (None if w._whole is None else w._whole.tile_kv) == tile
    assert w._whole is None or w._whole.spec.pipeline == "transposed"
    w.plan(*table([4096] * (128 // w._stream_items())), page_size=16)
    assert (w.planned_kernel[0] is w._whole) is (tile is not None)
    if (hq, hkv) == (32, 2):  # one request: two items cut into 66 equal chunks, one a CTA
        w.plan(*table([131072]), page_size=16)
        assert w.planned_kernel == (w._whole, 132) and scheduler.aligned_chunks(w._plan["work"]) == 66


def test_under_cuda_graphs_whole_items_is_opt_in_and_the_first_plan_decides():
    off = whole_wrapper(graph=True)  # None: never under graphs (placeholder lengths at capture)
    off.plan(*table([4096] * 16), page_size=16)
    assert off.planned_kernel[0] is off.kernel
    on = whole_wrapper(graph=True, whole_items=True)
    on.plan(*table([4096] * 16), page_size=16)
    assert on.planned_kernel == (on._whole, 132)
    on.plan(*table([65536] + [512] * 15), page_size=16)  # the captured kernel, its grid, a plain stream
    work = on._plan["work"]
    assert on.planned_kernel == (on._whole, 132) and work.span == -(-work.total // 132)
    small = whole_wrapper(graph=True, whole_items=True)
    small.plan(*table([4096] * 12), page_size=16)  # 96 items: the default kernel, kept after
    small.plan(*table([4096] * 12), page_size=16)
    assert small.planned_kernel == (small.kernel, small.num_ctas)


@pytest.mark.parametrize("hq,hkv,kv,batch,chunks", [(32, 8, "fp8_e4m3", 16, 1), (32, 8, "fp8_e4m3", 8, 2),
                                                    (32, 8, "fp8_e4m3", 1, 16), (8, 2, "fp8_e4m3", 2, 33),
                                                    (8, 2, "fp8_e4m3", 1, 0), (32, 2, "bf16", 4, 16),
                                                    (32, 2, "bf16", 16, 4), (32, 2, "bf16", 1, 66),
                                                    (32, 1, "bf16", 16, 8), (32, 1, "bf16", 4, 33),
                                                    (32, 1, "bf16", 2, 66), (32, 1, "bf16", 1, 132),
                                                    (64, 1, "bf16", 33, 4), (64, 1, "bf16", 8, 16),
                                                    (64, 1, "bf16", 4, 33), (64, 1, "bf16", 1, 132),
                                                    (32, 8, "bf16", 8, 0), (32, 8, "bf16", 1, 0),
                                                    (32, 2, "bf16", 40, 0)])
def test_chunked_plans_of_equal_items_on_the_whole_item_kernel(hq, hkv, kv, batch, chunks):
    """Tilings with max_chunks > 1 take equal items cut into k equal chunks, items x k ~ the SMs (one chunk a CTA),
    up to what was measured to win: fp8 33, the normal pipeline's 16-head tile 66, MQA 32/1 33 and 64/1 16 (an
    item's merge reads k x its heads' partial states: kernels.decode.MERGED_HEAD_ROWS), and MQA up to 132 where
    those merges go to the second launch (the default outside CUDA graphs). The transposed 16-bit
    kernel takes whole items only (chunked tied there), and 80 items (k = 1 leaves 52 SMs idle) plan the default
    kernel. MQA's whole-item kernel plans one item of every query head a request."""
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv), max_batch_size=64)
    w.plan(*table([5000 - b % 7 for b in range(batch)]), page_size=16)
    kernel, ctas = w.planned_kernel
    assert (kernel is w._whole) is (chunks > 0)
    if chunks:
        work = w._plan["work"]
        assert ctas == 132 and scheduler.aligned_chunks(work) == chunks and w._plan["stream_items"] == hkv
        rows = scheduler.expand(work)
        assert np.bincount(rows[:, 0]).max() == 1  # one chunk a CTA
        covered = np.bincount(rows[:, 1] * hkv + rows[:, 2], weights=rows[:, 4] - rows[:, 3])
        assert np.array_equal(covered, np.repeat([5000 - b % 7 for b in range(batch)], hkv))
    else:
        assert (kernel, ctas) == (w.kernel, w.num_ctas)
        assert w._plan["stream_items"] == hkv * w.kernel.head_splits


@pytest.mark.parametrize("hq,batch,in_kernel_cap", [(32, 1, 33), (32, 2, 33), (64, 1, 16), (64, 4, 16)])
def test_mqa_chunks_past_the_in_kernel_merge_cap_only_with_the_merge_launch(hq, batch, in_kernel_cap):
    """MQA's whole-item kernel takes more chunks than its tail merge was measured to win with only where the
    second launch merges them: by the rule (and it does), or forced on; not with merge_launch=False, nor under
    CUDA graphs unless merge_launch=True."""
    def planned(graph=False, merge_launch=None):
        w = whole_wrapper(graph, whole_items=graph or None, num_qo_heads=hq, num_kv_heads=1)
        w.merge_in_launch = merge_launch
        w.plan(*table([131072 // batch] * batch), page_size=16)
        return w, scheduler.aligned_chunks(w._plan["work"]) if w.planned_kernel[0] is w._whole else 0
    w, chunks = planned()
    assert chunks == 132 // batch > in_kernel_cap and w._plan["merge_launch"] is True
    assert w._whole.item_heads * chunks > scheduler.MERGE_LAUNCH_ROWS  # why the rule launches it
    assert planned(merge_launch=True)[1] == 132 // batch
    for kw in (dict(merge_launch=False), dict(graph=True), dict(graph=True, merge_launch=False)):
        w, chunks = planned(**kw)
        assert chunks == 0 and w.planned_kernel[0] is w.kernel, kw
    w, chunks = planned(graph=True, merge_launch=True)
    assert chunks == 132 // batch and w._plan["merge_launch"] is True


def test_partial_slots_hold_the_whole_item_kernels_larger_items():
    """MQA 64/1: the default kernel's 396 CTAs hold items of 16 heads, the whole-item kernel's 132 items of
    64; the partial-state regions are sized for whichever needs more rows, within workspace_bytes."""
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=64, num_kv_heads=1))
    assert (w.num_ctas, w.kernel.item_heads, w._whole_ctas, w._whole.item_heads) == (396, 16, 132, 64)
    rows = w.partial_slot_rows()
    assert rows == 132 * 64 > 396 * 16
    assert BatchDecode.workspace_bytes(w.spec, w.num_ctas) >= 2 * rows * (w.spec.head_dim_vo + 1) * 4
    assert w._workspace_need() >= 2 * rows * (w.spec.head_dim_vo + 1) * 4 + MERGE_LSE_SLACK_BYTES


@pytest.mark.parametrize("hq,hkv,lengths,expected", [
    ((32, 1, [131072], True)), (32, 1, [8192] * 16, False), (32, 8, [131072], False), (32, 8, [8192] * 16, False),
    (32, 2, [131072], True), (64, 1, [65536] * 2, True), (32, 8, [65536] + [512] * 127, False)])
@pytest.mark.parametrize("head_dim,kv_dtype", [(128, "bf16"), (64, "bf16"), (64, "fp8_e4m3")])
def test_merge_launch_where_an_items_merge_reads_many_partial_rows(hq, hkv, lengths, expected, head_dim, kv_dtype):
    """merge_launch=None: a second launch merges where one item's merge on the first kernel's tail would read
    more than scheduler.MERGE_LAUNCH_ROWS partial rows (chunks x query heads): few long requests of many
    query heads (MQA B1: ~200 chunks x 16 heads), not GQA 32/8 B1 (~50 x 4), batches, or the skewed batch.
    At d64 too since the seventy-sixth session (its merge kernel's lanes are half warps)."""
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim, head_dim_vo=head_dim,
                         kv_dtype=kv_dtype)
    w = BatchDecode.host_only(spec, max_batch_size=128)
    w.plan(*table(lengths), page_size=16)
    k = w.planned_kernel[0]
    assert w._plan["merge_launch"] is expected
    assert (scheduler.longest_merge_rows(w._plan["work"], k.item_heads) > scheduler.MERGE_LAUNCH_ROWS) is expected


def test_merge_launch_forced_and_under_cuda_graphs():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=1)
    w = BatchDecode.host_only(spec)
    w.merge_in_launch = False
    w.plan(*table([131072]), page_size=16)
    assert w._plan["merge_launch"] is False
    w.merge_in_launch = True
    w.plan(*table([100] * 4), page_size=16)  # (nothing split: the second launch's blocks exit)
    assert w._plan["merge_launch"] is True
    g = BatchDecode.host_only(spec)
    g.use_cuda_graph = True  # None: never under graphs; the first plan's choice is kept
    g.plan(*table([131072]), page_size=16)
    assert g._plan["merge_launch"] is False
    g.merge_in_launch = True
    g.plan(*table([131072]), page_size=16)
    assert g._plan["merge_launch"] is False  # (as captured)


def test_merge_launch_takes_none_or_a_bool_at_every_head_dim():
    with pytest.raises(ValueError, match=r"merge_launch=...\): expected None, True or False"):
        BatchDecode(AttentionSpec(), merge_launch=1, device="cpu")
    # one block a row, 4 dims a thread: d64's lanes are half warps (two a warp), d128's and d256's whole warps
    for d, block in ((64, (16, 1, 16)), (128, (32, 1, 8)), (256, (64, 1, 4))):
        kernel = DecodeKernel(AttentionSpec(head_dim_qk=d, head_dim_vo=d))
        assert kernel.row_merge and kernel.row_merge_block == block
        assert "batch_decode_merge_kernel" in kernel.module().kernel_names


def test_whole_items_takes_only_none_or_a_bool():
    with pytest.raises(ValueError, match=r"whole_items=...\): expected None, True or False"):
        BatchDecode(AttentionSpec(), whole_items="yes", device="cpu")


def test_the_whole_item_kernel_needs_hopper_sized_shared_memory():
    from types import SimpleNamespace
    whole = whole_wrapper()._whole  # 196 KB of dynamic shared memory
    assert fits_device_smem(SimpleNamespace(major=9, shared_memory_per_block_optin=232448), whole)
    assert not fits_device_smem(SimpleNamespace(major=8, shared_memory_per_block_optin=166912), whole)  # A100
    assert fits_device_smem(SimpleNamespace(major=9), whole)  # (a torch without the field: by capability)
    assert not fits_device_smem(SimpleNamespace(major=8), whole)


def test_planned_kernel_before_a_plan_says_to_plan():
    with pytest.raises(RuntimeError, match="call plan"):
        whole_wrapper().planned_kernel


def test_align_slack_overrides_the_planners_bound():
    # fp8 B16 L65536 (one kernel, 528 CTAs): four chunks of 16400 positions an item would lengthen the
    # span by 497, past ALIGN_SLACK, so the plan streams; a larger slack aligns (what benchmarks compare)
    w = whole_wrapper(kv_dtype="fp8_e4m3", whole_items=False)
    assert w._whole is None and w.num_ctas == 528
    w.plan(*table([65536] * 16), page_size=16)
    assert w._plan["work"].span == -(-128 * (65536 + 64) // 528)
    w.align_slack = 1 << 30
    w.plan(*table([65536] * 16), page_size=16)
    assert w._plan["work"].span == (65536 + 64) // 4


def test_an_aot_build_covers_the_kernels_the_wrapper_may_launch():
    from attnforge import presets
    for spec in (AttentionSpec(), AttentionSpec(kv_dtype="fp8_e4m3"), AttentionSpec(num_qo_heads=32, num_kv_heads=2)):
        w = BatchDecode.host_only(spec)
        launched = {w.kernel.module().name} | {whole.kernel.module().name for whole in w._wholes}
        assert {m.name for m in presets.modules_for(spec)} == launched
    # prefill: one kernel, and its twin and the merge for plans that split KV
    prefill = presets.modules_for(AttentionSpec(family="prefill"))
    assert [m.name.replace("_outf32_", "_outbf16_") for m in prefill[:2]] == [prefill[0].name] * 2
    assert [m.name for m in prefill[2:]] == ["merge_states_float_outbf16"]


def test_a_spec_file_builds_the_verify_wrappers_kernel(tmp_path):
    """A decode entry with max_q_len builds the kernels BatchDecode(spec, max_q_len) launches (its pipeline picked
    for heads x tokens rows; q4's 16 rows have two whole-item kernels, one CTA an SM and 4, fp8 q2 none), and host
    plans of q_len tokens a request stream each request's KV once."""
    from attnforge import presets
    path = tmp_path / "specs.json"
    path.write_text('[{"family": "decode", "num_qo_heads": 32, "num_kv_heads": 8, "max_q_len": 4}, '
                    '{"family": "decode", "num_qo_heads": 32, "num_kv_heads": 8, "kv_dtype": "fp8_e4m3", '
                    '"max_q_len": 2}, {"family": "decode"}]')
    entries = presets.load_spec_file(path)
    assert isinstance(entries[2], AttentionSpec) and entries[0].name.endswith("normal_q4_t64s2w4")
    for entry, spec, q in zip(entries, (AttentionSpec(num_qo_heads=32, num_kv_heads=8),
                                        AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_dtype="fp8_e4m3")), (4, 2)):
        w = BatchDecode.host_only(spec, max_q_len=q)
        launched = [w.kernel.module().name] + [whole.kernel.module().name for whole in w._wholes]
        assert [m.name for m in presets.modules_for(entry)] == launched and len(w._wholes) == 2 * (q == 4)
        w.plan([0, 2, 5], [0, 1, 2, 3, 4], [16, 9], page_size=16, q_len=q)
        one = BatchDecode.host_only(spec)
        one.plan([0, 2, 5], [0, 1, 2, 3, 4], [16, 9], page_size=16)
        mine, theirs = w._plan["work"], one._plan["work"]  # each item's tokens streamed once, as for one token
        assert w._plan["q_len"] == q and mine.num_kv_heads == theirs.num_kv_heads == 8
        assert (mine.kv_end == theirs.kv_end).all() and (mine.kv_begin == theirs.kv_begin).all()
    # a request of fewer keys than q_len is planned as any other (its first tokens see no key: zero rows, as
    # MLA's and prefill's; tests/test_decode_verify_gpu.py), its keys streamed once
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_q_len=4)
    w.plan([0, 1, 2, 3], [0, 1, 2], [5, 3, 16], page_size=16, q_len=4)
    work = w._plan["work"]
    assert work.kv_begin.tolist() == [0, 0, 0] and work.kv_end.tolist() == [5, 3, 16]
    path.write_text('[{"family": "decode"}, "decode"]')
    with pytest.raises(ValueError, match=r"entry 1: expected an object of AttentionSpec fields .*got str 'decode'"):
        presets.load_spec_file(path)
    path.write_text('[{"family": "prefill", "max_q_len": 4}]')
    with pytest.raises(ValueError, match="max_q_len: expected only in decode entries"):
        presets.load_spec_file(path)


def test_the_kernels_meta_row_carries_the_plans_snap():
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=512,
                              max_num_pages=1 << 15)
    lengths = np.random.default_rng(0).integers(64, 1024, 512).tolist()  # unequal short items: snapped
    off, n = w._offsets["meta"]
    for snap in (0, 128):
        w.span_snap = snap
        w.plan(*table(lengths), page_size=16)
        work = w._plan["work"]
        assert work.snap == snap and n == 5  # batch, span, total, snap, any_split (work_stream.cuh: StreamMeta)
        # decode merges in-kernel and never reads any_split: plan() writes 1 without the check
        assert w._upload.dev[off:off + 5].tolist() == [len(lengths), work.span, work.total, snap, 1]


def stub_cuda_for_constructors(monkeypatch):
    """The CUDA queries of the decode-shaped constructors and plan(), stubbed so they run on the host."""
    import types
    import attnforge.decode as decode
    from attnforge import checks
    props = types.SimpleNamespace(major=9, shared_memory_per_block_optin=232448, multi_processor_count=132)
    monkeypatch.setattr(decode, "_num_sms", lambda device: 132)
    monkeypatch.setattr(checks, "cuda_device", lambda device, *_, **__: torch.device("cpu"))
    monkeypatch.setattr(checks, "check_cuda", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(BatchDecode, "_staged_upload", lambda self, n: HostOnlyUpload(n))


def test_wrappers_built_by_their_constructors_shadow_no_method(monkeypatch):
    """BatchDecode.__init__ runs for every decode-shaped wrapper: an attribute it sets must not hide a
    subclass's method (its merge-launch choice, named merge_launch, once hid BatchMLADecode.merge_launch()).
    The CUDA queries are stubbed so the constructors and plan() run here."""
    from attnforge import BatchMLADecode
    stub_cuda_for_constructors(monkeypatch)
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    mqa = AttentionSpec(num_qo_heads=32, num_kv_heads=1)
    for cls, spec, page in ((BatchDecode, mqa, 16), (BatchMLADecode, mla, 64)):
        w = cls(spec)
        assert not [k for k in vars(w) if callable(getattr(cls, k, None))]
        w.plan(*table([131072], page), page_size=page)
        assert w._plan["merge_launch"] is (cls is BatchDecode)  # (MQA B1: ~200 chunks x 16 heads an item)
    assert w.merge_launch()[0] == "mla_merge_one_wave_kernel"  # BatchMLADecode's own merge, still a method


def test_the_wrappers_own_workspace_starts_zeroed(monkeypatch):
    """The merges copy 16-byte blocks around each chunk's LSEs, and neighbours nothing writes are read (their
    values unused): a workspace the wrapper allocates starts zeroed, so compute-sanitizer's initcheck has nothing
    to report there. torch.empty is made to return garbage here, so the test fails where the wrapper uses it."""
    from attnforge import BatchMLADecode
    stub_cuda_for_constructors(monkeypatch)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(7 if k.get("dtype") == torch.uint8
                                                                              else float("nan")))
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    for cls, spec in ((BatchDecode, AttentionSpec()), (BatchMLADecode, mla)):
        w = cls(spec)
        assert w._partial_o.numel() and not w._partial_o.any() and not w._partial_lse.any(), cls.__name__


@pytest.mark.parametrize("kw,match", [
    (dict(k_scale=-1.0), r"plan\(k_scale=...\): expected a finite float > 0, got -1.0"),
    (dict(k_scale=float("nan")), r"k_scale=...\): expected a finite float > 0, got nan"),
    (dict(v_scale=0.0), r"v_scale=...\): expected a finite float > 0, got 0.0"),
    (dict(v_scale=float("inf")), r"v_scale=...\): expected a finite float > 0, got inf"),
    (dict(k_scale=True), r"k_scale=...\): expected a finite float > 0, got True"),
    (dict(sm_scale=float("nan")), r"plan\(sm_scale=...\): expected None \(1 / sqrt\(head_dim\)\) or a finite float"),
    (dict(sm_scale="0.1"), r"sm_scale=...\): expected .* got '0.1'"),
    (dict(sm_scale=1e39), r"sm_scale=...\): expected .* got 1e\+39"),  # (finite, but inf as the kernel's float32)
    (dict(v_scale=-1e39), r"v_scale=...\): expected a finite float > 0, got -1e\+39")])
def test_plan_refuses_scales_that_would_reach_every_score(kw, match):
    """Decode's and MLA's plan refuse a NaN, infinite, non-positive or non-numeric scale before any work (they
    took any value float() accepted: NaN outputs, or a sign flip of every score); numpy scalars pass."""
    from attnforge import BatchMLADecode
    for w in (BatchDecode.host_only(AttentionSpec(kv_dtype="fp8_e4m3")),
              BatchMLADecode.host_only(AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1,
                                                     head_dim_qk=576, head_dim_vo=512))):
        with pytest.raises(ValueError, match=match):
            w.plan(np.array([0, 1]), np.array([0]), np.array([5]), page_size=16, **kw)
        assert w._plan is None, "nothing planned"
        w.plan(np.array([0, 1]), np.array([0]), np.array([5]), page_size=16, sm_scale=np.float32(0.1),
               k_scale=np.float64(0.5), v_scale=2)


@pytest.mark.parametrize("page_size", [16.0, 0, False])
def test_plan_names_a_page_size_that_is_not_a_positive_int(page_size):
    """Decode's and MLA's plan name the page size itself (16.0 used to pass and fail as kv_last_page_len)."""
    from attnforge import BatchMLADecode
    for w in (BatchDecode.host_only(AttentionSpec()),
              BatchMLADecode.host_only(AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1,
                                                     head_dim_qk=576, head_dim_vo=512))):
        with pytest.raises(ValueError, match=r"plan\(page_size=...\): expected an int >= 1"):
            w.plan(np.array([0, 1]), np.array([0]), np.array([5]), page_size=page_size)
        assert w._plan is None, "nothing planned"

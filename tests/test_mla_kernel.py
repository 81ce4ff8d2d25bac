"""MLA kernel shapes on the host: rows per CTA, shared memory, row blocks, rendering."""
import dataclasses
import re
import shutil
import types

import pytest
import torch

from attnforge import AttentionSpec
from attnforge.jit import build_many
from attnforge.kernels.decode import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from attnforge.kernels.mla import MLADecodeKernel, rows_per_cta


def spec(h, pipeline, **kw):
    return AttentionSpec(family="mla_decode", num_qo_heads=h, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         pipeline=pipeline, **kw)


@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_every_head_count_fits_one_cta(h, pipeline, kv):
    k = MLADecodeKernel(spec(h, pipeline, kv_dtype=kv))
    assert k.smem_bytes + SMEM_RESERVED_PER_CTA <= SMEM_PER_SM
    assert k.rows in (8, 16, 32, 64) and k.rows >= min(h, 64)
    assert k.rows % (16 if pipeline == "normal" else 8) == 0
    for q_len in (1, 2, 3, 4):  # every (token, head) row lands in exactly one block
        assert (k.row_blocks(q_len) - 1) * k.rows < q_len * h <= k.row_blocks(q_len) * k.rows


def test_transposed_pipeline_does_not_pad_eight_heads():
    assert rows_per_cta(8, "transposed") == 8 and rows_per_cta(8, "normal") == 16


def test_deeper_pipeline_refused_when_it_does_not_fit():
    with pytest.raises(ValueError, match="shared memory"):
        MLADecodeKernel(spec(128, "normal"), num_stages=3, tile_kv=64)
    for stages in (2.5, "2", False):
        with pytest.raises(ValueError, match="MLADecodeKernel.num_stages: expected an int in 2..6, got"):
            MLADecodeKernel(spec(16, "transposed"), num_stages=stages)
    from attnforge import BatchMLADecode
    for falsy in (0, ""):  # (taken as None, the default, before)
        with pytest.raises(ValueError, match=rf"MLADecodeKernel.backend: expected one of .*got {falsy!r}"):
            BatchMLADecode(spec(16, "transposed"), backend=falsy)


def test_rendered_source_matches_spec():
    src = MLADecodeKernel(spec(32, "transposed", q_dtype="fp16", kv_dtype="fp8_e4m3")).module().source
    assert "constexpr int kHeads = 32;" in src and "constexpr int kRows = 32;" in src
    assert "using TKV = fp8e4m3;" in src and "constexpr bool kTransposed = true;" in src


def test_tiling_defaults_and_overrides():
    assert MLADecodeKernel(spec(16, "normal")).tiling == (32, 2)  # two CTAs per SM
    assert MLADecodeKernel(spec(16, "normal")).ctas_per_sm == 2
    assert MLADecodeKernel(spec(128, "normal")).tiling == (64, 2)
    assert MLADecodeKernel(spec(16, "normal"), tile_kv=64).tiling == (64, 2)  # an override keeps 2 stages
    assert MLADecodeKernel(spec(128, "normal"), tile_kv=32, num_stages=3).tiling == (32, 3)
    with pytest.raises(ValueError, match="tile_kv"):
        MLADecodeKernel(spec(16, "normal"), tile_kv=48)


def test_wgmma_backend_shape_and_refusals():
    k = MLADecodeKernel(spec(16, "normal"), backend="wgmma")
    assert (k.rows, k.tiling, k.ctas_per_sm) == (64, (64, 2), 1)  # m64 tiles: 16 heads padded to 64 rows
    # Q + two 576-wide stages + P + row state + the 1024-byte alignment slack: the whole SM
    assert k.smem_bytes == 64 * 576 * 2 * 3 + 64 * 64 * 2 + 7 * 64 * 4 + 1024
    assert k.smem_bytes <= 227 * 1024
    assert k.row_blocks(1) == 1 and MLADecodeKernel(spec(128, "normal"), backend="wgmma").row_blocks(2) == 4
    mod = k.module()
    assert mod.archs == ("9.0a",) and "_wgmma_" in mod.name and "constexpr bool kWgmma = true;" in mod.source
    assert "wgmma_ss_tb<256, TMma>" in mod.source
    # transposed (ETAP): one computing warpgroup (and one that copies), rows = heads (8..32), O^T [512 x
    # rows] in registers
    for h, rows in ((8, 8), (16, 16), (32, 32), (128, 32)):
        t = MLADecodeKernel(spec(h, "transposed"), backend="wgmma")
        assert (t.rows, t.tiling, t.threads) == (rows, (64, 2), 256)
        assert t.smem_bytes == rows * 576 * 2 + 2 * 64 * 576 * 2 + rows * 64 * 2 + 11 * rows * 4 + 1024
        assert "wgmma_ss_ta<kRows, TMma>" in t.module().source and "kWarps = 4" in t.module().source
    assert MLADecodeKernel(spec(128, "transposed"), backend="wgmma").row_blocks(1) == 4
    # a request's row blocks run side by side on wgmma (measured +5-15% at h128), one per CTA on mma.sync
    assert MLADecodeKernel(spec(128, "transposed"), backend="wgmma").side_blocks(4) == 4
    assert MLADecodeKernel(spec(128, "normal"), backend="mma").side_blocks(2) == 1
    with pytest.raises(ValueError, match="does not take fp8 KV"):
        MLADecodeKernel(spec(16, "normal", kv_dtype="fp8_e4m3"), backend="wgmma")
    with pytest.raises(ValueError, match="64-token tiles in 2 stages"):
        MLADecodeKernel(spec(16, "normal"), backend="wgmma", tile_kv=32)
    with pytest.raises(ValueError, match="backend: expected one of"):
        MLADecodeKernel(spec(16, "normal"), backend="tensor")


def test_wgmma_backend_builds_for_sm90a_whatever_the_arch_list():
    mod = MLADecodeKernel(spec(128, "normal"), backend="wgmma").module()
    (path,) = build_many([mod], ("8.0",))
    assert "/90a/" in path.as_posix() and b"mla_decode_kernel" in path.read_bytes()


def test_kernel_fields_are_validated_before_any_device_work():
    """BatchMLADecode(kernel_fields=...) and the roles fields it reaches refuse bad values with the
    expected value, the one received and the fix (constructed here without a GPU: the checks come first)."""
    from attnforge.mla import BatchMLADecode
    with pytest.raises(ValueError, match=r"kernel_fields: expected keys among \[.*'roles_w0_dims'.*got \['bogus'\]"):
        BatchMLADecode(num_qo_heads=128, kernel_fields={"bogus": 1})
    with pytest.raises(ValueError, match="kernel_fields: expected keys.*got \\['backend'\\]. Pass \\['num_stages'"):
        BatchMLADecode(num_qo_heads=128, kernel_fields={"backend": "mma"})
    with pytest.raises(ValueError, match="kernel_fields: expected None or a dict"):
        BatchMLADecode(num_qo_heads=128, kernel_fields=[("roles_w0_dims", 256)])
    assert BatchMLADecode._checked_kernel_fields(None) == {}  # the valid ones pass through, as a copy
    fields = {"roles_w0_dims": 256, "roles_q_steps": 0}
    checked = BatchMLADecode._checked_kernel_fields(fields)
    assert checked == fields and checked is not fields
    h128 = spec(128, "normal")
    for bad in (3.5, True, -1, 37):
        with pytest.raises(ValueError, match="roles_q_steps: expected None or an int in 0..36"):
            MLADecodeKernel(h128, backend="wgmma", roles_q_steps=bad)
    with pytest.raises(ValueError, match="roles_pv_rs: expected None, True or False, got 1"):
        MLADecodeKernel(h128, backend="wgmma", roles_pv_rs=1)


def test_tma_refills_are_the_roles_kernels_and_qualify_by_page_size(monkeypatch):
    """tma=True: the roles kernel's refills by the copy engine (the even split's whole tiles, the narrow
    splits' part 1); the box's rows from the page size (a page, or 64 rows of a longer one; pages under 8
    tokens or not tiling the 64-token tile: rows 0, every tile by cp.async), for two caches or one
    576-wide cache."""
    from attnforge.jit import tma as tma_maps
    from attnforge.mla import BatchMLADecode
    k = MLADecodeKernel(spec(64, "normal"), backend="wgmma", tma=True)
    m = k.module()
    assert k.uses_tma and "_tma_" in m.name and m.context["tma"]
    assert "TensorMap ckv_tmap" in m.source and "tma_load_4d" in m.source and "tma_bar(sm, s)" in m.source
    plain = MLADecodeKernel(spec(64, "normal"), backend="wgmma")
    assert not plain.uses_tma and "tma_load_4d" not in plain.module().source
    assert plain.tma_values(None, None, 64) == {}
    for w0 in (None, 128, 256):  # part 1 of each refill, or (256) whole tiles
        narrow = MLADecodeKernel(spec(128, "normal"), backend="wgmma", roles_w0_dims=w0, tma=True)
        assert narrow.uses_tma and "issue_tile_tma<" in narrow.module().source
    with pytest.raises(ValueError, match="tma: the copy engine refills the 'roles' schedule's.*schedule='symmetric'"):
        MLADecodeKernel(spec(64, "normal"), backend="mma", tma=True)
    with pytest.raises(ValueError, match="tma: expected None, True or False"):
        MLADecodeKernel(spec(64, "normal"), backend="wgmma", tma=1)
    encoded = []
    monkeypatch.setattr(tma_maps, "encode", lambda t, box: encoded.append((tuple(t.shape), box)) or bytes(128))
    for page, rows in ((64, 64), (16, 16), (128, 64), (32, 32), (7, 0), (1, 0)):
        unified = torch.zeros(4, page, 576, dtype=torch.bfloat16)
        pair = (torch.zeros(4, page, 512, dtype=torch.bfloat16), torch.zeros(4, page, 64, dtype=torch.bfloat16))
        for ckv, kpe in (BatchMLADecode._latent_views(unified, None), pair):
            encoded.clear()
            values = k.tma_values(ckv, kpe, page)
            assert values["tma_rows"] == rows, page
            if rows:  # coordinates (dim, token in page, 0, page): box [rows][64 dims] of each map
                assert [box.box for _, box in encoded] == [(64, rows, 1, 1)] * 2 and not encoded[0][1].heads_inner
                assert [shape[2] for shape, _ in encoded] == [512, 64]
            else:
                assert values["ckv_tmap"] is None and not encoded


def test_tma_l2_promotion_sets_both_maps_and_leaves_the_source(monkeypatch):
    """tma_l2_promotion: a host-side map setting (the same cubin), checked before any device work; 128 bytes
    by default (256, the prefill maps', cost h128 2%)."""
    from attnforge.jit import tma as tma_maps
    from attnforge.kernels.mla import ROLES_TMA_L2_PROMOTION
    encoded = []
    monkeypatch.setattr(tma_maps, "encode", lambda t, box: encoded.append(box) or bytes(128))
    ckv, kpe = torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    default = MLADecodeKernel(spec(128, "normal"), backend="wgmma", tma=True)
    default.tma_values(ckv, kpe, 64)
    assert [b.l2_promotion for b in encoded] == [ROLES_TMA_L2_PROMOTION] * 2 and ROLES_TMA_L2_PROMOTION == 128
    for size in (0, 64, 256):
        encoded.clear()
        k = MLADecodeKernel(spec(128, "normal"), backend="wgmma", tma=True, tma_l2_promotion=size)
        k.tma_values(ckv, kpe, 64)
        assert [b.l2_promotion for b in encoded] == [size, size]
        assert k.module().source == default.module().source
    for bad, tma in ((96, True), (128, None), (128, False)):
        with pytest.raises(ValueError, match=r"tma_l2_promotion: expected None, or one of \(0, 64, 128, 256\) with tma=True"):
            MLADecodeKernel(spec(128, "normal"), backend="wgmma", tma=tma, tma_l2_promotion=bad)


def test_pdl_by_default_except_for_the_narrow_roles_kernel():
    from attnforge.kernels.mla import ROLES_NARROW_PDL
    assert MLADecodeKernel(spec(128, "normal"), backend="wgmma").pdl_by_default is ROLES_NARROW_PDL is False
    assert MLADecodeKernel(spec(128, "normal"), backend="wgmma", roles_w0_dims=256).pdl_by_default
    assert MLADecodeKernel(spec(128, "normal"), backend="wgmma", schedule="symmetric").pdl_by_default
    assert MLADecodeKernel(spec(64, "normal"), backend="wgmma").pdl_by_default
    assert MLADecodeKernel(spec(128, "normal"), backend="mma").pdl_by_default


def test_default_backend_is_the_measured_winner():
    from attnforge.kernels.mla import WGMMA_MIN_HEADS, default_backend
    for h in (8, 16, 32, 64, 128):
        normal, transposed = default_backend(spec(h, "normal"), ("9.0a",)), default_backend(spec(h, "transposed"), ("9.0a",))
        assert normal == ("wgmma" if h >= WGMMA_MIN_HEADS else "mma") and transposed == "wgmma"
        assert default_backend(spec(h, "normal"), ("8.0", "8.9")) == "mma"  # no sm_90a being built
        assert default_backend(spec(h, "transposed"), ("8.0", "8.9")) == "mma"
    assert WGMMA_MIN_HEADS == 16  # measured: wgmma normal won every 16-head case (twenty-ninth session)
    for pipeline in ("normal", "transposed"):  # wgmma reads 16-bit tiles
        assert default_backend(spec(128, pipeline, kv_dtype="fp8_e4m3"), ("9.0a",)) == "mma"


def test_default_pipeline_is_transposed_at_8_heads_with_16_bit_kv():
    def auto(heads, **kw):
        return AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576,
                             head_dim_vo=512, **kw)
    assert auto(8).pipeline == "transposed" and auto(8, kv_dtype="fp16", q_dtype="fp16").pipeline == "transposed"
    assert auto(8, kv_dtype="fp8_e4m3").pipeline == "normal"  # mma.sync only: its normal kernel wins
    assert all(auto(h).pipeline == "normal" for h in (16, 32, 64, 128))
    assert "transposed" not in auto(8).name and "normal" in auto(8, pipeline="normal").name


def test_roles_dims_split_defaults_by_heads_and_is_validated():
    # 192 dims for warpgroup 0 where the tensor work bounds the kernel (128 heads), 256 below
    for heads, dims in ((32, 256), (64, 256), (128, 192)):
        k = MLADecodeKernel(spec(heads, "normal"), backend="wgmma")
        assert k.module().context["roles_w0_dims"] == dims and f"roles{dims}_" in k.module().name
    k = MLADecodeKernel(spec(128, "normal"), backend="wgmma", roles_w0_dims=256)
    assert k.module().context["roles_w0_dims"] == 256
    # Q in registers and P.V from registers at the narrow split only, whatever the modifier
    import attnforge.mods as mods
    from attnforge.kernels.mla import ROLES_NARROW_PDL, ROLES_PV_FROM_REGISTERS, ROLES_Q_REG_STEPS
    h128 = spec(128, "normal")
    for kw in ({}, {"logits_soft_cap": 30.0}, {"score_mod": mods.alibi(torch.ones(128))}):
        ctx = MLADecodeKernel(dataclasses.replace(h128, **kw), backend="wgmma").module().context
        assert (ctx["roles_w0_dims"], ctx["roles_q_reg_steps"], ctx["roles_pv_from_registers"]) == \
            (192, ROLES_Q_REG_STEPS, ROLES_PV_FROM_REGISTERS), kw
    ctx = MLADecodeKernel(h128, backend="wgmma", roles_q_steps=0, roles_pv_rs=False).module().context
    assert (ctx["roles_q_reg_steps"], ctx["roles_pv_from_registers"]) == (0, False)
    ctx = MLADecodeKernel(spec(64, "normal"), backend="wgmma", roles_q_steps=8, roles_pv_rs=True).module().context
    assert (ctx["roles_w0_dims"], ctx["roles_q_reg_steps"], ctx["roles_pv_from_registers"]) == (256, 0, False)
    with pytest.raises(ValueError, match="roles_w0_dims: expected None, 128, 192 or 256, got 64"):
        MLADecodeKernel(spec(128, "normal"), backend="wgmma", roles_w0_dims=64)
    k = MLADecodeKernel(spec(128, "normal"), backend="wgmma", roles_w0_dims=128)  # an ablation (not a default)
    ctx = k.module().context
    assert (ctx["roles_w0_dims"], ctx["roles_q_reg_steps"]) == (128, ROLES_Q_REG_STEPS)
    assert k.pdl_by_default == ROLES_NARROW_PDL
    with pytest.raises(ValueError, match="applies to the 'roles' schedule only"):
        MLADecodeKernel(spec(128, "normal"), backend="wgmma", schedule="symmetric", roles_w0_dims=192)


def test_roles_schedule_is_the_wgmma_normal_pipelines():
    k = MLADecodeKernel(spec(128, "normal"), backend="wgmma", schedule="roles")
    assert "roles" in k.module().name and k.module().context["schedule"] == "roles"
    assert MLADecodeKernel(spec(128, "normal"), backend="wgmma").module().context["schedule"] == "roles"  # default
    sym = MLADecodeKernel(spec(128, "normal"), backend="wgmma", schedule="symmetric").module()
    assert sym.context["schedule"] == "symmetric" and "roles" not in sym.name
    assert MLADecodeKernel(spec(16, "transposed"), backend="wgmma").module().context["schedule"] == "symmetric"
    with pytest.raises(ValueError, match="wgmma normal pipeline"):
        MLADecodeKernel(spec(16, "transposed"), backend="wgmma", schedule="roles")
    with pytest.raises(ValueError, match="wgmma normal pipeline"):
        MLADecodeKernel(spec(16, "normal"), schedule="roles")
    with pytest.raises(ValueError, match="schedule: expected"):
        MLADecodeKernel(spec(16, "normal"), backend="wgmma", schedule="pingpong")


def test_roles_schedule_compiles_for_sm90a():
    mod = MLADecodeKernel(spec(128, "normal"), backend="wgmma", schedule="roles").module()
    (path,) = build_many([mod], ("9.0a",))
    assert b"mla_decode_kernel" in path.read_bytes()


def test_wrapper_backend_choice():
    """BatchMLADecode(backend=None): the measured winner, except that a tile_kv / num_stages override
    means the mma.sync kernel (the wgmma one has a fixed tiling); an explicit backend always wins."""
    from attnforge.kernels.mla import default_backend
    from attnforge.mla import BatchMLADecode
    w = BatchMLADecode.__new__(BatchMLADecode)  # only _make_kernel: no GPU buffers
    s128 = spec(128, "normal")
    for backend, schedule, tile, stages, want in [(None, None, None, None, default_backend(s128)),
                                                  (None, None, 32, 3, "mma"), (None, None, None, 2, "mma"),
                                                  ("wgmma", "symmetric", None, None, "wgmma"), ("mma", None, 64, 2, "mma")]:
        w._backend, w._schedule, w._kernel_fields = backend, schedule, {}
        k = w._make_kernel(s128, tile, stages, None)
        assert k.backend == want and (schedule is None or k.schedule == schedule)


def test_merge_lanes_split_only_rows_cut_into_many_chunks():
    import numpy as np

    from attnforge import scheduler
    from attnforge.mla import MAX_MERGE_LANES, MERGE_DIM_SPLIT, merge_lanes

    def lanes(lengths, ctas):
        end = np.asarray(lengths, dtype=np.int64)
        return merge_lanes(scheduler.plan_stream(np.zeros_like(end), end, 1, ctas))

    assert lanes([131072], 264) == MAX_MERGE_LANES  # one request over every CTA: ~264 chunks
    assert lanes([65536] * 16, 264) == 2            # ~18 chunks per request
    assert MAX_MERGE_LANES * 512 // 4 // MERGE_DIM_SPLIT <= 512  # the merge kernel's __launch_bounds__
    assert lanes([4096] * 128, 66) == 1             # at most 2 chunks: one lane, two rows per block
    assert lanes([], 264) == 1 and lanes([0, 0], 264) == 1


def test_host_only_wrapper_plans_without_a_gpu():
    """BatchMLADecode.host_only (plan()'s host side, no GPU): the MLA constructor's own fields get their
    defaults, and a plan lays out the latent cache's one KV head in row blocks."""
    import numpy as np

    from attnforge.mla import BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    w = BatchMLADecode.host_only(spec, max_batch_size=4)
    w.plan(np.array([0, 4, 6]), np.arange(6), np.array([64, 10]), page_size=64)
    work = w._plan["work"]
    assert (w._plan["batch"], w._plan["q_len"], w.max_q_len) == (2, 1, 1)
    blocks = w.kernel.row_blocks(1) // w.kernel.side_blocks(w.kernel.row_blocks(1))
    assert work.total == blocks * (256 + 74 + 2 * 64)  # tokens (4 pages; 1 page + 10) and a fixed cost each


def test_equal_requests_plan_aligned_spans():
    """As decode: B64 L8192 at h16 on the mma.sync kernel (fp8 KV; one row block a request) cuts each
    request into CTAs // 64 chunks of equal length, one a span."""
    import numpy as np

    from attnforge.mla import BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         kv_dtype="fp8_e4m3")
    w = BatchMLADecode.host_only(spec, max_batch_size=64, max_num_pages=64 * 128)
    indptr = np.arange(65) * 128
    w.plan(indptr, np.arange(64 * 128), np.full(64, 64), page_size=64)
    work = w._plan["work"]
    per = w.num_ctas // 64  # (the mma.sync kernel's cuts are not rounded to its tiles: ALIGN_CUTS_TO_TILES)
    assert work.span == -(-(8192 + 64) // per) and work.total % work.span == 0
    # B16 L65536: aligning would lengthen every span by 124 tokens (past MLA_ALIGN_SLACK): the even split stays
    indptr = np.arange(17) * 1024
    w.plan(indptr, np.arange(16 * 1024), np.full(16, 64), page_size=64)
    work = w._plan["work"]
    assert work.span == -(-work.total // w.num_ctas) and work.num_spans == w.num_ctas


def test_64_row_kernels_align_spans_within_a_fraction_of_the_even_span():
    """From 32 heads (wgmma normal, 64-row blocks) a split item costs most: equal requests go whole to
    spans (or one equal chunk a span) when that lengthens a span by less than MLA_WIDE_ALIGN_FRACTION;
    past it the even split stays."""
    import numpy as np

    from attnforge import scheduler
    from attnforge.mla import MLA_WIDE_ALIGN_FRACTION, BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=128, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    w = BatchMLADecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 14)
    pairs = w.num_ctas // 2  # two row blocks side by side

    def plan(batch, pages):
        w.plan(np.arange(batch + 1) * pages, np.arange(batch * pages), np.full(batch, 64), page_size=64)
        return w._plan["work"], scheduler.expand(w._plan["work"])
    for batch in (64, 128):  # B64 L8192 (one item a span), B128 L4096 (two whole items a span)
        work, rows = plan(batch, 8192 * 64 // batch // 64)
        even = -(-work.total // pairs)
        assert len(rows) == batch and (rows[:, 5] < 0).all()  # none split, none merged
        assert 0 < work.span - even < MLA_WIDE_ALIGN_FRACTION * even
        assert not w._plan["merge"]  # so run() launches no merge kernel
        off, _ = w._offsets["meta"]
        assert w._upload.dev[off + 4] == 0  # StreamMeta.any_split: a graph's merge exits at once
    work, rows = plan(pairs + 1, 16)  # two whole items a span would nearly double it: the even split
    assert work.span == -(-work.total // pairs) and len(rows) > pairs + 1
    assert w._plan["merge"] and w._upload.dev[w._offsets["meta"][0] + 4] == 1
    w = BatchMLADecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 14)
    w.use_cuda_graph = True  # a captured graph launches the merge for every plan, whole items too
    work, rows = plan(64, 128)
    assert (rows[:, 5] < 0).all() and w._plan["merge"]
    # the 64-row mma.sync kernel (fp8 KV: no wgmma) keeps the 96-token bound: B64 L8192 splits its items
    w = BatchMLADecode.host_only(dataclasses.replace(spec, kv_dtype="fp8_e4m3"), max_batch_size=256,
                                 max_num_pages=1 << 14)
    assert (w.kernel.backend, w.kernel.rows) == ("mma", 64)
    pairs = w.num_ctas // w.kernel.side_blocks(w.kernel.row_blocks(1))
    work, rows = plan(64, 128)
    assert work.span == -(-work.total // pairs) and len(rows) > 64


def test_graph_merge_lanes_match_eager_on_equal_batches_and_stay_fixed():
    """A graph's merge lanes are chosen at its first plan as eager runs choose them for equal requests
    of its batch (one long request: many lanes), and kept for every later plan (the launch shape is
    captured)."""
    import numpy as np

    from attnforge.mla import BatchMLADecode, merge_lanes
    for heads in (16, 128):
        spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
        for batch, length in ((1, 131072), (4, 32768), (16, 65536), (64, 8192)):
            w = BatchMLADecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 16)
            w.use_cuda_graph = True
            pages = length // 64
            w.plan(np.arange(batch + 1) * pages, np.arange(batch * pages), np.full(batch, 64), page_size=64)
            assert w._plan["merge_lanes"] == merge_lanes(w._plan["work"]), (heads, batch)
            if batch == 1:
                assert w._plan["merge_lanes"] > 1
                w.plan(np.array([0, 1]), np.array([0]), np.array([5]), page_size=64)  # now a short request
                assert w._plan["merge_lanes"] > 1 and merge_lanes(w._plan["work"]) == 1



@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads,soft_cap,w0", [(64, 0.0, None), (16, 30.0, None), (128, 0.0, None), (128, 0.0, 128)])
def test_ptxas_builds_the_tma_refills_without_spills(tmp_path, heads, soft_cap, w0):
    """The copy-engine refills (tma=True): the barrier waits are loops, placed where no wgmma of the
    waiting warpgroup is in flight; ptxas keeps every wgmma asynchronous and spills nothing. (h128 with
    soft-cap spills 16 bytes at 12 Q steps: a default would need fewer.)"""
    from helpers import ptxas_log_of_async_wgmmas
    s = dataclasses.replace(spec(heads, "normal"), logits_soft_cap=soft_cap)
    m = MLADecodeKernel(s, backend="wgmma", tma=True, roles_w0_dims=w0).module()
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(m, "mla_decode_kernel", tmp_path)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("kw", [{}, {"roles_pv_rs": True}, {"logits_soft_cap": 30.0}, {"roles_w0_dims": 128}])
def test_ptxas_keeps_the_roles_wgmmas_asynchronous(tmp_path, kw):
    """h128's roles kernel issues warpgroup 0's P.V and then publishes P while it runs (P from
    registers): a branch there, or a touched accumulator, would make ptxas serialise every wgmma (info
    C7514 / C7515, or waits injected, C7517); the kBarPFree wait is one predicated instruction."""
    from helpers import ptxas_log_of_async_wgmmas
    kw = dict(kw)
    soft_cap = kw.pop("logits_soft_cap", 0.0)
    h128 = dataclasses.replace(spec(128, "normal"), logits_soft_cap=soft_cap)
    m = MLADecodeKernel(h128, backend="wgmma", **kw).module()
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(m, "mla_decode_kernel", tmp_path)


def test_producer_is_the_transposed_wgmma_kernels():
    """producer (the default there): a second warpgroup (256 threads) copies for the transposed wgmma
    kernel, whose computing warps then synchronise among themselves (named barrier 1), not with
    __syncthreads; producer=False keeps the one-warpgroup kernel."""
    k = MLADecodeKernel(spec(16, "transposed"), backend="wgmma")
    assert k.uses_producer and k.threads == 256 and k.module().name.endswith("_wgmma_pw_es_cbb_rbw_r16t64s2")
    src = k.module().source
    assert "constexpr bool kProducer = true;" in src and "named_bar_sync(kBarCompute, 32 * kWarps);" in src
    one = MLADecodeKernel(spec(16, "transposed"), backend="wgmma", producer=False)
    assert one.threads == 128 and "constexpr bool kProducer = false;" in one.module().source
    assert not MLADecodeKernel(spec(16, "transposed"), backend="mma").uses_producer
    for bad in ({"backend": "mma"}, {"backend": "wgmma", "pipeline": "normal"}):
        kw = dict(bad)
        with pytest.raises(ValueError, match="producer: the wgmma transposed kernel's"):
            MLADecodeKernel(spec(16, kw.pop("pipeline", "transposed")), producer=True, **kw)
    with pytest.raises(ValueError, match="producer: expected None, True or False"):
        MLADecodeKernel(spec(16, "transposed"), backend="wgmma", producer=1)


def test_early_scores_is_the_producer_kernels():
    """early_scores (the default there): the transposed wgmma kernel with its producer warpgroup issues
    S^T(t + 1) behind P.V(t) where tile t + 1 has landed, and hands the refilled stages over by mbarriers;
    anywhere else it is an error that says what to pass."""
    k = MLADecodeKernel(spec(16, "transposed"), backend="wgmma", early_scores=True)
    assert k.uses_early_scores and k.module().name.endswith("_wgmma_pw_es_cbb_rbw_r16t64s2")
    src = k.module().source
    assert "constexpr bool kEarlyScores = true;" in src and "named_bar_sync_and(kBarCompute" in src
    off = MLADecodeKernel(spec(16, "transposed"), backend="wgmma", early_scores=False)
    assert not off.uses_early_scores and "constexpr bool kEarlyScores = false;" in off.module().source
    for bad in ({"backend": "wgmma", "producer": False}, {"backend": "mma"}, {"backend": "wgmma", "pipeline": "normal"}):
        kw = dict(bad)
        with pytest.raises(ValueError, match="early_scores: the wgmma transposed kernel with its producer"):
            MLADecodeKernel(spec(16, kw.pop("pipeline", "transposed")), early_scores=True, **kw)
    with pytest.raises(ValueError, match="early_scores: expected None, True or False"):
        MLADecodeKernel(spec(16, "transposed"), backend="wgmma", early_scores="yes")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads,soft_cap", [(8, 0.0), (16, 0.0), (32, 30.0)])
def test_ptxas_keeps_early_scores_asynchronous(tmp_path, heads, soft_cap):
    """S^T(t + 1) flies through the branch on whether it was issued early and the loop's back edge: ptxas
    keeps every wgmma asynchronous and spills nothing. Without the loop's closing wait, where nothing flies,
    ptxas cannot tell, and waits after every P.V (C7517): the check catches that build."""
    from helpers import ptxas_log_of_async_wgmmas
    s = dataclasses.replace(spec(heads, "transposed"), logits_soft_cap=soft_cap)
    m = MLADecodeKernel(s, backend="wgmma", early_scores=True).module()
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(m, "mla_decode_kernel", tmp_path)
    closing_wait = "      wgmma_wait<0>();  // nothing flies here;"
    assert m.source.count(closing_wait) == 1
    without = types.SimpleNamespace(name=m.name, source=m.source.replace(closing_wait, "      //"))
    with pytest.raises(AssertionError, match="C7517"):
        ptxas_log_of_async_wgmmas(without, "mla_decode_kernel", tmp_path)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads", [8, 16, 64])
def test_ptxas_builds_the_producer_warpgroup_without_spills(tmp_path, heads):
    """The computing warpgroup's wgmmas stay asynchronous beside the copying one (no C7514 / C7515 / C7517)."""
    from helpers import ptxas_log_of_async_wgmmas
    m = MLADecodeKernel(spec(heads, "transposed"), backend="wgmma").module()
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(m, "mla_decode_kernel", tmp_path)


def test_one_request_at_16_heads_plans_the_transposed_kernel():
    """LONG_REQUEST_TRANSPOSED: a plan of one request at 16 heads runs the transposed wgmma kernel (its
    producer warpgroup copying), a batch the default normal one, plan by plan; other head counts, and
    kernels chosen explicitly, keep theirs."""
    import numpy as np

    from attnforge import scheduler
    from attnforge.kernels.mla import default_backend
    from attnforge.mla import BatchMLADecode
    h16 = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    if default_backend(h16) != "wgmma":
        pytest.skip("the arch list builds no sm_90a: the mma.sync kernels have no such choice")
    w = BatchMLADecode.host_only(h16, max_batch_size=4, max_num_pages=4096)
    w.max_q_len = 2  # (a batch of two query tokens a request keeps the default: BATCHES_TRANSPOSED)
    one = (np.array([0, 2048]), np.arange(2048), np.array([64]))
    two = (np.array([0, 4, 6]), np.arange(6), np.array([64, 10]))
    for table, q_len, pipeline in ((one, 1, "transposed"), (two, 2, "normal"), (one, 1, "transposed")):
        w.plan(*table, page_size=64, q_len=q_len)
        k = w.planned_kernel[0]
        assert (k.backend, k.spec.pipeline, w.kernel) == ("wgmma", pipeline, k)
    assert k.uses_producer and k.rows == 16
    work = w._plan["work"]  # one 16-row block holds all 16 heads: one item, over every CTA
    assert (w.kernel.row_blocks(1), work.num_kv_heads, int(work.kv_end[0])) == (1, 1, 2048 * 64)
    assert work.total >= 2048 * 64 + scheduler.CHUNK_FIXED_COST and work.num_ctas == w.num_ctas
    for heads in (8, 32, 128):
        other = BatchMLADecode.host_only(dataclasses.replace(h16, num_qo_heads=heads, pipeline="auto"), max_batch_size=4,
                                         max_num_pages=4096)
        other.plan(*one, page_size=64)
        assert other.planned_kernel[0] is other._default_kernel
    # a refused plan keeps the last plan's kernel: under CUDA graphs (the batch size is captured) a plan of
    # one request after a batch of two raises, and run() must still launch the captured normal kernel
    w.plan(*two, page_size=64, q_len=2)
    w.use_cuda_graph = True
    with pytest.raises(ValueError, match="batch size in CUDA-graph mode"):
        w.plan(*one, page_size=64, q_len=2)
    assert w.kernel is w.planned_kernel[0] and w.kernel.spec.pipeline == "normal"
    explicit = BatchMLADecode.host_only(h16, max_batch_size=4, max_num_pages=4096)
    explicit._kernel_fields = {"roles_w0_dims": 256}  # as BatchMLADecode(kernel_fields=...) sets it: no switch
    explicit.plan(*one, page_size=64)
    assert explicit.planned_kernel[0].spec.pipeline == "normal"


def test_batches_at_16_heads_plan_the_transposed_kernel(monkeypatch):
    """BATCHES_TRANSPOSED: a batch at 16 heads of one query token a request runs the transposed wgmma kernel,
    long or short, eager or in graph mode; of two query tokens the default normal one, plan by plan."""
    import numpy as np

    from attnforge import mla
    from attnforge.kernels.mla import default_backend
    h16 = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    if default_backend(h16) != "wgmma":
        pytest.skip("the arch list builds no sm_90a: the mma.sync kernels have no such choice")
    short = (np.array([0, 4, 6]), np.arange(6), np.array([64, 10]))
    long = (np.array([0, 1024, 2048]), np.arange(2048), np.array([64, 1]))

    def picked(w, table, q_len=1):
        w.plan(*table, page_size=64, q_len=q_len)
        return w.planned_kernel[0].spec.pipeline

    def wrapper(graph=False):
        w = mla.BatchMLADecode.host_only(h16, max_batch_size=4, max_num_pages=4096)
        w.max_q_len, w.use_cuda_graph = 2, graph  # (host_only plans one query token unless told)
        return w

    w = wrapper()
    assert [picked(w, short), picked(w, long, 2), picked(w, long), picked(w, short, 2)] == \
        ["transposed", "normal", "transposed", "normal"]
    assert picked(wrapper(graph=True), short) == "transposed" and picked(wrapper(graph=True), long, 2) == "normal"
    monkeypatch.setattr(mla, "BATCHES_TRANSPOSED", False)  # one request still switches, a batch no longer
    one = (np.array([0, 1024]), np.arange(1024), np.array([64]))
    assert picked(wrapper(), long) == "normal" and picked(wrapper(), one) == "transposed"
    monkeypatch.setattr(mla, "BATCHES_TRANSPOSED", True)
    monkeypatch.setattr(mla, "LONG_REQUEST_TRANSPOSED", False)  # each switch alone
    assert picked(wrapper(), long) == "transposed" and picked(wrapper(), one, 2) == "normal"


def test_transposed_wgmma_kernel_aligns_spans_within_a_fraction_of_the_even_span():
    """From 16 heads the transposed wgmma kernel aligns equal requests to spans within MLA_WIDE_ALIGN_FRACTION
    too: B64 L8192 one equal chunk a span, B128 L4096 one whole request a span, none merged (with the
    96-token bound both were cut over two spans, and h16 B128 L4096 ran 10% slower: thirty-sixth session).
    At 8 heads it aligns within MLA_TRANSPOSED_ALIGN_SLACK tokens only (at 4% B16 L65536 lost 0.9%): B128
    L4096 and B64 L8192 align (-6.2% / -1.8% against 96 tokens: thirty-seventh session; B64 L8192 cut on the
    tiles, 4096 + 4096 tokens, another -0.5..-1.0%: forty-second session), B16 L65536 (304 tokens more)
    keeps its even split."""
    import numpy as np

    from attnforge import scheduler
    from attnforge.kernels.mla import default_backend
    from attnforge.mla import MLA_TRANSPOSED_ALIGN_SLACK, MLA_WIDE_ALIGN_FRACTION, BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    if default_backend(dataclasses.replace(spec, pipeline="transposed")) != "wgmma":
        pytest.skip("the arch list builds no sm_90a")

    def plan(w, batch, pages):
        w.plan(np.arange(batch + 1) * pages, np.arange(batch * pages), np.full(batch, 64), page_size=64)
        assert (w.planned_kernel[0].backend, w.planned_kernel[0].spec.pipeline) == ("wgmma", "transposed")
        return w._plan["work"], scheduler.expand(w._plan["work"]), -(-w._plan["work"].total // w.num_ctas)

    w = BatchMLADecode.host_only(spec, max_batch_size=256, max_num_pages=1 << 14)
    work, rows, even = plan(w, 128, 64)
    assert 0 < work.span - even < MLA_WIDE_ALIGN_FRACTION * even
    assert len(rows) == 128 and (rows[:, 5] < 0).all() and not w._plan["merge"]
    work, rows, even = plan(w, 64, 128)  # two equal chunks an item, each a span of its own
    assert 0 < work.span - even < MLA_WIDE_ALIGN_FRACTION * even and len(rows) == 128
    assert len(set(rows[:, 0].tolist())) == 128 and np.bincount(rows[:, 1]).tolist() == [2] * 64  # a CTA each
    h8 = BatchMLADecode.host_only(dataclasses.replace(spec, num_qo_heads=8, pipeline="auto"), max_batch_size=256,
                                  max_num_pages=1 << 14)
    work, rows, even = plan(h8, 128, 64)  # one whole request a span
    assert 0 < work.span - even < MLA_TRANSPOSED_ALIGN_SLACK and len(rows) == 128 and not h8._plan["merge"]
    work, rows, even = plan(h8, 64, 128)  # one equal half of a request a span, cut on a tile boundary
    assert 0 < work.span - even < MLA_TRANSPOSED_ALIGN_SLACK and len(rows) == 128
    assert sorted({int(hi - lo) for _, _, _, lo, hi, _ in rows.tolist()}) == [4096]
    work, rows, even = plan(h8, 16, 1024)  # aligning would add 304 tokens: the even split
    assert work.span == even and len(rows) > 128


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads,pipeline", [(16, "transposed"), (128, "normal")])
def test_kpe_batched_copies_compile_without_spills(tmp_path, heads, pipeline):
    """kpe_batched (wgmma kernels): the rope chunks of 4 rows a copy, the transposed kernel's default
    (TRANSPOSED_KPE_BATCHED) where it copies by row, the roles kernel's where asked; named, refused on
    mma.sync and beside copies by column block, and ptxas keeps the wgmmas asynchronous without spills (the
    transposed kernel and the roles kernel's prologue)."""
    from helpers import ptxas_log_of_async_wgmmas
    by_row = {"copies_by_block": False} if pipeline == "transposed" else {}
    k = MLADecodeKernel(spec(heads, pipeline), backend="wgmma", kpe_batched=True, **by_row)
    assert "_kb_" in k.module().name and "constexpr bool kKpeBatched = true;" in k.module().source
    default = MLADecodeKernel(spec(heads, pipeline), backend="wgmma", **by_row)
    assert default.uses_kpe_batched == (pipeline == "transposed")
    # by column block (the transposed kernel's default) issue_tile is not called: kpe_batched resolves off
    assert not MLADecodeKernel(spec(heads, pipeline), backend="wgmma").uses_kpe_batched
    if pipeline == "transposed":
        with pytest.raises(ValueError, match="kpe_batched=True shapes the row copies.*copies_by_block=False"):
            MLADecodeKernel(spec(heads, pipeline), backend="wgmma", kpe_batched=True)
    row_copies = MLADecodeKernel(spec(heads, pipeline), backend="wgmma", kpe_batched=False, **by_row).module()
    assert "constexpr bool kKpeBatched = false;" in row_copies.source and "_kb_" not in row_copies.name
    with pytest.raises(ValueError, match="kpe_batched: expected None, False, or True on a wgmma kernel"):
        MLADecodeKernel(spec(heads, pipeline), backend="mma", kpe_batched=True)
    assert not MLADecodeKernel(spec(heads, pipeline), backend="mma").uses_kpe_batched
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(k.module(), "mla_decode_kernel", tmp_path)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads", [8, 16])
def test_copies_by_block_on_the_transposed_kernel(tmp_path, heads):
    """copies_by_block (the default there): the early-scores transposed kernel's copier copies its tiles as the
    roles kernel does (issue_blocks); named, refused elsewhere, and ptxas keeps the wgmmas asynchronous
    without spills."""
    from helpers import ptxas_log_of_async_wgmmas
    k = MLADecodeKernel(spec(heads, "transposed"), backend="wgmma")
    assert k.uses_copies_by_block and "_cbb_" in k.module().name and "_kb_" not in k.module().name
    assert "issue_blocks<0, 8, true>(p, rows" in k.module().source
    by_row = MLADecodeKernel(spec(heads, "transposed"), backend="wgmma", copies_by_block=False)
    assert not by_row.uses_copies_by_block and "issue_blocks<0, 8, true>" not in by_row.module().source
    assert "_cbb_" not in by_row.module().name and by_row.uses_kpe_batched
    for kw in ({"backend": "mma"}, {"backend": "wgmma", "early_scores": False}):
        with pytest.raises(ValueError, match="copies_by_block: expected None, False, or True on the early-scores"):
            MLADecodeKernel(spec(heads, "transposed"), copies_by_block=True, **kw)
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(k.module(), "mla_decode_kernel", tmp_path)


@pytest.mark.parametrize("name", ["kpe_batched", "copies_by_block", "partial_16bit", "reads_before_wait"])
def test_optional_flags_refuse_what_is_not_a_bool(name):
    """MLADecodeKernel's optional bool fields: 1, "yes" and 0 are refused before any build, naming the field,
    what it takes and how to leave it (None: the measured default)."""
    for bad in (1, "yes", 0):
        with pytest.raises(ValueError, match=rf"MLADecodeKernel.{name}: expected None, False, or True on .*got "
                                             rf"{bad!r}.*leave it None"):
            MLADecodeKernel(spec(16, "transposed"), backend="wgmma", **{name: bad})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("partial_16bit", [False, True])
def test_the_two_merges_fit_their_blocks_an_sm(tmp_path, partial_16bit):
    """mla_merge_kernel keeps two 512-thread blocks an SM (at most 64 registers) with each batch's LSE loads, then
    its values; the one-wave merge, with every load of a batch in flight, fits one block an SM; neither spills.
    plan() picks the one-wave merge where the merge's grid fits one block an SM."""
    from helpers import ptxas_log_of_async_wgmmas

    from attnforge.mla import merge_kernel_name
    k = MLADecodeKernel(spec(16, "transposed"), backend="wgmma", partial_16bit=partial_16bit).module()
    for kernel, most in (("mla_merge_kernel", 64), ("mla_merge_one_wave_kernel", 128)):
        log = ptxas_log_of_async_wgmmas(k, kernel, tmp_path)
        assert "0 bytes spill stores" in log and int(re.search(r"Used (\d+) registers", log).group(1)) <= most, kernel
    assert [merge_kernel_name(b, 132) for b in (64, 132, 133)] == ["mla_merge_one_wave_kernel"] * 2 + ["mla_merge_kernel"]


@pytest.mark.parametrize("heads,batch,length,kernel,blocks", [
    (16, 1, 131072, "mla_merge_one_wave_kernel", 64),  # 16 rows x 4 blocks (16 lanes)
    (64, 1, 131072, "mla_merge_kernel", 256),  # 64 rows x 4 blocks: two waves at one block an SM
    (16, 16, 65536, "mla_merge_one_wave_kernel", 128),  # 256 rows, two a block (one lane)
    (16, 64, 8192, "mla_merge_kernel", 512)])
def test_plans_launch_the_merge_that_fits_their_grid(heads, batch, length, kernel, blocks):
    """BatchMLADecode.merge_launch: the one-wave merge where the planned merge's grid fits one block an SM of
    132, else the two-blocks-an-SM one; the grid as the plan's rows and merge lanes make it."""
    import math

    import numpy as np

    from attnforge.mla import BatchMLADecode
    w = BatchMLADecode.host_only(spec(heads, "normal"), max_batch_size=batch, max_num_pages=1 << 15)
    pages = length // 64
    w.plan(np.arange(batch + 1) * pages, np.arange(batch * pages), np.full(batch, 64), page_size=64)
    name, grid, block, smem = w.merge_launch()
    assert (name, math.prod(grid)) == (kernel, blocks) and math.prod(block) <= 512
    assert smem == (0 if w._plan["merge_lanes"] == 1 else w._plan["merge_lanes"] * (512 + 4) * 4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads,pipeline", [(16, "transposed"), (128, "normal")])
def test_partial_16bit_is_a_named_kernel_field(tmp_path, heads, pipeline):
    """MLADecodeKernel.partial_16bit: split items' partial outputs as fp16 over a row scale (TPartial), named in
    the kernel; off by default (PARTIALS_16BIT: fp32 partials); refused on the mma.sync kernels (no staged output
    tile to scale) and as a non-bool; the wgmma kernels keep their wgmmas asynchronous without spills."""
    from helpers import ptxas_log_of_async_wgmmas

    from attnforge.kernels.mla import PARTIALS_16BIT
    k = MLADecodeKernel(spec(heads, pipeline), backend="wgmma", partial_16bit=True).module()
    assert "_p16_" in k.name and "constexpr bool kPartial16 = true;" in k.source
    default = MLADecodeKernel(spec(heads, pipeline), backend="wgmma").module()
    assert not PARTIALS_16BIT and "_p16_" not in default.name and "constexpr bool kPartial16 = false;" in default.source
    for bad, backend in ((1, "wgmma"), (True, "mma")):
        with pytest.raises(ValueError, match="partial_16bit: expected None, False, or True on a wgmma kernel"):
            MLADecodeKernel(spec(heads, pipeline), backend=backend, partial_16bit=bad)
    assert not MLADecodeKernel(spec(heads, pipeline), backend="mma").uses_partial_16bit
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(k, "mla_decode_kernel", tmp_path)
    merge = ptxas_log_of_async_wgmmas(k, "mla_merge_kernel", tmp_path)  # two 512-thread blocks an SM
    assert "0 bytes spill stores" in merge and int(re.search(r"Used (\d+) registers", merge).group(1)) <= 64


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("heads,pipeline,backend", [(16, "transposed", "wgmma"), (128, "normal", "wgmma"),
                                                    (16, "normal", "mma")])
def test_reads_before_wait_is_a_named_kernel_field(tmp_path, heads, pipeline, backend):
    """MLADecodeKernel.reads_before_wait: each CTA's first item (and the transposed wgmma kernel's copier's first
    page-table rows) read before the PDL wait, named in the kernel; on by default where the kernel launches with
    PDL by default (READS_BEFORE_WAIT; h128's roles kernel launches plainly); the wgmma kernels keep their
    wgmmas asynchronous without spills. (Its refusal of non-bools: test_optional_flags_refuse_what_is_not_a_bool.)"""
    from helpers import ptxas_log_of_async_wgmmas

    from attnforge.kernels.mla import READS_BEFORE_WAIT
    k = MLADecodeKernel(spec(heads, pipeline), backend=backend, reads_before_wait=True).module()
    off = MLADecodeKernel(spec(heads, pipeline), backend=backend, reads_before_wait=False).module()
    default = MLADecodeKernel(spec(heads, pipeline), backend=backend)
    assert READS_BEFORE_WAIT and default.uses_reads_before_wait == default.pdl_by_default == (heads != 128)
    body = k.source[k.source.index(") mla_decode_kernel(const __grid_constant__"):]
    before_wait = body[:body.index("wait_for_prior_grid();")]
    assert "_rbw_" in k.name and "bool have_item = stream.next(it);" in before_wait
    assert ("resolve_copy_rows" in before_wait) == (pipeline == "transposed")
    assert "_rbw_" not in off.name and "have_item" not in off.source
    assert "0 bytes spill stores" in ptxas_log_of_async_wgmmas(k, "mla_decode_kernel", tmp_path)


@pytest.mark.parametrize("heads,pipeline", [(16, "transposed"), (64, "normal")])
def test_aligned_chunks_cut_on_the_kernel_tiles(heads, pipeline):
    """ALIGN_CUTS_TO_TILES: B64 L8192 (two chunks a request) on the wgmma kernels, transposed at 16 heads and
    roles at 64, is cut at token 4096, 64 tiles each, not 4064 + 4128 (64 + 65 tiles); align_tile = 0 on the
    wrapper restores the unrounded cut."""
    import numpy as np

    from attnforge import scheduler
    from attnforge.mla import BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    sizes = {}
    for tile in (None, 0):
        w = BatchMLADecode.host_only(spec, max_batch_size=64, max_num_pages=64 * 128)
        w.align_tile = tile
        w.plan(np.arange(65) * 128, np.arange(64 * 128), np.full(64, 64), page_size=64)
        k = w.kernel
        assert (k.backend, k.spec.pipeline, k.tiling[0]) == ("wgmma", pipeline, 64)
        chunks = scheduler.expand(w._plan["work"])
        sizes[tile] = sorted({int(hi - lo) for _, _, _, lo, hi, _ in chunks.tolist()})
    assert sizes == {None: [4096], 0: [4064, 4128]}
    w.align_tile = 48  # a bad wrapper setting: refused at plan(), before anything runs
    with pytest.raises(ValueError, match=r"BatchMLADecode.align_tile\): expected 0 or a positive divisor"):
        w.plan(np.arange(65) * 128, np.arange(64 * 128), np.full(64, 64), page_size=64)


def test_only_the_roles_kernel_lets_its_row_max_lag():
    """MLADecodeKernel.rescale_slack is what the template renders (kRescaleSlack) and what the GPU tests'
    accuracy rule reads (helpers.weight_rounding_allowance): 8 (log2) for the roles kernel, 0 for the rest."""
    from attnforge.kernels.mla import ROLES_RESCALE_SLACK
    spec = AttentionSpec(family="mla_decode", num_qo_heads=128, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         pipeline="normal")
    roles = MLADecodeKernel(spec, backend="wgmma")
    assert roles.resolved_schedule == "roles" and roles.rescale_slack == ROLES_RESCALE_SLACK == 8.0
    assert "constexpr float kRescaleSlack = 8.0f;" in roles.module().source
    for other in (MLADecodeKernel(spec, backend="wgmma", schedule="symmetric"), MLADecodeKernel(spec, backend="mma"),
                  MLADecodeKernel(dataclasses.replace(spec, pipeline="transposed"), backend="wgmma")):
        assert other.rescale_slack == 0.0, other


def test_plan_q_len_is_checked_as_decodes():
    """MLA's plan shares decode's q_len check (BatchDecode._check_q_len): an int in [1, max_q_len], a bool refused;
    requests shorter than q_len are planned, as decode's (their early tokens' rows give zeros: tests/test_mla_gpu.py)."""
    import numpy as np

    from attnforge.mla import BatchMLADecode
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    w = BatchMLADecode.host_only(spec, max_batch_size=4, max_q_len=2)
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match=r"plan\(q_len=...\): expected an int in \[1, max_q_len=2\]"):
            w.plan(np.array([0, 1, 2]), np.arange(2), np.array([1, 10]), page_size=64, q_len=bad)
    w.plan(np.array([0, 1, 2]), np.arange(2), np.array([1, 10]), page_size=64, q_len=2)
    assert (w._plan["q_len"], w.max_q_len) == (2, 2)

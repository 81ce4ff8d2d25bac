"""The prefill family's two kernels: which one runs, what each refuses, and the sm_90a-only build."""
import dataclasses
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnforge import AttentionSpec
from attnforge.jit import build_many
from attnforge.kernels.prefill import PrefillKernel, default_backend, wgmma_applies

ROOT = Path(__file__).resolve().parent.parent
SPEC = AttentionSpec(family="prefill", causal=True)  # GQA 32/8, d128, bf16


def test_wgmma_where_it_applies_and_sm90a_is_built(monkeypatch):
    monkeypatch.delenv("ATTNFORGE_PREFILL_BACKEND", raising=False)
    assert default_backend(SPEC, ("9.0a",)) == "wgmma"
    assert default_backend(SPEC, ("8.0", "9.0a+PTX")) == "wgmma"
    assert default_backend(SPEC, ("8.0",)) == "mma"
    for d in (64, 128, 256):
        for dt in ("bf16", "fp16"):
            spec = AttentionSpec(family="prefill", head_dim_qk=d, q_dtype=dt)
            assert wgmma_applies(spec) is None and default_backend(spec, ("9.0a",)) == "wgmma"


def test_backend_knob_forces_and_validates(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_PREFILL_BACKEND", "mma")
    assert default_backend(SPEC, ("9.0a",)) == "mma"
    monkeypatch.setenv("ATTNFORGE_PREFILL_BACKEND", "tensor")
    with pytest.raises(ValueError, match="ATTNFORGE_PREFILL_BACKEND='tensor' is invalid: expected auto, wgmma or mma"):
        default_backend(SPEC, ("9.0a",))


def test_shapes_and_refusals():
    k = PrefillKernel(SPEC, "wgmma")
    # wgmma defaults to a producer warpgroup beside the two consumers, with a full/empty mbarrier pair per stage
    assert (k.tile_q, k.tile_kv, k.stages, k.threads, k.producer) == (128, 128, 3, 384, True)
    # (+ 8: the persistent CTAs' q_empty mbarrier)
    assert k.smem_bytes == 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 1024 + 128 + 3 * 16 + 128 * 8 + 8
    assert k.ctas_per_sm == 1
    plain = PrefillKernel(SPEC, "wgmma", producer=False)
    assert (plain.threads, plain.smem_bytes) == (256, 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 1024 + 128)
    mma = PrefillKernel(SPEC, "mma")  # four warps of two m16 row tiles each
    assert (mma.tile_q, mma.threads, mma.producer, mma.m_tiles) == (128, 128, False, 2)
    assert mma.ctas_per_sm == 228 * 1024 // (mma.smem_bytes + 1024) == 2
    one = PrefillKernel(SPEC, "mma", m_tiles=1)
    assert (one.tile_q, one.threads, one.smem_bytes) == (64, 128, 64 * 128 * 2 + 2 * 2 * 64 * 128 * 2)
    assert "_m2_" in mma.module().name and "_m2_" not in one.module().name
    # two where measured faster: d128 without a window or a score modifier (soft-cap and fp8 K/V included)
    for kw, m_tiles in (({"head_dim_qk": 256}, 1), ({"head_dim_qk": 64}, 1), ({"window_left": 100}, 1),
                        ({"score_mod": __import__("attnforge.mods").mods.alibi(torch.ones(32))}, 1),
                        ({"logits_soft_cap": 30.0}, 2), ({"kv_dtype": "fp8_e4m3"}, 2), ({"causal": False}, 2)):
        k = PrefillKernel(AttentionSpec(family="prefill", **kw), "mma")
        assert (k.m_tiles, k.tile_q) == (m_tiles, 64 * m_tiles), kw
    with pytest.raises(ValueError, match="m_tiles: the mma backend takes 1 or 2 .*got 3"):
        PrefillKernel(SPEC, "mma", m_tiles=3)
    with pytest.raises(ValueError, match=r"m_tiles: .*wgmma: 1\), got 2 with backend 'wgmma'"):
        PrefillKernel(SPEC, "wgmma", m_tiles=2)
    d256 = AttentionSpec(family="prefill", head_dim_qk=256)  # (its registers table has no two-tile entry)
    with pytest.raises(ValueError, match="d256's accumulators fill the registers at one.*at head_dim 256"):
        PrefillKernel(d256, "mma", m_tiles=2)
    # d256: Q of 128 rows and a split ring of two K and three V 64-token slots (each on a full and
    # an empty mbarrier) beside a producer; without one, 64 rows and three shared stages
    d256_spec = AttentionSpec(family="prefill", head_dim_qk=256)
    d256 = PrefillKernel(d256_spec, "wgmma")
    assert (d256.tile_q, d256.tile_kv, d256.stages, d256.threads, d256.split_ring) == (128, 64, 2, 384, True)
    assert d256.smem_bytes == 128 * 256 * 2 + 5 * 64 * 256 * 2 + 1024 + 128 + 5 * 16 + 64 * 8 + 8 <= 227 * 1024
    assert d256.module().context["split_ring"] and d256.module().name.endswith("_ws_pers_tma_s2")
    d256_plain = PrefillKernel(d256_spec, "wgmma", producer=False)
    assert (d256_plain.tile_q, d256_plain.stages, d256_plain.threads, d256_plain.split_ring) == (64, 3, 128, False)
    assert d256_plain.smem_bytes == 64 * 256 * 2 + 3 * 2 * 64 * 256 * 2 + 1024 + 128
    assert not k.split_ring and PrefillKernel(SPEC, "wgmma", num_stages=2).split_ring  # a producer at 2 stages
    with pytest.raises(ValueError, match="without a producer needs an int of at least 3, got 2"):
        PrefillKernel(SPEC, "wgmma", producer=False, num_stages=2)
    with pytest.raises(ValueError, match="with a producer needs an int of at least 2, got 1"):
        PrefillKernel(SPEC, "wgmma", num_stages=1)
    for stages in (2.5, "3"):
        with pytest.raises(ValueError, match=r"needs an int of at least 2, got (2.5|'3')"):
            PrefillKernel(SPEC, "wgmma", num_stages=stages)
    with pytest.raises(ValueError, match="exceeds 232448 B at 4 stages of 128-token tiles; use fewer stages, or None"):
        PrefillKernel(SPEC, "wgmma", num_stages=4)
    with pytest.raises(ValueError, match="expected one of .*got 'tensor'; or pass backend=None"):
        PrefillKernel(SPEC, "tensor")
    from attnforge import BatchPrefill
    for falsy in (0, "", False):  # (BatchPrefill took them as None, the default, before)
        with pytest.raises(ValueError, match=rf"expected one of .*got {falsy!r}; or pass backend=None"):
            BatchPrefill(SPEC, backend=falsy)


def test_wgmma_module_builds_for_sm90a_whatever_the_arch_list():
    mod = PrefillKernel(SPEC, "wgmma").module()
    assert mod.archs == ("9.0a",) and "batch_prefill_wgmma_kernel" in mod.kernel_names
    (path,) = build_many([mod], ("8.0",))  # an sm_80 list would reject wgmma; the module overrides it
    assert "/90a/" in path.as_posix() and path.suffix == ".cubin"
    assert b"batch_prefill_wgmma_kernel" in path.read_bytes()


def test_generated_wgmma_header_is_current():
    out = subprocess.run([sys.executable, "-c", "import runpy,sys; sys.argv=['x']; "
                          "m = runpy.run_path('tools/gen_wgmma.py', run_name='lib'); print(m['render'](), end='')"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    committed = (ROOT / "csrc_include" / "attnforge" / "wgmma_ops.cuh").read_text()
    assert out == committed, "run: python tools/gen_wgmma.py"
    assert committed.count("wgmma.mma_async.sync.aligned") == 70  # {ss, ss_tb, ss_ta, rs, rs_tb} x {8..256, 192} x {bf16, fp16}


def test_kv_tile_override():
    k = PrefillKernel(SPEC, "wgmma", num_stages=4, kv_tile=64)
    assert (k.tile_kv, k.stages) == (64, 4) and k.module().name.endswith("_t64_ws_pers_tma_s4")
    assert k.smem_bytes == 128 * 128 * 2 + 4 * 2 * 64 * 128 * 2 + 1024 + 128 + 4 * 16 + 64 * 8 + 8
    with pytest.raises(ValueError, match="kv_tile: the wgmma backend takes 64 or 128"):
        PrefillKernel(SPEC, "mma", kv_tile=64)


def test_exponentials_on_the_fma_pipe_where_a_score_function_shares_the_sfu():
    """fma_exp_every: by default FMA_EXP_EVERY's choice by head_dim and whether the logits transform is a
    transcendental function of the score (soft-cap's tanh, by the spec or a mod); 0 on the mma.sync kernel."""
    import dataclasses

    from attnforge import mods
    from attnforge.kernels.prefill import FMA_EXP_EVERY
    capped = dataclasses.replace(SPEC, logits_soft_cap=30.0)
    runtime_cap = dataclasses.replace(SPEC, score_mod=mods.softcap(torch.tensor(30.0)))  # not a folded core
    alibi = dataclasses.replace(SPEC, score_mod=mods.alibi(torch.ones(32)))
    d64 = dataclasses.replace(SPEC, head_dim_qk=64, head_dim_vo=64)
    cases = ((SPEC, (128, False)), (capped, (128, True)), (runtime_cap, (128, True)), (alibi, (128, False)),
             (d64, (64, False)), (dataclasses.replace(d64, logits_soft_cap=30.0), (64, True)))
    assert any(FMA_EXP_EVERY.get(key, 0) for _, key in cases) and not all(FMA_EXP_EVERY.get(key, 0) for _, key in cases)
    for spec, key in cases:
        want = FMA_EXP_EVERY.get(key, 0)
        k = PrefillKernel(spec, "wgmma")
        assert k.fma_exp_every == want and f"constexpr int kFmaExpEvery = {want};" in k.module().source
        assert (f"_fx{want}_" in k.module().name) == (want > 0)
        assert PrefillKernel(spec, "mma").fma_exp_every == 0
    assert PrefillKernel(SPEC, "wgmma", fma_exp_every=2).module().name.endswith("_tma_fx2_s3")
    with pytest.raises(ValueError, match=r"fma_exp_every: expected one of \(0, 1, 2, 4, 8\).*got 3"):
        PrefillKernel(SPEC, "wgmma", fma_exp_every=3)
    for bad in (True, 4.0):
        with pytest.raises(ValueError, match=f"fma_exp_every: expected one of.*got {bad!r}"):
            PrefillKernel(SPEC, "wgmma", fma_exp_every=bad)
    with pytest.raises(ValueError, match="only the wgmma backend has it"):
        PrefillKernel(SPEC, "mma", fma_exp_every=4)


def test_persistent_shape_and_refusals():
    k = PrefillKernel(SPEC, "wgmma", persistent=True)
    assert k.module().name.endswith("_ws_pers_tma_s3") and "constexpr bool kPersistent = true;" in k.module().source
    assert k == PrefillKernel(SPEC, "wgmma"), "persistent by default with a producer and no ping-pong"
    per_item = PrefillKernel(SPEC, "wgmma", persistent=False)
    assert k.smem_bytes == per_item.smem_bytes + 8  # the q_empty mbarrier
    assert not PrefillKernel(SPEC, "wgmma", pingpong=True).persistent and not PrefillKernel(SPEC, "mma").persistent
    with pytest.raises(ValueError, match="persistent: needs the producer warpgroup"):
        PrefillKernel(SPEC, "wgmma", producer=False, persistent=True)
    both = PrefillKernel(SPEC, "wgmma", pingpong=True, persistent=True)  # turns taken within each item
    assert both.module().name.endswith("_ws_pp_pers_tma_s3") and "constexpr bool kPingPong = true;" in both.module().source
    with pytest.raises(ValueError, match="persistent: needs the producer warpgroup"):
        PrefillKernel(SPEC, "mma", persistent=True)


def test_producer_warpgroup_shape():
    k = PrefillKernel(SPEC, "wgmma", producer=True)
    assert k.threads == 384 and k.module().name.endswith("_ws_pers_tma_s3")
    assert k.smem_bytes == PrefillKernel(SPEC, "wgmma", producer=False).smem_bytes + 2 * 3 * 8 + 128 * 8 + 8
    assert k == PrefillKernel(SPEC, "wgmma")  # the default on wgmma
    assert not PrefillKernel(SPEC, "wgmma", producer=False).module().name.endswith("_ws_s3")
    assert "producer_warpgroup" in k.module().context and "setmaxnreg_dec<kProducerRegs>" in k.module().source
    with pytest.raises(ValueError, match="only the wgmma backend has a producer warpgroup, got backend .mma.; pass"):
        PrefillKernel(SPEC, "mma", producer=True)
    pp = PrefillKernel(SPEC, "wgmma", producer=True, pingpong=True)
    assert pp.module().name.endswith("_ws_pp_tma_s3") and "named_bar_sync(1 + wg, 256)" in pp.module().source
    with pytest.raises(ValueError, match="pingpong: needs the producer warpgroup .*got producer=False; pass producer=True"):
        PrefillKernel(SPEC, "wgmma", producer=False, pingpong=True)
    pp256 = PrefillKernel(AttentionSpec(family="prefill", head_dim_qk=256), "wgmma", pingpong=True)
    assert (pp256.tile_q, pp256.split_ring) == (128, True)  # two consumer warpgroups at d256 too


def test_one_resident_wgmma_cta_per_sm_whatever_shared_memory_allows():
    d64 = AttentionSpec(family="prefill", head_dim_qk=64, causal=True)
    small = PrefillKernel(d64, "wgmma", num_stages=4, kv_tile=64)  # 82 KB: two would fit by shared memory
    assert small.smem_bytes * 2 < 228 * 1024 and small.ctas_per_sm == 1  # registers: 384 x 168 of 65536
    mma = PrefillKernel(d64, "mma", m_tiles=1)  # 5 fit by shared memory, 3 by its ~129 registers a thread
    assert (228 * 1024 // (mma.smem_bytes + 1024), mma.ctas_per_sm) == (5, 3)
    two = PrefillKernel(d64, "mma", m_tiles=2)  # two m16 tiles a warp: 4 by shared memory, 2 by ~250 registers
    assert (228 * 1024 // (two.smem_bytes + 1024), two.ctas_per_sm) == (4, 2)
    assert PrefillKernel(d64, "wgmma").stages == 4 and PrefillKernel(d64, "wgmma", producer=False).stages == 3


def test_split_kv_is_off_where_a_row_epilogue_needs_the_whole_row():
    import attnforge.mods as m
    from attnforge import BatchPrefill
    dev = "cuda:0"  # a device name only: nothing is allocated outside CUDA-graph mode
    assert BatchPrefill(SPEC, device=dev).split_kv
    assert not BatchPrefill(SPEC, device=dev, split_kv=False).split_kv
    sink = AttentionSpec(family="prefill", score_mod=m.attention_sink(torch.zeros(32)))
    assert not BatchPrefill(sink, device=dev).split_kv  # the sink joins the denominator once
    raw = m.raw_mod("static constexpr bool kHasOutputTransform = true;")
    assert not BatchPrefill(AttentionSpec(family="prefill", score_mod=raw), device=dev).split_kv


def test_tma_option_rides_on_the_producer():
    k = PrefillKernel(SPEC, "wgmma")  # built with maps; the host picks boxes per cache (tma_values)
    assert k.tma is None and k.has_tma and k.params.has_tmap
    assert [f.name for f in k.params.fields[:2]] == ["k_tmap", "v_tmap"] and k.module().name.endswith("_ws_pers_tma_s3")
    src = k.module().source
    assert "tma_load_4d(" in src and "mbar_expect_tx(bar, tma_rows * 128)" in src
    off = PrefillKernel(SPEC, "wgmma", tma=False)
    assert not off.has_tma and not off.params.has_tmap and "tma_load_4d(" not in off.module().source
    assert not PrefillKernel(SPEC, "wgmma", producer=False).has_tma and not PrefillKernel(SPEC, "mma").has_tma
    with pytest.raises(ValueError, match="tma: the copy engine is driven by the producer warpgroup.*producer=True"):
        PrefillKernel(SPEC, "wgmma", producer=False, tma=True)
    with pytest.raises(ValueError, match="tma: expected None .by measurement., True or False, got 'yes'"):
        PrefillKernel(SPEC, "wgmma", tma="yes")


@pytest.mark.parametrize("tma,page,rows", [(None, 4, 0), (None, 8, 8), (None, 256, 128), (True, 16, 16),
                                           (True, 7, 0), (False, 64, None)])
def test_tma_boxes_per_cache(monkeypatch, tma, page, rows):
    """Which caches get TMA boxes: by default pages of 8+ tokens (measured faster), with tma=True any
    page that tiles the KV tile; ragged KV never. Maps are encoded only when used (stubbed here)."""
    import torch

    from attnforge.jit import tma as tma_maps
    monkeypatch.setattr(tma_maps, "encode", lambda t, box: bytes(128))
    k = PrefillKernel(SPEC, "wgmma", tma=tma)
    cache = torch.empty(4, 2, page, SPEC.num_kv_heads, SPEC.head_dim_qk, dtype=torch.bfloat16)
    got = k.tma_values(cache[:, 0], cache[:, 1], page, ragged=False)
    assert got.get("tma_box_rows") == rows
    if rows is not None:  # ragged K/V [tokens, Hkv, D]: a whole tile per box; 4-D views (attention()) never
        ragged = torch.empty(1000, SPEC.num_kv_heads, SPEC.head_dim_qk, dtype=torch.bfloat16)
        assert k.tma_values(ragged, ragged, 0, ragged=True)["tma_box_rows"] == k.tile_kv
        # attention()'s [B, Hkv, Lk, D]: one Lk-token page per request, whole tiles when Lk is a multiple
        dense = torch.empty(2, SPEC.num_kv_heads, 1024, SPEC.head_dim_qk, dtype=torch.bfloat16)
        got = k.tma_values(dense, dense, 0, ragged=True)
        assert (got["tma_box_rows"], got["tma_page_per_request"], got["tma_heads_inner"]) == (k.tile_kv, 1, 0)
        odd = torch.empty(2, SPEC.num_kv_heads, 300, SPEC.head_dim_qk, dtype=torch.bfloat16)
        assert k.tma_values(odd, odd, 0, ragged=True)["tma_box_rows"] == 0


def test_exact_max_renders_a_row_max_without_slack():
    """exact_max: the wgmma kernel's reference max follows every new maximum (slack 0, its own build), the default
    lags by 8 (log2); the mma kernel's max is always exact, so there the option changes neither name nor source."""
    lagging, exact = PrefillKernel(SPEC, "wgmma"), PrefillKernel(SPEC, "wgmma", exact_max=True)
    assert (lagging.rescale_slack, exact.rescale_slack) == (8.0, 0.0)
    assert "constexpr float kRescaleSlack = 8.0f;" in lagging.module().source
    assert "constexpr float kRescaleSlack = 0.0f;" in exact.module().source
    assert exact.module().name == lagging.module().name.replace("_s3", "_xm_s3") != lagging.module().name
    assert exact.for_partials().module().name.endswith("_xm_s3") and exact.for_kv(True).exact_max
    mma = PrefillKernel(SPEC, "mma", exact_max=True)
    assert mma.rescale_slack == 0.0 and mma.module().source == PrefillKernel(SPEC, "mma").module().source
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match=f"exact_max: expected True or False, got {bad!r}"):
            PrefillKernel(SPEC, "wgmma", exact_max=bad)


def emulated_rows(q, k, v, slack: float, tile: int = 128) -> torch.Tensor:
    """The Hopper prefill's online softmax on the CPU, one KV tile at a time: scores in log2 units (float32), a
    reference max that moves only past `slack`, float32 row sums, P rounded to bf16 for P.V, float32 O."""
    s = (q.float() @ k.float().T) * (math.log2(math.e) / math.sqrt(q.shape[1]))
    m, l, o = torch.full((q.shape[0],), -math.inf), torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[1])
    for t in range(0, k.shape[0], tile):
        tile_max = s[:, t:t + tile].max(1).values
        moved = torch.where(tile_max > m + slack, tile_max, m)
        alpha = torch.where(torch.isinf(m), torch.zeros(()), torch.exp2(m - moved))
        p = torch.exp2(s[:, t:t + tile] - moved[:, None])
        l, o, m = l * alpha + p.sum(1), o * alpha[:, None] + p.bfloat16().float() @ v[t:t + tile].float(), moved
    return o / l[:, None]


@pytest.mark.parametrize("seed", [0, 1])
def test_an_exact_row_max_rounds_peaked_rows_closer(seed):
    """Why exact_max exists: with a lagging reference max a peaked row's dominant weight is 2^f rounded to bf16,
    not exactly 1. Emulated float32 rows over 2000 keys at twice randn's scale (the cascade GPU test's kind):
    the lag's RMS error against float64 is 1.4x+ the exact max's (1.55-1.88x over four seeds), and the exact
    max's is below that of torch's softmax with P rounded to bf16 once."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(64, 128, generator=g).bfloat16()
    k, v = ((torch.randn(2000, 128, generator=g) * 2).bfloat16() for _ in range(2))
    ref = torch.softmax(q.double() @ k.double().T / math.sqrt(128), 1) @ v.double()

    def rms(rows):
        return ((rows.double() - ref) ** 2).mean().sqrt().item()
    exact, lagging = rms(emulated_rows(q, k, v, 0.0)), rms(emulated_rows(q, k, v, 8.0))
    torch_p = rms(torch.softmax(q.float() @ k.float().T / math.sqrt(128), 1).bfloat16().float() @ v.float())
    assert lagging >= 1.4 * exact and exact < torch_p, (exact, lagging, torch_p)


def test_trace_stamps_only_when_asked():
    """The debug trace (benchmarks/trace_prefill.py) renders its per-item and per-tile stamps only with
    trace=True: one interior tile's six phase stamps per consumer warpgroup (--tiles)."""
    import dataclasses
    m = PrefillKernel(SPEC, "wgmma", persistent=True).module()
    assert "af_trace" not in m.source and "#define AF_STAMP_ITEM(it, k) do { } while (0)" in m.source
    assert "af_tile_trace" not in m.source and "#define AF_TILE_STAMP(t, k) do { } while (0)" in m.source
    traced = dataclasses.replace(m, context={**m.context, "trace": True}).source
    assert "__device__ unsigned long long af_trace" in traced and traced.count("AF_STAMP") >= 9
    assert "__device__ unsigned long long af_tile_trace" in traced
    assert "af_cta_trace" not in m.source and traced.count("AF_CTA_STAMP(") == 3  # the macro, a CTA's start and end
    assert sorted(int(k) for k in re.findall(r"AF_TILE_STAMP\(t, (\d)\)", traced)) == [0, 1, 2, 3, 4, 5]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("kw", [{}, {"persistent": False}, {"score_mod": "alibi"}, {"score_mod": "softcap"},
                                {"score_mod": "spec_softcap"}, {"persistent": False, "head_dim": 64},
                                {"pingpong": True, "persistent": False}, {"exact_max": True, "partial_out": True}])
def test_ptxas_keeps_the_wgmmas_asynchronous(tmp_path, kw):
    """ptxas silently serialises every wgmma (info C7514 / C7515, or injects waits, C7517) when code
    between an issue and its wait branches or touches accumulators: the deferred epilogue runs under
    the next item's S(0), so its stores are predicated, never branched around. No spills either."""
    import dataclasses

    from attnforge import mods
    from helpers import ptxas_log_of_async_wgmmas
    kw = dict(kw)
    spec = {"alibi": dataclasses.replace(SPEC, score_mod=mods.alibi(torch.ones(SPEC.num_qo_heads))),
            "softcap": dataclasses.replace(SPEC, score_mod=mods.softcap(50.0)),
            "spec_softcap": dataclasses.replace(SPEC, logits_soft_cap=50.0)}.get(kw.pop("score_mod", None), SPEC)
    d = kw.pop("head_dim", 128)
    spec = dataclasses.replace(spec, head_dim_qk=d, head_dim_vo=d)
    log = ptxas_log_of_async_wgmmas(PrefillKernel(spec, "wgmma", **kw).module(), "batch_prefill_wgmma_kernel", tmp_path)
    assert re.search(r"\b0 bytes spill stores", log), log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("head_dim,kw", [(64, {}), (128, {}), (256, {}), (128, {"pingpong": True, "persistent": False})])
def test_setmaxnreg_split_fits_the_registers_the_launch_allocates(tmp_path, head_dim, kw):
    """setmaxnreg.inc waits until the CTA's pool holds the registers it asks for, so a split over the pool
    hangs the consumers on the GPU (the MLA producer's first run, thirty-first session); ptxas accepts any
    split. The pool is ptxas's register count for the kernel times its threads."""
    import dataclasses

    from helpers import ptxas_log_of_async_wgmmas
    spec = dataclasses.replace(SPEC, head_dim_qk=head_dim, head_dim_vo=head_dim)
    m = PrefillKernel(spec, "wgmma", **kw).module()
    launch = int(re.search(r"Used (\d+) registers", ptxas_log_of_async_wgmmas(m, "batch_prefill_wgmma_kernel",
                                                                              tmp_path)).group(1))
    consumers = m.context["tile_q"] // 64
    producer_regs = re.search(r"kProducerRegs = kWarpgroups == 2 \? (\d+) : (\d+);", m.source).groups()
    producer = int(producer_regs[0] if consumers == 2 else producer_regs[1])
    (consumer,) = {int(x) for x in re.findall(r"setmaxnreg_inc<(\d+)>", m.source)}
    assert producer + consumers * consumer <= (consumers + 1) * launch, (launch, producer, consumer)


FP8 = AttentionSpec(family="prefill", kv_dtype="fp8_e4m3", causal=True)


def test_fp8_kv_on_the_mma_kernel_widens_a_tile_in_shared_memory():
    """fp8 K/V on the portable kernel: the ring of tiles at one byte a value and one widened K/V tile beside
    it; v_scale is a parameter of the fp8 kernels alone."""
    k, plain = PrefillKernel(FP8, "mma"), PrefillKernel(SPEC, "mma")
    d, q_bytes = 128, 128 * 128 * 2
    assert k.smem_bytes == q_bytes + 2 * 2 * 64 * d * 1 + 2 * 64 * d * 2
    assert plain.smem_bytes == q_bytes + 2 * 2 * 64 * d * 2
    assert "kvfp8" in k.module().name and "kvfp8" not in plain.module().name
    assert "v_scale" in k.params.cpp() and "v_scale" not in plain.params.cpp()
    src, plain_src = k.module().source, plain.module().source
    assert "Loader::widen" in src and "inv *= p.v_scale" in src and "inv *= p.v_scale" not in plain_src


def test_fp8_kv_on_the_wgmma_kernel_stages_tiles_for_its_producer():
    """fp8 K/V on Hopper: the wgmma kernel (the default at head_dim 64 and 128) copies fp8 tiles as stored
    into a staging ring of their own, and its producer widens them into the 16-bit ring (head_dim 128: two
    K and two V slots of 128 tokens beside two staging slots; 64: three shared stages, four staging slots);
    head_dim 256 has no room for the staging and runs the mma kernel."""
    assert wgmma_applies(FP8) is None and default_backend(FP8, ("9.0a",)) == "wgmma"
    assert default_backend(FP8, ("8.0",)) == "mma"
    d256 = dataclasses.replace(FP8, head_dim_qk=256, head_dim_vo=256)
    assert "at head_dim 256" in wgmma_applies(d256) and default_backend(d256, ("9.0a",)) == "mma"
    with pytest.raises(ValueError, match="the wgmma backend does not take kv_dtype fp8_e4m3 at head_dim 256"):
        PrefillKernel(d256, "wgmma")
    k = PrefillKernel(FP8, "wgmma")
    assert (k.tile_q, k.tile_kv, k.stages, k.split_ring, k.fp8_stages, k.has_tma, k.persistent) == (
        128, 128, 2, True, 2, False, True)
    ws = 16 * 4 + 8 * 128 + 8 + 8 * 2  # full / empty mbarriers of four slots, row offsets, q_empty, staged
    assert k.smem_bytes == 128 * 128 * 2 + 4 * 128 * 128 * 2 + 2 * 2 * 128 * 128 + 1024 + 128 + ws <= 227 * 1024
    d64 = PrefillKernel(dataclasses.replace(FP8, head_dim_qk=64, head_dim_vo=64), "wgmma")
    assert (d64.tile_kv, d64.stages, d64.split_ring, d64.fp8_stages) == (128, 3, False, 4)
    assert PrefillKernel(FP8, "wgmma", kv_tile=64, num_stages=3).fp8_stages == 4  # as many as fit, up to 4
    assert PrefillKernel(SPEC, "wgmma").fp8_stages == 0
    src = k.module().source
    assert "widen_sw128" in src and "v_out_scale = p.v_scale" in src and "stage_q_fp16" in src
    assert "kFp8Stages = 2;" in src and "v_scale" in k.params.cpp()
    names = {PrefillKernel(FP8, "wgmma", kv_tile=64, num_stages=3, fp8_stages=n).module().name for n in (2, 3, 4)}
    assert len(names) == 3 and all("kvfp8" in n for n in names)
    # staging by TMA boxes of whole byte rows (swizzled at head_dim 128): an option
    assert "k_tmap" not in k.params.cpp() and "load_fp8_tma" not in src and not d64.has_tma
    tma = PrefillKernel(FP8, "wgmma", tma=True)
    assert tma.has_tma and "k_tmap" in tma.params.cpp() and "load_fp8_tma" in tma.module().source
    assert "load_tile_tma" not in tma.module().source and PrefillKernel(d64.spec, "wgmma", tma=True).has_tma
    plain_src = PrefillKernel(SPEC, "wgmma").module().source
    assert "kFp8Stages = 0;" in plain_src and "constexpr float v_out_scale = 1.f;" in plain_src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_widening_mapping_check_holds_for_the_kernels_and_catches_bank_conflicts(tmp_path):
    """KVTileLoader::widen_mapping_holds (the static_assert of widen_sw128), evaluated on the host: it holds for
    the producer's two loaders (head_dim 128 staged swizzled, 64 plain) and fails for 128-byte rows staged
    plain, where a quarter-warp's eight loads of one column hit one bank group."""
    from helpers import run_host_program
    out = run_host_program(r"""
#include <cstdio>
#include "attnforge/kv_tile.cuh"
template <int D, bool kSwizzled> using L = attnforge::KVTileLoader<attnforge::fp8e4m3, attnforge::fp16, D, 128, 128,
                                                                  kSwizzled>;
int main() {
  std::printf("%d %d %d", int(L<128, true>::widen_mapping_holds()), int(L<64, false>::widen_mapping_holds()),
              int(L<128, false>::widen_mapping_holds()));
}
""", tmp_path)
    assert out.split() == ["1", "1", "0"]


def test_ragged_fp8_plans_run_a_tma_built_twin_at_head_dim_128():
    """PrefillKernel.for_kv: fp8 K/V at head_dim 128 with tma=None stages ragged K/V by TMA boxes on a twin
    (measured 5.7-5.9% faster) and keeps pages on the cp.async-only kernel (a TMA build runs them slower);
    every other kernel, and any explicit tma choice, serves both kinds itself."""
    k = PrefillKernel(FP8, "wgmma")
    twin = k.for_kv(ragged=True)
    assert k.for_kv(ragged=False) is k and twin is not k and twin.has_tma and not k.has_tma
    assert dataclasses.replace(twin, tma=None) == k and twin.module().name != k.module().name
    assert (twin.smem_bytes, twin.fp8_stages, twin.tile_kv, twin.ctas_per_sm) == (
        k.smem_bytes, k.fp8_stages, k.tile_kv, k.ctas_per_sm)
    d64 = PrefillKernel(dataclasses.replace(FP8, head_dim_qk=64, head_dim_vo=64), "wgmma")
    for other in (d64, PrefillKernel(FP8, "wgmma", tma=False), PrefillKernel(FP8, "wgmma", tma=True),
                  PrefillKernel(FP8, "mma"), PrefillKernel(SPEC, "wgmma")):
        assert other.for_kv(ragged=True) is other and other.for_kv(ragged=False) is other


@pytest.mark.parametrize("kw,match", [
    ({"producer": False}, "widened by the producer warpgroup"), ({"pingpong": True}, "pingpong=True"),
    ({"fp8_stages": 1}, "fp8_stages: 2 or more"), ({"fp8_stages": "4"}, "fp8_stages: .*got '4'"),
    ({"fp8_stages": 3}, r"at 2 stages of 128-token tiles \(3 fp8 staging slots: 98304 B\); use fewer stages, fewer "
                        r"fp8_stages or kv_tile=64"), ({"fp8_int_widen": 1}, "fp8_int_widen")])
def test_fp8_kv_on_the_wgmma_kernel_refuses_what_it_cannot_run(kw, match):
    with pytest.raises(ValueError, match=match):
        PrefillKernel(FP8, "wgmma", **kw)
    with pytest.raises(ValueError, match="fp8_stages"):  # staging belongs to fp8 K/V
        PrefillKernel(SPEC, "wgmma", fp8_stages=4)
    with pytest.raises(ValueError, match="fp8_int_widen: True only with fp8 K/V on the wgmma backend"):
        PrefillKernel(FP8, "mma", fp8_int_widen=True)


@pytest.mark.parametrize("spec,kw,match", [
    (SPEC, {"v_scale": 2.0}, r"v_scale=...\): expected 1.0 for bf16 K/V"),
    (FP8, {"k_scale": 0.0}, r"k_scale=...\): expected a finite float > 0"),
    (FP8, {"v_scale": float("nan")}, r"v_scale=...\): expected a finite float > 0"),
    (FP8, {"k_scale": "1"}, r"k_scale=...\): expected a finite float > 0")])
def test_plan_refuses_bad_scales_before_any_work(spec, kw, match):
    from attnforge import BatchPrefill
    w = BatchPrefill(spec, device="cuda:0")  # (nothing is allocated outside CUDA-graph mode)
    with pytest.raises(ValueError, match=match):
        w.plan([0, 4], [0, 9], **kw)


@pytest.mark.parametrize("qo,kv,match", [
    (5, [0, 9], r"qo_indptr: expected a non-decreasing 1-D array \[B\+1\] starting at 0, got 5\."),
    ([[0, 4]], [0, 9], r"qo_indptr: expected .*, got \[\[0 4\]\]"),
    (np.zeros(0, np.int64), [0, 9], r"qo_indptr: expected .*, got \[\]"),
    ([1, 4], [0, 9], r"qo_indptr: expected .*, got \[1 4\]"),
    ([0, 5, 3], [0, 9, 9], r"qo_indptr: expected .*, got \[0 5 3\]"),
    ([0, 4], 9, r"kv_indptr: expected a non-decreasing array \[2\] starting at 0 \(token offsets\), got 9\."),
    ([0, 4], [0, 9, 12], r"kv_indptr: expected a non-decreasing array \[2\]"),
    ([0, 4, 6], [0, 9, 7], r"kv_indptr: expected .*, got \[0 9 7\]"),
    ([0, 4], [2, 9], r"kv_indptr: expected .*, got \[2 9\]")])
def test_plan_refuses_bad_index_arrays_with_what_it_got(qo, kv, match):
    """A scalar where an array belongs gets the same message as any bad array (not an IndexError)."""
    from attnforge import BatchPrefill
    w = BatchPrefill(SPEC, device="cuda:0")
    with pytest.raises(ValueError, match=match):
        w.plan(qo, kv)


def test_paged_plan_refuses_a_scalar_page_table_indptr():
    from attnforge import BatchPrefill
    w = BatchPrefill(SPEC, device="cuda:0")
    with pytest.raises(ValueError, match=r"kv_indptr: expected a 1-D array \[B\+1\] starting at 0, got 3\."):
        w.plan([0, 4], 3, [0], [1], page_size=16)


def test_plan_takes_scales_of_any_real_type_but_bool():
    """numpy scalars (a cache's scales often are) pass the check; True is not a scale."""
    import numpy as np
    from attnforge import BatchPrefill
    w = BatchPrefill(FP8, device="cuda:0")
    assert w._check_scales(np.float32(0.5), np.float64(2.0)) == 2.0 and w._check_scales(1, 3) == 3.0
    with pytest.raises(ValueError, match=r"k_scale=...\): expected a finite float > 0, got True"):
        w._check_scales(True, 1.0)


def test_single_prefill_refuses_bad_tensors_before_any_work():
    from attnforge import single_prefill
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"single_prefill k: expected a 3-D tensor \[tokens, heads, head_dim\]"):
        single_prefill(q, torch.zeros(4, 128), torch.zeros(4, 8, 128))
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device cpu"):
        single_prefill(q, torch.zeros(4, 8, 128), torch.zeros(4, 8, 128))


def test_the_llama_prefill_preset_builds_what_batch_prefill_launches():
    """`python -m attnforge build --preset llama-prefill`: each spec's modules are those BatchPrefill launches
    (16-bit and fp8 K/V, bf16 and fp16 queries; a split plan's merge too), so an AOT cache serves prefill under
    ATTNFORGE_DISABLE_JIT."""
    from attnforge import BatchPrefill, presets
    specs = presets.PRESETS["llama-prefill"]()
    names = []
    for spec in specs:
        w = BatchPrefill(spec, device="cuda:0")  # (nothing is allocated outside CUDA-graph mode)
        launched = [k.module().name for k in w.launchable_kernels()]
        assert sorted(m.name for m in presets.modules_for(spec)) == sorted(launched)
        assert sum(n.startswith("merge_states_float_out") for n in launched) == 1
        names += [n for n in launched if n.startswith("prefill_")]
    # fp8 K/V at head_dim 128: ragged plans run a TMA-built twin; plans that split KV, a float32-partials twin of each
    assert len(set(names)) == 12 and sum("kvfp8" in n for n in set(names)) == 8
    assert sum("tma" in n and "kvfp8" in n for n in set(names)) == 4
    assert sum("outf32" in n for n in set(names)) == 6

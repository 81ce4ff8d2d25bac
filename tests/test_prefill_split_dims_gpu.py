"""Prefill with values narrower than keys (head_dim_vo < head_dim_qk: DeepSeek's 192/128 before absorption) on
the H200: the wgmma kernel against the float64 reference, ragged K/V, outputs poisoned first."""
import math

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchPrefill
from attnforge.spec import PREFILL_QK_VO_DIMS
from helpers import weight_rounding_allowance
from test_prefill_gpu import check_against_reference

pytestmark = pytest.mark.gpu

# lengths off every tile size, a one-token request, an empty KV and a chunked prefill (qo_len < kv_len)
QO_LENS, KV_LENS = [1, 77, 300, 129, 5, 640], [1, 200, 300, 1000, 0, 640]


def split_case(spec, qo_lens, kv_lens, seed=0, v_view=False):
    """q [Σqo, Hq, dqk], k [Σkv, Hkv, dqk], v [Σkv, Hkv, dvo]; v_view: V sliced out of a fused [.., dqk + dvo]
    projection (strides of its own, as DeepSeek's kv_b_proj output gives)."""
    g = torch.Generator().manual_seed(seed)
    dt = attnforge.checks.TORCH_DTYPES[spec.q_dtype]
    n, h, dk, dv = sum(kv_lens), spec.num_kv_heads, spec.head_dim_qk, spec.head_dim_vo
    q = torch.randn(sum(qo_lens), spec.num_qo_heads, dk, generator=g).to(dt).cuda()
    k = torch.randn(n, h, dk, generator=g).to(dt).cuda()
    if v_view:
        v = torch.randn(n, h, dk + dv, generator=g).to(dt).cuda()[..., dk:]
    else:
        v = torch.randn(n, h, dv, generator=g).to(dt).cuda()
    return q, k, v, np.concatenate([[0], np.cumsum(qo_lens)]), np.concatenate([[0], np.cumsum(kv_lens)])


def run_and_check(spec, qo_lens=QO_LENS, kv_lens=KV_LENS, seed=0, v_view=False, **options):
    q, k, v, qo, kv = split_case(spec, qo_lens, kv_lens, seed, v_view)
    w = BatchPrefill(spec, **options)
    w.plan(qo, kv)
    out = torch.full((q.shape[0], spec.num_qo_heads, spec.head_dim_vo), math.nan, dtype=q.dtype, device="cuda")
    res, lse = w.run(q, (k, v), out=out, return_lse=True)
    torch.cuda.synchronize()
    assert res is out and out.shape[-1] == spec.head_dim_vo
    per = [(k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]]) for b in range(len(kv_lens))]
    # the wgmma kernel's row max lags by up to 2^8 (kRescaleSlack), so P's bf16 rounding can reach a dominant
    # weight's: one seed of GQA-4 read 6.4e-3 against torch's 1.9e-3, as d128 and d256 do on other seeds
    # (session 62's probe); the masks themselves are checked exactly by test_masks_are_exact below
    check_against_reference(spec, q, out, lse, per, qo,
                            dominant_weight_error=weight_rounding_allowance(q.dtype, v.abs().max().item()))
    for b, n in enumerate(kv_lens):  # an empty KV range: zeros and LSE -inf
        if n == 0:
            assert torch.all(out[qo[b]:qo[b + 1]] == 0) and torch.all(lse[qo[b]:qo[b + 1]] == -math.inf)
    return w


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims,heads", [((192, 128), (16, 16)), ((192, 128), (32, 8)), ((128, 64), (16, 2)),
                                        ((256, 128), (8, 8))])
def test_ragged_against_reference(dims, heads, causal):
    assert dims in PREFILL_QK_VO_DIMS
    spec = AttentionSpec(family="prefill", num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim_qk=dims[0],
                         head_dim_vo=dims[1], causal=causal)
    w = run_and_check(spec, seed=dims[0] + heads[1])
    assert w.kernel.backend == "wgmma"


@pytest.mark.parametrize("options", [dict(producer=False), dict(tma=False), dict(persistent=False),
                                     dict(kv_tile=64, num_stages=2), dict(kv_tile=64, num_stages=4),
                                     dict(split_kv=True), dict(k_ahead=False), dict(k_ahead=False, tma=False),
                                     dict(pingpong=True), dict(pingpong=True, persistent=True)],
                         ids=["no-producer", "cp.async", "one-cta-per-item", "split-ring-64", "shared-ring-64",
                              "split-kv", "k-with-v", "k-with-v-cp.async", "ping-pong", "ping-pong-persistent"])
def test_kernel_options(options):
    """Each schedule of the kernel: without a producer (cp.async ring, every thread loads), edge and whole
    tiles by cp.async, one CTA per item, 64-token tiles on a split ring (V one slot more than K; the default's
    128-token tiles leave room for as many as K's) and on a shared one, KV split across CTAs (merged), K
    copied beside V(t) and freed with it (not a tile ahead), and the consumer warpgroups in ping-pong."""
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=4, head_dim_qk=192, head_dim_vo=128,
                         causal=True)
    if "split_kv" in options:  # few rows over a long KV: the planner cuts the ranges across the SMs
        w = run_and_check(spec, qo_lens=[8, 3], kv_lens=[12000, 5], seed=7, **options)
        assert w._plan["num_slots"] > 1, "the plan split no KV range: the merge went untested"
    else:
        run_and_check(spec, qo_lens=[1, 77, 300, 2000, 5], kv_lens=[1, 200, 300, 3000, 0], seed=7, **options)


def test_strided_v_and_soft_cap():
    """V a view of a fused projection (its token stride is not K's: TMA boxes and the edge tile's copies read
    V's own strides) under a soft-capped score hook."""
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128,
                         causal=True, logits_soft_cap=30.0)
    w = run_and_check(spec, seed=3, v_view=True)
    assert w._plan["kernel"].has_tma


@pytest.mark.parametrize("causal", [False, True])
def test_masks_are_exact(causal):
    """q = 0 weighs every visible key alike and V one-hot of (token % 128) makes each output a histogram of the
    visible tokens: entries are multiples of 1/n (n visible; P exactly 1), so one key too many or too few moves an
    entry by 1/n, far beyond its bf16 rounding."""
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, head_dim_qk=192, head_dim_vo=128,
                         causal=causal)
    q, k, v, qo, kv = split_case(spec, QO_LENS, KV_LENS, seed=5)
    q.zero_()
    tok = torch.arange(v.shape[0], device="cuda")
    in_request = tok - torch.as_tensor(np.repeat(kv[:-1], np.diff(kv)), device="cuda")
    v.zero_()
    v[tok, :, in_request % 128] = 1
    w = BatchPrefill(spec)
    w.plan(qo, kv)
    out = w.run(q, (k, v), out=torch.full((q.shape[0], 32, 128), math.nan, dtype=q.dtype, device="cuda"))
    torch.cuda.synchronize()
    for b in range(len(QO_LENS)):
        if QO_LENS[b] == 0 or KV_LENS[b] == 0:
            continue
        ref, _ = attnforge.reference.attention(q[qo[b]:qo[b + 1]], k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]],
                                               causal=causal)
        # bf16 rounds an entry by at most 2^-9 of it; a key too many or too few moves one by 1/n or more
        excess = (out[qo[b]:qo[b + 1]].double() - ref).abs() - 2.0 ** -8 * ref.abs()
        assert excess.max().item() < 1e-5, f"request {b}: a histogram entry off (a key masked wrongly)"


def test_single_prefill_takes_v_width_from_v():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(333, 16, 192, generator=g).bfloat16().cuda()
    k = torch.randn(333, 16, 192, generator=g).bfloat16().cuda()
    v = torch.randn(333, 16, 128, generator=g).bfloat16().cuda()
    out, lse = attnforge.single_prefill(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = attnforge.reference.attention(q, k, v, causal=True)
    low, _ = attnforge.reference.attention(q.float(), k.float(), v.float(), causal=True, dtype=torch.float32)
    from helpers import assert_attention_close, assert_lse_close
    assert out.shape == (333, 16, 128)
    assert_attention_close(out, ref, low.bfloat16(), "single_prefill 192/128")
    assert_lse_close(lse, ref_lse, "single_prefill 192/128")


def test_cuda_graph_replays_after_replans():
    from helpers import replays_after_replans
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128,
                         causal=True)
    q, k, v, _, _ = split_case(spec, [600], [1200], seed=5)
    out = torch.empty(600, 16, 128, dtype=q.dtype, device="cuda")
    w = BatchPrefill(spec, use_cuda_graph=True, max_batch_size=4, max_work_items=256)
    rng = np.random.default_rng(0)
    state = {}

    def replan():
        qo_lens = rng.integers(0, 150, size=4)
        kv_lens = qo_lens + rng.integers(0, 150, size=4)
        state["qo"] = np.concatenate([[0], np.cumsum(qo_lens)])
        state["kv"] = np.concatenate([[0], np.cumsum(kv_lens)])
        w.plan(state["qo"], state["kv"])

    for _ in replays_after_replans(lambda: w.run(q, (k, v), out=out), replan, lambda: out.fill_(math.nan), 5):
        qo, kv = state["qo"], state["kv"]
        for b in range(4):
            rows = slice(qo[b], qo[b + 1])
            if qo[b + 1] == qo[b]:
                continue
            ref, _ = attnforge.reference.attention(q[rows], k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]], causal=True)
            low, _ = attnforge.reference.attention(q[rows].float(), k[kv[b]:kv[b + 1]].float(),
                                                   v[kv[b]:kv[b + 1]].float(), causal=True, dtype=torch.float32)
            from helpers import assert_attention_close
            assert_attention_close(out[rows], ref, low.bfloat16(), f"graph replay request {b}")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_takes_a_narrower_v(causal):
    """The SDPA-layout call: q, k [B, H, L, 192], v [B, H, L, 128] (one page a request: the 4-D TMA maps of K and
    V, each its own width), with a causal mask_mod, against torch SDPA's own layout in float64."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 16, 300, 192, generator=g).bfloat16().cuda()
    k = torch.randn(2, 4, 700, 192, generator=g).bfloat16().cuda()
    v = torch.randn(2, 4, 700, 128, generator=g).bfloat16().cuda()
    mask = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
    out, lse = attnforge.attention(q, k, v, mask_mod=mask, enable_gqa=True, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (2, 16, 300, 128) and lse.shape == (2, 16, 300)
    from helpers import assert_attention_close, assert_lse_close
    for b in range(2):
        rows = [t[b].transpose(0, 1) for t in (q, k, v)]  # [L, H, D]
        ref, ref_lse = attnforge.reference.attention(*rows, causal=causal)
        low, _ = attnforge.reference.attention(*(t.float() for t in rows), causal=causal, dtype=torch.float32)
        allowance = weight_rounding_allowance(torch.bfloat16, v.abs().max().item())
        assert_attention_close(out[b].transpose(0, 1), ref, low.bfloat16(), f"attention() batch {b}", allowance)
        assert_lse_close(lse[b].transpose(0, 1), ref_lse, f"attention() batch {b}")


def test_attention_merges_split_kv_at_v_width():
    """attention() with few query rows over long keys: the plan cuts each request's keys across CTAs, so the
    partials ([B, H, Lq, slots, Dv]) and their merge run at V's width (128), not Q's (192)."""
    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 8, 40, 192, generator=g).bfloat16().cuda()
    k = torch.randn(1, 2, 24000, 192, generator=g).bfloat16().cuda()
    v = torch.randn(1, 2, 24000, 128, generator=g).bfloat16().cuda()
    out, lse = attnforge.attention(q, k, v, enable_gqa=True, return_lse=True)
    torch.cuda.synchronize()
    call = attnforge.dense.dense_call(q, k, v, None, True)
    assert call.wrapper._plan["num_slots"] > 1, "the plan split no KV range: the merge went untested"
    assert out.shape == (1, 8, 40, 128)
    from helpers import assert_attention_close, assert_lse_close
    rows = [t[0].transpose(0, 1) for t in (q, k, v)]  # [L, H, D]
    ref, ref_lse = attnforge.reference.attention(*rows, causal=False)
    low, _ = attnforge.reference.attention(*(t.float() for t in rows), causal=False, dtype=torch.float32)
    allowance = weight_rounding_allowance(torch.bfloat16, v.abs().max().item())
    assert_attention_close(out[0].transpose(0, 1), ref, low.bfloat16(), "attention() split KV", allowance)
    assert_lse_close(lse[0].transpose(0, 1), ref_lse, "attention() split KV")

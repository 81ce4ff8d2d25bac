"""The oracle itself, on the CPU: split-and-merge equals the whole; masks and caps behave."""
import math

import pytest
import torch

from attnforge import reference


def test_split_kv_then_merge_equals_full():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 64), torch.randn(100, 2, 64), torch.randn(100, 2, 64)
    full, lse = reference.attention(q, k, v)
    parts = [reference.attention(q, k[a:b], v[a:b], sm_scale=1 / 8) for a, b in ((0, 37), (37, 100))]
    # queries sit at the end of each part's keys, so compare without a mask: non-causal attention
    vs = torch.stack([p[0] for p in parts], dim=1).reshape(3, 2, 8, 64)
    ss = torch.stack([p[1] for p in parts], dim=1)
    merged, mlse = reference.merge_states(vs, ss)
    assert torch.allclose(merged, full, atol=1e-12) and torch.allclose(mlse, lse, atol=1e-12)


def test_merge_all_neg_inf_gives_zero_not_nan():
    v = torch.randn(2, 3, 4, 8)
    s = torch.full((2, 3, 4), -math.inf)
    out, lse = reference.merge_states(v, s)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_empty_kv_and_window_and_causal():
    q = torch.randn(4, 2, 16)
    out, lse = reference.attention(q, torch.randn(0, 2, 16), torch.randn(0, 2, 16))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    win, _ = reference.attention(q[-1:], k, v, window_left=0)  # last query sees only the last key
    assert torch.allclose(win[0], v[-1].double(), atol=1e-12)
    causal, _ = reference.attention(q, k[:4], v[:4], causal=True)  # qo_len == kv_len: first sees one
    assert torch.allclose(causal[0], v[0].double(), atol=1e-12)


def test_softcap_bounds_scores():
    q, k, v = torch.randn(1, 1, 8) * 100, torch.randn(5, 1, 8) * 100, torch.randn(5, 1, 8)
    _, lse = reference.attention(q, k, v, logits_soft_cap=2.0)
    assert lse.item() <= 2.0 + math.log(5) + 1e-9


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_oracle_matches_torch_sdpa_for_every_head_layout(hq, hkv, causal):
    """The grouped einsums (MHA, GQA, MQA/MLA) against torch's own SDPA with its GQA broadcast; causal
    is bottom-right aligned here, so an explicit mask for Lq < Lk."""
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    lq, lk, d = 5, 37, 16
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
    out, lse = reference.attention(q, k, v, causal=causal)
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq) if causal else None
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                            attn_mask=mask, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hkv, dim=1)) / d ** 0.5
    if causal:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1).transpose(0, 1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_left=5), dict(logits_soft_cap=3.0),
                                dict(causal=True, sink=torch.tensor([0.5, -1.0, 2.0, 0.0])),
                                dict(score_mod=lambda s, b, h, q, kv: s - 0.1 * (h + 1) * (q - kv).abs(),
                                     mask_mod=lambda b, h, q, kv: (q + kv + h) % 3 != 0)])
def test_long_requests_in_row_chunks_equal_one_pass(kw, monkeypatch):
    """Past MAX_SCORES_PER_PASS the oracle computes chunks of query rows (each at its own key position, so
    causal, windows and mods see the right q_idx): the same output and LSE as one pass, GQA and Lq < Lk."""
    torch.manual_seed(3)
    q, k, v = torch.randn(23, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 8)
    whole, whole_lse = reference.attention(q, k, v, **kw)
    monkeypatch.setattr(reference, "MAX_SCORES_PER_PASS", 4 * 40 * 5)  # 5 rows a pass: 5 chunks, the last of 3
    calls = []
    real = reference._attention_rows
    monkeypatch.setattr(reference, "_attention_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunked, chunked_lse = reference.attention(q, k, v, **kw)
    assert len(calls) == 5
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-13)
    assert torch.equal(torch.isinf(chunked_lse), torch.isinf(whole_lse))
    fin = torch.isfinite(whole_lse)
    assert torch.allclose(chunked_lse[fin], whole_lse[fin], rtol=0, atol=1e-13)

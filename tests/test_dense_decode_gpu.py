"""attention()'s one-query calls on the decode kernels (ATTNFORGE_ATTENTION_DECODE=1, attnforge/dense_decode.py)
against the float64 reference (FlashAttention's rule: at most twice torch's own low-precision error), the same
call on the prefill kernels and SDPA: group sizes, head dims, dtypes, odd lengths (1, 17, 513, 4097), a sliced
static cache read in place, score and mask modifiers, SDPA's attn_mask, and torch.compile."""
import math

import pytest
import torch

import attnforge
from helpers import assert_attention_close, assert_lse_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def decode_route(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "1")


def inputs(batch, hq, hkv, lk, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, hq, 1, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(batch, hkv, lk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v


def dense_reference(q, k, v, score_fn=None, keep=None, dtype=torch.float64, scale=None):
    """(out [B, Hq, 1, D], lse [B, Hq, 1]) in `dtype` from q's and K/V's values: scores scaled, then score_fn(s, h,
    kv) (h [Hq, 1], kv [Lk] broadcast), then keep [B, Lk] (False: masked). A row with no key: zeros, -inf."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = (qf @ kf.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))  # [B, Hq, 1, Lk]
    if score_fn is not None:
        h = torch.arange(q.shape[1], device=q.device)[:, None, None]
        s = score_fn(s, h, torch.arange(k.shape[2], device=q.device))
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vf, lse


def check(q, k, v, out, lse, what, **ref_kw):
    ref, ref_lse = dense_reference(q, k, v, **ref_kw)
    low, _ = dense_reference(q, k, v, dtype=torch.float32, **ref_kw)
    assert_attention_close(out.flatten(0, 2), ref.flatten(0, 2), low.to(q.dtype).flatten(0, 2), what)
    assert_lse_close(lse, ref_lse, what)


@pytest.mark.parametrize("batch,hq,hkv,lk,d,dtype", [
    (2, 8, 2, 1, 128, torch.bfloat16), (3, 8, 2, 17, 128, torch.bfloat16), (2, 32, 8, 1000, 128, torch.bfloat16),
    (2, 16, 16, 513, 64, torch.float16), (1, 8, 1, 4097, 256, torch.bfloat16), (4, 64, 8, 300, 128, torch.float16),
    (2, 32, 1, 777, 128, torch.bfloat16)])
def test_one_query_calls_match_the_reference_and_the_prefill_path(monkeypatch, batch, hq, hkv, lk, d, dtype):
    q, k, v = inputs(batch, hq, hkv, lk, d, dtype, seed=lk)
    out, lse = attnforge.attention(q, k, v, enable_gqa=hq != hkv, return_lse=True)
    check(q, k, v, out, lse, f"B{batch} {hq}/{hkv} L{lk} d{d}")
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "0")
    by_prefill, prefill_lse = attnforge.attention(q, k, v, enable_gqa=hq != hkv, return_lse=True)
    assert (out.float() - by_prefill.float()).abs().max().item() < 2e-2
    assert (lse - prefill_lse).abs().max().item() < 2e-3


def test_a_sliced_static_cache_gives_what_its_contiguous_copy_gives():
    """The decode path reads [:, :, :Lk] of a preallocated [B, Hkv, max_len, D] cache in place: the same kernel and
    plan as for a contiguous copy, so the same bits, and neither reads past Lk (poisoned positions there)."""
    q, kc, vc = inputs(3, 32, 8, 2048, 128, seed=5)
    kc[:, :, 777:], vc[:, :, 777:] = math.nan, math.nan  # positions past the filled length
    k, v = kc[:, :, :777], vc[:, :, :777]
    out, lse = attnforge.attention(q, k, v, enable_gqa=True, return_lse=True)
    copied, copied_lse = attnforge.attention(q, k.contiguous(), v.contiguous(), enable_gqa=True, return_lse=True)
    assert torch.equal(out, copied) and torch.equal(lse, copied_lse)
    check(q, k, v, out, lse, "static cache")


def test_modifiers_and_sdpas_mask_match_the_reference():
    q, k, v = inputs(3, 16, 4, 900, 128, seed=9)
    q = q * 2  # scores spread enough for soft-cap and the bias to matter
    slopes = torch.rand(16, device="cuda")
    keep = torch.rand(3, 900, device="cuda") < 0.6
    keep[2] = False  # every key of request 2 masked: zeros and LSE -inf

    def softcap(s, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(s / 20.0)

    def alibi(s, b, h, q_idx, kv_idx):  # q_idx is Lk - 1: decode's and attention()'s end-aligned position
        return s + slopes[h] * (kv_idx - q_idx)
    out, lse = attnforge.attention(q, k, v, score_mod=softcap, enable_gqa=True, return_lse=True)
    check(q, k, v, out, lse, "soft-cap", score_fn=lambda s, h, kv: 20.0 * torch.tanh(s / 20.0))
    out, lse = attnforge.attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, qi, ki: keep[b, ki],
                                   enable_gqa=True, return_lse=True)
    check(q, k, v, out, lse, "alibi + mask", keep=keep,
          score_fn=lambda s, h, kv: s + (slopes[h] * (kv - 899)).to(s.dtype))
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    out = attnforge.attention(q, k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:2].float(), k[:2].float(), v[:2].float(),
                                                             attn_mask=keep[:2, None, None, :], enable_gqa=True)
    assert (out[:2].float() - sdpa).abs().max().item() < 2e-2 and (out[2] == 0).all()


def test_compiled_one_query_calls_equal_eager():
    q, k, v = inputs(2, 32, 8, 600, 128, seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attnforge.attention(q * 0.5, k, v, enable_gqa=True, return_lse=True),
                             fullgraph=True)
    got, got_lse = compiled(q, k, v)
    want, want_lse = attnforge.attention(q * 0.5, k, v, enable_gqa=True, return_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)

"""The decode kernels over K/V that are not paged (attnforge/dense_decode.py) against the float64 reference
(FlashAttention's rule: at most twice torch's own low-precision error): attention()'s one-query calls and causal
verify steps (ATTNFORGE_ATTENTION_DECODE=1), also against the same call on the prefill kernels and SDPA (group
sizes, head dims, dtypes, odd lengths 1, 17, 513, 4097, a sliced static cache read in place, score modifiers, masks
on the prefill path, torch.compile); BatchDecode.run_narrowed against run(); single_decode."""
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


def test_modifiers_and_sdpas_mask_match_the_reference(monkeypatch):
    """Score modifiers on the decode route; a mask_mod and SDPA's attn_mask take the prefill kernels' path (which
    skips the tiles a mask hides), and agree with the reference and SDPA there."""
    from attnforge import dense, dense_decode
    monkeypatch.setattr(dense, "_CALLS", {})  # (this test's calls alone)
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
    out, lse = attnforge.attention(q, k, v, score_mod=alibi, enable_gqa=True, return_lse=True)
    check(q, k, v, out, lse, "alibi", score_fn=lambda s, h, kv: s + (slopes[h] * (kv - 899)).to(s.dtype))
    assert [type(c) for c in dense._CALLS.values()] == [dense_decode.DecodeCall] * 2
    out, lse = attnforge.attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, qi, ki: keep[b, ki],
                                   enable_gqa=True, return_lse=True)
    check(q, k, v, out, lse, "alibi + mask", keep=keep,
          score_fn=lambda s, h, kv: s + (slopes[h] * (kv - 899)).to(s.dtype))
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert isinstance(list(dense._CALLS.values())[-1], dense.DenseCall)
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


@pytest.mark.parametrize("layout,dtype,length,kwargs", [
    ("NHD", torch.bfloat16, 1000, {}), ("HND", torch.float16, 17, {}), ("NHD", torch.bfloat16, 1, {}),
    ("NHD", torch.bfloat16, 0, {}), ("HND", torch.bfloat16, 4097, {"logits_soft_cap": 30.0}),
    ("NHD", torch.float16, 600, {"window_left": 100})])
def test_single_decode_matches_the_reference(layout, dtype, length, kwargs):
    """One request (FlashInfer's single_decode_with_kv_cache) against the float64 reference, LSE too: both layouts,
    one key, none (zeros and -inf), soft-cap and a window."""
    from attnforge import AttentionSpec
    from helpers import decode_expected
    g = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(32, 128, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(length, 8, 128, device="cuda", generator=g).to(dtype) for _ in range(2))  # NHD
    args = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = attnforge.single_decode(q, *args, kv_layout=layout, return_lse=True, **kwargs)
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, q_dtype=dtype, **kwargs)
    ref, ref_lse, low = decode_expected(spec, q[None], [(k, v)])
    assert_attention_close(out[None].cpu(), ref, low, f"{layout} L{length} {kwargs}")
    assert_lse_close(lse[None], ref_lse, f"{layout} L{length}")
    if length == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_single_decode_of_an_fp8_cache_takes_its_scales():
    from attnforge import AttentionSpec
    from helpers import decode_reference
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(32, 128, device="cuda", generator=g).bfloat16()
    k8, v8 = ((torch.randn(777, 8, 128, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn) for _ in range(2))
    out = attnforge.single_decode(q, k8, v8, k_scale=0.5, v_scale=0.25)
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_dtype="fp8_e4m3")
    ref, _ = decode_reference(spec, q[None].cpu(), [(k8.cpu().double() * 0.5, v8.cpu().double())], v_scale=0.25)
    err = (out.double().cpu() - ref[0]).abs().max().item()
    assert torch.isfinite(out).all() and err < 2e-2 * ref.abs().max().item() + 1e-2, err


@pytest.mark.parametrize("lq,lk,how", [(4, 300, "mask"), (8, 1000, "and_masks"), (3, 3, "is_causal"), (4, 2, "mask")])
def test_causal_calls_of_a_few_queries_match_the_reference(monkeypatch, lq, lk, how):
    """The verify step under attention(): Lq queries a request, each seeing the keys up to its end-aligned position
    (Lq > Lk: the first queries see none, zeros and -inf), against the float64 reference per request and against
    the same call on the prefill kernels."""
    from attnforge import reference
    from torch.nn.attention.flex_attention import and_masks
    q, k, v = inputs(2, 32, 8, lk, 128, seed=lq * lk)
    q = torch.cat([q * (1 + t / 4) for t in range(lq)], dim=2)  # [2, 32, lq, 128]: tokens that differ

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    mask = {"mask": causal, "and_masks": and_masks(causal), "is_causal": None}[how]
    kw = dict(mask_mod=mask, is_causal=how == "is_causal", enable_gqa=True, return_lse=True)
    out, lse = attnforge.attention(q, k, v, **kw)
    for b in range(2):
        rows = [t[b].transpose(0, 1) for t in (q, k, v)]  # [L, H, D]
        ref, ref_lse = reference.attention(*rows, causal=True)
        low, _ = reference.attention(*rows, causal=True, dtype=torch.float32)
        assert_attention_close(out[b].transpose(0, 1).cpu(), ref.cpu(), low.to(q.dtype).cpu(), f"{how} request {b}")
        assert_lse_close(lse[b].transpose(0, 1), ref_lse, f"{how} request {b}")
    monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", "0")
    by_prefill, _ = attnforge.attention(q, k, v, **kw)
    assert (out.float() - by_prefill.float()).abs().max().item() < 2e-2


def test_narrowed_runs_equal_run_bit_for_bit():
    """BatchDecode.run_narrowed (the route's launch) against run() on the same tensors and plan, with a modifier."""
    from attnforge import AttentionSpec, BatchDecode, mods
    q4, k, v = inputs(3, 32, 8, 500, 128, seed=11)
    q = q4[:, :, 0]
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_layout="HND", score_mod=mods.softcap(30.0))
    w = BatchDecode(spec, max_batch_size=3, max_num_pages=3)
    w.plan([0, 1, 2, 3], [0, 1, 2], [500, 500, 500], page_size=500)
    want, want_lse = w.run(q, (k, v), return_lse=True)
    for _ in range(2):
        got, got_lse = w.run_narrowed(q, k, v, return_lse=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)

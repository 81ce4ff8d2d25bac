"""SDPA's attn_mask as modifiers (attnforge/attn_mask.py), on the CPU: the modifiers' torch evaluation through the
float64 reference equals SDPA given the mask; layouts, reuse and refusals. (The kernels run the same graphs: the
g++ tests check their C++ against this evaluation; tests/test_prefill_gpu.py runs attention(attn_mask=) on a GPU.)"""
import math

import pytest
import torch

import attnforge
from attnforge import attn_mask, reference
from attnforge.dense import _mod_key
from attnforge.mods import compile_mod

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 5, 9, 16
CPU = torch.device("cpu")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, LQ, D, generator=g, dtype=torch.float64),
            torch.randn(B, HKV, LK, D, generator=g, dtype=torch.float64),
            torch.randn(B, HKV, LK, D, generator=g, dtype=torch.float64))


def through_reference(q, k, v, mask, score_mod=None, mask_mod=None):
    """attention() as the kernels compute it, in float64: the modifiers the mask becomes, applied per request."""
    adapter = attn_mask.as_modifiers(mask, tuple(q.shape), k.shape[2], score_mod, mask_mod, CPU, _mod_key)
    mod = compile_mod(score_mod=adapter.score_mod, mask_mod=adapter.mask_mod)
    outs = []
    for b in range(q.shape[0]):
        o, _ = reference.attention(*(t[b].transpose(0, 1) for t in (q, k, v)), batch_index=b,
                                   score_mod=mod.torch_score if mod.score_root is not None else None,
                                   mask_mod=mod.torch_mask if mod.mask_root is not None else None)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


def sdpa(q, k, v, mask, scale=None):
    mask = mask if mask.dim() >= 2 else mask[None]  # (torch's broadcast rule takes [Lk]; SDPA on the CPU wants 2-d)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def masks(g):
    """Every layout SDPA broadcasts (as 4-d, 2-d and expanded views) in bool and in float dtypes, -inf included;
    each row keeps a key (SDPA's math backend gives NaN for a row with none)."""
    keep = torch.rand(B, HQ, LQ, LK, generator=g) < 0.6
    keep[..., 0] = True
    bias = torch.randn(B, HQ, LQ, LK, generator=g, dtype=torch.float64)
    return {"bool 4-d": keep, "bool [B, 1, Lq, Lk]": keep[:, :1], "bool [Lq, Lk]": keep[0, 0],
            "bool expanded heads": keep[:, :1].expand(B, HQ, LQ, LK), "bool [B, Hq, 1, Lk]": keep[:, :, :1],
            "float64 4-d": bias, "float32 [Lk]": bias[0, 0, 0].float(), "float32 [1, Hq, 1, 1]": bias[:1, :, :1, :1],
            "bf16 with -inf": torch.where(keep, bias, -math.inf).bfloat16()[:, :1]}


@pytest.mark.parametrize("name", list(masks(torch.Generator().manual_seed(1))))
def test_the_modifiers_a_mask_becomes_give_sdpas_result(name):
    """Queries aligned as SDPA aligns its mask rows (row i: query i, though attnforge's q_idx counts from the end of
    the keys): Lq < Lk here, so a misaligned row index would read another row's mask."""
    q, k, v = inputs()
    mask = masks(torch.Generator().manual_seed(1))[name]
    want = sdpa(q, k, v, mask if mask.dtype == torch.bool else mask.double())
    got = through_reference(q, k, v, mask)
    assert got.shape == want.shape and torch.isfinite(want).all()
    assert (got - want).abs().max().item() < 1e-6, name  # (the modifiers evaluate in float32)


def test_a_mask_applies_after_the_callers_own_modifiers():
    """A bool mask is and-ed with mask_mod, a float one added to what score_mod returned."""
    q, k, v = inputs(2)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(LQ, LK, generator=g) < 0.7
    odd_keys = torch.arange(LK) % 2 == 1
    keep[:, 1] = True
    got = through_reference(q, k, v, keep, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx % 2 == 1)
    assert (got - sdpa(q, k, v, keep & odd_keys)).abs().max().item() < 1e-6
    bias = torch.randn(LQ, LK, generator=g, dtype=torch.float64)
    got = through_reference(q, k, v, bias, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5)
    assert (got - sdpa(q, k, v, bias, scale=0.5 / math.sqrt(D))).abs().max().item() < 1e-6


def test_one_adapter_per_layout_refilled_each_call():
    """A new mask tensor of the same layout reuses the modifiers (so attention() keeps its planned call) and
    refills their buffer; another layout or dtype gets its own; an expanded view is held at its own size."""
    g = torch.Generator().manual_seed(4)
    first, second = (torch.rand(B, 1, LQ, LK, generator=g) < 0.5 for _ in range(2))
    shape = (B, HQ, LQ, 32)
    a = attn_mask.as_modifiers(first, shape, LK, None, None, CPU, _mod_key)
    assert torch.equal(a.buf, first)
    b = attn_mask.as_modifiers(second, shape, LK, None, None, CPU, _mod_key)
    assert a is b and b.score_mod is None and b.mask_mod is not None
    assert torch.equal(compile_mod(mask_mod=b.mask_mod).tensors[0], second)  # (this call's values)
    other = attn_mask.as_modifiers(second.float(), shape, LK, None, None, CPU, _mod_key)
    assert other.score_mod is not None and other.mask_mod is None  # (a float mask: a score_mod)
    wide = attn_mask.as_modifiers(second.expand(B, HQ, LQ, LK), shape, LK, None, None, CPU, _mod_key)
    assert wide is b and wide.buf.shape == (B, 1, LQ, LK)  # (the expanded view is the [B, 1, Lq, Lk] layout)


@pytest.mark.parametrize("mask,match", [
    (torch.ones(LQ, LK, dtype=torch.int32), r"attn_mask.dtype: expected torch.bool .* or a float dtype"),
    (torch.ones(LQ, LK + 1, dtype=torch.bool), r"attn_mask.shape: expected a shape broadcastable to \[B, Hq, Lq, Lk\]"),
    (torch.ones(1, B, HQ, LQ, LK, dtype=torch.bool), r"attn_mask.shape"),
    (torch.ones(3, 1, LQ, LK, dtype=torch.bool), r"got \[3, 1, 5, 9\]"),
    ([[True]], r"attention\(attn_mask=...\): expected a torch.Tensor")])
def test_bad_masks_are_refused_naming_the_rule(mask, match):
    with pytest.raises(ValueError, match=match):
        attn_mask.as_modifiers(mask, (B, HQ, LQ, D), LK, None, None, CPU, _mod_key)
    with pytest.raises(ValueError, match=r"attn_mask: expected a tensor on meta"):
        attn_mask.as_modifiers(torch.ones(LQ, LK, dtype=torch.bool), (B, HQ, LQ, D), LK, None, None,
                               torch.device("meta"), _mod_key)


def test_attention_refuses_a_second_mask_and_a_compiled_call(monkeypatch):
    """attn_mask beside is_causal (SDPA refuses it too) or a block_mask, and under torch.compile: refused before
    anything runs, each with the form that works."""
    _, k, v = (t.float() for t in inputs())
    q = torch.randn(B, HQ, LK, D)  # (as many queries as keys, for is_causal)
    keep = torch.ones(LK, LK, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"an attn_mask and is_causal=True.*q_idx >= kv_idx"):
        attnforge.attention(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)

    class BlockMask:  # (what attention() reads of a FlexAttention BlockMask)
        seq_lengths = (LK, LK)

        @staticmethod
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    with pytest.raises(ValueError, match=r"an attn_mask and a block_mask"):
        attnforge.attention(q, k, v, attn_mask=keep, block_mask=BlockMask(), enable_gqa=True)
    from attnforge import ops
    monkeypatch.setattr(ops, "compiling", lambda: True)
    with pytest.raises(ValueError, match=r"a call under torch.compile.*mask_mod"):
        attnforge.attention(q, k, v, attn_mask=keep, enable_gqa=True)

"""Quest page-summary formats: how kmin / kmax are stored, and read back in key units (host side).

  fp32, bf16   the values themselves
  fp8          e4m3 of key / scale, rounded outward (kmin down, kmax up: the bound holds)
  int4         codes c in [-8, 7] of key / scale, rounded outward, stored as c + 8, two a byte (the
               even dim in the low nibble): half of fp8's bytes. Its step is uniform, so with one
               scale per KV head and dim (`channel_scales`) it ranks pages as exact summaries do
               (tools/quest_summary_quality.py), where fp8's step grows with the key.

A scale is one float or a tensor [Hkv, D] of per-channel scales; the scoring kernel folds it into the
query sums, so either costs the same there.
"""
from __future__ import annotations

import math

import torch

from ..checks import fail, finite_float32

INT4 = "int4"  # QuestIndex(dtype=INT4)
FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", INT4: "int4"}
LEVELS = {"fp8": 448.0, "int4": 7.0}  # |key| / scale must stay within this (larger keys saturate)


def format_of(dtype) -> str:
    fmt = FORMATS.get(dtype)
    if fmt is None:
        raise fail("QuestIndex dtype", "torch.float32, torch.bfloat16, torch.float8_e4m3fn or 'int4'", dtype,
                   "Pick one of those.")
    return fmt


def channel_scales(keys: torch.Tensor, dtype=torch.float8_e4m3fn, headroom: float = 1.25) -> torch.Tensor:
    """Per-channel scales [Hkv, D] from sample keys [..., Hkv, D] (e.g. a prefill's): each channel's
    largest |key| times `headroom`, mapped to the format's largest code (fp8: 448, int4: 7)."""
    if not isinstance(keys, torch.Tensor) or not keys.is_floating_point():
        got = f"a {keys.dtype} tensor" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise fail("channel_scales(keys=...)", "a floating-point tensor of sample keys [..., Hkv, D]", got,
                   "Pass keys as the cache holds them (bf16, fp16, or fp8 as float after its dequantization).")
    if keys.dim() < 2:
        raise fail("channel_scales(keys.shape)", "[..., Hkv, D]", list(keys.shape), "Pass keys with their head axis.")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1.0 <= headroom < math.inf:
        raise fail("channel_scales(headroom=...)", "a finite float >= 1.0 (keys past the sample's largest are "
                   "clamped, and a clamped maximum no longer bounds the page's scores)", repr(headroom),
                   "Keep the default 1.25, or raise it for keys that grow past the sample.")
    top = keys.detach().abs()
    if keys.dim() > 2:  # (amax over no dims would reduce all of them)
        top = top.amax(dim=tuple(range(keys.dim() - 2)))
    top = top.float()  # (no float copy of all the keys)
    fmt = format_of(dtype)
    if fmt not in LEVELS:
        raise fail("channel_scales(dtype)", "torch.float8_e4m3fn or 'int4' (the formats that store key / scale)",
                   dtype, "float32 / bfloat16 summaries take no scale.")
    return (top * headroom / LEVELS[fmt]).clamp_min(torch.finfo(torch.float32).tiny)


def checked_scale(scale, fmt: str, num_kv_heads: int, head_dim: int, device):
    """A float, or a float32 tensor [Hkv, D] on the index's device; 1.0 for fp32 / bf16 summaries."""
    if isinstance(scale, torch.Tensor):
        if scale.shape != (num_kv_heads, head_dim):
            raise fail("QuestIndex scale.shape", f"[{num_kv_heads}, {head_dim}] (one scale per KV head and dim)",
                       list(scale.shape), "Pass channel_scales(sample_keys, dtype), or one float.")
        if not bool(torch.isfinite(scale).all() & (scale > 0).all()):
            raise fail("QuestIndex scale", "finite values > 0", "a zero, negative or non-finite value",
                       "Clamp the scales away from 0 (channel_scales does).")
        if fmt not in LEVELS:
            raise fail("QuestIndex scale", "1.0 for float32 / bfloat16 summaries", "a tensor",
                       "Drop scale, or use fp8 / int4 summaries.")
        return scale.detach().to(device=device, dtype=torch.float32)
    if not (finite_float32(scale) and scale > 0):
        raise fail("QuestIndex scale", "a finite float > 0 or a tensor [Hkv, D] (fp8 / int4 summaries hold "
                   "key / scale)", scale, "Pass about max|key| / 448 (int4: / 7), channel_scales(...), or 1.0.")
    if fmt not in LEVELS and scale != 1.0:
        raise fail("QuestIndex scale", "1.0 for float32 / bfloat16 summaries", scale,
                   "Drop scale, or use fp8 / int4 summaries.")
    return float(scale)


def _divided(x: torch.Tensor, scale) -> torch.Tensor:
    return x.float() / (scale.to(x.device) if isinstance(scale, torch.Tensor) else scale)


def fp8_outward(x: torch.Tensor, scale, up: bool) -> torch.Tensor:
    """x / scale as e4m3, rounded toward +inf (up) or -inf (down) instead of to nearest, saturating at
    +-448: a rounded-down minimum and a rounded-up maximum still bound every key of the page. scale: a
    float or per-channel scales broadcasting against x's last two dims [Hkv, D]."""
    y = _divided(x, scale).clamp(-448.0, 448.0)
    q = y.to(torch.float8_e4m3fn)
    wrong = q.float() < y if up else q.float() > y
    bits = q.view(torch.uint8).to(torch.int16)
    sign, mag = bits & 0x80, bits & 0x7F
    if up:  # one step toward +inf: negatives shrink in magnitude, zero and positives grow
        step = torch.where((sign != 0) & (mag > 0), bits - 1, torch.where(mag == 0, torch.ones_like(bits), bits + 1))
    else:  # toward -inf: positives shrink, zero becomes the smallest negative, negatives grow
        step = torch.where((sign == 0) & (mag > 0), bits - 1,
                           torch.where(mag == 0, torch.full_like(bits, 0x81), bits + 1))
    out = torch.where(wrong, step, bits).to(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def int4_outward(x: torch.Tensor, scale, up: bool) -> torch.Tensor:
    """x [..., D] / scale as int4 codes rounded up (ceil) or down (floor), clamped to [-8, 7], packed two
    a byte as c + 8 (even dim in the low nibble): [..., D / 2] uint8. +inf / -inf (an empty page's
    master) become 7 / -8, so kmin > kmax there as in the other formats."""
    y = _divided(x, scale)
    c = (torch.ceil(y) if up else torch.floor(y)).clamp(-8, 7).to(torch.int16) + 8
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """The codes c in [-8, 7] of packed int4 summaries [..., D / 2] -> [..., D] (float32)."""
    b = packed.to(torch.int16)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).float() - 8.0


def encode(fmt: str, master: torch.Tensor, scale, up: bool) -> torch.Tensor:
    """What the scoring kernel reads, from the bf16 master (fp8 / int4 only)."""
    return fp8_outward(master, scale, up) if fmt == "fp8" else int4_outward(master, scale, up)


def values(fmt: str, stored: torch.Tensor) -> torch.Tensor:
    """Stored summaries as float32 in units of the scale (int4 unpacked to [..., D])."""
    return int4_codes(stored) if fmt == "int4" else stored.float()

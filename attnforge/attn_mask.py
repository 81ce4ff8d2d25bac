"""SDPA's `attn_mask` for attention(): turned into the modifiers that read it.

A bool mask (True: the key takes part) becomes a mask_mod, a float one (added to the scaled scores, -inf masking)
a score_mod; either is broadcastable to [B, Hq, Lq, Lk] as SDPA takes it, row i being query i. The modifiers
read a buffer of the mask's own layout (broadcast dimensions kept at size 1), which each call refills with one
copy, so a model that passes a new mask tensor every step keeps one modifier and one planned call: only the
values change (a bool mask's new values plan the skipped tiles again, as any mask_mod's inputs do).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import checks

_FLOAT_KEPT = (torch.float32, torch.float16, torch.bfloat16)  # (float64 is held as float32: the scores' type)
_ADAPTERS: dict = {}
MAX_ADAPTERS = 64  # mask layouts kept (a model has one or two); past it the table starts over


def mask_layout(attn_mask: torch.Tensor, target: tuple, device: torch.device) -> torch.Tensor:
    """attn_mask checked and viewed as 4-d: leading 1s added, dimensions broadcast by stride 0 cut to size 1."""
    if not isinstance(attn_mask, torch.Tensor):
        raise checks.fail("attention(attn_mask=...)", "a torch.Tensor (bool, or float added to the scores)",
                          type(attn_mask).__name__, "Pass a tensor, as to SDPA.")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise checks.fail("attn_mask.dtype", "torch.bool (True: the key takes part) or a float dtype (added to the "
                          "scores)", attn_mask.dtype, "Pass mask.bool(), or a float bias with -inf where masked.")
    if attn_mask.device != device:
        raise checks.fail("attn_mask", f"a tensor on {device} (q's device)", f"device {attn_mask.device}",
                          "Move it to q's GPU.")
    if attn_mask.dim() > 4 or any(n not in (1, want) for n, want in zip(attn_mask.shape[::-1], target[::-1])):
        raise checks.fail("attn_mask.shape", f"a shape broadcastable to [B, Hq, Lq, Lk] = {list(target)}",
                          list(attn_mask.shape), "Give each dimension its full size or 1 (SDPA's rule).")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    for d in range(4):  # (an expanded view: one copy of what it repeats)
        if m.shape[d] > 1 and m.stride(d) == 0:
            m = m.narrow(d, 0, 1)
    return m


class MaskAdapter:
    """One mask layout's buffer and the modifiers that read it. A call on another stream may still be reading the
    buffer when the next call refills it: a fill on another stream waits for the event the last launch recorded
    (read_by_launch). Not while a graph is captured: its replay repeats the fill from the captured mask, and
    orders itself against other streams as any replay does."""

    def __init__(self, buf: torch.Tensor, offset: int, score_mod, mask_mod):
        self.buf = buf
        self.score_mod, self.mask_mod = _modifiers(buf, offset, score_mod, mask_mod)
        self._read = None  # (stream, event recorded there after the last launch that read buf)

    def fill(self, m: torch.Tensor) -> None:
        if self._read is not None and not torch.cuda.is_current_stream_capturing():
            stream, event = self._read
            current = torch.cuda.current_stream(self.buf.device)
            if current != stream:
                current.wait_event(event)
        self.buf.copy_(m)  # (this call's values; a bool mask's are compared with the planned ones by the call)

    def read_by_launch(self) -> None:
        """After the launch that reads buf, on the stream current then."""
        if self.buf.is_cuda and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(self.buf.device)
            event = torch.cuda.Event()
            event.record(stream)
            self._read = (stream, event)


def as_modifiers(attn_mask: torch.Tensor, q_shape: tuple, lk: int, score_mod: Optional[Callable],
                 mask_mod: Optional[Callable], device: torch.device, key_of: Callable) -> MaskAdapter:
    """The adapter whose score_mod and mask_mod apply attn_mask after the caller's own (a bool mask and-ed with
    mask_mod, a float one added to what score_mod returns), its buffer filled with this call's mask. key_of(fn):
    what a modifier built from fn depends on (dense._mod_key); the adapters are kept per mask layout and those
    keys, so their functions are the same objects call after call."""
    bq, hq, lq, _ = q_shape
    m = mask_layout(attn_mask, (bq, hq, lq, lk), device)
    dtype = m.dtype if m.dtype == torch.bool or m.dtype in _FLOAT_KEPT else torch.float32
    key = (tuple(m.shape), dtype, device, lk - lq, key_of(score_mod), key_of(mask_mod))
    adapter = _ADAPTERS.get(key)
    if adapter is None:
        if len(_ADAPTERS) >= MAX_ADAPTERS:
            _ADAPTERS.clear()
        adapter = _ADAPTERS[key] = MaskAdapter(torch.empty(m.shape, dtype=dtype, device=device), lk - lq,
                                               score_mod, mask_mod)
    adapter.fill(m)
    return adapter


def _modifiers(buf: torch.Tensor, offset: int, score_mod, mask_mod) -> tuple:
    """(score_mod, mask_mod) reading buf[b, h, q_idx - offset, kv_idx], with 0 for a size-1 dimension
    (attnforge's q_idx is aligned to the end of the keys, SDPA's mask rows to the first query)."""
    nb, nh, nq, nk = buf.shape

    def at(b, h, q_idx, kv_idx):
        return buf[b if nb > 1 else 0, h if nh > 1 else 0, q_idx - offset if nq > 1 else 0, kv_idx if nk > 1 else 0]

    if buf.dtype == torch.bool:
        if mask_mod is None:
            return score_mod, at

        def masked(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx, kv_idx) & at(b, h, q_idx, kv_idx)
        return score_mod, masked
    if score_mod is None:
        def biased(score, b, h, q_idx, kv_idx):
            return score + at(b, h, q_idx, kv_idx)
    else:
        def biased(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx, kv_idx) + at(b, h, q_idx, kv_idx)
    return biased, mask_mod

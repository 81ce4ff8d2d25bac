"""attention()'s calls of one query a request (Lq == 1: a model's decode step over its own K/V tensors) on the decode
kernels, with ATTNFORGE_ATTENTION_DECODE=1.

k and v [B, Hkv, Lk, D] are read in place as an HND paged cache of B pages of Lk tokens, page b holding request b.
Why: the prefill kernels pad one query's group of heads to a 64-row tile and stream K/V through a compute-bound
pipeline, where the decode kernels are built to read K/V at the bandwidth limit (as FlexAttention runs its
decoding kernel below 128 queries). Any strides with 16-byte aligned rows are read as they are, so a static cache
sliced to its filled length (`cache[:, :, :Lk]` of [B, Hkv, max_len, D]) costs no copy (the prefill path copies
tensors that are not contiguous).

Same meaning as the prefill path: q_idx is Lk - 1 (queries aligned to the end of the keys, decode's own
convention), so every score_mod / mask_mod and SDPA attn_mask gives the same attention. One plan per call
signature (batch and Lk are in it), again when the scale changes; a mask needs no plan (decode evaluates it per
score, with no tile lists to make).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .decode import BatchDecode
from .jit import env
from .spec import AttentionSpec


def wanted(q: torch.Tensor) -> bool:
    """Whether a call of q's shape takes this path: one query a request, and the knob on."""
    return q.dim() == 4 and q.shape[2] == 1 and env.ATTENTION_DECODE.value


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes the decode kernels run (checked 4-d tensors): some requests, some keys, and V as wide as K (narrower
    values are the prefill kernels' DeepSeek form)."""
    return q.shape[0] > 0 and k.shape[2] > 0 and v.shape[3] == q.shape[3]


def make_wrapper(spec: AttentionSpec, device: torch.device, batch: int) -> BatchDecode:
    """The call's wrapper: one page a request (tests without a GPU replace this with a host-only one)."""
    return BatchDecode(spec, device=device, max_batch_size=batch, max_num_pages=batch)


def reads_in_place(t: torch.Tensor) -> bool:
    """What the decode kernels read without a copy: unit stride along D, 16-byte aligned start and rows."""
    step = 16 // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % step == 0 for s in t.stride()[:-1])


class DecodeCall:
    """One call signature's decode wrapper and the scale its plan was made for (dense.DenseCall's twin)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod):
        bq, hq, _, d = q.shape
        self.mod = mod  # (held: the signature keys the modifier by identity)
        spec = AttentionSpec(family="decode", num_qo_heads=hq, num_kv_heads=k.shape[1], head_dim_qk=d,
                             q_dtype=q.dtype, kv_layout="HND", score_mod=mod)
        self.wrapper = make_wrapper(spec, q.device, bq)
        self.planned = False  # whether the wrapper holds this call's plan (a failed plan leaves none)
        self.scale: Optional[float] = None

    def plan(self, batch: int, lk: int, scale: Optional[float]) -> None:
        if self.planned and scale == self.scale:
            return
        self.planned = False
        self.wrapper.plan(np.arange(batch + 1, dtype=np.int32), np.arange(batch, dtype=np.int32),
                          np.full(batch, lk, dtype=np.int32), page_size=lk, sm_scale=scale)
        self.scale, self.planned = scale, True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], return_lse: bool):
        """(out [B, Hq, 1, D], lse [B, Hq, 1] or None), as dense.attention_with_mod returns them."""
        if not reads_in_place(q):  # (copies take torch's own strides, also along dims of size 1)
            q = q.clone(memory_format=torch.contiguous_format)
        if not (reads_in_place(k) and reads_in_place(v)) or k.stride() != v.stride():  # (one stride set for both)
            k, v = (t.clone(memory_format=torch.contiguous_format) for t in (k, v))
        bq, hq, _, d = q.shape
        self.plan(bq, k.shape[2], scale)
        out = q.new_empty((bq, hq, 1, d))
        lse = torch.empty((bq, hq, 1), dtype=torch.float32, device=q.device) if return_lse else None
        # [B, Hkv, Lk, D] is HND's (K, V) pair form [pages, Hkv, page_size, D]: strides pass through as they are
        self.wrapper.run(q[:, :, 0], (k, v), out=out[:, :, 0], lse=None if lse is None else lse[:, :, 0])
        return out, lse


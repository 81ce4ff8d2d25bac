"""The decode kernels over K/V that are not paged: attention()'s calls of one query a request (Lq == 1: a model's
decode step over its own K/V tensors), or of up to 8 causal ones (a verify step of speculative decoding: is_causal,
or the mask_mod q_idx >= kv_idx), with ATTNFORGE_ATTENTION_DECODE=1; and single_decode (one request,
FlashInfer's single_decode_with_kv_cache).

k and v [B, Hkv, Lk, D] are read in place as an HND paged cache of B pages of Lk tokens, page b holding request b.
Why: the prefill kernels pad one query's group of heads to a 128-row tile and stream K/V through a compute-bound
pipeline, where the decode kernels are built to read K/V at the bandwidth limit (as FlexAttention runs its
decoding kernel below 128 queries). Any strides with 16-byte aligned rows are read as they are, so a static cache
sliced to its filled length (`cache[:, :, :Lk]` of [B, Hkv, max_len, D]) costs no copy (the prefill path copies
tensors that are not contiguous). Masks other than the causal rule stay on the prefill kernels, which skip the
tiles a mask hides where the decode kernels would read every key: pass the filled slice, not a padding mask.

Same meaning as the prefill path: query t of Lq has q_idx Lk - Lq + t (queries aligned to the end of the keys,
decode's own convention), so a score_mod gives the same attention on both. One plan per call signature (batch
and Lk are in it), again when the scale changes; the causal mask needs no plan (decode evaluates it per score,
with no tile lists to make).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import checks
from .decode import BatchDecode
from .jit import env
from .prefill import _cached_wrapper
from .spec import AttentionSpec


# (q_idx >= kv_idx, end-aligned: the verify step's causal rule among a request's tokens)
CAUSAL_NODES = {("ge", ("input", "q_idx"), ("input", "kv_idx")), ("le", ("input", "kv_idx"), ("input", "q_idx"))}
TRUE_NODE = ("const", True, "b")  # (and_masks starts its chain with it)


def wanted(q: torch.Tensor) -> bool:
    """Whether a call of q's shape may take this path: at most a verify step's queries a request, and the knob on."""
    return q.dim() == 4 and q.shape[2] <= BatchDecode.MAX_Q_LEN and env.ATTENTION_DECODE.value


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod, causal: bool = False) -> bool:
    """Calls the decode kernels run (checked 4-d tensors): some requests and keys, V as wide as K (narrower values
    are the prefill kernels' DeepSeek form), no mask but the causal rule (the decode kernels read every key in
    [0, Lk), where the prefill kernels skip the tiles a mask hides: a window or documents over long keys), and one
    query a request or several that see only the keys up to their own positions (is_causal, or that mask): the
    verify step's rule, which its kernels apply."""
    mask = None if mod is None else mod.mask_root
    causal = causal or (mask is not None and causal_only(mask))
    return q.shape[0] > 0 and k.shape[2] > 0 and v.shape[3] == q.shape[3] and (mask is None or causal) and (
        q.shape[2] == 1 or causal)


def causal_only(node) -> bool:
    """Whether a mask graph is the causal rule q_idx >= kv_idx (alone, or and-ed with itself or True)."""
    parts = conjuncts(node)
    return any(p in CAUSAL_NODES for p in parts) and all(p in CAUSAL_NODES or p == TRUE_NODE for p in parts)


def conjuncts(node) -> list:
    return [p for a in node[1:] for p in conjuncts(a)] if node[0] == "and" else [node]


def make_wrapper(spec: AttentionSpec, device: torch.device, batch: int, q_len: int = 1) -> BatchDecode:
    """The call's wrapper: one page a request, q_len tokens each (tests without a GPU replace this with a host-only
    one)."""
    return BatchDecode(spec, device=device, max_batch_size=batch, max_num_pages=batch, max_q_len=q_len)


def aligned_rows(t: torch.Tensor) -> bool:
    """Strides the decode kernels read without a copy (with a 16-byte aligned start): unit stride along D, rows
    16-byte aligned."""
    step = 16 // t.element_size()
    return t.stride(-1) == 1 and all(s % step == 0 for s in t.stride()[:-1])


def readable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k and v, each as it is or as a contiguous copy where the kernels cannot read it in place (K and V: one
    stride set for both)."""
    if not aligned_rows(q) or q.data_ptr() % 16:  # (copies take torch's own strides, also along dims of size 1)
        q = q.clone(memory_format=torch.contiguous_format)
    if not (aligned_rows(k) and aligned_rows(v)) or (k.data_ptr() | v.data_ptr()) % 16 or k.stride() != v.stride():
        k, v = (t.clone(memory_format=torch.contiguous_format) for t in (k, v))
    return q, k, v


class DecodeCall:
    """One call signature's decode wrapper and the scale its plan was made for (dense.DenseCall's twin)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod):
        bq, hq, lq, d = q.shape
        self.mod = mod  # (held: the signature keys the modifier by identity)
        spec = AttentionSpec(family="decode", num_qo_heads=hq, num_kv_heads=k.shape[1], head_dim_qk=d,
                             q_dtype=q.dtype, kv_layout="HND", score_mod=mod)
        self.wrapper = make_wrapper(spec, q.device, bq, lq)
        # (strides are in the call's signature: only the addresses can differ between its calls)
        self.strides_fit = aligned_rows(q) and aligned_rows(k) and aligned_rows(v) and k.stride() == v.stride()
        self.planned = False  # whether the wrapper holds this call's plan (a failed plan leaves none)
        self.scale: Optional[float] = None

    def plan(self, batch: int, lq: int, lk: int, scale: Optional[float]) -> None:
        if self.planned and scale == self.scale:
            return
        self.planned = False
        self.wrapper.plan(np.arange(batch + 1, dtype=np.int32), np.arange(batch, dtype=np.int32),
                          np.full(batch, lk, dtype=np.int32), page_size=lk, sm_scale=scale, q_len=lq)
        self.scale, self.planned = scale, True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], return_lse: bool):
        """(out [B, Hq, Lq, D], lse [B, Hq, Lq] or None), as dense.attention_with_mod returns them."""
        if not self.strides_fit or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:  # (the usual case is neither)
            q, k, v = readable(q, k, v)
        bq, hq, lq, d = q.shape
        self.plan(bq, lq, k.shape[2], scale)
        # [B, Hkv, Lk, D] is HND's (K, V) pair form [pages, Hkv, page_size, D]: strides pass through as they are.
        # Several tokens a request: rows b * lq + t (a copy of q, and of the rows back into SDPA's layout)
        rows = q.select(2, 0) if lq == 1 else q.transpose(1, 2).reshape(bq * lq, hq, d)
        out, lse = self.wrapper.run_narrowed(rows, k, v, return_lse)
        if lq == 1:
            return out.unsqueeze(2), (lse.unsqueeze(2) if return_lse else None)
        out = out.view(bq, lq, hq, d).transpose(1, 2).contiguous()
        return out, (lse.view(bq, lq, hq).transpose(1, 2).contiguous() if return_lse else None)


def single_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kv_layout: str = "NHD",
                  sm_scale: Optional[float] = None, return_lse: bool = False, k_scale: float = 1.0,
                  v_scale: float = 1.0, **spec_kwargs):
    """One request's decode step: q [Hq, D]; k, v [Lk, Hkv, D] (NHD) or [Hkv, Lk, D] (HND) of q's dtype, or fp8 e4m3
    with the cache's per-tensor k_scale / v_scale. spec_kwargs: AttentionSpec's (logits_soft_cap, window_left,
    score_mod, pipeline, ...). Returns out [Hq, D], and lse [Hq] (natural log) with return_lse; no keys give zeros
    and -inf. The K/V are read in place as one page of Lk tokens. Each call plans and packs its launch anew (~130 us
    of host time on the CI machine, CUDA stubbed; single_prefill ~260): a loop of steps wants BatchDecode."""
    checks.check_untracked("single_decode", ("q", q), ("k", k), ("v", v))
    for name, t, dims, meaning in (("q", q, 2, "[num_qo_heads, head_dim]"),
                                   ("k", k, 3, f"[kv_len, num_kv_heads, head_dim] ({kv_layout})"),
                                   ("v", v, 3, f"[kv_len, num_kv_heads, head_dim] ({kv_layout})")):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise checks.fail(f"single_decode {name}", f"a {dims}-D tensor {meaning}",
                              getattr(t, "shape", type(t).__name__), "Batches of requests go through BatchDecode.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_cuda(name, t, q.device if name != "q" else None)
    if v.shape != k.shape:
        raise checks.fail("single_decode v.shape", f"k's shape {list(k.shape)}", list(v.shape),
                          "Decode reads K and V of one width; narrower values run on single_prefill.")
    tokens_at = 0 if kv_layout == "NHD" else 1  # (the spec refuses any other layout)
    spec = AttentionSpec(family="decode", num_qo_heads=q.shape[0], num_kv_heads=k.shape[1 - tokens_at],
                         head_dim_qk=q.shape[1], q_dtype=q.dtype, kv_dtype=spec_kwargs.pop("kv_dtype", k.dtype),
                         kv_layout=kv_layout, **spec_kwargs)
    length = k.shape[tokens_at]
    w = _cached_wrapper(spec, q.device, lambda s, device: make_wrapper(s, device, 1))
    w.plan(np.array([0, 1 if length else 0]), np.zeros(1 if length else 0, dtype=np.int32), np.array([length]),
           page_size=max(length, 1), sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    if length:
        pair = (k[None], v[None])
    else:  # no keys, no page: the run still checks a cache, so one of a token that no plan entry names
        shape = list(k.shape)
        shape[tokens_at] = 1
        pair = (k.new_empty(1, *shape),) * 2
    out = w.run(q[None], pair, return_lse=return_lse)
    return (out[0][0], out[1][0]) if return_lse else out[0]

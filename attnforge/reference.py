"""The torch oracle every kernel test compares against (float64 by default, on any device).

Conventions shared with the kernels: scores are q.k * sm_scale; soft-cap is cap*tanh(s/cap);
queries are aligned to the END of the keys (query i of qo_len sits at kv_len - qo_len + i, which is
also the q_idx a score_mod / mask_mod sees; it equals FlexAttention's q_idx when qo_len == kv_len);
window_left=W keeps keys with qo_pos - W <= kv <= qo_pos; LSE is natural-log; a row with no
visible key gives output 0 and LSE -inf.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

ScoreMod = Callable[..., torch.Tensor]  # (score, b, h, q_idx, kv_idx) -> score
MaskMod = Callable[..., torch.Tensor]  # (b, h, q_idx, kv_idx) -> bool


def merge_states(v: torch.Tensor, s: torch.Tensor, dtype=torch.float64):
    """v [N, S, H, D], s [N, S, H] natural-log LSE -> (out [N, H, D], lse [N, H])."""
    v, s = v.to(dtype), s.to(dtype)
    lse = torch.logsumexp(s, dim=1)  # [N, H]; all -inf -> -inf
    w = torch.exp(s - lse[:, None, :]).nan_to_num(0.0)  # -inf - -inf = nan -> weight 0
    out = (w[..., None] * v.nan_to_num(0.0)).sum(dim=1)
    return out, lse


# float64 scores one pass holds (512 MB; a few such temporaries live at once): longer requests are computed in
# chunks of query rows, each row being independent, so the oracle checks long prefills in bounded memory
MAX_SCORES_PER_PASS = 1 << 26


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: Optional[float] = None,
              causal: bool = False, window_left: int = -1, logits_soft_cap: float = 0.0,
              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
              sink: Optional[torch.Tensor] = None, batch_index: int = 0, dtype=torch.float64):
    """One request. q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] -> (out [Lq, Hq, Dv], lse [Lq, Hq]).

    sink [Hq]: attention-sink logits added to each row's softmax denominator (not to the output).
    """
    lq, hq, d = q.shape
    lk, hkv, dv = v.shape
    if hq % hkv:
        raise ValueError(f"reference.attention: Hq={hq} must be a multiple of Hkv={hkv}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if lk == 0:
        lse = torch.full((lq, hq), -math.inf, dtype=dtype, device=q.device)
        if sink is not None:
            lse = sink.to(dtype).to(q.device)[None].expand(lq, hq).clone()
        return torch.zeros(lq, hq, dv, dtype=dtype, device=q.device), lse
    kf, vf = k.to(dtype), v.to(dtype)
    rows = max(1, MAX_SCORES_PER_PASS // (hq * lk))
    kw = dict(sm_scale=sm_scale, causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap,
              score_mod=score_mod, mask_mod=mask_mod, sink=sink, batch_index=batch_index, dtype=dtype)
    if lq <= rows:
        return _attention_rows(q, kf, vf, first_pos=lk - lq, **kw)
    parts = [_attention_rows(q[i:i + rows], kf, vf, first_pos=lk - lq + i, **kw) for i in range(0, lq, rows)]
    return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])


def _attention_rows(q, kf, vf, *, first_pos: int, sm_scale, causal, window_left, logits_soft_cap, score_mod,
                    mask_mod, sink, batch_index, dtype):
    """attention() for query rows at key positions first_pos, first_pos + 1, ... (K, V already in dtype)."""
    lq, hq, d = q.shape
    lk, hkv, dv = vf.shape
    g = hq // hkv
    # grouped einsums, not K/V repeated per query head: MLA (128 heads on one latent row) would need
    # Hq copies of the whole cache (34 GB in float64 for 64K tokens)
    qg = q.to(dtype).reshape(lq, hkv, g, d)
    s = (torch.einsum("qngd,knd->ngqk", qg, kf) * sm_scale).reshape(hq, lq, lk)  # [Hq, Lq, Lk]
    if logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    qo_pos = torch.arange(lq, device=q.device)[:, None] + first_pos
    kv_idx = torch.arange(lk, device=q.device)[None, :]
    h_idx = torch.arange(hq, device=q.device)[:, None, None]
    if score_mod is not None:
        s = score_mod(s, torch.tensor(batch_index, device=q.device), h_idx, qo_pos[None], kv_idx[None]).to(dtype)
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= kv_idx <= qo_pos
    if window_left >= 0:
        keep &= kv_idx >= qo_pos - window_left
    keep = keep[None].expand(hq, lq, lk)
    if mask_mod is not None:
        keep = keep & mask_mod(torch.tensor(batch_index, device=q.device), h_idx, qo_pos[None], kv_idx[None])
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("ngqk,knd->qngd", p.reshape(hkv, g, lq, lk), vf).reshape(lq, hq, dv)
    if sink is not None:  # the sink takes part of the mass: scale rows by e^(lse - lse')
        total = torch.logaddexp(lse, sink.to(dtype).to(q.device)[:, None])
        out = out * torch.exp(lse - total).nan_to_num(0.0).transpose(0, 1)[..., None]
        lse = total
    return out, lse.transpose(0, 1)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, *,
                  sm_scale: float, batch_index: int = 0, dtype=torch.float64, **kw):
    """One MLA request. q_nope [Lq, H, 512], q_pe [Lq, H, 64], ckv [Lk, 512], kpe [Lk, 64] ->
    (out [Lq, H, 512], lse [Lq, H]). The latent row is both key (with its rope part) and value;
    the Lq query tokens are the request's last positions, causal among themselves."""
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([ckv, kpe], dim=-1)[:, None, :]
    return attention(q, k, ckv[:, None, :], sm_scale=sm_scale, causal=True, batch_index=batch_index,
                     dtype=dtype, **kw)


def gather_paged(cache_k: torch.Tensor, cache_v: torch.Tensor, kv_layout: str, indptr, indices,
                 last_page_len, page_size: int):
    """Per-request contiguous (k [L, Hkv, D], v [L, Hkv, D]) from a paged cache of [P, page, H, D]
    (NHD) or [P, H, page, D] (HND) tensors and a CSR page table (host int sequences)."""
    out = []
    for b in range(len(indptr) - 1):
        pages = [int(p) for p in indices[int(indptr[b]):int(indptr[b + 1])]]
        n = 0 if not pages else (len(pages) - 1) * page_size + int(last_page_len[b])
        ks, vs = [], []
        for p in pages:
            kp, vp = cache_k[p], cache_v[p]
            if kv_layout == "HND":
                kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)
            ks.append(kp)
            vs.append(vp)
        if ks:
            out.append((torch.cat(ks)[:n], torch.cat(vs)[:n]))
        else:
            shape = (0, cache_k.shape[2 if kv_layout == "NHD" else 1], cache_k.shape[-1])
            out.append((cache_k.new_empty(shape), cache_v.new_empty(shape)))
    return out


# -- KV-cache appends (attnforge.append): the torch formulation, also what torch.compile traces ----------
def quantize_rows(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: unchanged where the types match, else e4m3 codes of x / scale
    (fp32 division, rounded to nearest, saturated to +-448)."""
    if x.dtype == dtype:
        return x
    return (x.float() / scale).clamp(-448.0, 448.0).to(dtype)


def _kv_pair(kv_cache, kv_layout: str):
    kc, vc = (kv_cache[:, 0], kv_cache[:, 1]) if isinstance(kv_cache, torch.Tensor) else kv_cache
    if kv_layout == "HND":  # written through [P, page, H, D] views of the same memory
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    return kc, vc


def _csr_rows(batch_indices, positions, kv_indices, kv_indptr, page_size: int):
    pos = positions.to(torch.int64)
    slot = kv_indptr.to(torch.int64)[batch_indices.to(torch.int64)] + pos // page_size
    return kv_indices.to(torch.int64)[slot], pos % page_size


def append_paged_kv(k, v, batch_indices, positions, kv_cache, kv_indices, kv_indptr, kv_layout: str = "NHD",
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """append_paged_kv_cache in torch indexing (in place; every index assumed valid)."""
    kc, vc = _kv_pair(kv_cache, kv_layout)
    pages, offs = _csr_rows(batch_indices, positions, kv_indices, kv_indptr, kc.shape[1])
    kc[pages, offs] = quantize_rows(k, k_scale, kc.dtype)
    vc[pages, offs] = quantize_rows(v, v_scale, vc.dtype)


def append_kv_slots(k, v, slot_mapping, kv_cache, kv_layout: str = "NHD", k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """append_kv_by_slots in torch indexing: negative slots skipped."""
    kc, vc = _kv_pair(kv_cache, kv_layout)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    pages, offs = slots // kc.shape[1], slots % kc.shape[1]
    kc[pages, offs] = quantize_rows(k[keep], k_scale, kc.dtype)
    vc[pages, offs] = quantize_rows(v[keep], v_scale, vc.dtype)


def append_paged_mla(ckv, kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices, kv_indptr,
                     kv_scale: float = 1.0) -> None:
    """append_paged_mla_kv_cache in torch indexing (kpe_cache None: one [P, page, 576] cache)."""
    latent = ckv.shape[-1]
    if kpe_cache is None:  # one cache: latent, then rope
        ckv_dst, kpe_dst = ckv_cache[..., :latent], ckv_cache[..., latent:]
    else:
        ckv_dst, kpe_dst = ckv_cache, kpe_cache
    pages, offs = _csr_rows(batch_indices, positions, kv_indices, kv_indptr, ckv_cache.shape[1])
    ckv_dst[pages, offs] = quantize_rows(ckv, kv_scale, ckv_dst.dtype)
    kpe_dst[pages, offs] = quantize_rows(kpe, kv_scale, kpe_dst.dtype)

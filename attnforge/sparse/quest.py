"""Quest: query-aware page selection for sparse decode (torch ops; CUDA-graph friendly shapes).

Per page and KV head the index keeps the elementwise min and max of the keys. A page's score for a
query is an upper bound of its best dot product: sum_i max(q_i * min_i, q_i * max_i); with GQA the
bound is summed over the group's query heads, and over KV heads for a per-request selection. Each
request keeps its top pages within a token budget, always including its last page (the newest
tokens), in their original order, so the selection is an ordinary page table for batch decode.
"""
from __future__ import annotations

import math

import torch

from ..checks import fail


class QuestIndex:
    """kmin / kmax [num_pages, num_kv_heads, head_dim] float32; empty pages hold +inf / -inf."""

    def __init__(self, num_pages: int, num_kv_heads: int, head_dim: int, device=None):
        shape = (num_pages, num_kv_heads, head_dim)
        self.kmin = torch.full(shape, math.inf, dtype=torch.float32, device=device)
        self.kmax = torch.full(shape, -math.inf, dtype=torch.float32, device=device)

    def reset(self, pages: torch.Tensor) -> None:
        """Pages just (re)allocated to a request: forget their old keys."""
        self.kmin[pages] = math.inf
        self.kmax[pages] = -math.inf

    def append(self, k: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Fold new keys k [N, Hkv, D] written to pages page_ids [N] into the summaries."""
        if k.dim() != 3 or k.shape[1:] != self.kmin.shape[1:]:
            raise fail("k.shape", f"[N, {self.kmin.shape[1]}, {self.kmin.shape[2]}]", list(k.shape),
                       "Pass the keys being appended, one row per token.")
        idx = page_ids.to(torch.int64)[:, None, None].expand_as(k)
        self.kmin.scatter_reduce_(0, idx, k.float(), reduce="amin")
        self.kmax.scatter_reduce_(0, idx, k.float(), reduce="amax")


def page_scores(q: torch.Tensor, index: QuestIndex, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                per_head: bool = False) -> torch.Tensor:
    """Scores of every listed page: [n_pages] (summed over heads) or [n_pages, Hkv] with per_head.

    q [B, Hq, D]; kv_indptr [B+1] / kv_indices [n_pages] a CSR page table (on q's device)."""
    b, hq, d = q.shape
    hkv = index.kmin.shape[1]
    if hq % hkv:
        raise fail("q.shape[1]", f"a multiple of num_kv_heads={hkv}", hq, "Check the head counts.")
    counts = kv_indptr[1:] - kv_indptr[:-1]
    request = torch.repeat_interleave(torch.arange(b, device=q.device), counts.to(torch.int64))
    pages = kv_indices.to(torch.int64)
    qg = q.float()[request].view(-1, hkv, hq // hkv, d)  # [n, Hkv, G, D]
    lo, hi = index.kmin[pages][:, :, None, :], index.kmax[pages][:, :, None, :]
    bound = torch.maximum(qg * lo, qg * hi).nan_to_num(0.0).sum(dim=-1).sum(dim=-1)  # [n, Hkv]
    return bound if per_head else bound.sum(dim=-1)


def select_pages(scores: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, budget_pages: int):
    """Per request: the top `budget_pages` pages by score, the last page always among them, kept in
    their original order. Returns (indptr [B+1], indices) of the selection (on the input's device)."""
    if budget_pages < 1:
        raise fail("budget_pages", "an int >= 1 (the last page is always kept)", budget_pages, "Raise the budget.")
    b = kv_indptr.numel() - 1
    counts = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    width = max(int(counts.max()) if b else 0, 1)
    pos = torch.arange(width, device=scores.device)[None, :]
    valid = pos < counts[:, None]
    flat = (kv_indptr[:-1].to(torch.int64)[:, None] + pos).clamp(max=max(scores.numel() - 1, 0))
    padded = torch.where(valid, scores[flat] if scores.numel() else torch.zeros_like(pos, dtype=scores.dtype),
                         torch.full_like(pos, -math.inf, dtype=scores.dtype))
    padded = torch.where(pos == (counts - 1)[:, None], torch.full_like(padded, math.inf), padded)  # keep last page
    k = min(budget_pages, width)
    top = torch.topk(padded, k, dim=1).indices.sort(dim=1).values  # original order
    keep = top < counts[:, None]
    chosen = torch.gather(flat, 1, top)
    new_counts = keep.sum(dim=1)
    indptr = torch.zeros(b + 1, dtype=torch.int64, device=scores.device)
    indptr[1:] = torch.cumsum(new_counts, dim=0)
    return indptr, kv_indices.to(torch.int64)[chosen[keep]]


class QuestDecode:
    """Score pages, keep each request's best `budget_tokens`, then batch decode over the selection.

    This first version plans the selection on the host (one device-to-host copy per step), so it is
    not CUDA-graph capturable yet; the scoring and selection themselves are fixed-shape torch ops.
    """

    def __init__(self, spec, index: QuestIndex, budget_tokens: int, page_size: int, **decode_kwargs):
        from ..decode import BatchDecode
        if budget_tokens < page_size:
            raise fail("budget_tokens", f"at least one page ({page_size} tokens)", budget_tokens, "Raise the budget.")
        self.index, self.page_size = index, page_size
        self.budget_pages = budget_tokens // page_size
        self.decode = BatchDecode(spec, **decode_kwargs)

    def run(self, q: torch.Tensor, kv_cache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_last_page_len: torch.Tensor, return_lse: bool = False):
        scores = page_scores(q, self.index, kv_indptr, kv_indices)
        indptr, indices = select_pages(scores, kv_indptr, kv_indices, self.budget_pages)
        self.decode.plan(indptr.cpu(), indices.cpu(), kv_last_page_len.cpu(), page_size=self.page_size)
        return self.decode.run(q, kv_cache, return_lse=return_lse)

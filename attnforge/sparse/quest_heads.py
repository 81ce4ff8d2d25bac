"""Quest with a selection per (request, KV head), as the Quest paper selects per head.

QuestDecode picks one page set per request (its bound summed over every head). QuestHeadDecode picks
one per (request, KV head): row b * Hkv + h of a head-expanded batch lists request b's pages, scored
with KV head h's summaries and its group of query heads, and keeps its own top pages. No new kernel:

- the summaries [P, Hkv, D] are read as [P * Hkv, 1, D], so page p of head h is summary p * Hkv + h
  and the scoring kernel runs with one KV head and the group's query heads (q viewed [B * Hkv, G, D]);
- an HND cache ([P, Hkv, page, D] per K and V) is read as single-head pages: page p of head h is
  virtual page p * r + h with r = stride_page / stride_head, so decode runs unchanged with one KV head
  over B * Hkv rows (the selection writes ids p * Hkv + h; run() rewrites them when r != Hkv).
The head-expanded page lists are built on the device in plan(), by one kernel (quest_expand_heads_kernel;
expand_per_head below is its torch definition): no host loop over B * Hkv * pages.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import checks, ops, paged
from ..checks import fail
from ..jit.loader import on_device
from .quest import QuestDecode, QuestIndex, check_wrapper_args


def expand_per_head(indptr: torch.Tensor, pages: torch.Tensor, num_kv_heads: int):
    """Request b's listed pages repeated for each KV head h, as rows b * Hkv + h (b-major).

    indptr [B+1], pages [n] (one device) -> (row_indptr [B*Hkv + 1], head_ids [n*Hkv]) with
    head_ids = page * Hkv + h, in each row the request's pages in list order."""
    hkv = num_kv_heads
    counts = (indptr[1:] - indptr[:-1]).to(torch.int64)
    row_counts = counts.repeat_interleave(hkv)
    row_indptr = torch.zeros(row_counts.numel() + 1, dtype=torch.int64, device=pages.device)
    torch.cumsum(row_counts, dim=0, out=row_indptr[1:])
    k = torch.arange(int(pages.numel()) * hkv, device=pages.device)
    row = torch.searchsorted(row_indptr[1:], k, right=True)
    b, h = row // hkv, row % hkv
    page = pages.to(torch.int64)[indptr.to(torch.int64)[b] + (k - row_indptr[row])]
    return row_indptr, page * hkv + h


def head_pages_view(k: torch.Tensor, v: torch.Tensor, stride_page: int, stride_token: int, stride_head: int,
                    num_kv_heads: int):
    """HND K and V [P, Hkv, page, D] as single-head caches [P', 1, page, D]: page p of head h is virtual
    page p * r + h, r = stride_page / stride_head. Returns (k_view, v_view, r)."""
    hkv = num_kv_heads
    if stride_page % stride_head or stride_page // stride_head < hkv:
        raise fail("kv_cache strides", f"a page stride that is a multiple (>= Hkv={hkv}) of the head stride",
                   f"page {stride_page}, head {stride_head}", "Allocate the HND cache contiguous per page.")
    r = stride_page // stride_head
    n_virtual = (k.shape[0] - 1) * r + hkv  # the last real page's last head is the last row
    size, stride = (n_virtual, 1, k.shape[2], k.shape[3]), (stride_head, stride_head, stride_token, 1)
    return torch.as_strided(k, size, stride), torch.as_strided(v, size, stride), r


class QuestHeadDecode(QuestDecode):
    """QuestDecode with the selection per (request, KV head). Needs an HND cache and a spec without a
    score_mod (its head index would be the group's, not the model's); soft-cap and windows work.

        quest = QuestHeadDecode(spec, index, budget_tokens=4096, page_size=16)   # spec.kv_layout="HND"
        quest.plan(kv_indptr, kv_indices, kv_last_page_len)
        out = quest.run(q, kv_cache)
    """

    def __init__(self, spec, index: QuestIndex, budget_tokens: int, page_size: int, *, use_cuda_graph: bool = False,
                 max_batch_size: int = 256, max_num_pages: int = 1 << 16, max_pages_per_request: int = 8192,
                 select: str = "kernel", **decode_kwargs):
        checks.check_spec("QuestHeadDecode", spec, "decode", "Quest selects pages for decode: pass a decode spec.")
        check_wrapper_args("QuestHeadDecode", index, use_cuda_graph, max_batch_size, max_num_pages,
                           max_pages_per_request)
        if spec.kv_layout != "HND":
            raise fail("QuestHeadDecode spec.kv_layout", "'HND' (a head's tokens contiguous in a page)",
                       repr(spec.kv_layout), "Use an HND cache, or QuestDecode for one selection per request.")
        if spec.score_mod is not None:
            raise fail("QuestHeadDecode spec.score_mod", "None (each row decodes one KV head's group)",
                       spec.score_mod.cache_key, "Use QuestDecode with modifiers.")
        hkv = spec.num_kv_heads
        self.model_spec, self.num_kv_heads = spec, hkv
        head_spec = dataclasses.replace(spec, num_qo_heads=spec.group_size, num_kv_heads=1)
        summaries = index.per_head_view()  # the same tensors, one "KV head" per (page, head)
        super().__init__(head_spec, summaries, budget_tokens, page_size, use_cuda_graph=use_cuda_graph,
                         max_batch_size=max_batch_size * hkv, max_num_pages=max_num_pages * hkv,
                         max_pages_per_request=max_pages_per_request, select=select, **decode_kwargs)
        self.model_index = index
        self._raw_ids = None  # scratch for the selected ids when they need rewriting (see _selection_out)
        self._ratio = hkv  # the cache's virtual page stride in heads (run() reads it from the cache)
        # (use_cuda_graph: the captured caches' real pages bound each plan; the decode's own bound counts the
        # per-head view's virtual pages, which the placeholder ids it plans never reach)
        self._captured_cache = paged.CapturedPages()

    def _selection_out(self) -> torch.Tensor:
        # ids p * Hkv + h go straight to the decode page table when the cache's pages are Hkv heads
        # apart; otherwise to a scratch table of the same size, rewritten whole as p * r + h (so a
        # captured graph stays right whatever later plans select)
        table = self.decode._device_region("kv_indices")
        if self._ratio == self.num_kv_heads:
            return table
        if self._raw_ids is None or self._raw_ids.shape != table.shape:
            self._raw_ids = torch.zeros_like(table)
        return self._raw_ids

    def plan(self, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
        """As QuestDecode.plan, one selection per (request, KV head)."""
        hkv = self.num_kv_heads
        table, width, sel_indptr, last = self._plan_selection(kv_indptr, kv_indices, kv_last_page_len, hkv)
        self._captured_cache.check(table.max_page_index)
        b, n = table.batch_size, len(table.indices)
        self.decode.plan(sel_indptr, np.zeros(int(sel_indptr[-1]), dtype=np.int32), last, page_size=self.page_size,
                         sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        self.decode._plan["max_page"] = -1  # ids are virtual; run() checks the real ones against the cache
        self._max_page = table.max_page_index
        self._stage({"meta": (b * hkv, n * hkv), "sel_indptr": sel_indptr[:-1], "raw_indptr": table.indptr,
                     "raw_pages": table.indices})
        self._expand_on_device(b)
        self._planned = {"batch": b * hkv, "width": width}

    def _expand_on_device(self, batch: int) -> None:
        """The staged request-level table -> the table per (request, KV head) in the scoring kernel's regions:
        one launch (expand_per_head, its torch definition, took ~15 torch ops: ~150-250 us of plan())."""
        from ..jit import registry
        from ..kernels.quest import EXPAND_MAX_CTAS, EXPAND_THREADS
        lib = registry.get_library(self.kernel, self.kernel.module, self.device)
        params = self.kernel.expand_params.pack(
            kv_indptr=self._region("raw_indptr").data_ptr(), kv_indices=self._region("raw_pages").data_ptr(),
            row_indptr=self._indptr.data_ptr(), head_ids=self._pages.data_ptr(), batch=batch,
            num_heads=self.num_kv_heads)
        with on_device(self.device):  # (one CTA at batch 0 writes the table's end, row_indptr[0] = 0)
            lib["quest_expand_heads_kernel"].launch((max(1, min(batch, EXPAND_MAX_CTAS)),), (EXPAND_THREADS,), params)

    def _extra_regions(self, max_batch_size: int, max_num_pages: int) -> dict:
        # the request-level page table, staged as given and expanded per head on the device (expand_per_head);
        # the base regions are sized for the head-expanded batch (Hkv rows and Hkv ids per request and page)
        hkv = self.num_kv_heads
        return {"raw_indptr": max_batch_size // hkv + 1, "raw_pages": max_num_pages // hkv}

    def run(self, q: torch.Tensor, kv_cache, out=None, return_lse: bool = False):
        checks.check_untracked("QuestHeadDecode.run", ("q", q), ("kv_cache", kv_cache), ("out", out))
        if ops.compiling():  # scoring, selection and decode as one custom op (attnforge.ops)
            return ops.compiled_run(self, self._planned is not None, [q, *paged.cache_list(kv_cache)], out, None,
                                    return_lse)
        if self._planned is None:
            raise RuntimeError("QuestHeadDecode.run: call plan(...) first (once per step, outside graph capture).")
        s, hkv = self.model_spec, self.num_kv_heads
        k, v, stride_page, stride_token, stride_head = paged.split_cache(s, kv_cache, self.page_size, self._max_page,
                                                                         self.device)
        k1, v1, r = head_pages_view(k, v, stride_page, stride_token, stride_head, hkv)
        if q.dim() != 3 or q.shape[1:] != (s.num_qo_heads, s.head_dim_qk):
            raise fail("q.shape", f"[B, {s.num_qo_heads}, {s.head_dim_qk}]", list(q.shape),
                       "One query token per request.")
        rows = q.reshape(q.shape[0] * hkv, s.group_size, s.head_dim_qk)
        if out is not None:  # (before the scoring launches)
            checks.check_out(out, tuple(q.shape[:2]) + (s.head_dim_vo,), checks.TORCH_DTYPES[s.out_dtype], self.device,
                             "[B, num_qo_heads, head_dim]", aligned=False)  # (as decode's)
        self._ratio = r
        self._captured_cache.note(self.use_cuda_graph, k.shape[0])
        self._select(self.scores(rows))  # page * Hkv + h, into the page table or the scratch table
        if r != hkv:  # the cache's virtual pages are p * r + h
            raw = self._raw_ids
            torch.add(torch.div(raw, hkv, rounding_mode="floor") * r, torch.remainder(raw, hkv),
                      out=self.decode._device_region("kv_indices"))
        flat_out = None if out is None else out.view(rows.shape[0], s.group_size, -1)
        res = self.decode.run(rows, (k1, v1), out=flat_out, return_lse=return_lse)
        if return_lse:
            o, lse = res
            return o.view(q.shape[0], s.num_qo_heads, -1), lse.view(q.shape[0], s.num_qo_heads)
        return res.view(q.shape[0], s.num_qo_heads, -1)

    def _op_out_shape(self, args: list):  # (attnforge::run's fake)
        return ops.rows_out_shape(self.model_spec, args)

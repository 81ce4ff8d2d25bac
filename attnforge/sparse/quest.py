"""Quest: query-aware page selection for sparse decode, CUDA-graph capturable end to end.

Per page and KV head the index keeps the elementwise min and max of the keys. A page's score for a
query is an upper bound of its best dot product: sum_i max(q_i * min_i, q_i * max_i); with GQA the
bound is summed over the group's query heads, and over KV heads for a per-request selection. Each
request keeps its top pages within a token budget, always including its last page (the newest
tokens), in their original order, so the selection is an ordinary page table for batch decode.

`page_scores` / `select_pages` are the torch definitions (the tests' oracle); QuestDecode runs the
scoring kernel (templates/quest_score.cu.jinja) and a fixed-shape selection on the device.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import checks, ops, paged
from ..checks import fail
from ..jit.loader import on_device
from ..jit.upload import StagedUpload
from . import summaries
from .summaries import channel_scales, fp8_outward  # noqa: F401 (re-exported)


class QuestIndex:
    """kmin / kmax [num_pages, num_kv_heads, head_dim]; empty pages hold +inf / -inf (a page's KV
    head is written in all its dims or in none).

    dtype float32 (default), bfloat16, float8_e4m3fn or "int4" (attnforge.sparse.summaries): each
    halves the bytes the scoring reads (with page 16 and bf16 keys: 1/8, 1/16, 1/32, 1/64 of the KV
    bytes). fp8 and int4 summaries keep a bf16 master copy (exact updates) and are stored as
    kmin / scale rounded down and kmax / scale rounded up, so the page score stays an upper bound;
    `scale` must keep |key| / scale within the format's range (fp8: 448, int4: 7; larger keys
    saturate, and the bound no longer holds on that side). `scale` is one float or per-channel
    scales [Hkv, D] (`channel_scales(sample_keys, dtype)`): int4 wants the latter (its step is
    uniform, so one scale per channel keeps small channels apart). int4's kmin / kmax are packed
    codes [num_pages, Hkv, D / 2] uint8; `decoded()` gives every format in key units."""

    def __init__(self, num_pages: int, num_kv_heads: int, head_dim: int, device=None, dtype=torch.float32,
                 scale=1.0):
        for name, value in (("num_pages", num_pages), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            # (num_pages -1 made an index of no rows that took appends)
            checks.check_count("QuestIndex", name, value, fix="Pass the cache's pages, KV heads and head_dim.")
        self.format = summaries.format_of(dtype)
        if self.format == "int4" and head_dim % 2:
            raise fail("QuestIndex head_dim", "an even number for int4 summaries (two codes a byte)", head_dim,
                       "Use fp8 summaries.")
        self.scale = summaries.checked_scale(scale, self.format, num_kv_heads, head_dim, device)
        self.num_pages = num_pages
        # one spare row past the pages: device page ids out of range land there (see _rows), and no score reads it
        shape = (num_pages + 1, num_kv_heads, head_dim)
        self.quantized = self.format in summaries.LEVELS
        master = torch.bfloat16 if self.quantized else dtype
        self._min_rows = torch.full(shape, math.inf, dtype=master, device=device)
        self._max_rows = torch.full(shape, -math.inf, dtype=master, device=device)
        if self.quantized:  # what the scoring reads; empty pages: lo > hi (no key yet)
            self._kmin_rows = summaries.encode(self.format, self._min_rows, self.scale, up=False)
            self._kmax_rows = summaries.encode(self.format, self._max_rows, self.scale, up=True)
        else:
            self._kmin_rows, self._kmax_rows = self._min_rows, self._max_rows
        self._min, self._max = self._min_rows[:num_pages], self._max_rows[:num_pages]  # (contiguous views)
        self.kmin, self.kmax = self._kmin_rows[:num_pages], self._kmax_rows[:num_pages]

    @property
    def summary_shape(self) -> tuple[int, int, int]:
        """(rows, KV heads, head_dim) of the summaries, whatever their packing."""
        n, h, d = self.kmin.shape
        return (n, h, 2 * d if self.format == "int4" else d)

    def reset(self, pages, check_indices: bool = False) -> None:
        """Pages just (re)allocated to a request: forget their old keys. pages: ids as append's page_ids."""
        rows = self._rows("pages", pages, None, check_indices)
        self._min_rows[rows] = math.inf
        self._max_rows[rows] = -math.inf
        self._encode(rows)

    def append(self, k: torch.Tensor, page_ids, check_indices: bool = False) -> None:
        """Fold new keys k [N, Hkv, D] (any float dtype, on the index's device) written to pages page_ids [N]
        into the summaries. page_ids: a tensor on the index's device, read without synchronising: ids
        outside [0, num_pages) are not folded (check_indices=True counts them and raises, a sync); or host ids
        (a list, a numpy array, a CPU tensor), checked here before anything is written."""
        checks.check_untracked("QuestIndex.append", ("k", k))  # (else the summaries join k's autograd graph)
        if not isinstance(k, torch.Tensor):
            raise TypeError(f"k: expected a torch tensor [N, Hkv, D], got {type(k).__name__}. Pass the keys.")
        if not k.dtype.is_floating_point:
            raise fail("k.dtype", "a floating dtype (the keys as written to the cache)", k.dtype, "Pass the keys.")
        if k.device != self._min_rows.device:
            raise fail("k.device", f"the index's device {self._min_rows.device}", k.device,
                       "Build the index on the keys' device, or move them.")
        if k.dim() != 3 or k.shape[1:] != self._min.shape[1:]:
            raise fail("k.shape", f"[N, {self._min.shape[1]}, {self._min.shape[2]}]", list(k.shape),
                       "Pass the keys being appended, one row per token.")
        rows = self._rows("page_ids", page_ids, k.shape[0], check_indices)
        idx = rows[:, None, None].expand_as(k)
        self._min_rows.scatter_reduce_(0, idx, k.to(self._min_rows.dtype), reduce="amin")
        self._max_rows.scatter_reduce_(0, idx, k.to(self._max_rows.dtype), reduce="amax")
        self._encode(rows)

    def _rows(self, name: str, ids, count, check_indices: bool) -> torch.Tensor:
        """Page ids as int64 rows on the index's device, never out of bounds: torch's indexing would fault
        on a CUDA id past the rows (a device assert ends the process's CUDA context) and wrap a negative one
        onto the last pages. Ids already on a CUDA index's device are not read back: those out of range go
        to the spare row num_pages. Host ids are checked and refused here."""
        device = self._min_rows.device
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise fail(f"{name}.dtype", "an integer tensor of page ids", ids.dtype, f"Pass int32 or int64 {name}.")
        else:
            ids = torch.from_numpy(paged.host_int_array(name, ids))
        if ids.dim() != 1 or (count is not None and ids.shape[0] != count):
            want = "a 1-D tensor of page ids" + ("" if count is None else f" [{count}] (one per key row)")
            raise fail(name, want, f"shape {list(ids.shape)}", f"Pass one page id per {'key' if count else 'page'}.")
        if ids.device.type == "cuda" and ids.device != device:
            raise fail(f"{name}.device", f"the index's device {device} or the host", ids.device, f"Move {name}.")
        ids = ids.to(torch.int64)
        if ids.device.type == "cpu" or check_indices:  # (a host check, or the sync asked for)
            bad = (ids < 0) | (ids >= self.num_pages)
            if bool(bad.any()):
                first = int(bad.nonzero()[0])
                raise fail(name, f"page ids in [0, num_pages={self.num_pages})",
                           f"{int(bad.sum())} outside, first {name}[{first}] = {int(ids[first])}",
                           "Nothing was written; fix the ids or build the index with more pages.")
            return ids.to(device)
        # two small kernels, nothing read back: an id below 0 or past the pages becomes num_pages (the spare row)
        return torch.remainder(ids.clamp(-1, self.num_pages), self.num_pages + 1)

    def assign(self, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Set every page's summaries at once, kmin / kmax [num_pages, Hkv, D] (e.g. built from a cache)."""
        checks.check_untracked("QuestIndex.assign", ("kmin", kmin), ("kmax", kmax))
        for name, t in (("kmin", kmin), ("kmax", kmax)):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise TypeError(f"assign({name}): expected a floating torch tensor {list(self._min.shape)}, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}. Pass the summaries as tensors.")
            if t.shape != self._min.shape:
                raise fail(f"assign({name}.shape)", list(self._min.shape), list(t.shape), "One row per page.")
        written = kmin <= kmax  # the scoring kernel tests one dim per 16 bytes of a head's summary
        mixed = written.any(dim=-1) & ~written.all(dim=-1)
        if bool(mixed.any()):
            page, head = (int(x) for x in mixed.nonzero()[0])
            raise fail(f"assign: page {page}, KV head {head}", "kmin <= kmax in every dim (keys written) or in none "
                       "(an empty page: +inf / -inf)", "kmin > kmax in some dims only",
                       "Build the summaries from whole key vectors.")
        self._min.copy_(kmin)
        self._max.copy_(kmax)
        if self.quantized:
            self.kmin.copy_(summaries.encode(self.format, self._min, self.scale, up=False))
            self.kmax.copy_(summaries.encode(self.format, self._max, self.scale, up=True))

    def _encode(self, pages: torch.Tensor) -> None:
        if self.quantized:  # only the touched pages (rows from _rows): rounded outward from the exact master
            self._kmin_rows[pages] = summaries.encode(self.format, self._min_rows[pages], self.scale, up=False)
            self._kmax_rows[pages] = summaries.encode(self.format, self._max_rows[pages], self.scale, up=True)

    def per_head_view(self) -> "QuestIndex":
        """The same summaries as [num_pages * Hkv, 1, D]: one "KV head" per (page, head), for a
        selection per head (QuestHeadDecode). Scoring only: appends go through this index."""
        view = QuestIndex.__new__(QuestIndex)
        view.kmin, view.kmax = (t.view(-1, 1, t.shape[2]) for t in (self.kmin, self.kmax))
        view.scale, view.format, view.quantized = self.scale, self.format, self.quantized
        return view

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kmin, kmax) as float32 in key units, [rows, Hkv, D]: what the scoring kernel sees."""
        return self._unscaled(self.kmin), self._unscaled(self.kmax)

    def _unscaled(self, t: torch.Tensor) -> torch.Tensor:
        """Stored values times their channel's scale; rows cycle through the scale's KV heads (the
        per-head view's rows are page * Hkv + h)."""
        v = summaries.values(self.format, t)
        if not isinstance(self.scale, torch.Tensor):
            return v * self.scale
        heads, d = self.scale.shape
        return (v.reshape(-1, heads, d) * self.scale.to(v.device)).reshape(v.shape)

    def channel_scale_table(self, device) -> torch.Tensor:
        """The scales as a float32 table [Hkv, D] ([1, D] for one scale) on `device`: the scoring kernel
        scales a KV head row's query sums by table row (row index) % rows."""
        if isinstance(self.scale, torch.Tensor):
            return self.scale.to(device=device, dtype=torch.float32).contiguous()
        return torch.full((1, self.summary_shape[2]), self.scale, dtype=torch.float32, device=device)


def page_scores(q: torch.Tensor, index: QuestIndex, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                per_head: bool = False) -> torch.Tensor:
    """Scores of every listed page: [n_pages] (summed over heads) or [n_pages, Hkv] with per_head.

    q [B, Hq, D]; kv_indptr [B+1] / kv_indices [n_pages] a CSR page table (on q's device)."""
    b, hq, d = q.shape
    hkv = index.summary_shape[1]
    if hq % hkv:
        raise fail("q.shape[1]", f"a multiple of num_kv_heads={hkv}", hq, "Check the head counts.")
    counts = kv_indptr[1:] - kv_indptr[:-1]
    request = torch.repeat_interleave(torch.arange(b, device=q.device), counts.to(torch.int64))
    pages = kv_indices.to(torch.int64)
    qg = q.float()[request].view(-1, hkv, hq // hkv, d)  # [n, Hkv, G, D]
    kmin, kmax = index.decoded()
    lo, hi = kmin[pages][:, :, None, :], kmax[pages][:, :, None, :]
    written = lo <= hi  # dims of a page with no key yet contribute nothing
    bound = torch.where(written, torch.maximum(qg * lo, qg * hi), 0.0).sum(dim=-1).sum(dim=-1)  # [n, Hkv]
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


def check_wrapper_args(who: str, index, use_cuda_graph, max_batch_size, max_num_pages, max_pages_per_request) -> None:
    """A Quest wrapper's index and capacities, named as the caller passed them (before the per-head wrapper scales
    them by Hkv and the decode wrapper adds its dump slot to max_num_pages)."""
    if not isinstance(index, QuestIndex):
        raise fail(f"{who}(index=...)", "a QuestIndex (the cache's page summaries)", type(index).__name__,
                   "Build one with QuestIndex(num_pages, num_kv_heads, head_dim, device=...).")
    checks.check_flag(who, "use_cuda_graph", use_cuda_graph)
    for name, value in (("max_batch_size", max_batch_size), ("max_num_pages", max_num_pages),
                        ("max_pages_per_request", max_pages_per_request)):
        checks.check_count(who, name, value)


class QuestDecode:
    """Score pages, keep each request's best `budget_tokens`, then batch decode over the selection.

        quest = QuestDecode(spec, index, budget_tokens=4096, page_size=16)
        quest.plan(kv_indptr, kv_indices, kv_last_page_len)   # host arrays, once per step
        out = quest.run(q, kv_cache)                            # device only: graph-capturable

    plan() knows every request's page count, hence how many pages it keeps, hence the selected
    lengths: the decode planner runs on the host with placeholder page ids. run() scores the pages
    (one kernel), picks the top pages with fixed-shape torch ops and writes their ids straight into
    the decode wrapper's device page table, then decodes. With use_cuda_graph=True all buffers are
    sized at construction (max_batch_size, max_num_pages, max_pages_per_request).
    """

    def __init__(self, spec, index: QuestIndex, budget_tokens: int, page_size: int, *, use_cuda_graph: bool = False,
                 max_batch_size: int = 256, max_num_pages: int = 1 << 16, max_pages_per_request: int = 8192,
                 select: str = "kernel", **decode_kwargs):
        from ..decode import BatchDecode
        from ..kernels.quest import QuestScoreKernel
        if select not in ("kernel", "torch"):
            raise fail("QuestDecode(select=...)", "'kernel' (one radix-select launch) or 'torch' (topk)", repr(select),
                       "Use 'kernel' unless comparing the two.")
        self.select = select
        checks.check_spec(type(self).__name__, spec, "decode", "Quest selects pages for decode: pass a decode spec.")
        check_wrapper_args(type(self).__name__, index, use_cuda_graph, max_batch_size, max_num_pages,
                           max_pages_per_request)
        paged.check_page_size("QuestDecode(page_size=...)", page_size)
        if not isinstance(budget_tokens, int) or budget_tokens < page_size:
            raise fail("budget_tokens", f"at least one page ({page_size} tokens)", budget_tokens, "Raise the budget.")
        if budget_tokens >= 2 ** 31:  # (the select kernel takes the budget's pages as int32)
            raise fail("budget_tokens", "fewer than 2^31 tokens (the kernels' lengths are 32-bit)", budget_tokens,
                       "A budget past every request's length keeps every page: pass the longest context.")
        if index.summary_shape[1:] != (spec.num_kv_heads, spec.head_dim_qk):
            raise fail("QuestIndex shape", f"[pages, {spec.num_kv_heads}, {spec.head_dim_qk}] (the spec's KV heads, "
                       "head_dim)", list(index.summary_shape), "Build the index for this model.")
        device = checks.cuda_device(decode_kwargs.get("device"), type(self).__name__, host_ok=True)
        if index.kmin.device != device:  # the scoring kernel reads the summaries by address
            raise fail("QuestIndex device", f"the wrapper's device {device}", index.kmin.device,
                       "Build the index with device= the GPU that decodes.")
        self.index, self.page_size, self.spec = index, page_size, spec
        self.budget_pages = budget_tokens // page_size
        # whole_items also under CUDA graphs: every request longer than the budget keeps the same number of
        # pages, so a batch of ~one (request, KV head) per SM reads each selection whole on one CTA
        decode_kwargs.setdefault("whole_items", True)
        self.decode = BatchDecode(spec, use_cuda_graph=use_cuda_graph, max_batch_size=max_batch_size,
                                  max_num_pages=max_num_pages + 1, **decode_kwargs)  # +1: _select's dump slot
        self.decode.launch_after_own_kernel = True  # right after the selection: a PDL launch
        self.device = self.decode.device
        self.use_cuda_graph = use_cuda_graph
        self.max_pages_per_request = max_pages_per_request
        self.kernel = QuestScoreKernel(spec.q_dtype, index.format, spec.head_dim_qk, spec.num_kv_heads,
                                       spec.group_size)
        n = max_num_pages
        # the plan's int32 arrays: regions of one device buffer, filled through two reused pinned buffers
        # (StagedUpload): a plan copies only the extents it filled and waits only for the copy of two plans ago
        self._regions = self._plan_regions(max_batch_size, n)
        end = max(start + size for start, size in self._regions.values())
        self._upload = StagedUpload(end, self.device)
        self._meta, self._indptr, self._sel_indptr, self._pages = (self._region(name) for name in (
            "meta", "indptr", "sel_indptr", "pages"))  # (pages: all listed pages, +1 a dump slot)
        self._scores = torch.zeros(n, dtype=torch.float32, device=self.device)
        # per request and KV head: the sums of the group's positive and negative query values
        self._q_split = torch.zeros(2, max_batch_size, spec.num_kv_heads, spec.head_dim_qk, dtype=torch.float32,
                                    device=self.device)
        self._channel_scale = index.channel_scale_table(self.device)  # folded into the query sums
        # int4 summaries: the sums as int8 (in _q_split's bytes) and their scale per request and KV head
        self._q_scale = torch.zeros(max_batch_size * spec.num_kv_heads, 2, dtype=torch.float32, device=self.device)
        self._planned = None
        ops.handle(self)  # (its name in compiled graphs: attnforge.ops)

    def _plan_selection(self, kv_indptr, kv_indices, kv_last_page_len, rows_per_request: int = 1):
        """The host side of plan(): the validated page table, the row width of the selection and, per
        selection row (rows_per_request consecutive rows per request), the selection's CSR offsets and
        last-page lengths: every kept page is full except the last, which is always kept."""
        from .. import paged
        name = type(self).__name__
        table = paged.from_csr(kv_indptr, kv_indices, kv_last_page_len, self.page_size)
        n = len(table.indices)
        index_pages = self.index.summary_shape[0] // rows_per_request  # (a per-head view has a row per head)
        if n and table.max_page_index >= index_pages:  # the scoring kernel reads each listed page's summary
            raise fail("plan: page ids", f"below the QuestIndex's {index_pages} pages", table.max_page_index,
                       f"Build the QuestIndex with one summary per cache page, or list only pages below {index_pages}.")
        if n * rows_per_request > len(self._scores):
            raise fail("plan: number of pages", f"at most max_num_pages={len(self._scores) // rows_per_request}", n,
                       f"Construct {name} with a larger max_num_pages.")
        counts = np.diff(table.indptr)
        width = self.max_pages_per_request if self.use_cuda_graph else max(int(counts.max(initial=1)), 1)
        if counts.max(initial=0) > width:
            raise fail("plan: pages of one request", f"at most max_pages_per_request={width}", int(counts.max()),
                       f"Construct {name} with a larger max_pages_per_request.")
        keep = np.repeat(np.minimum(counts, self.budget_pages), rows_per_request)
        sel_indptr = np.concatenate([[0], np.cumsum(keep)])
        last = np.repeat(np.where(counts > 0, table.kv_len - (counts - 1) * self.page_size, 0), rows_per_request)
        return table, width, sel_indptr, last

    def plan(self, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
        """The step's page table (host arrays). sm_scale, k_scale and v_scale are the decode's (BatchDecode.plan:
        an fp8 cache's per-tensor scales); the selection ranks pages by their summaries alone."""
        table, width, sel_indptr, last = self._plan_selection(kv_indptr, kv_indices, kv_last_page_len)
        self.decode._captured.check(table.max_page_index)  # (the decode plans placeholder ids; these are the real ones)
        b, n = table.batch_size, len(table.indices)
        self.decode.plan(sel_indptr, np.zeros(int(sel_indptr[-1]), dtype=np.int32), last, page_size=self.page_size,
                         sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        self.decode._plan["max_page"] = table.max_page_index  # run() checks the cache against the real ids
        self._stage({"meta": (b, n), "indptr": table.indptr, "sel_indptr": sel_indptr[:-1], "pages": table.indices})
        self._planned = {"batch": b, "width": width}

    # -- the plan's device buffer ----------------------------------------------------------------------
    def _plan_regions(self, max_batch_size: int, max_num_pages: int) -> dict:
        """name -> (start, size) in int32 values, each region 16-byte aligned (the kernels read them in
        vectors); the small arrays first, so one copy can cover them."""
        sizes = {"meta": 2, "indptr": max_batch_size + 1, "sel_indptr": max_batch_size, "pages": max_num_pages + 1,
                 **self._extra_regions(max_batch_size, max_num_pages)}
        regions, start = {}, 0
        for name, size in sizes.items():
            regions[name] = (start, size)
            start += -(-size // 4) * 4
        return regions

    def _extra_regions(self, max_batch_size: int, max_num_pages: int) -> dict:
        """Regions a subclass adds after the pages (QuestHeadDecode: the page table before its expansion)."""
        return {}

    def _stage(self, values: dict) -> None:
        """Copy each named array into the start of its region: one pinned buffer filled, the filled extents
        copied (two plans in flight at most: host() waits for the copy of two plans ago)."""
        pieces = []
        for name, (start, size) in self._regions.items():
            if name in values:
                if len(values[name]) > size:  # a planner bug, not a user error (plan() checks the capacities first)
                    raise ValueError(f"{type(self).__name__}: {len(values[name])} values for the {size}-value "
                                     f"region {name}")
                pieces.append((start, values[name]))
        self._upload.stage(pieces)

    def _region(self, name: str) -> torch.Tensor:
        start, size = self._regions[name]
        return self._upload.dev[start:start + size]

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """Quest bound of every listed page of the plan, [max_num_pages] float32 (the kernel)."""
        from ..jit import registry
        from ..kernels.quest import SCORE_THREADS
        if self._planned is None:
            raise RuntimeError(f"{type(self).__name__}.scores: call plan(...) first (once per step, outside "
                               "graph capture).")
        self.decode._check_q(q)  # the kernels read q's rows in 16-byte vectors, batch as planned
        lib = registry.get_library(self.kernel, self.kernel.module, self.device)
        params = self.kernel.params.pack(q=q.data_ptr(), kmin=self.index.kmin.data_ptr(),
                                         kmax=self.index.kmax.data_ptr(), kv_indptr=self._indptr.data_ptr(),
                                         kv_indices=self._pages.data_ptr(), meta=self._meta.data_ptr(),
                                         scores=self._scores.data_ptr(), q_pos=self._q_split[0].data_ptr(),
                                         q_neg=self._q_split[1].data_ptr(), q_stride_b=q.stride(0),
                                         q_stride_h=q.stride(1), q_scale=self._q_scale.data_ptr(),
                                         channel_scale=self._channel_scale.data_ptr(),
                                         scale_rows=self._channel_scale.shape[0])
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        with on_device(self.device):
            self._upload.order_run()  # (after a plan copied on another stream)
            lib["quest_qsplit_kernel"].launch((sms,), (256,), params)  # grid-stride over the batch's values
            lib["quest_score_kernel"].launch((sms * self.kernel.score_ctas_per_sm,), (SCORE_THREADS,), params,
                                             pdl=True)  # waits for P / N in-kernel
        return self._scores

    def _select(self, scores: torch.Tensor) -> None:
        """Top pages per request, in order, written into the decode wrapper's device page table."""
        if self.select == "torch":
            return self._select_torch(scores)
        if self._planned["batch"] == 0:
            return
        from ..jit import registry
        from ..kernels.quest import SELECT_THREADS
        lib = registry.get_library(self.kernel, self.kernel.module, self.device)
        params = self.kernel.select_params.pack(
            scores=scores.data_ptr(), kv_indptr=self._indptr.data_ptr(), kv_indices=self._pages.data_ptr(),
            meta=self._meta.data_ptr(), sel_indptr=self._sel_indptr.data_ptr(),
            out_indices=self._selection_out().data_ptr(), budget_pages=self.budget_pages)
        with on_device(self.device):
            lib["quest_select_kernel"].launch((self._planned["batch"],), (SELECT_THREADS,), params,
                                              pdl=True)  # waits for the scores in-kernel

    def _select_torch(self, scores: torch.Tensor) -> None:
        """The same selection with torch ops (topk over a [batch, width] view): the reference path."""
        b, width = self._planned["batch"], self._planned["width"]
        k = min(self.budget_pages, width)
        start, end = self._indptr[:b].long(), self._indptr[1:b + 1].long()
        counts = end - start
        pos = torch.arange(width, device=self.device)[None, :]
        flat = (start[:, None] + pos).clamp(max=len(self._scores) - 1)
        padded = torch.where(pos < counts[:, None], scores[flat], -math.inf)
        padded = torch.where(pos == (counts - 1)[:, None], math.inf, padded)  # the last page is always kept
        top = torch.topk(padded, k, dim=1).indices.sort(dim=1).values  # [B, k], original order
        valid = top < counts[:, None]  # padding sorts after the real pages
        dump = self.decode.max_num_pages - 1  # one slot past any plan's pages: invalid entries land there
        dst = torch.where(valid, self._sel_indptr[:b, None] + torch.arange(k, device=self.device)[None, :], dump)
        src = self._pages[torch.gather(flat, 1, top)]
        self._selection_out().scatter_(0, dst.flatten(), src.flatten())

    def _selection_out(self) -> torch.Tensor:
        """Where the selected page ids go: the decode wrapper's device page table."""
        return self.decode._device_region("kv_indices")

    def run(self, q: torch.Tensor, kv_cache, out=None, return_lse: bool = False):
        checks.check_untracked("QuestDecode.run", ("q", q), ("kv_cache", kv_cache), ("out", out))
        if ops.compiling():  # scoring, selection and decode as one custom op (attnforge.ops)
            return ops.compiled_run(self, self._planned is not None, [q, *paged.cache_list(kv_cache)], out, None,
                                    return_lse)
        if self._planned is None:
            raise RuntimeError("QuestDecode.run: call plan(...) first (once per step, outside graph capture).")
        self.decode.check_inputs(q, kv_cache, out)  # all of run()'s inputs, before the scoring launches
        self._select(self.scores(q))
        return self.decode.run(q, kv_cache, out=out, return_lse=return_lse)

    def _op_out_shape(self, args: list):  # (attnforge::run's fake)
        return ops.rows_out_shape(self.spec, args)

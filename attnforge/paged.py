"""Page-table inputs: validation and conversion to the CSR form the kernels read (host side)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from . import checks
from .checks import fail


def host_int_array(name: str, x, widen: bool = True) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            raise fail(name, "a host (CPU) int array: plan() reads it without syncing the GPU",
                       f"a tensor on {x.device}", f"Pass {name}.cpu() (keep a host copy in the engine).")
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise fail(f"{name}.dtype", "an integer array", arr.dtype, f"Pass int32 values for {name}.")
    return arr.astype(np.int64, copy=False) if widen else arr


def preview(arr: np.ndarray, n: int = 8):
    """An index array's first n entries for an error message; a scalar as it is (slicing one raises)."""
    return arr[:n] if arr.ndim else arr


class PageTable(NamedTuple):  # (immutable, and built in a third of a frozen dataclass's time: plan()'s path)
    indptr: np.ndarray  # [B + 1]
    indices: np.ndarray  # [indptr[-1]]
    kv_len: np.ndarray  # [B]
    page_size: int
    max_index: Optional[int] = None  # the largest page id, when the checks already found it

    @property
    def batch_size(self) -> int:
        return len(self.kv_len)

    @property
    def max_page_index(self) -> int:
        if self.max_index is not None:
            return self.max_index
        return int(self.indices.max()) if len(self.indices) else -1


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _max_page_id(indices: np.ndarray) -> int:
    """The largest page id in one pass that also catches negatives (viewed as unsigned, a negative id
    outranks every valid one); a negative result is the smallest id, for the error. -1 when empty."""
    if not len(indices):
        return -1
    if indices.dtype.kind == "u":
        return int(np.maximum.reduce(indices))
    top = int(np.maximum.reduce(indices.view(_UNSIGNED[indices.dtype.itemsize])))  # (reduce: .max()'s wrapper
    # costs ~0.3 us on plan()'s path, as does building the dtype from its name)
    return int(indices.min()) if top >= 1 << (8 * indices.dtype.itemsize - 1) else top


def check_page_size(name: str, page_size) -> None:
    """An int >= 1 (numpy's ints too): a float or bool would pass `>= 1` and turn every length computed from it
    into floats, and the folded checks of from_csr would then blame kv_last_page_len."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise fail(name, "an int >= 1 (tokens per page)", repr(page_size),
                   "Pass the cache's tokens per page as an int.")


def from_csr(kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> PageTable:
    check_page_size("page_size", page_size)
    indptr = host_int_array("kv_indptr", kv_indptr)
    indices = host_int_array("kv_indices", kv_indices, widen=False)  # only scanned: no widening copy
    last = host_int_array("kv_last_page_len", kv_last_page_len)
    if indptr.ndim != 1 or len(indptr) < 1 or indptr[0] != 0:
        raise fail("kv_indptr", "a 1-D array [B+1] starting at 0", preview(indptr, 4), "Build it as a prefix sum.")
    batch = len(indptr) - 1
    if last.shape != (batch,):
        raise fail("kv_last_page_len", f"shape [{batch}] (one per request)", list(last.shape),
                   "Pass one entry per request.")
    # plan() is on the decode step's path and each numpy call costs ~1 us on 256-entry arrays, so the
    # checks are folded: one unsigned maximum tests 0 <= page_size - last < page_size where a request
    # has pages, and, where it has none, its page count (0 passes, a negative one is huge as unsigned)
    pages = indptr[1:] - indptr[:-1]  # (np.diff costs 3x this in Python overhead)
    probe = np.where(pages > 0, page_size - last, pages)
    if np.maximum.reduce(probe.view(np.uint64), initial=0) >= page_size:
        _raise_bad_pages(indptr, pages, last, page_size)
    if indices.ndim != 1:
        raise fail("kv_indices", "a 1-D array of page ids", f"shape {list(indices.shape)}", "Flatten it (CSR order).")
    if len(indices) != indptr[-1]:
        raise fail("kv_indices", f"kv_indptr[-1]={indptr[-1]} entries", len(indices),
                   "kv_indices must list exactly the pages kv_indptr counts.")
    top = _max_page_id(indices)  # one pass: the check below and the plan's bound on the cache
    if len(indices) and top < 0:
        raise fail("kv_indices", "page ids >= 0", top, "Fix the page table.")
    kv_len = pages * page_size
    kv_len -= probe  # (pages - 1) * page_size + last where a request has pages, 0 where it has none
    return PageTable(indptr, indices, kv_len, page_size, top)


def _raise_bad_pages(indptr: np.ndarray, pages: np.ndarray, last: np.ndarray, page_size: int):
    """The specific error behind a failed folded check of from_csr."""
    if pages.min() < 0:
        bad = int(np.argmax(pages < 0))
        raise fail("kv_indptr", "non-decreasing values", f"kv_indptr[{bad}]={indptr[bad]} > "
                   f"kv_indptr[{bad + 1}]={indptr[bad + 1]}", "Pages per request must be >= 0.")
    b = int(np.argmax((pages > 0) & ((last < 1) | (last > page_size))))
    raise fail(f"kv_last_page_len[{b}]", f"a value in [1, page_size={page_size}]", int(last[b]),
               "A request's last page holds between 1 and page_size tokens.")


def from_either_form(kv_indptr, kv_indices, kv_last_page_len, seq_lens, block_table, page_size: int) -> PageTable:
    """A plan's page table from one of its two forms: the CSR arrays (FlashInfer's), or per-request lengths and a
    block table (vLLM's: seq_lens= and block_table=). Both at once, or a form in part, is refused."""
    csr = (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len))
    if block_table is None and seq_lens is None:
        if kv_indptr is None or kv_indices is None or kv_last_page_len is None:  # (plan()'s path: tests, no list)
            missing = ", ".join(n for n, x in csr if x is None)
            raise TypeError(f"plan: expected kv_indptr, kv_indices and kv_last_page_len (or seq_lens= and "
                            f"block_table=), got None for {missing}. Pass the page table's host arrays.")
        return from_csr(kv_indptr, kv_indices, kv_last_page_len, page_size)
    given = [n for n, x in csr if x is not None]
    if given:
        raise TypeError(f"plan: expected either the CSR arrays or seq_lens= and block_table=, got both ("
                        f"{', '.join(given)} beside them). Pass one form of the page table.")
    return from_block_table(seq_lens, block_table, page_size)


def from_block_table(seq_lens, block_table, page_size: int) -> PageTable:
    """vLLM's form: per-request lengths [B] and a block table [B, max_pages]."""
    check_page_size("page_size", page_size)
    lens = host_int_array("seq_lens", seq_lens)
    table = host_int_array("block_table", block_table, widen=False)  # only gathered: no widening copy of every slot
    if lens.ndim != 1:
        raise fail("seq_lens", "a 1-D array [B] of KV lengths", f"shape {list(lens.shape)}",
                   "Pass one length a request.")
    if table.ndim != 2 or table.shape[0] != len(lens):
        raise fail("block_table.shape", f"[B={len(lens)}, max_pages]", list(table.shape),
                   "One row of page ids per request.")
    if np.any(lens < 0):
        raise fail("seq_lens", "lengths >= 0", int(lens.min()), "Fix the lengths.")
    pages = -(-lens // page_size)
    if np.any(pages > table.shape[1]):
        b = int(np.argmax(pages > table.shape[1]))
        raise fail(f"seq_lens[{b}]", f"at most {table.shape[1] * page_size} tokens (block_table width "
                   f"{table.shape[1]} x page_size {page_size})", int(lens[b]), "Widen the block table.")
    indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    # row b's first pages[b] slots, request order, by a mask over the columns some request uses: vLLM's tables are as
    # wide as the longest context the engine allows (B256 of 64 pages in 512 slots: 108 -> 26 us)
    used = int(pages.max(initial=0))
    if len(pages) and int(pages.min()) == used:  # every request the same pages: the columns as they are
        indices = table[:, :used].reshape(-1)
    else:  # (the B x used mask compared in 16 bits where the widths allow: B256 of up to 512 pages 78 -> 15 us)
        narrow = np.int16 if used < 1 << 15 else np.int64
        indices = table[:, :used][np.arange(used, dtype=narrow) < pages.astype(narrow)[:, None]]
    # lengths and offsets are valid by construction; the page ids as from_csr checks them (one pass)
    top = _max_page_id(indices)
    if len(indices) and top < 0:
        raise fail("block_table", "page ids >= 0 in the slots seq_lens uses", top, "Fix the block table.")
    return PageTable(indptr, indices, lens.copy(), page_size, top)  # (a copy: lens may be the caller's array)


def split_cache(s, kv_cache, ps: int, max_page: int, device: torch.device):
    """A paged cache (one [P, 2, ...] tensor or a (K, V) pair) -> K, V views and their strides."""
    if isinstance(kv_cache, torch.Tensor):
        checks.check_cuda("kv_cache", kv_cache, device)
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise checks.fail("kv_cache.shape", "[P, 2, page, Hkv, D] (NHD) or [P, 2, Hkv, page, D] (HND)",
                              list(kv_cache.shape), "Or pass a (K, V) pair of 4-D tensors.")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k, v = kv_cache
    else:
        raise checks.fail("kv_cache", "a 5-D tensor or a (K, V) pair", type(kv_cache).__name__,
                          "See BatchDecode.run's docstring.")
    shape = (None, ps, s.num_kv_heads, s.head_dim_qk) if s.kv_layout == "NHD" else \
        (None, s.num_kv_heads, ps, s.head_dim_qk)
    meaning = "[pages, page_size, Hkv, D] (NHD)" if s.kv_layout == "NHD" else "[pages, Hkv, page_size, D] (HND)"
    for name, t in (("k_cache", k), ("v_cache", v)):
        checks.check_cuda(name, t, device)
        checks.check_dtype(name, t, (checks.TORCH_DTYPES[s.kv_dtype],))
        checks.check_shape(name, t, shape, meaning)
        checks.check_contiguous_last(name, t)
        checks.check_aligned_rows(name, t)  # the kernels copy rows as 16-byte vectors
    if k.stride() != v.stride() or k.shape[0] != v.shape[0]:
        raise checks.fail("kv_cache", "K and V with the same shape and strides",
                          f"{list(k.shape)}/{k.stride()} vs {list(v.shape)}/{v.stride()}", "Allocate them alike.")
    check_page_bound(max_page, k.shape[0])
    tok, head = (1, 2) if s.kv_layout == "NHD" else (2, 1)
    return k, v, k.stride(0), k.stride(tok), k.stride(head)


class CapturedPages:
    """In a graph-mode wrapper, the fewest pages of any cache a captured run() read: a replay reads that cache
    with no run() to check the page ids, so every later plan's ids must index it (plan() calls check)."""

    def __init__(self):
        self.pages: Optional[int] = None

    def note(self, use_cuda_graph: bool, num_pages: int) -> None:
        """A run's cache (its pages), kept where the run is being captured."""
        if use_cuda_graph and torch.cuda.is_current_stream_capturing():
            self.pages = num_pages if self.pages is None else min(self.pages, num_pages)

    def check(self, max_page: int) -> None:
        if self.pages is not None and max_page >= self.pages:
            raise fail("kv_indices", f"page ids < {self.pages} (the pages of the cache a captured graph reads)",
                       f"max id {max_page}", "Capture the graph over a cache holding every page a plan may name.")


def check_page_bound(max_page: int, num_pages: int, cache: str = "the cache") -> None:
    """The plan's largest page id must index the cache passed to run()."""
    if max_page >= num_pages:
        raise checks.fail("kv_indices", f"page ids < {num_pages} (pages in {cache})", f"max id {max_page}",
                          "Fix the page table or pass the right cache.")


def cache_list(kv) -> list:
    """A run's K/V argument as a flat list (attnforge::run's arguments): a cache alone, or a (K, V) pair's two."""
    return list(kv) if isinstance(kv, (tuple, list)) else [kv]

"""Page-table inputs: validation and conversion to the CSR form the kernels read (host side)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checks import fail


def host_int_array(name: str, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            raise fail(name, "a host (CPU) int array: plan() reads it without syncing the GPU",
                       f"a tensor on {x.device}", f"Pass {name}.cpu() (keep a host copy in the engine).")
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise fail(f"{name}.dtype", "an integer array", arr.dtype, f"Pass int32 values for {name}.")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class PageTable:
    indptr: np.ndarray  # [B + 1]
    indices: np.ndarray  # [indptr[-1]]
    kv_len: np.ndarray  # [B]
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.kv_len)

    @property
    def max_page_index(self) -> int:
        return int(self.indices.max()) if len(self.indices) else -1


def from_csr(kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> PageTable:
    indptr = host_int_array("kv_indptr", kv_indptr)
    indices = host_int_array("kv_indices", kv_indices)
    last = host_int_array("kv_last_page_len", kv_last_page_len)
    if indptr.ndim != 1 or len(indptr) < 1 or indptr[0] != 0:
        raise fail("kv_indptr", "a 1-D array [B+1] starting at 0", indptr[:4], "Build it as a prefix sum.")
    if np.any(np.diff(indptr) < 0):
        bad = int(np.argmax(np.diff(indptr) < 0))
        raise fail("kv_indptr", "non-decreasing values", f"kv_indptr[{bad}]={indptr[bad]} > "
                   f"kv_indptr[{bad + 1}]={indptr[bad + 1]}", "Pages per request must be >= 0.")
    if indices.ndim != 1 or len(indices) != indptr[-1]:
        raise fail("kv_indices", f"kv_indptr[-1]={indptr[-1]} entries", len(indices),
                   "kv_indices must list exactly the pages kv_indptr counts.")
    if len(indices) and indices.min() < 0:
        raise fail("kv_indices", "page ids >= 0", int(indices.min()), "Fix the page table.")
    batch = len(indptr) - 1
    if last.shape != (batch,):
        raise fail("kv_last_page_len", f"shape [{batch}] (one per request)", list(last.shape),
                   "Pass one entry per request.")
    pages = np.diff(indptr)
    used = pages > 0
    if np.any(used & ((last < 1) | (last > page_size))):
        b = int(np.argmax(used & ((last < 1) | (last > page_size))))
        raise fail(f"kv_last_page_len[{b}]", f"a value in [1, page_size={page_size}]", int(last[b]),
                   "A request's last page holds between 1 and page_size tokens.")
    kv_len = np.where(used, (pages - 1) * page_size + last, 0)
    return PageTable(indptr, indices, kv_len, page_size)


def from_block_table(seq_lens, block_table, page_size: int) -> PageTable:
    """vLLM's form: per-request lengths [B] and a block table [B, max_pages]."""
    lens = host_int_array("seq_lens", seq_lens)
    table = host_int_array("block_table", block_table)
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
    indices = table[np.arange(table.shape[1])[None, :] < pages[:, None]]  # row-major: request order
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
    return from_csr(indptr, indices, last, page_size)

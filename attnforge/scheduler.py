"""Split-KV planner: balanced work for persistent CTAs, in fixed-capacity int32 arrays.

Every (request, kv head) is an item whose cost is its KV tokens plus a fixed cost per chunk
(query load, pipeline fill, merge). Items are laid end to end on one "work stream" and the
stream is cut into `num_ctas` equal spans; an item crossing a cut is split into chunks there.
Each CTA therefore carries the mean load plus at most one extra fixed cost, however skewed the
batch. Chunks of a split item get consecutive partial slots that the merge kernel combines.

Host-only (numpy); no device synchronisation. All outputs fit capacities fixed at construction,
so a CUDA graph captured once stays valid for every later plan of the same batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_FIXED_COST = 64  # token-equivalents per chunk: q load + pipeline fill + merge (see perf-notes)
MIN_SPAN = 192  # smallest per-CTA span: splitting shorter work costs more than it saves
ITEM_FIELDS = 5  # request, kv_head, kv_begin, kv_end, partial_slot


@dataclass(frozen=True)
class Capacity:
    max_batch_size: int
    num_kv_heads: int
    num_ctas: int

    @property
    def max_items(self) -> int:  # each of the num_ctas - 1 cuts adds at most one chunk
        return self.max_batch_size * self.num_kv_heads + self.num_ctas - 1

    @property
    def max_partial_slots(self) -> int:  # a split item has <= cuts + 1 chunks; cuts <= num_ctas - 1
        return 2 * max(self.num_ctas - 1, 1)


@dataclass
class DecodePlan:
    work_indptr: np.ndarray  # [num_ctas + 1]: CTA c runs items work_indptr[c] .. work_indptr[c+1]
    work_items: np.ndarray  # [num_items, 5]
    merge_indptr: np.ndarray  # [B * Hkv + 1] over partial slots (0 slots: written directly)
    num_partial_slots: int

    def cta_loads(self, fixed_cost: int = CHUNK_FIXED_COST) -> np.ndarray:
        tokens = self.work_items[:, 3] - self.work_items[:, 2] + fixed_cost
        return np.add.reduceat(np.append(tokens, 0), self.work_indptr[:-1]) * \
            (np.diff(self.work_indptr) > 0)


def plan_decode(kv_begin: np.ndarray, kv_end: np.ndarray, num_kv_heads: int, cap: Capacity) -> DecodePlan:
    """kv_begin/kv_end: [B] token range each request must attend (begin > 0 under a sliding window)."""
    batch = len(kv_end)
    if batch > cap.max_batch_size:
        raise ValueError(f"plan: batch size {batch} exceeds max_batch_size={cap.max_batch_size} given at "
                         "construction; build the wrapper with a larger max_batch_size.")
    n_items = batch * num_kv_heads
    begin = np.repeat(kv_begin.astype(np.int64), num_kv_heads)  # item = request * Hkv + head
    length = np.repeat((kv_end - kv_begin).astype(np.int64), num_kv_heads)
    cost = length + CHUNK_FIXED_COST
    start = np.zeros(n_items + 1, dtype=np.int64)
    np.cumsum(cost, out=start[1:])
    total = int(start[-1])
    span = max(-(-total // cap.num_ctas), MIN_SPAN + CHUNK_FIXED_COST)

    # Cuts: stream positions span, 2*span, ...; a cut inside an item's tokens splits it there.
    cuts = np.arange(span, total, span, dtype=np.int64)
    cut_item = np.searchsorted(start, cuts, side="right") - 1
    cut_off = cuts - start[cut_item] - CHUNK_FIXED_COST
    keep = (cut_off > 0) & (cut_off < length[cut_item])
    cut_item, cut_off, cut_pos = cut_item[keep], cut_off[keep], cuts[keep]

    # Chunks in stream order: item i's first chunk, then its cuts. Both lists are sorted, so the
    # merged order is computed directly (no sort): cut j lands at index cut_item[j] + j + 1.
    n_cuts = len(cut_item)
    n_chunks = n_items + n_cuts
    items_range = np.arange(n_items)
    cuts_before = np.searchsorted(cut_item, items_range, side="left")  # cuts in items < i
    first_idx = items_range + cuts_before
    cut_idx = cut_item + np.arange(1, n_cuts + 1)
    chunk_item = np.empty(n_chunks, dtype=np.int64)
    chunk_off = np.zeros(n_chunks, dtype=np.int64)
    token_pos = np.empty(n_chunks, dtype=np.int64)  # stream position of the chunk's first token
    chunk_item[first_idx] = items_range
    chunk_item[cut_idx] = cut_item
    chunk_off[cut_idx] = cut_off
    token_pos[first_idx] = start[:-1] + np.where(length > 0, CHUNK_FIXED_COST, 0)
    token_pos[cut_idx] = cut_pos
    chunk_end = np.empty(n_chunks, dtype=np.int64)
    chunk_end[:-1] = chunk_off[1:]
    chunk_end[first_idx - 1] = length[items_range - 1]  # the chunk before an item's first is its item's last
    chunk_end[-1] = length[-1] if n_items else 0

    cta = np.minimum(token_pos // span, cap.num_ctas - 1)  # non-decreasing along chunks
    work_indptr = np.searchsorted(cta, np.arange(cap.num_ctas + 1), side="left").astype(np.int32)

    pieces = 1 + np.diff(np.append(cuts_before, n_cuts))
    merge_indptr = np.zeros(n_items + 1, dtype=np.int64)
    np.cumsum(np.where(pieces > 1, pieces, 0), out=merge_indptr[1:])
    rank = np.zeros(n_chunks, dtype=np.int64)
    rank[cut_idx] = np.arange(1, n_cuts + 1) - cuts_before[cut_item]
    partial_slot = np.where(pieces[chunk_item] > 1, merge_indptr[chunk_item] + rank, -1)

    items = np.empty((n_chunks, ITEM_FIELDS), dtype=np.int32)
    items[:, 0] = chunk_item // num_kv_heads
    items[:, 1] = chunk_item % num_kv_heads
    items[:, 2] = begin[chunk_item] + chunk_off
    items[:, 3] = begin[chunk_item] + chunk_end
    items[:, 4] = partial_slot
    if n_chunks > cap.max_items or merge_indptr[-1] > cap.max_partial_slots:  # guarded by construction
        raise AssertionError(f"planner exceeded its capacity: {n_chunks} items, {merge_indptr[-1]} slots")
    return DecodePlan(work_indptr, items, merge_indptr.astype(np.int32), int(merge_indptr[-1]))

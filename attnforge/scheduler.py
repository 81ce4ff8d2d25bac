"""Split-KV planner: a balanced "work stream" for persistent CTAs (stream-K for decode).

Every (request, kv head) is an item of cost  tokens + CHUNK_FIXED_COST  (the fixed part stands for
loading q, filling the pipeline and merging). Items are laid end to end, request-major, on one
stream of length `total`; CTA c owns the stream positions [c*span, (c+1)*span). A token belongs to
the CTA whose span holds its stream position, so an item crossing a span boundary is split into
chunks there, and every CTA carries at most `span` tokens plus one fixed cost, however skewed the
batch. An empty item (no tokens) belongs to the CTA holding its start; it writes zeros and -inf.

The host computes only per-request prefix sums and `span`; the kernel walks its own span with
the same rules (templates/batch_decode.cu.jinja, attnforge/work_stream.cuh), so plan() is a few
vector operations and one async copy. `expand` below re-derives every chunk in Python exactly
as the kernel does; the CPU tests check its properties.

With `snap` > 0 a boundary k*span that falls within snap positions of the start or end of an item
moves there (span_cuts): CTA c owns [cut(c), cut(c+1)) instead, and an item is split only by the cuts
strictly inside its tokens, so short items are not split into slivers that each pay a chunk's fixed
cost, a partial state and a merge.

A chunk of a split item writes a partial state to slot 2*cta + (1 if the chunk starts its item
else 0): a CTA holds at most one continuation chunk and at most one chunk that starts a split
item, so slots never collide; the merge kernel recomputes the slots of each split item.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

CHUNK_FIXED_COST = 64  # token-equivalents per chunk (see docs/perf-notes.md)
MIN_SPAN = 192  # smallest per-CTA span in tokens: splitting shorter work costs more than it saves
# Spans aligned to equal items may grow by up to this much (token-equivalents): the second chunk a
# straddling span pays. Measured on the H200 (thirteenth session, B16 L8192 in rotation): aligned spans
# 83 tokens longer won 1.4% (GQA 32/8), 20-41 longer 2.6-18% (32/4, 32/2, MQA); 662 longer lost 0.9% (L65536)
ALIGN_SLACK = 2 * CHUNK_FIXED_COST
# Items whose costs differ by at most this much count as equal for aligned spans, each padded to the
# costliest: Quest's selections differ by their last pages' fill
EQUAL_ITEM_TOLERANCE = CHUNK_FIXED_COST
# Span boundaries this close (token-equivalents) to an item's start or end move there (plan_stream's
# snap), on batches where that pays (snap_pays): 128 beat 192 and 256 on two random short batches
SPAN_SNAP = 128
# A kernel of one CTA per SM that reads each item whole (BatchDecode(whole_items=...)) may leave SMs idle
# for that: its span may grow by this fraction of itself. Measured on the H200 (twenty-first session,
# benchmarks/bench_decode_whole_items.py): 128 equal items on 132 SMs (+3.1%) won 1.4-8.2% over the
# default three CTAs per SM; 120 on 132 (+10%) lost 4.7%, 96 on 132 (+37%) 29%
WHOLE_ITEM_SLACK = 0.04


class StreamPlan(NamedTuple):  # (immutable, and built in a third of a frozen dataclass's time: plan()'s path)
    prefix: np.ndarray  # [B + 1] stream position where request r's first item starts
    kv_begin: np.ndarray  # [B]
    kv_end: np.ndarray  # [B]
    num_kv_heads: int
    num_ctas: int
    span: int
    total: int
    snap: int = 0  # 0, or CHUNK_FIXED_COST <= snap < span / 2: see span_cuts
    longest: int = -1  # the most tokens any item reads (kv_end - kv_begin), found while planning; -1: not known

    @property
    def batch_size(self) -> int:
        return len(self.kv_end)

    @property
    def num_spans(self) -> int:  # spans holding work (the kernel's CTAs past them find none)
        return -(-self.total // self.span)


_ZERO_BEGINS: dict = {}


def zero_begins(batch: int) -> np.ndarray:
    """kv_begin for a batch without a window: a shared read-only int64 zeros [batch], built once a batch size
    (plan()'s path: np.zeros and its subtraction cost ~1 us a plan; plan_stream knows it by identity)."""
    zeros = _ZERO_BEGINS.get(batch)
    if zeros is None:
        if len(_ZERO_BEGINS) > 4096:  # (an engine sees at most its max batch size of them)
            _ZERO_BEGINS.clear()
        zeros = _ZERO_BEGINS[batch] = np.zeros(batch, dtype=np.int64)
        zeros.flags.writeable = False
    return zeros


def plan_stream(kv_begin: np.ndarray, kv_end: np.ndarray, num_kv_heads: int, num_ctas: int,
                align_equal_items: bool = False, align_slack: int = ALIGN_SLACK, snap: int = 0,
                snap_where_it_pays: bool = True, whole_items_per_span: bool = False,
                align_fraction: float = 0.0, align_tile: int = 0) -> StreamPlan:
    """kv_begin/kv_end [B]: the token range each request attends (begin > 0 under a sliding window).
    align_equal_items: when every item costs the same (within EQUAL_ITEM_TOLERANCE: each is padded to the
    costliest) and there are at most num_ctas of them, cut each
    into chunks = num_ctas // items equal chunks: span = cost / chunks rounded up, and every item
    padded to chunks * span stream positions, so each span holds one chunk of one item (B16 L8192 GQA
    32/8: 384 one-chunk spans instead of 396, most of them two chunks; unpadded, the rounding drifted
    the boundaries into the next item's tokens: Quest's B16 L4096 got 63 chunks of 1-63 tokens) --
    where that lengthens the span by less than ALIGN_SLACK: a straddling span pays a second chunk's
    fixed cost, an aligned one leaves num_ctas % items CTAs idle (B16 L65536: +662 tokens a span, +0.9%).
    align_slack: that bound in the kernel's tokens (MLA's tokens weigh more than decode's);
    align_fraction: or this fraction of the even span, where that is more (kernels whose chunks cost more).
    align_tile: with aligned chunks, the aligned span rounded up to a multiple of this (the kernel's KV tile,
    which must divide CHUNK_FIXED_COST) where that still fits the slack: every cut then falls on a tile
    boundary of its item, so no chunk ends in a partial tile that its neighbour also reads. Two chunks of
    B64 L8192 (MLA) were 4064 + 4128 tokens, 64 + 65 tiles of 64; rounded, 4096 + 4096.
    snap: span boundaries within this many positions of an item's start or end move there (span_cuts);
    0 for none, else at least CHUNK_FIXED_COST, and capped below span / 2 (aligned plans need none).
    snap_where_it_pays: apply it only to batches of unequal items that each fit a span (snap_pays).
    whole_items_per_span: with align_equal_items, equal items that outnumber the CTAs go ceil(items /
    num_ctas) whole to a span (each padded to the costliest) where that lengthens the span by less than
    align_slack: no item is split, so none is merged (MLA's 64-row blocks, whose chunks cost most).
    An item's stream length (its stride) is what the kernel reads back: (prefix[r+1] - prefix[r]) / heads."""
    if align_tile and (not isinstance(align_tile, int) or align_tile < 0 or CHUNK_FIXED_COST % align_tile):
        raise ValueError(f"plan_stream(align_tile=...) (BatchMLADecode.align_tile): expected 0 or a positive divisor "
                         f"of CHUNK_FIXED_COST={CHUNK_FIXED_COST} (the kernel's KV tile), got {align_tile!r}; set it "
                         f"to None for the kernel's tile, or 0 to leave cuts unrounded")
    if snap and not (isinstance(snap, int) and snap >= CHUNK_FIXED_COST):
        raise ValueError(f"plan_stream(snap=...): expected 0 or an int >= {CHUNK_FIXED_COST} (the fixed cost), "
                         f"got {snap!r}; pass 0 for uncut span boundaries or scheduler.SPAN_SNAP")
    if kv_begin is _ZERO_BEGINS.get(len(kv_end)):  # (no window: one vector op, not two)
        item_cost = kv_end + CHUNK_FIXED_COST
    else:
        item_cost = kv_end - kv_begin
        item_cost += CHUNK_FIXED_COST
    prefix = np.zeros(len(kv_end) + 1, dtype=np.int64)
    np.add.accumulate(item_cost * num_kv_heads, out=prefix[1:])  # (np.cumsum: 2.5x the call overhead)
    total = int(prefix[-1])
    if total >= 2**31:
        raise ValueError(f"plan: {total} token-heads in one batch exceed the int32 stream; split the batch")
    costliest = int(np.maximum.reduce(item_cost, initial=0))  # once: the branches, snap_pays and `longest`
    longest = costliest - CHUNK_FIXED_COST if len(item_cost) else -1
    span = max(-(-total // num_ctas), MIN_SPAN + CHUNK_FIXED_COST)
    align_slack = max(align_slack, int(align_fraction * span))
    items = len(kv_end) * num_kv_heads
    if align_equal_items and 0 < items <= num_ctas and _equal_costs(item_cost, costliest):
        chunks = num_ctas // items
        aligned = max(-(-costliest // chunks), MIN_SPAN + CHUNK_FIXED_COST)
        rounded = -(-aligned // align_tile) * align_tile if align_tile > 0 else aligned
        if aligned < costliest and rounded - span < align_slack:  # (items cut in chunks)
            aligned = rounded  # cut k at token k * aligned - CHUNK_FIXED_COST: a multiple of the tile
        if aligned - span < align_slack:
            np.multiply(np.arange(len(kv_end) + 1), num_kv_heads * chunks * aligned, out=prefix)
            return StreamPlan(prefix, kv_begin, kv_end, num_kv_heads, num_ctas, aligned, int(prefix[-1]),
                              longest=longest)
    elif align_equal_items and whole_items_per_span and items > num_ctas and _equal_costs(item_cost, costliest):
        stride = costliest  # every item padded to the costliest: span boundaries fall between items
        aligned = max(-(-items // num_ctas), -(-(MIN_SPAN + CHUNK_FIXED_COST) // stride)) * stride
        if aligned - span < align_slack:
            np.multiply(np.arange(len(kv_end) + 1), num_kv_heads * stride, out=prefix)
            return StreamPlan(prefix, kv_begin, kv_end, num_kv_heads, num_ctas, aligned, int(prefix[-1]),
                              longest=longest)
    if snap_where_it_pays and not snap_pays(costliest, span, total // max(items, 1)):
        snap = 0
    # cuts stay increasing: each moves by less than half a span (span >= MIN_SPAN + CHUNK_FIXED_COST keeps
    # the cap at or above CHUNK_FIXED_COST)
    return StreamPlan(prefix, kv_begin, kv_end, num_kv_heads, num_ctas, span, total, min(snap, (span - 1) // 2),
                      longest)


def _equal_costs(item_cost: np.ndarray, costliest: int) -> bool:
    """Every item within EQUAL_ITEM_TOLERANCE of the costliest (np.ptp costs three times one reduction)."""
    return costliest - int(np.minimum.reduce(item_cost)) <= EQUAL_ITEM_TOLERANCE


def snap_pays(costliest: int, span: int, mean_cost: int) -> bool:
    """Whether snapped cuts were measured to gain on a batch like this (H200, twenty-fourth session, in
    rotation against none): unequal items (the costliest more than EQUAL_ITEM_TOLERANCE above the mean:
    one reduction, not two, on plan()'s path) that each fit a span, where a boundary often leaves a
    sliver (random 64-1024 and 100-1500 tokens: -1.2..-1.6% at 128). Equal items are split evenly
    already and lost up to +0.9% (B200 L700, B256 L512); beside items longer than a span the moved cuts
    unbalanced the CTAs (B32 of 100-4000 tokens +0.6..+2.2%, skew mixed)."""
    return costliest <= span and costliest - mean_cost > EQUAL_ITEM_TOLERANCE


def span_cuts(plan: StreamPlan) -> np.ndarray:
    """[num_spans + 1] stream positions where the CTAs' shares start (and the last ends): k*span, or with
    plan.snap the start of the item that position falls in when at most snap after it, else its end when
    at most snap before it (work_stream.cuh: span_cut)."""
    cuts = np.minimum(np.arange(plan.num_spans + 1, dtype=np.int64) * plan.span, plan.total)
    if plan.snap and plan.num_spans > 1:
        b = cuts[1:-1]
        r = np.searchsorted(plan.prefix, b, side="right") - 1
        stride = (plan.prefix[r + 1] - plan.prefix[r]) // plan.num_kv_heads
        s = plan.prefix[r] + np.minimum((b - plan.prefix[r]) // stride, plan.num_kv_heads - 1) * stride
        cuts[1:-1] = np.where(b - s <= plan.snap, s, np.where(s + stride - b <= plan.snap, s + stride, b))
    return cuts


def in_whole_item_band(items: int, num_ctas: int, max_chunks: int = 1) -> bool:
    """Whether `items` items, each cut into k = num_ctas // items equal chunks (k <= max_chunks; 1: read
    whole), could fill one of `num_ctas` CTAs each within WHOLE_ITEM_SLACK (before planning)."""
    if not 0 < items <= num_ctas:
        return False
    chunks = num_ctas // items
    return chunks <= max_chunks and num_ctas <= items * chunks * (1 + WHOLE_ITEM_SLACK)


def plan_whole_items(kv_begin: np.ndarray, kv_end: np.ndarray, num_kv_heads: int, num_ctas: int) -> StreamPlan:
    """plan_stream for a one-CTA-per-SM kernel: spans aligned to whole (near-)equal items, or to equal
    chunks of them where items x chunks ~ num_ctas, where that grows the span by at most WHOLE_ITEM_SLACK;
    else the plain stream (aligned_chunks tells which)."""
    return plan_stream(kv_begin, kv_end, num_kv_heads, num_ctas, align_equal_items=True,
                       align_fraction=WHOLE_ITEM_SLACK)


def aligned_chunks(plan: StreamPlan) -> int:
    """k where every item fills exactly k spans of its own (so each span holds one chunk of one item, and
    only k > 1 merges), else 0."""
    if plan.batch_size == 0:
        return 0
    strides = np.diff(plan.prefix)
    k = int(strides[0]) // (plan.num_kv_heads * plan.span)
    return k if k > 0 and bool((strides == k * plan.num_kv_heads * plan.span).all()) else 0


def is_whole_item_plan(plan: StreamPlan) -> bool:
    """Every item in one span of its own (so no item is split, and nothing merges)."""
    return aligned_chunks(plan) == 1


# Decode merges split items in a second launch (BatchDecode's merge_launch) where an item's merge on the first
# kernel's tail (one CTA) would read more partial rows (chunks x the item's query heads) than this
MERGE_LAUNCH_ROWS = 512


def longest_merge_rows(plan: StreamPlan, item_heads: int) -> int:
    """An upper bound on the partial rows (chunks x query heads) one split item's merge reads: the longest
    item's chunks of a span each, plus one at each end where it straddles span boundaries."""
    if plan.batch_size == 0:
        return 0
    return (longest_item(plan) // plan.span + 2) * item_heads


def longest_item(plan: StreamPlan) -> int:
    """The most tokens any of the plan's items reads (0 for an empty batch)."""
    if plan.longest >= 0:
        return plan.longest
    return int((plan.kv_end - plan.kv_begin).max()) if plan.batch_size else 0


def item_stride(plan: StreamPlan, request: int) -> int:
    """Stream positions of each of the request's items: its cost, or more when spans are aligned."""
    return int(plan.prefix[request + 1] - plan.prefix[request]) // plan.num_kv_heads


def expand(plan: StreamPlan) -> np.ndarray:
    """Every chunk, as the kernel derives it: rows (cta, request, kv_head, kv_lo, kv_hi, slot)."""
    rows = []
    cuts = span_cuts(plan)

    def owner(x: int) -> int:  # the CTA holding stream position x
        return int(np.searchsorted(cuts, x, side="right")) - 1

    for r in range(plan.batch_size):
        n, stride = int(plan.kv_end[r] - plan.kv_begin[r]), item_stride(plan, r)
        for h in range(plan.num_kv_heads):
            s = int(plan.prefix[r]) + h * stride
            if n == 0:
                rows.append((owner(s), r, h, int(plan.kv_begin[r]), int(plan.kv_begin[r]), -1))
                continue
            lo, hi = s + CHUNK_FIXED_COST, s + CHUNK_FIXED_COST + n
            first, last = owner(lo), owner(hi - 1)
            for cta in range(first, last + 1):
                a, b = max(lo, int(cuts[cta])), min(hi, int(cuts[cta + 1]))
                slot = -1 if first == last else 2 * cta + (1 if a == lo else 0)
                rows.append((cta, r, h, int(plan.kv_begin[r]) + a - lo, int(plan.kv_begin[r]) + b - lo, slot))
    return np.array(rows, dtype=np.int64).reshape(-1, 6)


def cta_loads(chunks: np.ndarray, num_ctas: int) -> np.ndarray:
    return np.bincount(chunks[:, 0], weights=chunks[:, 4] - chunks[:, 3] + CHUNK_FIXED_COST, minlength=num_ctas)


def split_slots(plan: StreamPlan, request: int, kv_head: int) -> list[int]:
    """The partial slots the merge kernel reads for one item ([] when the item is whole)."""
    n = int(plan.kv_end[request] - plan.kv_begin[request])
    if n == 0:
        return []
    stride = item_stride(plan, request)
    lo, hi = _cuttable_tokens(plan, int(plan.prefix[request]) + kv_head * stride, stride, n)
    first, last = int(lo) // plan.span, (int(hi) - 1) // plan.span if hi > lo else 0  # boundaries k*span in (lo, hi)
    return [] if first >= last else [2 * c + (1 if c == first else 0) for c in range(first, last + 1)]


def has_split_items(plan: StreamPlan) -> bool:
    """Whether any item is cut over more than one CTA: split_slots for every item at once (MLA launches
    its merge kernel only then, outside CUDA graphs)."""
    if plan.batch_size == 0:
        return False
    if plan.longest > 0:  # (known from plan_stream): an item whose cuttable tokens outrun a span is cut wherever
        # it starts. Those tokens' least extent: its tokens, less what snapping takes at each end (_cuttable_tokens
        # with the item's stride at its least, cost). Most of MLA's plans answer here, not over every item (~20 us).
        n = plan.longest
        least = n if not plan.snap else n + CHUNK_FIXED_COST - plan.snap - max(CHUNK_FIXED_COST, plan.snap)
        if least > plan.span:
            return True
    return _split_anywhere(plan)


def _split_anywhere(plan: StreamPlan) -> bool:
    """has_split_items over every item: [B] arrays where a request is one item (MLA), [B, H] otherwise."""
    n = np.asarray(plan.kv_end - plan.kv_begin, dtype=np.int64)
    first = plan.prefix[:-1]
    stride = plan.prefix[1:] - first  # (int64: plan_stream's prefix)
    if plan.num_kv_heads > 1:
        stride //= plan.num_kv_heads
        n, stride = n[:, None], stride[:, None]
        first = first[:, None] + np.arange(plan.num_kv_heads)[None, :] * stride
    lo, hi = _cuttable_tokens(plan, first, stride, n)
    # a boundary falls strictly inside [lo, hi) where the first one past lo comes before hi (also none where hi <= lo)
    return bool((((lo // plan.span + 1) * plan.span < hi) & (n > 0)).any())


def _cuttable_tokens(plan: StreamPlan, s, stride, n):
    """[lo, hi): the stream positions of the tokens of the item at s (ints or arrays) where a span
    boundary splits it; with plan.snap, cuts within snap of the item's ends moved there
    (work_stream.cuh: item_ctas)."""
    lo, hi = s + CHUNK_FIXED_COST, s + CHUNK_FIXED_COST + n
    if plan.snap:
        lo, hi = np.maximum(lo, s + plan.snap), np.minimum(hi, s + stride - plan.snap)
    return lo, hi


def prefill_work(qo_len: np.ndarray, kv_len: np.ndarray, group: int, num_kv_heads: int, tile_q: int,
                 causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Prefill work items, one per (request, kv head, tile_q packed query rows), and their costs.

    Packed row r of a request is (token r // group, head r % group) of one KV head. Returns work
    [N, 3] = (request, kv_head, first packed row) and cost [N] = the KV tokens the item reads (causal:
    up to its last token's position, queries aligned to the end of the keys). Unsorted.
    """
    tiles = prefill_tiles(qo_len, group, tile_q)
    # one entry per (request, query tile), then the kv heads as the innermost axis: [tiles, heads]
    req = np.repeat(np.arange(len(qo_len)), tiles)
    row0 = (np.arange(len(req)) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * tile_q
    kv = kv_len[req]
    if causal:  # up to the tile's last token, queries end-aligned: kv - qo + min(qo - 1, last row's token) + 1
        qo = qo_len[req]
        cost = kv - qo + 1 + np.minimum(qo - 1, (row0 + (tile_q - 1)) // group)
        np.minimum(cost, kv, out=cost)
    else:
        cost = kv
    work = np.empty((len(req), num_kv_heads, 3), dtype=np.int64)
    work[:, :, 0] = req[:, None]
    work[:, :, 1] = np.arange(num_kv_heads)
    work[:, :, 2] = row0[:, None]
    return work.reshape(-1, 3), np.repeat(cost, num_kv_heads)


def prefill_tiles(qo_len: np.ndarray, group: int, tile_q: int) -> np.ndarray:
    """[B] query tiles of each request: its qo_len * group packed rows in tiles of tile_q."""
    return -(-(qo_len * group) // tile_q)


PREFILL_ITEM_FIXED_COST = 2  # an item's fixed cost, x tile_q token-equivalents (load Q, write O: the 2*qo term)
MIN_PREFILL_CHUNK_TILES = 4  # a split chunk covers at least this many KV tiles (prologue and merge amortised)
SPLIT_SLACK = 1.1  # a chunk may exceed the fair share by this much before an item is cut once more


@dataclass(frozen=True)
class PrefillSplit:
    work: np.ndarray  # [N, 6] int64: request, kv head, first packed row, kv_begin, kv_end, slot
    num_slots: int  # partial states per query row (1: no item was split, outputs go straight to out)
    chunk: int  # the longest chunk in KV tokens (0: no split)


_ROW_HALF = np.dtype((np.void, 24))  # three int64 values as one element
_WHOLE_ITEM_TAIL = np.array([0, 2**31 - 1, 0], dtype=np.int64).view(_ROW_HALF)[0]  # kv_begin, kv_end, slot


def unsplit_prefill_work(work: np.ndarray) -> PrefillSplit:
    """Every item [N, 3] whole: an unbounded KV chunk, slot 0 (rows written straight to the output)."""
    n = len(work)
    if n < 256:  # (a short plan's numpy calls cost more than its values: 128 items 2.1 against 2.4 us)
        out = np.zeros((n, 6), np.int64)
        out[:, :3] = work
        out[:, 4] = 2**31 - 1
        return PrefillSplit(out, 1, 0)
    out = np.empty((n, 6), np.int64)
    # each row's halves as 24-byte elements: two element copies a row, not six strided values (8192 items: -64%)
    halves = out.view(_ROW_HALF).reshape(n, 2)
    halves[:, 0] = np.ascontiguousarray(work, dtype=np.int64).view(_ROW_HALF).reshape(n)
    halves[:, 1] = _WHOLE_ITEM_TAIL
    return PrefillSplit(out, 1, 0)


def _kv_tiles(kv_hi: np.ndarray, tile_kv: int) -> np.ndarray:
    """KV tiles of ranges [0, kv_hi) (a causal item's range may be empty: kv < q)."""
    return -(-np.maximum(kv_hi, 0) // tile_kv)


def _share_tiles(kv_tiles: int, items: int, tile_q: int, tile_kv: int, num_ctas: int) -> float:
    """split_prefill_work's longest chunk in KV tiles: SPLIT_SLACK x the fair share of the batch's cost (its items'
    kv_tiles plus PREFILL_ITEM_FIXED_COST * tile_q an item), at least MIN_PREFILL_CHUNK_TILES."""
    total = kv_tiles * tile_kv + PREFILL_ITEM_FIXED_COST * tile_q * items
    return max(SPLIT_SLACK * total / max(num_ctas, 1) / tile_kv, MIN_PREFILL_CHUNK_TILES)


def prefill_items_fit_one_share(tile_kv_hi: np.ndarray, heads: int, tile_q: int, tile_kv: int, num_ctas: int) -> bool:
    """split_prefill_work's first test, whether no item is cut, for prefill_work's own items whose KV ranges start
    at 0 (no window), from their query tiles: every head of tile p reads [0, tile_kv_hi[p]). A heads-th of the
    values, so a plan that cuts nothing (most) skips the test over every item (B16 S2048: ~25 us)."""
    if len(tile_kv_hi) == 0:
        return True
    tiles = _kv_tiles(tile_kv_hi, tile_kv)
    share_tiles = _share_tiles(int(tiles.sum()) * heads, len(tiles) * heads, tile_q, tile_kv, num_ctas)
    return math.ceil(int(tiles.max()) / share_tiles) <= 1


def split_prefill_work(work: np.ndarray, kv_hi: np.ndarray, kv_lo: Optional[np.ndarray], tile_q: int, tile_kv: int,
                       num_ctas: int) -> PrefillSplit:
    """Split prefill items [N, 3] whose KV range [kv_lo, kv_hi) exceeds a fair share of the GPU.

    The fair share is the batch's total cost (KV tokens plus PREFILL_ITEM_FIXED_COST * tile_q per
    item: the issue's 2*qo + kv) over `num_ctas`. An item is cut into the fewest equal, tile-aligned
    chunks of at most SPLIT_SLACK x the share (and at least MIN_PREFILL_CHUNK_TILES tiles), counted
    from its own tile-aligned start: a 2.05-share item becomes two chunks, not two and a sliver that
    would start a second wave. Chunk c of an item writes partial slot c, merged afterwards by LSE.
    When no item is cut every item writes its rows directly (slot 0, range unbounded). Input order is
    kept; the chunks of one item are adjacent. kv_lo None: every range starts at 0.
    """
    n = len(work)
    if kv_lo is None:
        lo, tiles = 0, _kv_tiles(kv_hi, tile_kv)
    else:
        lo = (kv_lo // tile_kv) * tile_kv
        tiles = -(-(np.maximum(kv_hi, lo) - lo) // tile_kv)
    share_tiles = _share_tiles(int(tiles.sum()), n, tile_q, tile_kv, num_ctas)
    if n == 0 or math.ceil(int(tiles.max()) / share_tiles) <= 1:  # (the costliest item's count: one test)
        return unsplit_prefill_work(work)
    if kv_lo is None:
        lo = np.zeros(n, dtype=np.int64)
    pieces = np.maximum(np.ceil(tiles / share_tiles).astype(np.int64), 1)
    per_chunk = -(-tiles // pieces)  # tiles per chunk of each item
    pieces = np.maximum(-(-tiles // np.maximum(per_chunk, 1)), 1)  # rounding may leave a chunk empty: drop it
    item = np.repeat(np.arange(n), pieces)
    slot = np.arange(len(item)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    begin = lo[item] + slot * per_chunk[item] * tile_kv
    end = np.minimum(begin + per_chunk[item] * tile_kv, np.maximum(kv_hi[item], lo[item]))
    out = np.column_stack([np.take(work, item, axis=0), begin, end, slot]).astype(np.int64)
    return PrefillSplit(out, int(pieces.max()), int(per_chunk.max()) * tile_kv)


WORK_ORDERS = ("longest_first", "grouped")


def balance_persistent_rounds(cost: np.ndarray, ctas: int) -> np.ndarray:
    """A permutation of items (in launch order, with their costs) for a persistent grid, where CTA b
    runs positions b, b + ctas, b + 2 ctas, ...: round r (positions [r ctas, (r + 1) ctas)) keeps the
    items it had, so the launch order's locality holds, but within it the costliest item goes to the
    CTA with the least work so far (longest processing time first, round by round). Static round-robin
    on a causal batch gave some CTAs whole rounds of the longest items (B1 S8192: 1128 vs 911 us
    for one CTA per item)."""
    n = len(cost)
    if n <= ctas:  # one round on idle CTAs: costliest first is the whole answer (no trade changes a load)
        return np.argsort(-cost, kind="stable")
    full, m = divmod(n, ctas)  # whole rounds, then a last one with positions for CTAs 0..m-1 only
    rounds = cost[:full * ctas].reshape(full, ctas)
    base = np.arange(full)[:, None] * ctas
    # each round's items, costliest first (one call), as positions in cost (a flat gather: half take_along_axis's)
    items = np.argsort(-rounds, axis=1, kind="stable") + base
    takers, load = _least_loaded_takers(cost[items], ctas)
    perm = np.empty(n, dtype=np.int64)
    perm[(base + takers).reshape(-1)] = items.reshape(-1)
    if m:
        last = full * ctas + np.argsort(-cost[full * ctas:], kind="stable")
        perm[full * ctas + np.argsort(load[:m], kind="stable")] = last
    return _swap_within_rounds(perm, cost, ctas)


def _least_loaded_takers(item_cost: np.ndarray, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy's rounds: takers[r] lists the CTAs least loaded first (ties by CTA index) as round r starts,
    the r-th round's items (costliest first) going to them in that order; and the loads after the last round.
    The loads carry from round to round. Integer costs (the planners'): each CTA is one int64 key, load * ctas +
    index, so one in-place sort a round orders the CTAs as a stable sort of their loads does, and a round's costs
    (times ctas) add to the keys in the sorted order without moving the index: 2.4x faster than an argsort and a
    scatter-add a round (ragged 16 random: 138 rounds, 0.93 -> 0.38 ms on the CI machine), the same takers."""
    full = item_cost.shape[0]
    bound = int(item_cost.max()) * item_cost.size if full else 0  # a load's bound (no numpy sum to wrap)
    integral = np.issubdtype(item_cost.dtype, np.integer) and (
        full == 0 or (int(item_cost.min()) >= 0 and bound < 2**53 and (bound + 1) * ctas < 2**62))
    if integral:  # (loads exact in float64 as the other form's, and every key fits int64)
        keys = np.empty((full, ctas), dtype=np.int64)
        step = item_cost.astype(np.int64) * ctas
        rows, steps = list(keys), list(step)  # (row views made once: an index costs a call a round)
        key = np.arange(ctas, dtype=np.int64)  # every load 0 (sorted)
        if full:
            rows[0][:] = key
        for r in range(1, full):  # round r's keys written in place, then sorted there: two calls a round (-7%)
            np.add(key, steps[r - 1], out=rows[r])
            key = rows[r]
            key.sort()
        if full:
            key = key + steps[-1]  # the loads after the last round
        load = np.empty(ctas, dtype=np.float64)
        load[key % ctas] = key // ctas
        return keys % ctas, load
    takers = np.empty((full, ctas), dtype=np.int64)
    load = np.zeros(ctas, dtype=np.float64)
    for r in range(full):  # two numpy calls a round
        takers[r] = np.argsort(load, kind="stable")  # least loaded first
        load[takers[r]] += item_cost[r]
    return takers, load


SWAP_PASSES = 4  # x ctas trades at most (each ~5-10 us: two numpy scans and a loop over the rounds)
SWAP_SLACK = 0.005  # the most loaded CTA's excess over the mean load that is left alone
SWAP_VECTOR_ROUNDS = 40  # from this many rounds a trade's scan is one numpy expression (the crossover, CI machine)


def _swap_within_rounds(perm: np.ndarray, cost: np.ndarray, ctas: int) -> np.ndarray:
    """Refine a round-by-round greedy assignment: while the most loaded CTA can trade one of its
    items for a cheaper one of the least loaded CTA in the same round (so the rounds, and the launch
    order's locality, stay as they are), trade the pair that best halves their gap. The greedy
    leaves B1 S8192 (causal, 2048 items on 132 CTAs) 2.4% above the mean load; the trades, < 1%."""
    n = len(perm)
    full = n // ctas  # whole rounds; the last, partial one keeps its prefix of CTAs as it is
    if full == 0:
        return perm
    grid = perm[:full * ctas].reshape(full, ctas).copy()  # grid[r, b]: the item CTA b runs in round r
    c = cost[grid]
    load = c.sum(axis=0)
    if n > full * ctas:
        load[:n - full * ctas] += cost[perm[full * ctas:]]
    # stop within this of the mean (load.mean()'s value: its float64 sum over the count, without its wrapper's ~3 us)
    good_enough = (1 + SWAP_SLACK) * (np.add.reduce(load, dtype=np.float64) / len(load))
    # cols[b][r]: CTA b's item cost in round r; a few rounds scan faster in Python than through numpy calls,
    # many (a ragged batch: 138) as one array op (the same pick: the first round of the least |d - gap / 2|)
    vector = full >= SWAP_VECTOR_ROUNDS
    cols = np.ascontiguousarray(c.T) if vector else c.T.tolist()
    # the loads also as Python numbers (read without numpy's scalar calls); numpy's copy finds the extremes
    values = load.tolist()
    trades = []  # (round, a, b) in order, applied to the grid after the loop
    for _ in range(SWAP_PASSES * ctas):
        a, b = int(load.argmax()), int(load.argmin())
        top = values[a]
        if top <= good_enough:
            break
        gap = top - values[b]
        half, best, r = gap / 2, math.inf, -1
        if vector:
            d = cols[a] - cols[b]  # a trade in round i moves d[i] from a to b
            miss = np.abs(d - half)
            miss[(d <= 0) | (d >= gap)] = math.inf
            r = int(miss.argmin())
            r = r if miss[r] < math.inf else -1
        else:
            for i, (ca, cb) in enumerate(zip(cols[a], cols[b])):
                d = ca - cb
                if 0 < d < gap and abs(d - half) < best:
                    best, r = abs(d - half), i
        if r < 0:
            break
        trades.append((r, a, b))
        d = cols[a][r] - cols[b][r]  # what the trade moves from a to b
        cols[a][r], cols[b][r] = cols[b][r], cols[a][r]
        load[a] = values[a] = values[a] - d
        load[b] = values[b] = values[b] + d
    for r, a, b in trades:
        grid[r, a], grid[r, b] = grid[r, b], grid[r, a]
    out = perm.copy()
    out[:full * ctas] = grid.reshape(-1)
    return out


def order_prefill_work(work: np.ndarray, cost: np.ndarray, mode: str) -> np.ndarray:
    """A launch order (a permutation) of prefill items [N, >= 2] (request, kv head, ...).

    longest_first: by cost, descending (stable): the shortest tail, but the CTAs resident at one time
        work on many different (request, kv head) K/V streams, so a batch whose K/V outgrows the L2
        re-reads each stream's prefix from HBM for every query tile.
    grouped: the items of one (request, kv head) adjacent, longest first within it (as FA3 launches
        m-blocks), groups ordered by their longest item: resident CTAs share their K/V through the L2,
        and the tail is still short items.
    """
    if mode == "longest_first":
        return np.argsort(-cost, kind="stable")
    if mode != "grouped":
        raise ValueError(f"order_prefill_work: mode must be one of {WORK_ORDERS}, got {mode!r}")
    if len(work) == 0:
        return np.zeros(0, dtype=np.int64)
    # the (request, kv head) key itself names the group: ordered as its rank would be, no np.unique needed
    group = work[:, 0].astype(np.int64) * (int(work[:, 1].max()) + 1) + work[:, 1]
    group_max = np.zeros(int(group.max()) + 1, dtype=np.int64)
    np.maximum.at(group_max, group, cost)
    # longest group first, then by group, then longest item first: as one stable sort of a composite key
    # (integer costs, 512+ items: 2-3x faster than the three-key lexsort, whose order it gives; fewer calls below)
    if len(cost) >= 512 and np.issubdtype(cost.dtype, np.integer):
        top = int(cost.max())
        span = top - min(int(cost.min()), 0) + 1
        if len(group_max) * span < 2**62:  # (the key fits int64)
            rank = np.empty(len(group_max), dtype=np.int64)  # of each group in (longest item desc, key asc) order
            rank[np.lexsort((np.arange(len(group_max)), -group_max))] = np.arange(len(group_max))
            return np.argsort(rank[group] * span + (top - cost), kind="stable")
    return np.lexsort((-cost, group, -group_max[group]))  # (last key primary)


GROUPED_BY_TILES_MIN = 512  # items from which grouped_order_by_tiles beats order_prefill_work (CI machine: 8 items
# 21 against 6 us; 8192 items 44 against 123)


def grouped_order_by_tiles(tiles: np.ndarray, tile_cost: np.ndarray, heads: int) -> np.ndarray:
    """order_prefill_work(work, cost, "grouped") for prefill_work's own items (integer costs), from their tiles alone.

    prefill_work lays item p * heads + h out as query tile p (request-major: tiles [B] a request) of KV head h, and
    every head of a tile costs the same, tile_cost[p]. So a request's groups (one per head) share its longest item
    and are adjacent in the order, heads ascending, each its tiles costliest first. One stable sort of the T tiles
    and one gather of the T * heads items give what order_prefill_work's sort of every item gives (B16 S2048:
    123 -> 44 us on the CI machine; 16 random requests of 128-8192 tokens: 277 -> 68)."""
    t = len(tile_cost)
    if t == 0:
        return np.zeros(0, dtype=np.int64)
    has = tiles > 0
    counts = tiles[has]  # the requests with tiles, in request order
    first = np.cumsum(counts) - counts
    longest = np.maximum.reduceat(tile_cost, first)  # each request's costliest tile
    by_longest = np.argsort(-longest, kind="stable")  # requests: longest item first, then by index
    rank = np.empty(len(longest), dtype=np.int64)
    rank[by_longest] = np.arange(len(longest))
    top = int(longest.max())
    span = top - min(int(tile_cost.min()), 0) + 1
    # tiles: by their request's rank, then costliest first (stable: ties by tile index), as one integer key where
    # it fits int64, else by the lexsort of the two keys (the same order)
    if len(longest) * span < 2**62:
        tile_order = np.argsort(np.repeat(rank * span, counts) + (top - tile_cost), kind="stable")
    else:
        tile_order = np.lexsort((-tile_cost, np.repeat(rank, counts)))
    block = counts[by_longest]  # request blocks of tile_order
    block_start = np.cumsum(block) - block
    # items[h, i] = item of tile tile_order[i] and head h; the order reads, block by block, each head's run of the
    # block's tiles: runs (block, head) are contiguous ranges of items' rows, gathered by one index array
    items = (tile_order * heads)[None, :] + np.arange(heads)[:, None]
    run_len = np.repeat(block, heads)
    run_src = (np.arange(heads)[None, :] * t + block_start[:, None]).ravel()
    run_dst = np.cumsum(run_len) - run_len
    return items.ravel()[np.arange(t * heads) + np.repeat(run_src - run_dst, run_len)]

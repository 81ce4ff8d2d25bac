"""Planner properties on random and skewed batches (CPU). `expand` derives chunks exactly as the
kernel's WorkStream does, and `split_slots` as its merge kernel does."""
import math

import numpy as np
import pytest

from attnforge import scheduler
from attnforge.scheduler import CHUNK_FIXED_COST, MIN_SPAN, cta_loads, expand, plan_stream, split_slots

HKV, CTAS = 8, 264


def plan(lengths, begin=None, hkv=HKV, ctas=CTAS, snap=0):
    end = np.asarray(lengths, dtype=np.int64)
    begin = np.zeros_like(end) if begin is None else np.asarray(begin, dtype=np.int64)
    p = plan_stream(begin, end, hkv, ctas, snap=snap, snap_where_it_pays=False)  # the mechanism on every batch
    return p, expand(p)


SNAPS = [0, CHUNK_FIXED_COST, 288]  # none, the least, and half a 512-token item's stride


def batches():
    rng = np.random.default_rng(0)
    yield "skew", [65536] + [512] * 127
    yield "single-long", [131072]
    yield "single-short", [3]
    yield "equal", [4096] * 64
    yield "with-empty", [0, 1, 0, 17, 1000, 0]
    yield "all-empty", [0, 0, 0]
    for i in range(8):
        yield f"random{i}", rng.integers(0, 40000, size=int(rng.integers(1, 300))).tolist()


CASES = list(batches())


def groups(chunks):
    out = {}
    for cta, r, h, lo, hi, slot in chunks.tolist():
        out.setdefault((r, h), []).append((lo, hi, slot, cta))
    return out


@pytest.mark.parametrize("snap", SNAPS)
@pytest.mark.parametrize("name,lengths", CASES)
def test_every_token_covered_exactly_once(name, lengths, snap):
    p, chunks = plan(lengths, snap=snap)
    g = groups(chunks)
    assert set(g) == {(r, h) for r in range(len(lengths)) for h in range(HKV)}
    for (r, h), parts in g.items():
        spans = sorted((lo, hi) for lo, hi, _, _ in parts)
        assert spans[0][0] == 0 and spans[-1][1] == lengths[r], (name, r, h)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        assert all(lo < hi for lo, hi in spans) or spans == [(0, 0)]  # only empty items are empty


@pytest.mark.parametrize("snap", SNAPS)
@pytest.mark.parametrize("name,lengths", CASES)
def test_load_balance(name, lengths, snap):
    p, chunks = plan(lengths, snap=snap)
    loads = cta_loads(chunks, CTAS)
    assert loads.max() <= p.span + 2 * p.snap + 2 * CHUNK_FIXED_COST, name  # by construction of the spans
    if p.total >= CTAS * (MIN_SPAN + CHUNK_FIXED_COST):  # enough work for every CTA
        chunk = int((chunks[:, 4] - chunks[:, 3]).max()) + CHUNK_FIXED_COST
        assert loads.max() <= 1.1 * loads.mean() + chunk, name
        assert loads.max() <= 1.1 * p.total / CTAS + 2 * CHUNK_FIXED_COST, name


@pytest.mark.parametrize("snap", SNAPS)
@pytest.mark.parametrize("name,lengths", CASES)
def test_slots_unique_bounded_and_match_merge(name, lengths, snap):
    p, chunks = plan(lengths, snap=snap)
    assert chunks[:, 0].max() < CTAS
    slots = chunks[:, 5][chunks[:, 5] >= 0]
    assert len(set(slots.tolist())) == len(slots) and (len(slots) == 0 or slots.max() < 2 * CTAS)
    for (r, h), parts in groups(chunks).items():
        mine = [s for _, _, s, _ in sorted(parts)]
        assert split_slots(p, r, h) == (mine if len(parts) > 1 else []), (name, r, h)
        assert (len(parts) == 1) == (mine == [-1])
    assert scheduler.has_split_items(p) == any(len(parts) > 1 for parts in groups(chunks).values()), name


def test_deterministic():
    lengths = np.random.default_rng(1).integers(1, 20000, size=100)
    a, b = plan(lengths)[1], plan(lengths.copy())[1]
    assert np.array_equal(a, b)


def test_skew_spreads_the_long_request():
    p, chunks = plan([65536] + [512] * 127)
    # the 64K request is half the work, so it must land on about half the CTAs
    assert len(set(chunks[chunks[:, 1] == 0, 0].tolist())) >= 0.45 * CTAS


def test_window_ranges_respected():
    p, chunks = plan([1000, 50, 9000], begin=[500, 0, 8000])
    for cta, r, h, lo, hi, _ in chunks.tolist():
        assert p.kv_begin[r] <= lo <= hi <= p.kv_end[r]


def random_stream_plans(seed: int, n: int):
    """n random (begin, end, kv heads, CTAs, plan_stream options) draws: batch shapes the fixed cases above do not
    combine (windows with aligned spans, snap with whole items per span, tile-rounded cuts, 1 to 528 CTAs)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = int(rng.integers(1, 120))
        end = [rng.integers(0, 50000, b), np.full(b, int(rng.integers(0, 20000))),
               int(rng.integers(1, 9000)) + rng.integers(0, 64, b),  # near-equal (padded to the costliest)
               np.where(rng.random(b) < 0.05, rng.integers(20000, 200000, b), rng.integers(0, 1024, b)),
               rng.integers(0, 300, b)][int(rng.integers(0, 5))].astype(np.int64)
        begin = np.maximum(end - int(rng.integers(1, 5000)), 0) if rng.random() < 0.3 else np.zeros(b, np.int64)
        options = dict(align_equal_items=bool(rng.random() < 0.6), snap=int(rng.choice([0, 64, 128, 288])),
                       snap_where_it_pays=bool(rng.random() < 0.5), whole_items_per_span=bool(rng.random() < 0.3),
                       align_fraction=float(rng.choice([0.0, 0.04])), align_tile=int(rng.choice([0, 16, 32, 64])))
        yield begin, end, int(rng.choice([1, 2, 4, 8, 16])), int(rng.choice([1, 7, 66, 132, 264, 528])), options


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_across_every_option_cover_each_token_once(seed):
    """Every (request, kv head)'s tokens [begin, end) in contiguous chunks, each split item's slots as the merge
    finds them, and slots unique below 2 x CTAs, on 150 random draws per seed (25,500 such draws passed once)."""
    for begin, end, hkv, ctas, options in random_stream_plans(seed, 150):
        p = plan_stream(begin.copy(), end.copy(), hkv, ctas, **options)
        chunks = expand(p)
        g = groups(chunks)
        assert set(g) == {(r, h) for r in range(len(end)) for h in range(hkv)}, options
        for (r, h), parts in g.items():
            spans = sorted((lo, hi) for lo, hi, _, _ in parts)
            assert spans[0][0] == begin[r] and spans[-1][1] == end[r], (r, h, options)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and (len(spans) == 1 or
                                                                             all(lo < hi for lo, hi in spans))
            mine = [s for _, _, s, _ in sorted(parts)]
            assert split_slots(p, r, h) == (mine if len(parts) > 1 else []), (r, h, options)
        slots = chunks[:, 5][chunks[:, 5] >= 0]
        assert chunks[:, 0].max() < ctas and len(set(slots.tolist())) == len(slots) and \
            (len(slots) == 0 or slots.max() < 2 * ctas), options


def test_shared_zero_begins_plan_as_any_zeros_and_cannot_be_written():
    """plan_stream knows scheduler.zero_begins(b) by identity and skips its subtraction: the same plans as from
    a fresh zeros array, on random draws of every option; the shared array is read-only, so no caller can
    turn another plan's begins into nonzero ones."""
    for begin, end, hkv, ctas, options in random_stream_plans(7, 100):
        shared = scheduler.zero_begins(len(end))
        assert scheduler.zero_begins(len(end)) is shared and not shared.any()
        fresh, fast = (plan_stream(b, end.copy(), hkv, ctas, **options) for b in (np.zeros_like(shared), shared))
        assert fast.kv_begin is shared
        for a, b in zip(fresh, fast):
            assert np.array_equal(a, b), options
    with pytest.raises(ValueError, match="read-only"):
        scheduler.zero_begins(3)[0] = 1


def test_stream_overflow_is_an_error():
    with pytest.raises(ValueError, match="int32"):
        plan_stream(np.zeros(2, dtype=np.int64), np.full(2, 2**30), 8, 264)


@pytest.mark.parametrize("group,tile_q", [(1, 64), (4, 128), (8, 128), (3, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_work_covers_every_packed_row_once_with_its_kv_range(group, tile_q, causal):
    rng = np.random.default_rng(group * tile_q + causal)
    qo_len = rng.integers(0, 300, size=9)
    qo_len[0], qo_len[1] = 1, 0
    kv_len = qo_len + rng.integers(0, 500, size=9)  # queries end-aligned: kv_len >= qo_len
    kv_len[2] = 0 if qo_len[2] == 0 else kv_len[2]
    heads = 3
    work, cost = scheduler.prefill_work(qo_len, kv_len, group, heads, tile_q, causal)
    covered = {}
    for (r, h, row0), c in zip(work.tolist(), cost.tolist()):
        rows = range(row0, min(row0 + tile_q, qo_len[r] * group))
        assert len(rows) > 0, "no empty items"
        for pr in rows:
            assert covered.setdefault((r, h, pr), 0) == 0
            covered[(r, h, pr)] = 1
        # brute force: the KV tokens any of the item's rows may see
        last_pos = kv_len[r] - qo_len[r] + (rows[-1] // group)
        assert c == (min(kv_len[r], last_pos + 1) if causal else kv_len[r])
    expected = {(r, h, pr) for r in range(9) for h in range(heads) for pr in range(qo_len[r] * group)}
    assert set(covered) == expected


@pytest.mark.parametrize("num_ctas", [1, 7, 132])
@pytest.mark.parametrize("window", [-1, 300])
def test_prefill_split_covers_each_items_kv_range_once_and_balances(num_ctas, window):
    rng = np.random.default_rng(num_ctas + window)
    tile_q, tile_kv, group, heads = 128, 128, 4, 2
    qo_len = rng.integers(1, 40, size=5)
    kv_len = qo_len + rng.integers(0, 20000, size=5)
    kv_len[1] = qo_len[1]  # nothing before the queries
    work, kv_hi = scheduler.prefill_work(qo_len, kv_len, group, heads, tile_q, causal=True)
    req = work[:, 0]
    kv_lo = (np.maximum(0, kv_len[req] - qo_len[req] + work[:, 2] // group - window) if window >= 0
             else np.zeros(len(work), dtype=np.int64))
    sp = scheduler.split_prefill_work(work, kv_hi, kv_lo, tile_q, tile_kv, num_ctas)
    assert sp.work.shape[1] == 6 and sp.work.dtype == np.int64
    seen = {}
    for r, h, row0, begin, end, slot in sp.work.tolist():
        assert 0 <= slot < sp.num_slots and begin % tile_kv == 0 and begin <= end
        seen.setdefault((r, h, row0), []).append((slot, begin, end))
    assert len(seen) == len(work), "every item keeps at least one chunk"
    for (r, h, row0), lo, hi in zip(work.tolist(), kv_lo.tolist(), kv_hi.tolist()):
        chunks = sorted(seen[(r, h, row0)])
        assert [c[0] for c in chunks] == list(range(len(chunks))), "slots 0..n-1, one per chunk"
        # the chunks tile [lo rounded down to a tile, hi) exactly once (the kernel clamps to its own range)
        start = (lo // tile_kv) * tile_kv
        covered = [t for _, b, e in chunks for t in range(max(b, start), min(e, max(hi, start)))]
        assert covered == list(range(start, max(hi, start)))
        if sp.chunk:
            assert all(e - b <= sp.chunk for _, b, e in chunks)
    if sp.chunk:  # balance: no chunk exceeds the slack-scaled fair share (rounded up to a tile), and
        # an item is never cut into more chunks than that bound needs
        start = (kv_lo // tile_kv) * tile_kv
        tiles = -(-(np.maximum(kv_hi, start) - start) // tile_kv)
        share = (int(tiles.sum()) * tile_kv + scheduler.PREFILL_ITEM_FIXED_COST * tile_q * len(work)) / num_ctas
        bound = max(scheduler.SPLIT_SLACK * share, scheduler.MIN_PREFILL_CHUNK_TILES * tile_kv)
        assert sp.chunk <= bound + tile_kv
        for (r, h, row0), t in zip(work.tolist(), tiles.tolist()):
            assert len(seen[(r, h, row0)]) <= max(1, math.ceil(t * tile_kv / bound))


def test_prefill_split_without_window_starts_every_range_at_zero():
    """kv_lo None (no window: plan()'s usual case, one array fewer) plans as all-zero starts do, including
    causal items with no visible key (fewer keys than queries: a negative KV end)."""
    rng = np.random.default_rng(5)
    split = 0
    for _ in range(300):
        b = int(rng.integers(1, 8))
        qo_len = rng.integers(1, 300, size=b)
        kv_len = qo_len + rng.integers(0, 40000, size=b)
        kv_len[rng.integers(0, b)] = int(rng.integers(0, 200))  # (may be shorter than its queries)
        work, kv_hi = scheduler.prefill_work(qo_len, kv_len, 4, 2, 128, causal=True)
        ctas = int(rng.choice([1, 7, 132]))
        a = scheduler.split_prefill_work(work, kv_hi, None, 128, 64, ctas)
        z = scheduler.split_prefill_work(work, kv_hi, np.zeros(len(work), np.int64), 128, 64, ctas)
        assert (a.work == z.work).all() and (a.num_slots, a.chunk) == (z.num_slots, z.chunk)
        split += a.num_slots > 1
    assert split > 50, "most draws must split, or the comparison covers only the early exit"


def test_prefill_split_leaves_busy_batches_whole():
    qo_len = np.full(4, 8192)
    work, kv_hi = scheduler.prefill_work(qo_len, qo_len, 4, 8, 128, causal=True)
    sp = scheduler.split_prefill_work(work, kv_hi, np.zeros(len(work), np.int64), 128, 128, 132)
    assert (sp.num_slots, sp.chunk) == (1, 0)
    assert (sp.work[:, :3] == work).all() and (sp.work[:, 3] == 0).all() and (sp.work[:, 4] == 2**31 - 1).all()
    # a cascade-like level: 8 query tiles per KV head against 32768 shared tokens is cut in two
    work, kv_hi = scheduler.prefill_work(np.array([256]), np.array([32768]), 4, 8, 128, causal=False)
    sp = scheduler.split_prefill_work(work, kv_hi, np.zeros(len(work), np.int64), 128, 128, 132)
    assert sp.num_slots == 2 and len(sp.work) == 128 and sp.chunk == 16384


@pytest.mark.parametrize("mode", scheduler.WORK_ORDERS)
def test_prefill_orders_are_permutations_with_their_rule(mode):
    rng = np.random.default_rng(3)
    qo_len = rng.integers(1, 3000, size=7)
    work, cost = scheduler.prefill_work(qo_len, qo_len + rng.integers(0, 500, size=7), 4, 3, 128, causal=True)
    order = scheduler.order_prefill_work(work, cost, mode)
    assert sorted(order.tolist()) == list(range(len(work)))
    w, c = work[order], cost[order]
    if mode == "longest_first":
        assert np.all(np.diff(c) <= 0)
        return
    keys = [tuple(x) for x in w[:, :2].tolist()]
    runs = [k for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    assert len(runs) == len(set(keys)), "each (request, kv head) is one contiguous run"
    starts = [i for i in range(len(keys)) if i == 0 or keys[i] != keys[i - 1]] + [len(keys)]
    heads = [c[a] for a in starts[:-1]]
    assert heads == sorted(heads, reverse=True), "groups by their longest item, descending"
    for a, b in zip(starts, starts[1:]):
        assert np.all(np.diff(c[a:b]) <= 0), "longest first within a group"
    assert scheduler.order_prefill_work(work[:0], cost[:0], mode).size == 0
    with pytest.raises(ValueError, match="mode must be one of"):
        scheduler.order_prefill_work(work, cost, "random")


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_grouped_order_is_the_three_key_sort_ties_included(dtype):
    """The grouped order as one sort of a composite key (integer costs) or the lexsort (others): both the
    stable lexsort by (longest item of the group desc, group, cost desc), on batches with tied groups and
    tied items (equal requests; split chunks of equal length)."""
    rng = np.random.default_rng(11)
    sizes = []
    for _ in range(30):
        b, heads = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        qo = rng.choice([64, 128, 640, 2048, 8192], size=b)  # 16-4096 items a batch: both sides of 512
        work, cost = scheduler.prefill_work(qo, qo + rng.choice([0, 256], size=b), 4, heads, 128,
                                            causal=bool(rng.integers(2)))
        cost = (cost // int(rng.choice([1, 512]))).astype(dtype)  # coarse costs: many ties
        group = work[:, 0] * (heads + 1) + work[:, 1]
        group_max = np.zeros(int(group.max()) + 1, dtype)
        np.maximum.at(group_max, group, cost)
        want = np.lexsort((-cost, group, -group_max[group]))
        assert (scheduler.order_prefill_work(work, cost, "grouped") == want).all()
        sizes.append(len(work))
    assert min(sizes) < 512 <= max(sizes), "draws on both sides of the composite key's threshold"
    # 1024 items whose composite key would pass int64: the lexsort again, the same order
    work, cost = scheduler.prefill_work(np.array([8192, 8192]), np.array([8192, 8192]), 4, 2, 128, causal=True)
    huge = (cost + 2**61).astype(dtype)
    group = work[:, 0] * 3 + work[:, 1]
    group_max = np.zeros(int(group.max()) + 1, dtype)
    np.maximum.at(group_max, group, huge)
    assert len(work) >= 512
    assert (scheduler.order_prefill_work(work, huge, "grouped") == np.lexsort((-huge, group, -group_max[group]))).all()


def _cta_loads(cost, ctas):
    """Work per CTA when CTA b runs positions b, b + ctas, ... of a launch order."""
    return np.bincount(np.arange(len(cost)) % ctas, weights=cost, minlength=ctas)


@pytest.mark.parametrize("lengths,ctas", [([8192], 132), ([2048] * 16, 132), ([8192], 7), ([300, 5000, 77, 2500], 132),
                                          ([100], 132)])
def test_persistent_rounds_keep_their_items_and_balance_the_ctas(lengths, ctas):
    qo_len = np.array(lengths)
    work, cost = scheduler.prefill_work(qo_len, qo_len, 4, 8, 128, causal=True)
    order = scheduler.order_prefill_work(work, cost, "grouped")
    c = cost[order].astype(np.float64) + 256
    perm = scheduler.balance_persistent_rounds(c, ctas)
    assert sorted(perm.tolist()) == list(range(len(c)))
    for start in range(0, len(c), ctas):  # each round holds the items it had (the order's L2 locality)
        assert sorted(perm[start:start + ctas].tolist()) == list(range(start, min(len(c), start + ctas)))
    static, balanced = _cta_loads(c, ctas), _cta_loads(c[perm], ctas)
    assert balanced.sum() == pytest.approx(static.sum())
    assert balanced.max() <= static.max() + 1e-9
    assert balanced.max() - balanced.min() <= 2 * c.max(), "no CTA more than two items behind the others"
    if lengths == [8192] and ctas == 132:  # the causal case static round-robin left unbalanced
        assert balanced.max() < 0.9 * static.max()


def _greedy_by_rule(cost: np.ndarray, ctas: int) -> np.ndarray:
    """The round-by-round greedy of scheduler.balance_persistent_rounds, one round at a time: round r's
    items, costliest first (stable), go to its CTAs in order of their load so far, least first (stable);
    the last, partial round to CTAs 0..m-1 only."""
    perm, load = np.empty(len(cost), dtype=np.int64), np.zeros(ctas)
    for start in range(0, len(cost), ctas):
        m = min(ctas, len(cost) - start)
        items = start + np.argsort(-cost[start:start + m], kind="stable")
        takers = np.argsort(load[:m], kind="stable")
        perm[start + takers] = items
        load[takers] += cost[items]
    return perm


@pytest.mark.parametrize("ctas", [7, 132])
def test_greedy_rounds_follow_their_rule(ctas, monkeypatch):
    """The planner assigns all rounds' items in one sort and the loads round by round: the same launch
    order as the rule, ties included (integer costs repeat), with and without a partial last round."""
    rng = np.random.default_rng(ctas + 1)
    monkeypatch.setattr(scheduler, "SWAP_PASSES", 0)  # the greedy alone (the trades have their own test)
    for n in (ctas + 1, 2 * ctas, 5 * ctas + 3, 40 * ctas, 40 * ctas + ctas - 1):
        for cost in (rng.integers(0, 6, size=n) * 128 + 256, rng.random(n) * 9000, np.full(n, 512.0)):
            assert (scheduler.balance_persistent_rounds(cost, ctas) == _greedy_by_rule(cost, ctas)).all(), n


def test_integer_costs_take_the_sorted_keys_with_the_same_takers():
    """Integer costs run the greedy on sorted int64 keys (load x ctas + CTA); the takers and loads equal the
    argsort-a-round form's, which float costs take, ties included; negative or huge costs take that form too."""
    rng = np.random.default_rng(7)
    for ctas in (1, 7, 132):
        for full in (0, 1, 9, 140):
            item_cost = -np.sort(-rng.integers(0, 5, size=(full, ctas)) * 384, axis=1)
            keys = scheduler._least_loaded_takers(item_cost, ctas)
            floats = scheduler._least_loaded_takers(item_cost.astype(np.float64), ctas)
            assert np.array_equal(keys[0], floats[0]) and np.array_equal(keys[1], floats[1]), (ctas, full)
    for odd in (np.array([[3, -1]]), np.array([[2**61, 0]])):  # (a negative cost; a key past int64)
        takers, load = scheduler._least_loaded_takers(odd, 2)
        assert takers.tolist() == [[0, 1]] and load.tolist() == [float(odd[0, 0]), float(odd[0, 1])]


@pytest.mark.parametrize("rounds", [3, 45, 140])
def test_trades_scan_rounds_alike_in_python_and_numpy(rounds, monkeypatch):
    """A trade's scan over the rounds runs in Python for few rounds and as one numpy expression for many: both
    pick the same trades (the first round of the least |d - gap / 2|), on integer and float costs with ties."""
    rng = np.random.default_rng(rounds)
    n = rounds * 132 + 17
    for cost in (rng.integers(1, 9, size=n) * 128 + 2048, rng.random(n) * 9000 + 100):
        picks = []
        for threshold in (10**9, 1):  # Python, then numpy
            monkeypatch.setattr(scheduler, "SWAP_VECTOR_ROUNDS", threshold)
            picks.append(scheduler.balance_persistent_rounds(cost, 132))
        assert np.array_equal(picks[0], picks[1]), rounds
        loads = _cta_loads(cost[picks[1]], 132)
        assert loads.max() <= _cta_loads(cost, 132).max()


def test_trades_within_rounds_lower_the_most_loaded_cta(monkeypatch):
    # B1 S8192 causal (2048 items on 132 CTAs): the round-by-round greedy leaves the most loaded CTA
    # 2.4% above the mean; trading one item pair per step within a round brings it under 1.5%
    work, cost = scheduler.prefill_work(np.array([8192]), np.array([8192]), 4, 8, 128, causal=True)
    order = scheduler.order_prefill_work(work, cost, "grouped")
    c = (-(-cost[order] // 128) * 128 + 256).astype(np.float64)
    monkeypatch.setattr(scheduler, "SWAP_PASSES", 0)
    greedy = _cta_loads(c[scheduler.balance_persistent_rounds(c, 132)], 132)
    monkeypatch.undo()
    perm = scheduler.balance_persistent_rounds(c, 132)
    traded = _cta_loads(c[perm], 132)
    for start in range(0, len(c), 132):  # the rounds keep their items
        assert sorted(perm[start:start + 132].tolist()) == list(range(start, min(len(c), start + 132)))
    assert greedy.max() > 1.02 * greedy.mean() and traded.max() < 1.015 * traded.mean()
    assert traded.sum() == pytest.approx(greedy.sum())


def _trades_by_rule(perm: np.ndarray, cost: np.ndarray, ctas: int) -> np.ndarray:
    """The trade rule of scheduler._swap_within_rounds, one numpy step a trade (the planner walks the
    rounds in Python, 2-3x faster): the most loaded CTA a trades with the least loaded b the item pair
    of one round whose difference d is in (0, gap) and nearest gap / 2 (the first such round on ties),
    until a is within SWAP_SLACK of the mean load or no pair helps."""
    full = len(perm) // ctas
    if full == 0:
        return perm
    grid = perm[:full * ctas].reshape(full, ctas).copy()
    c = cost[grid]
    load = c.sum(axis=0)
    load[:len(perm) - full * ctas] += cost[perm[full * ctas:]]
    good_enough = (1 + scheduler.SWAP_SLACK) * load.mean()
    for _ in range(scheduler.SWAP_PASSES * ctas):
        a, b = int(np.argmax(load)), int(np.argmin(load))
        gap, d = load[a] - load[b], c[:, a] - c[:, b]
        useful = (d > 0) & (d < gap)
        if load[a] <= good_enough or not useful.any():
            break
        r = int(np.argmin(np.where(useful, np.abs(d - gap / 2), np.inf)))
        grid[r, [a, b]], c[r, [a, b]] = grid[r, [b, a]], c[r, [b, a]]
        load[a], load[b] = load[a] - d[r], load[b] + d[r]
    return np.concatenate([grid.reshape(-1), perm[full * ctas:]])


@pytest.mark.parametrize("ctas", [7, 33, 132])
@pytest.mark.parametrize("kind", ["random", "descending", "tiles", "float"])
def test_trades_follow_their_rule_step_by_step(ctas, kind, monkeypatch):
    """The planner's trades are exactly the rule's (the same pairs in the same order), not merely a
    balanced result: a launch order measured on the GPU stays the order the planner gives."""
    rng = np.random.default_rng(ctas)
    traded = 0
    for _ in range(6):
        n = int(rng.integers(ctas, 17 * ctas))
        cost = {"random": lambda: rng.integers(0, 9000, size=n), "tiles": lambda: rng.integers(1, 50, size=n) * 128,
                "descending": lambda: np.sort(rng.integers(100, 9000, size=n))[::-1].copy(),
                "float": lambda: rng.integers(0, 9000, size=n) + 0.5}[kind]() + 256
        monkeypatch.setattr(scheduler, "SWAP_PASSES", 0)  # the greedy rounds alone, then the rule's trades on them
        greedy = scheduler.balance_persistent_rounds(cost, ctas)
        monkeypatch.undo()
        planned = scheduler.balance_persistent_rounds(cost, ctas)
        assert (planned == _trades_by_rule(greedy, cost, ctas)).all()
        traded += int((planned != greedy).any())
    assert traded > 0, "some draw must trade, or the comparison tests nothing"


@pytest.mark.parametrize("row_blocks,side", [(2, 1), (2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("name,lengths", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_mla_row_blocks_side_by_side_cover_every_row_once(name, lengths, row_blocks, side):
    """BatchMLADecode plans R / S items per request over CTAS // S spans; physical CTA c runs side
    c % S of span c // S: row block item * S + c % S, partial slot s * S + c % S
    (templates/mla_decode.cu.jinja). Every (request, row block) token is covered once, the S side
    CTAs of an item read the same tokens, slots never collide and stay below the workspace's
    2 * CTAS, and the merge kernel's derivation finds them."""
    p, chunks = plan(lengths, hkv=row_blocks // side, ctas=CTAS // side)
    covered, slots, item_slots = {}, set(), {}
    for c in range(CTAS):
        v, sd = divmod(c, side)
        for cta, r, item, lo, hi, slot in chunks.tolist():
            if cta != v:
                continue
            block = item * side + sd
            covered.setdefault((r, block), []).append((lo, hi))
            if slot >= 0:
                phys = slot * side + sd
                assert phys not in slots and phys < 2 * CTAS
                slots.add(phys)
                item_slots.setdefault((r, block), []).append(phys)
    for r, n in enumerate(lengths):
        for block in range(row_blocks):
            ranges = sorted(covered[(r, block)])
            partner = sorted(covered[(r, block - block % side)])
            assert ranges == partner  # side by side: the same tokens
            assert sum(hi - lo for lo, hi in ranges) == n and (n > 0 or ranges == [(0, 0)])
            item, sd = divmod(block, side)  # the merge kernel's slot rows, as it derives them
            merged = [s * side + sd for s in split_slots(p, r, item)]
            assert sorted(merged) == sorted(item_slots.get((r, block), []))


@pytest.mark.parametrize("lengths,hkv", [([8192] * 16, 8), ([8192] * 16, 4), ([8128] * 16, 8), ([131072], 8),
                                         ([100] * 3, 8), ([65536] * 16, 8)])
def test_aligned_spans_cut_equal_items_into_equal_chunks(lengths, hkv):
    end = np.asarray(lengths, dtype=np.int64)
    p = plan_stream(np.zeros_like(end), end, hkv, CTAS, align_equal_items=True)
    rows = expand(p)
    per_item = np.bincount(rows[:, 1] * hkv + rows[:, 2])
    cost, chunks = lengths[0] + CHUNK_FIXED_COST, CTAS // (len(lengths) * hkv)
    unaligned = plan_stream(np.zeros_like(end), end, hkv, CTAS)
    assert p.num_spans <= CTAS
    if -(-cost // chunks) - unaligned.span >= scheduler.ALIGN_SLACK:  # B16 L65536: idle CTAs would cost more
        assert p.span == unaligned.span and p.total == unaligned.total
        return
    # items padded to whole spans: one chunk a span, whatever the rounding (8128 + 64 is no multiple of 3)
    assert np.bincount(rows[:, 0]).max() == 1 and (np.diff(p.prefix) % p.span == 0).all()
    if p.span > MIN_SPAN + CHUNK_FIXED_COST:  # (at the smallest span an item's last spans may hold no token)
        assert (per_item == chunks).all()


@pytest.mark.parametrize("lengths,hkv,ctas", [([4096] * 128, 1, 66), ([8192] * 70, 1, 66), ([100] * 300, 1, 264),
                                              ([1000 - i % 9 for i in range(70)], 2, 66), ([4096] * 128, 8, 396)])
def test_equal_items_outnumbering_the_ctas_go_whole_to_spans(lengths, hkv, ctas):
    end = np.asarray(lengths, dtype=np.int64)
    p = plan_stream(np.zeros_like(end), end, hkv, ctas, align_equal_items=True, align_slack=1 << 30,
                    whole_items_per_span=True)
    rows = expand(p)
    items = len(lengths) * hkv
    assert items > ctas and p.num_spans <= ctas
    assert len(rows) == items and (rows[:, 5] < 0).all()  # one chunk an item, none merged
    assert not scheduler.has_split_items(p)  # (MLA skips its merge launch)
    assert (rows[:, 3] == 0).all() and (rows[:, 4] == end[rows[:, 1]]).all()
    per_span = np.bincount(rows[:, 0])
    assert per_span.max() == max(-(-items // ctas), -(-(MIN_SPAN + CHUNK_FIXED_COST) // (max(lengths) + CHUNK_FIXED_COST)))
    # under the default slack, spans that would grow by that much or more keep the even split
    even = plan_stream(np.zeros_like(end), end, hkv, ctas)
    bounded = plan_stream(np.zeros_like(end), end, hkv, ctas, align_equal_items=True, whole_items_per_span=True)
    assert bounded.span == (p.span if p.span - even.span < scheduler.ALIGN_SLACK else even.span)


def test_whole_items_per_span_leave_unequal_batches_and_other_callers_alone():
    end = np.array([4096, 2000] * 64, dtype=np.int64)
    whole, plain = (plan_stream(np.zeros_like(end), end, 1, 66, align_equal_items=True, align_slack=1 << 30,
                                whole_items_per_span=w) for w in (True, False))
    assert whole.span == plain.span  # unequal items: the plain stream
    end = np.full(128, 4096, dtype=np.int64)
    decode = plan_stream(np.zeros_like(end), end, 1, 66, align_equal_items=True, align_slack=1 << 30)
    assert decode.span == -(-decode.total // 66)  # not asked for: decode keeps the even split


def test_quests_subset_decode_has_no_sliver_chunks():
    # Quest's decode over the selection (B16, 4096 tokens, 8 KV heads, 396 CTAs): unpadded, the rounded
    # span drifted into the next items and cut 63 chunks of 1-63 tokens
    p = plan_stream(np.zeros(16, dtype=np.int64), np.full(16, 4096), 8, 396, align_equal_items=True)
    rows = expand(p)
    assert len(rows) == 16 * 8 * 3 and (rows[:, 4] - rows[:, 3]).min() > 1000


def test_aligned_spans_leave_unequal_batches_alone():
    end = np.array([8192, 8000], dtype=np.int64)
    aligned, plain = (plan_stream(np.zeros_like(end), end, 8, CTAS, align) for align in (True, False))
    assert aligned.span == plain.span


def test_near_equal_items_align_padded_to_the_costliest():
    # Quest's selections: the same pages a request, the last one filled 1..16 tokens
    end = np.array([4096 - i % 16 for i in range(16)], dtype=np.int64)
    p = plan_stream(np.zeros_like(end), end, 8, 396, align_equal_items=True)
    rows = expand(p)
    assert (np.diff(p.prefix) == 8 * 3 * p.span).all()  # every item padded to three whole spans
    assert np.bincount(rows[:, 0]).max() == 1  # one chunk a span
    covered = np.bincount(rows[:, 1] * 8 + rows[:, 2], weights=rows[:, 4] - rows[:, 3])
    assert np.array_equal(covered, np.repeat(end, 8))


@pytest.mark.parametrize("items,expected", [(126, False), (127, True), (128, True), (132, True), (133, False),
                                            (0, False)])
def test_whole_item_band_is_items_within_the_slack_of_the_ctas(items, expected):
    assert scheduler.in_whole_item_band(items, 132) is expected


@pytest.mark.parametrize("items,max_chunks,expected", [(64, 2, True), (64, 1, False), (8, 16, True), (8, 8, False),
                                                       (33, 4, True), (40, 16, False), (44, 16, True), (1, 16, False),
                                                       (128, 16, True), (133, 16, False)])
def test_chunked_whole_item_band_is_items_times_chunks_within_the_slack(items, max_chunks, expected):
    # k = 132 // items chunks an item: 40 x 3 = 120 leaves 12 SMs idle (past the 4% slack); one item would
    # need 132 chunks
    assert scheduler.in_whole_item_band(items, 132, max_chunks) is expected


@pytest.mark.parametrize("batch,heads,chunks", [(8, 8, 2), (1, 8, 16), (16, 1, 8), (33, 1, 4), (16, 8, 1)])
def test_whole_item_plans_cut_equal_items_into_equal_chunks_one_a_cta(batch, heads, chunks):
    end = np.array([5000 - b % 7 for b in range(batch)], dtype=np.int64)
    p = scheduler.plan_whole_items(np.zeros_like(end), end, heads, 132)
    assert scheduler.aligned_chunks(p) == chunks and scheduler.is_whole_item_plan(p) is (chunks == 1)
    rows = expand(p)
    assert np.bincount(rows[:, 0]).max() == 1 and p.num_spans == batch * heads * chunks <= 132
    covered = np.bincount(rows[:, 1] * heads + rows[:, 2], weights=rows[:, 4] - rows[:, 3])
    assert np.array_equal(covered, np.repeat(end, heads))
    per_item = np.bincount(rows[:, 1] * heads + rows[:, 2])
    assert (per_item == chunks).all()  # every item in k chunks (short last ones included)


def test_aligned_chunks_is_zero_for_a_plain_stream():
    end = np.array([65536] + [512] * 15, dtype=np.int64)
    assert scheduler.aligned_chunks(scheduler.plan_whole_items(np.zeros_like(end), end, 8, 132)) == 0
    assert scheduler.aligned_chunks(plan_stream(np.zeros(0, np.int64), np.zeros(0, np.int64), 8, 132)) == 0


@pytest.mark.parametrize("lengths,whole", [([4096] * 16, True), ([65536] * 16, True),
                                           ([4096 - i for i in range(16)], True), ([8192] * 12, False),
                                           ([65536] + [512] * 15, False), ([8192] * 15 + [0], False)])
def test_whole_item_plans_give_each_item_one_span_or_fall_back_to_the_stream(lengths, whole):
    end = np.asarray(lengths, dtype=np.int64)
    p = scheduler.plan_whole_items(np.zeros_like(end), end, 8, 132)
    rows = expand(p)
    assert scheduler.is_whole_item_plan(p) is whole
    covered = np.bincount(rows[:, 1] * 8 + rows[:, 2], weights=rows[:, 4] - rows[:, 3], minlength=len(end) * 8)
    assert np.array_equal(covered, np.repeat(end, 8))  # every token once, whole or not
    if whole:  # one chunk an item, none split, one item a CTA
        assert (rows[:, 5] == -1).all() and len(np.unique(rows[:, 0])) == len(rows) == len(end) * 8
    else:
        assert p.total == plan_stream(np.zeros_like(end), end, 8, 132).total


@pytest.mark.parametrize("name,lengths", CASES)
def test_snapped_cuts_increase_and_stay_within_snap_of_the_span_boundaries(name, lengths):
    p = plan(lengths, snap=288)[0]
    cuts = scheduler.span_cuts(p)
    raw = np.minimum(np.arange(p.num_spans + 1) * p.span, p.total)
    assert cuts[0] == 0 and cuts[-1] == p.total and (np.diff(cuts) > 0).all(), name
    assert (np.abs(cuts - raw) <= p.snap).all() and 2 * p.snap < p.span, name


def test_snap_keeps_short_items_whole_beside_a_long_request():
    lengths = [65536] + [512] * 127  # items of 576 stream positions: every boundary is within 288 of an end
    before, after = (plan(lengths, ctas=396, snap=snap) for snap in (0, 288))

    def split(chunks):  # the (request, head) items cut into several chunks
        return {(r, h) for _, r, h, _, _, slot in chunks.tolist() if slot >= 0}
    assert any(r > 0 for r, _ in split(before[1]))  # without snapping, short items straddle spans
    assert {r for r, _ in split(after[1])} == {0}  # with it only the long request's items are cut
    assert after[0].span == before[0].span  # the same spans, cut elsewhere


@pytest.mark.parametrize("name,lengths,pays", [
    ("random short", np.random.default_rng(5).integers(64, 1024, 256).tolist(), True),
    ("equal short", [512] * 256, False),  # equal items: their splits are even already
    ("beside a long request", [65536] + [512] * 127, False),  # an item longer than a span
    ("empty", [], False)])
def test_the_planner_snaps_only_batches_where_that_was_measured_to_pay(name, lengths, pays):
    end = np.asarray(lengths, dtype=np.int64)
    p = plan_stream(np.zeros_like(end), end, HKV, 396, snap=scheduler.SPAN_SNAP)
    assert (p.snap == scheduler.SPAN_SNAP) == pays, name
    if pays:  # no item of at most two snaps is cut: any boundary inside is within one snap of an end
        short = {(r, h) for r, n in enumerate(lengths) if n + CHUNK_FIXED_COST <= 2 * p.snap for h in range(HKV)}
        assert short and not {(r, h) for _, r, h, _, _, slot in expand(p).tolist() if slot >= 0} & short


@pytest.mark.parametrize("snap", [1, CHUNK_FIXED_COST - 1, -64, 100.0])
def test_snap_below_the_fixed_cost_is_an_error(snap):
    with pytest.raises(ValueError, match="snap"):
        plan([4096] * 4, snap=snap)


def test_snap_is_capped_below_half_a_span():
    p = plan([300] * 8, hkv=1, ctas=4, snap=10_000)[0]
    assert CHUNK_FIXED_COST <= p.snap < p.span / 2


def test_align_fraction_bounds_aligned_spans_by_a_share_of_the_even_span():
    # 64 equal items on 66 CTAs: whole items lengthen each span by 3.1%, past ALIGN_SLACK (128 here)
    end = np.full(64, 8192, dtype=np.int64)
    even = plan_stream(np.zeros_like(end), end, 1, 66, align_equal_items=True)
    growth = 8192 + CHUNK_FIXED_COST - even.span
    assert even.span == -(-even.total // 66) and 0.02 * even.span < growth < 0.04 * even.span
    for fraction, aligned in ((0.02, False), (0.04, True)):
        p = plan_stream(np.zeros_like(end), end, 1, 66, align_equal_items=True, align_fraction=fraction)
        assert p.span == (8192 + CHUNK_FIXED_COST if aligned else even.span)


@pytest.mark.parametrize("lengths,ctas,tile", [([8192] * 64, 132, 64), ([65536] * 16, 132, 64), ([4000] * 30, 132, 32),
                                                ([8191, 8192, 8190] * 5, 66, 64), ([100] * 40, 132, 64)])
def test_aligned_cuts_fall_on_tile_boundaries(lengths, ctas, tile):
    """align_tile: equal items cut into aligned chunks are cut only at multiples of the tile within the item,
    every token is still covered once, no chunk needs more tiles than without the rounding, and the span
    grows by less than a tile; plans that are not aligned chunks (too unequal, or whole items) are unchanged."""
    end = np.asarray(lengths, dtype=np.int64)
    kw = dict(align_equal_items=True, align_fraction=0.04, align_slack=128)
    plain, rounded = (plan_stream(np.zeros_like(end), end, 1, ctas, align_tile=t, **kw) for t in (0, tile))
    assert plain.span <= rounded.span < plain.span + tile
    aligned = (np.diff(rounded.prefix) % rounded.span == 0).all()
    cut = aligned and any(len(parts) > 1 for parts in groups(expand(rounded)).values())
    assert cut == (lengths[0] in (8192, 65536, 4000)), "which of these plans cut items into aligned chunks"
    if not aligned:
        assert rounded.span == plain.span and np.array_equal(rounded.prefix, plain.prefix)
    tiles = {}
    for p in (plain, rounded):
        chunks = expand(p)
        for (r, _), parts in groups(chunks).items():
            spans = sorted((lo, hi) for lo, hi, _, _ in parts)
            assert spans[0][0] == 0 and spans[-1][1] == end[r]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            if p is rounded and cut:
                assert all(lo % tile == 0 for lo, _ in spans), (r, spans)
        tiles[p is rounded] = max(-(-(hi - lo) // tile) for _, _, _, lo, hi, _ in chunks.tolist())
    assert tiles[True] <= tiles[False]
    if lengths == [8192] * 64:  # two chunks a request: 4064 + 4128 tokens (65 tiles), now 4096 + 4096 (64)
        assert (tiles[False], tiles[True]) == (65, 64)


def test_align_tile_must_divide_the_fixed_cost():
    end = np.full(4, 1000)
    for bad in (48, -64, 128):
        with pytest.raises(ValueError, match="align_tile=...\\) \\(BatchMLADecode.align_tile\\): expected 0 or a positive divisor"):
            plan_stream(np.zeros_like(end), end, 1, 8, align_equal_items=True, align_tile=bad)


@pytest.mark.parametrize("name,lengths", CASES + [("none", [])])
def test_plans_carry_their_longest_item(name, lengths):
    """plan_stream records the most tokens an item reads (StreamPlan.longest, which the merge bounds and MLA's
    merge lanes read instead of another reduction) on plain, snapped, aligned and whole-item plans alike; a
    plan built without it falls back to the reduction."""
    end = np.asarray(lengths, dtype=np.int64)
    begin = np.minimum(end, 5)  # (a window's first keys: the item reads end - begin)
    expect = int((end - begin).max()) if len(end) else 0
    for kw in ({}, {"snap": scheduler.SPAN_SNAP}, {"align_equal_items": True},
               {"align_equal_items": True, "whole_items_per_span": True}):
        p = plan_stream(begin, end, HKV, CTAS, **kw)
        assert scheduler.longest_item(p) == expect and p.longest == (expect if len(end) else -1), kw
    bare = p._replace(longest=-1)
    assert scheduler.longest_item(bare) == expect
    assert scheduler.longest_merge_rows(p, 4) == (0 if not len(end) else (expect // p.span + 2) * 4)


def test_the_grouped_order_by_tiles_is_order_prefill_works():
    """BatchPrefill.plan orders prefill_work's own items (unsplit, no block mask) from their query tiles: the same
    permutation as order_prefill_work's grouped order, on batches with empty requests, tied requests and tiles,
    requests of fewer keys than queries (costs <= 0) and costs too large for the composite key."""
    rng = np.random.default_rng(21)
    for draw in range(60):
        b, heads, group = int(rng.integers(1, 40)), int(rng.integers(1, 9)), int(rng.choice([1, 3, 4, 8]))
        tile_q = int(rng.choice([64, 128]))
        qo = rng.choice([0, 1, 5, 64, 300, 640, 2048], size=b)
        kv = np.maximum(qo + rng.choice([-200, 0, 0, 256, 3000], size=b), 0)
        work, cost = scheduler.prefill_work(qo, kv, group, heads, tile_q, causal=bool(rng.integers(2)))
        if draw % 7 == 6:
            cost = cost + 2**61  # the composite key would pass int64
        tiles = scheduler.prefill_tiles(qo, group, tile_q)
        got = scheduler.grouped_order_by_tiles(tiles, cost[::heads], heads)
        assert (got == scheduler.order_prefill_work(work, cost, "grouped")).all(), draw
    assert scheduler.grouped_order_by_tiles(np.zeros(3, np.int64), np.zeros(0, np.int64), 4).size == 0


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("items", [0, 25, 300])  # (short plans take the column-wise path)
def test_unsplit_work_keeps_each_item_and_gives_it_the_whole_range(dtype, items):
    work = np.random.default_rng(2).integers(0, 1000, size=(2 * items, 3)).astype(dtype)
    out = scheduler.unsplit_prefill_work(work[::2]).work  # (a strided view: copied whole)
    assert out.dtype == np.int64 and out.shape == (items, 6)
    assert (out[:, :3] == work[::2]).all() and (out[:, 3] == 0).all() and (out[:, 4] == 2**31 - 1).all()
    assert (out[:, 5] == 0).all()


def test_the_one_share_test_on_tiles_is_split_prefill_works():
    """BatchPrefill._split asks whether any item is cut from the query tiles alone (no window): the same answer as
    split_prefill_work's over every item, on batches from one long request (cut) to many short ones (not)."""
    rng = np.random.default_rng(31)
    answers = set()
    for draw in range(80):
        b, heads, ctas = int(rng.integers(1, 20)), int(rng.choice([1, 2, 8])), int(rng.choice([8, 132]))
        qo = rng.choice([0, 1, 100, 2048, 16384], size=b)
        kv = np.maximum(qo + rng.choice([-50, 0, 4096, 60000], size=b), 0)
        work, cost = scheduler.prefill_work(qo, kv, 4, heads, 128, causal=bool(rng.integers(2)))
        whole = scheduler.split_prefill_work(work, cost, None, 128, 64, ctas).chunk == 0
        assert scheduler.prefill_items_fit_one_share(cost[::heads], heads, 128, 64, ctas) == whole, draw
        answers.add(whole)
    assert answers == {True, False}, "draws that cut and draws that do not"


def test_a_long_item_answers_has_split_items_as_the_walk_over_every_item():
    """has_split_items answers True at once where the longest item outruns a span (its cuttable tokens at their
    least, snap taken at both ends): the same answer as the test over every item, on plain, snapped and aligned
    plans of random batches, long and short."""
    rng = np.random.default_rng(41)
    shortcut = 0
    for draw in range(300):
        b, heads = int(rng.integers(1, 40)), int(rng.choice([1, 2, 8]))
        top = int(rng.choice([300, 3000, 70000]))
        lengths = rng.integers(0, top, size=b)
        if draw % 4 == 0:
            lengths[:] = lengths[0]  # equal items: aligned plans
        p = scheduler.plan_stream(np.zeros(b, np.int64), lengths, heads, int(rng.choice([8, 132, 396])),
                                  align_equal_items=bool(draw % 2), snap=int(rng.choice([0, 64, 128, 192])))
        assert scheduler.has_split_items(p) == scheduler._split_anywhere(p), draw
        n = p.longest
        shortcut += n > 0 and (n if not p.snap else n + CHUNK_FIXED_COST - p.snap - max(CHUNK_FIXED_COST, p.snap)) > p.span
    assert 30 < shortcut < 270, "draws on both paths"

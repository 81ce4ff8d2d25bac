"""Planner properties on random and skewed batches (CPU). `expand` derives chunks exactly as the
kernel's WorkStream does, and `split_slots` as its merge kernel does."""
import numpy as np
import pytest

from attnforge import scheduler
from attnforge.scheduler import CHUNK_FIXED_COST, MIN_SPAN, cta_loads, expand, plan_stream, split_slots

HKV, CTAS = 8, 264


def plan(lengths, begin=None, hkv=HKV, ctas=CTAS):
    end = np.asarray(lengths, dtype=np.int64)
    begin = np.zeros_like(end) if begin is None else np.asarray(begin, dtype=np.int64)
    p = plan_stream(begin, end, hkv, ctas)
    return p, expand(p)


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


@pytest.mark.parametrize("name,lengths", CASES)
def test_every_token_covered_exactly_once(name, lengths):
    p, chunks = plan(lengths)
    g = groups(chunks)
    assert set(g) == {(r, h) for r in range(len(lengths)) for h in range(HKV)}
    for (r, h), parts in g.items():
        spans = sorted((lo, hi) for lo, hi, _, _ in parts)
        assert spans[0][0] == 0 and spans[-1][1] == lengths[r], (name, r, h)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        assert all(lo < hi for lo, hi in spans) or spans == [(0, 0)]  # only empty items are empty


@pytest.mark.parametrize("name,lengths", CASES)
def test_load_balance(name, lengths):
    p, chunks = plan(lengths)
    loads = cta_loads(chunks, CTAS)
    assert loads.max() <= p.span + 2 * CHUNK_FIXED_COST, name  # by construction of the spans
    if p.total >= CTAS * (MIN_SPAN + CHUNK_FIXED_COST):  # enough work for every CTA
        chunk = int((chunks[:, 4] - chunks[:, 3]).max()) + CHUNK_FIXED_COST
        assert loads.max() <= 1.1 * loads.mean() + chunk, name
        assert loads.max() <= 1.1 * p.total / CTAS + 2 * CHUNK_FIXED_COST, name


@pytest.mark.parametrize("name,lengths", CASES)
def test_slots_unique_bounded_and_match_merge(name, lengths):
    p, chunks = plan(lengths)
    assert chunks[:, 0].max() < CTAS
    slots = chunks[:, 5][chunks[:, 5] >= 0]
    assert len(set(slots.tolist())) == len(slots) and (len(slots) == 0 or slots.max() < 2 * CTAS)
    for (r, h), parts in groups(chunks).items():
        mine = [s for _, _, s, _ in sorted(parts)]
        assert split_slots(p, r, h) == (mine if len(parts) > 1 else []), (name, r, h)
        assert (len(parts) == 1) == (mine == [-1])


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

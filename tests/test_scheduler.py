"""Planner properties on random and skewed batches (CPU)."""
import numpy as np
import pytest

from attnforge.scheduler import CHUNK_FIXED_COST, MIN_SPAN, Capacity, plan_decode

HKV, CTAS = 8, 264


def plan(lengths, begin=None, hkv=HKV, ctas=CTAS, max_batch=512):
    lengths = np.asarray(lengths, dtype=np.int64)
    begin = np.zeros_like(lengths) if begin is None else np.asarray(begin, dtype=np.int64)
    return plan_decode(begin, lengths, hkv, Capacity(max_batch, hkv, ctas)), begin, lengths


def batches():
    rng = np.random.default_rng(0)
    yield "skew", [65536] + [512] * 127
    yield "single-long", [131072]
    yield "single-short", [3]
    yield "equal", [4096] * 64
    yield "with-empty", [0, 1, 0, 17, 1000, 0]
    for i in range(8):
        yield f"random{i}", rng.integers(0, 40000, size=int(rng.integers(1, 300))).tolist()


@pytest.mark.parametrize("name,lengths", list(batches()))
def test_every_token_covered_exactly_once(name, lengths):
    p, begin, lengths = plan(lengths)
    items = p.work_items
    for (r, h), group in _groups(items).items():
        spans = sorted((s, e) for s, e in group)
        assert spans[0][0] == begin[r] and spans[-1][1] == lengths[r], (name, r, h)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        assert all(s < e for s, e in spans) or spans == [(begin[r], lengths[r])]  # only empty items empty
    assert len(_groups(items)) == len(lengths) * HKV


def _groups(items):
    out = {}
    for r, h, s, e, _ in items.tolist():
        out.setdefault((r, h), []).append((s, e))
    return out


@pytest.mark.parametrize("name,lengths", list(batches()))
def test_load_balance(name, lengths):
    p, _, _ = plan(lengths)
    loads = p.cta_loads()
    chunk = int((p.work_items[:, 3] - p.work_items[:, 2]).max()) + CHUNK_FIXED_COST
    total = (np.asarray(lengths) + CHUNK_FIXED_COST).sum() * HKV
    if total >= CTAS * (MIN_SPAN + CHUNK_FIXED_COST):
        # enough work for every CTA: the heaviest carries its share plus at most one chunk
        assert loads.max() <= 1.1 * loads.sum() / CTAS + chunk, name
        assert loads.max() <= 1.1 * total / CTAS + CHUNK_FIXED_COST, name
    else:  # tiny batches are packed into spans of MIN_SPAN, never spread thinner
        assert loads.max() <= MIN_SPAN + 2 * CHUNK_FIXED_COST + chunk, name


@pytest.mark.parametrize("name,lengths", list(batches()))
def test_capacity_and_merge_bookkeeping(name, lengths):
    p, _, lengths = plan(lengths)
    cap = Capacity(512, HKV, CTAS)
    assert len(p.work_items) <= cap.max_items and p.num_partial_slots <= cap.max_partial_slots
    assert p.work_indptr[0] == 0 and p.work_indptr[-1] == len(p.work_items)
    assert np.all(np.diff(p.work_indptr) >= 0) and len(p.work_indptr) == CTAS + 1
    counts = np.diff(p.merge_indptr)
    for (r, h), group in _groups(p.work_items).items():
        n = len(group)
        assert counts[r * HKV + h] == (n if n > 1 else 0)
    slots = p.work_items[:, 4]
    assert sorted(slots[slots >= 0].tolist()) == list(range(p.num_partial_slots))


def test_deterministic():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 20000, size=100)
    a, _, _ = plan(lengths)
    b, _, _ = plan(lengths.copy())
    assert np.array_equal(a.work_items, b.work_items) and np.array_equal(a.work_indptr, b.work_indptr)


def test_skew_splits_the_long_request():
    p, _, _ = plan([65536] + [512] * 127)
    # the 64K request holds half the work, so it must be spread over about half the CTAs
    ctas = np.repeat(np.arange(CTAS), np.diff(p.work_indptr))
    assert len(set(ctas[p.work_items[:, 0] == 0].tolist())) >= 0.45 * CTAS


def test_window_begin_respected():
    p, begin, lengths = plan([1000, 50, 9000], begin=[500, 0, 8000])
    assert p.work_items[:, 2].min() >= 0
    for r, _, s, e, _ in p.work_items.tolist():
        assert begin[r] <= s <= e <= lengths[r]


def test_batch_over_capacity_is_an_error():
    with pytest.raises(ValueError, match="max_batch_size=4"):
        plan([10] * 5, max_batch=4)

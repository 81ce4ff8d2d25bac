"""attnforge.jit.upload.coalesce: which filled extents of a staged buffer one copy covers."""
import numpy as np
import pytest

from attnforge.jit.upload import COPY_GAP, HostOnlyUpload, coalesce


def test_neighbours_within_the_gap_become_one_copy():
    assert coalesce([(0, 2), (4, 10), (14 + COPY_GAP, 5)]) == [(0, 19 + COPY_GAP)]
    assert coalesce([(0, 2), (3 + COPY_GAP, 1)]) == [(0, 2), (3 + COPY_GAP, 1)]  # one value past the gap
    assert coalesce([(8, 0), (8, 3)], gap=0) == [(8, 3)]  # an empty extent starts nothing
    assert coalesce([]) == []


@pytest.mark.parametrize("seed", range(20))
def test_copies_cover_every_filled_value_and_stay_inside_the_extents(seed):
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.integers(0, 3000, size=8))
    ranges = [(int(s), int(n)) for s, n in zip(starts, rng.integers(0, 40, size=8))]
    ranges = [(s, n) for (s, n), nxt in zip(ranges, list(starts[1:]) + [1 << 30]) if s + n <= nxt]
    copies = coalesce(ranges, gap=512)
    covered = set().union(*(range(s, s + n) for s, n in copies)) if copies else set()
    assert all(set(range(s, s + n)) <= covered for s, n in ranges)
    assert all(b[0] - (a[0] + a[1]) > 512 for a, b in zip(copies, copies[1:]))  # merged wherever allowed
    assert copies == [] or (copies[0][0] >= ranges[0][0] and sum(copies[-1]) <= max(s + n for s, n in ranges))


def test_a_staged_copy_moves_exactly_its_ranges():
    up = HostOnlyUpload(64)
    host = up.host()
    host[:] = np.arange(64)
    up.upload_ranges(coalesce([(0, 3), (10, 2), (40, 4)], gap=7))
    dev = up.dev.numpy()
    assert dev[:12].tolist() == list(range(12)) and dev[40:44].tolist() == [40, 41, 42, 43]
    assert not dev[12:40].any() and not dev[44:].any()

"""attnforge.jit.upload: which filled extents of a staged buffer one copy covers, and what stage() copies."""
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


def test_stage_writes_its_pieces_and_copies_only_their_extents():
    up = HostOnlyUpload(2048)
    up.dev.fill_(-7)  # poison: what no copy covers keeps it
    far = 8 + COPY_GAP + 1  # past the gap: a second copy
    host = up.stage([(0, [1, 2, 3]), (6, [4, 5]), (far, np.array([6, 7]))])
    assert host is up._host_nps[0] and up.host() is up._host_nps[1], "the next plan fills the other buffer"
    dev = up.dev.numpy()
    assert dev[:8].tolist() == [1, 2, 3, 0, 0, 0, 4, 5], "neighbours 3 apart: one copy over the gap"
    assert dev[far:far + 2].tolist() == [6, 7]
    assert (dev[8:far] == -7).all() and (dev[far + 2:] == -7).all()
    assert up.log == [("record", 0)], "one event for the plan's copies"


def test_a_dropped_upload_waits_for_its_copies_before_its_buffers_go_back():
    """torch's pinned allocator hands a freed block out again at once (it waits only for copies torch made), so a
    dropped upload's finalizer waits for each buffer's last copy, then destroys its event; it must not hold the
    upload itself, or no upload would ever be freed."""
    import gc
    import weakref
    up = HostOnlyUpload(64)
    up.upload(8)
    up.upload(8)  # both buffers now have a copy in flight (events 0 and 1)
    log, gone = up.log, weakref.ref(up)
    assert log == [("record", 0), ("record", 1)]
    del up
    gc.collect()
    assert gone() is None, "the finalizer kept the upload alive"
    assert log[2:] == [("wait", 0), ("destroy", 0), ("wait", 1), ("destroy", 1)]
    unused = HostOnlyUpload(64)  # no copy yet: nothing to wait for
    log = unused.log
    del unused
    gc.collect()
    assert log == []

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


def test_a_dropped_upload_keeps_its_buffers_until_its_copies_are_done(monkeypatch):
    """torch's pinned allocator hands a freed block out again at once (it knows only copies torch made), so a
    dropped upload's pinned buffers are held until its copies are done, then given back and its events
    destroyed, by the next upload or plan (never a wait); its finalizer must not hold the upload itself."""
    import gc
    import weakref
    from attnforge.jit import upload as upload_module
    gc.collect()  # (uploads other tests dropped go to the real list, not this test's)
    monkeypatch.setattr(upload_module, "_PENDING", [])
    up = HostOnlyUpload(64)
    up.upload(8)
    up.upload(8)  # both buffers now have a copy in flight (events 0 and 1)
    up.in_flight.add(1)  # the second copy has not run yet
    log, in_flight, gone = up.log, up.in_flight, weakref.ref(up)
    pinned = [weakref.ref(h) for h in up._hosts]
    del up
    gc.collect()
    assert gone() is None, "the finalizer kept the upload alive"
    other = HostOnlyUpload(64)  # (reaps: event 1 is not done, so nothing is given back)
    assert all(p() is not None for p in pinned) and log == [("record", 0), ("record", 1)]
    in_flight.clear()
    other.host()  # (a plan's first step reaps too)
    gc.collect()
    assert log[2:] == [("destroy", 0), ("destroy", 1)] and all(p() is None for p in pinned)
    assert upload_module._PENDING == []
    unused = HostOnlyUpload(64)  # no copy yet: nothing to hold
    del unused
    gc.collect()
    assert upload_module._PENDING == []


def test_an_upload_dropped_while_the_list_is_reaped_stays_on_it(monkeypatch):
    """The collector may run a finalizer in the middle of reap_dropped (any allocation can trigger it): the
    upload it adds must stay listed, not be given back unchecked."""
    from attnforge.jit import upload as upload_module
    late = ([7], [], lambda e: False, lambda e: None)  # its copy not done

    def ready_and_drop_another(e):
        upload_module._PENDING.append(late)
        return True

    destroyed = []
    monkeypatch.setattr(upload_module, "_PENDING", [([1], [], ready_and_drop_another, destroyed.append)])
    upload_module.reap_dropped()
    assert destroyed == [1] and upload_module._PENDING == [late]


def test_threads_reaping_at_once_destroy_each_event_once(monkeypatch):
    """Engines plan from several threads, and each plan reaps the dropped uploads: two threads walking the list at
    once would both find an upload done and destroy its events twice (a driver error on a freed handle)."""
    import threading
    import time
    from attnforge.jit import upload as upload_module
    destroyed, start = [], threading.Barrier(8)

    def slow_ready(e):
        time.sleep(0.001)  # (a driver query: the window in which another thread walks the same list)
        return True
    monkeypatch.setattr(upload_module, "_PENDING", [([i], [], slow_ready, destroyed.append) for i in range(40)])

    def reap():
        start.wait()
        upload_module.reap_dropped()
    threads = [threading.Thread(target=reap) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    upload_module.reap_dropped()
    assert sorted(destroyed) == list(range(40)) and upload_module._PENDING == []


def test_a_run_on_another_stream_waits_for_the_copy_and_the_next_copy_waits_for_the_run():
    """plan() copies on its stream; a run on another stream first waits for that copy's event, and the next plan's
    copy, which overwrites what the run reads, waits for a fence recorded on the run's stream. On the copy's own
    stream (the common case) nothing is added."""
    up = HostOnlyUpload(64)
    up.upload(8)  # plan 1, on stream 0
    up.order_run()  # a run on stream 0
    assert up.log == [("record", 0)]
    up.stream = 5
    up.order_run()  # a run on stream 5
    up.order_run()
    assert up.log[1:] == [("stream waits", 5, 0), ("stream waits", 5, 0)]
    up.stream = 0
    del up.log[:]
    up.upload(8)  # plan 2, on stream 0 again: waits for stream 5 once
    (rec, fence), wait, copied = up.log
    assert rec == "record" and wait == ("stream waits", 0, fence) and copied[0] == "record" and copied[1] != fence
    del up.log[:]
    up.upload(8)  # plan 3: no run read plan 2 elsewhere
    assert [entry[0] for entry in up.log] == ["record"]


def test_a_plan_on_a_new_stream_waits_for_the_old_streams_runs():
    up = HostOnlyUpload(64)
    up.upload(8)  # on stream 0, whose runs need no order_run
    up.stream = 3
    del up.log[:]
    up.upload(8)
    (rec, fence), wait, _ = up.log
    assert rec == "record" and wait == ("stream waits", 3, fence)


def test_runs_captured_in_a_graph_add_no_waits():
    """An event recorded outside a capture cannot be waited on inside it; graph mode keeps plan() and replay on one
    stream instead (docs/serving.md)."""
    up = HostOnlyUpload(64)
    up.upload(8)
    up.stream, up.capturing = 7, True
    up.order_run()
    up.stream, up.capturing = 0, False
    up.upload(8)
    assert [entry[0] for entry in up.log] == ["record", "record"]


def test_a_dropped_upload_destroys_its_fence_too(monkeypatch):
    """The fence order_run's readers get is the upload's third event: the finalizer hands it to the reaper with the
    buffers' events, so it is destroyed with them (not leaked, one event per wrapper)."""
    import gc
    from attnforge.jit import upload as upload_module
    gc.collect()
    monkeypatch.setattr(upload_module, "_PENDING", [])
    up = HostOnlyUpload(64)
    up.upload(8)  # event 0, stream 0
    up.stream = 4
    up.order_run()
    up.stream = 0
    up.upload(8)  # the fence (event 1) on stream 4, then the copy's event 2
    log = up.log
    fence = next(entry[2] for entry in log if entry[0] == "stream waits" and entry[1] == 0)
    del up
    gc.collect()
    HostOnlyUpload(64)  # (reaps: every copy is done)
    destroyed = sorted(entry[1] for entry in log if entry[0] == "destroy")
    assert fence in destroyed and destroyed == [0, 1, 2]

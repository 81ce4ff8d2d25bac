"""Plan uploads: int32 host arrays to one device buffer, asynchronously, through the driver.

Two pinned host buffers are filled in turn, so a plan waits only for the copy of two plans ago (long
done), never for the one it just enqueued. The copy and its completion event go straight to the
driver (cuMemcpyHtoDAsync, cuEventRecord): torch's `copy_` from pinned memory also looks the block
up in its caching host allocator and records an event of its own, on every plan.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref

import numpy as np
import torch

from .loader import check, current_stream_handle, driver, ensure_context, on_device

COPY_GAP = 1024  # int32 values of unfilled capacity one copy may span rather than start another (~3 us a copy)


def coalesce(ranges, gap: int = COPY_GAP) -> list:
    """(start, n) ranges in ascending order -> fewer ranges: neighbours at most `gap` values apart become one
    copy over the gap (what lies in it is copied too, unread)."""
    merged: list = []
    for start, n in ranges:
        if merged and start - sum(merged[-1]) <= gap:
            merged[-1] = (merged[-1][0], start + n - merged[-1][0])
        else:
            merged.append((start, n))
    return merged


# Dropped uploads whose last copies may still be queued: (events, pinned buffers, ready, destroy) each. torch's
# pinned allocator hands a freed block out again at once unless a copy torch made itself is pending on it, and
# ours go straight to the driver, so a dropped upload's buffers are held here until its copies are done.
_PENDING: list = []


def _release(events: list, hosts: list, ready, destroy) -> None:
    """A dropped StagedUpload's end (weakref.finalize): no driver call here (the collector may run it anywhere,
    a graph capture included); reap_dropped gives the buffers back later."""
    if any(e is not None for e in events):
        _PENDING.append((events, hosts, ready, destroy))


_REAPING = threading.Lock()  # one thread reaps at a time: two would destroy the same events


def reap_dropped() -> None:
    """Give back the buffers of dropped uploads whose copies are done and destroy their events; never blocks
    (each new upload and each plan's host() calls it: one list test when nothing is pending). Where another
    thread is reaping, this call leaves the list to it (a later call reaps what is left)."""
    if not _PENDING or not _REAPING.acquire(blocking=False):
        return
    try:
        _reap()
    finally:
        _REAPING.release()


def _reap() -> None:
    keep, n = [], len(_PENDING)  # (a finalizer may append while this runs, even in this thread: those stay)
    for item in _PENDING[:n]:
        events, _, ready, destroy = item
        try:
            done = all(e is None or ready(e) for e in events)
            if done:
                for e in events:
                    if e is not None:
                        destroy(e)
        except Exception:  # noqa: BLE001 (a context already torn down: nothing is left to wait for)
            done = True
        if not done:
            keep.append(item)
    _PENDING[:n] = keep


class StagedUpload:
    """host() -> the numpy buffer to fill; upload(n) copies its first n values to `dev`."""

    def __init__(self, num_int32: int, device: torch.device):
        self.device = device
        self.dev, self._hosts = self._alloc(num_int32)
        self._host_nps = [h.numpy() for h in self._hosts]
        # per buffer: recorded after its last copy; [2]: the fence recorded on each stream whose runs read the last
        # upload (order_run), before the next copy (in this list so that the finalizer destroys it too)
        self._events: list = [None, None, None]
        self._turn = 0
        self._copy_stream = None  # the stream the last upload's copies went on
        self._readers: set = set()  # other streams whose runs read the last upload (order_run)
        # (the finalizer holds the lists, not self: it sees the latest events and keeps the buffers to the end)
        weakref.finalize(self, _release, self._events, self._hosts, *self._event_ends()).atexit = False
        reap_dropped()

    def host(self) -> np.ndarray:
        """The host buffer of the next upload, once its previous copy has read it."""
        if _PENDING:
            reap_dropped()
        if self._events[self._turn] is not None:
            with self._on_device():  # (a worker thread's first driver call may be this wait)
                self._wait(self._events[self._turn])
        return self._host_nps[self._turn]

    def order_run(self) -> None:
        """A run on the current stream is about to read the last upload. On the copy's own stream nothing is needed
        (the common case: one comparison). On another, that stream waits for the copy's event, and the next upload's
        copy waits for the run (upload_ranges). Not while capturing a graph, whose replay plan() cannot reach:
        graph mode orders plan() and replay on one stream (docs/serving.md)."""
        stream = self._stream()
        if stream == self._copy_stream or self._copy_stream is None or self._capturing():
            return
        with self._on_device():
            self._stream_wait(stream, self._events[self._turn ^ 1])
        self._readers.add(stream)

    def upload(self, num_int32: int) -> None:
        """Enqueue the copy of the first num_int32 values of host() on torch's current stream."""
        self.upload_ranges(((0, num_int32),))

    def stage(self, pieces) -> np.ndarray:
        """Write each (start, values) into host() at start and enqueue the copies of those extents (neighbours
        within COPY_GAP as one copy). Returns the buffer written (the next host() is the other one)."""
        host = self.host()
        for start, values in pieces:
            host[start:start + len(values)] = values
        self.upload_ranges(coalesce([(start, len(values)) for start, values in pieces]))
        return host

    def upload_ranges(self, ranges) -> None:
        """Enqueue the copies of host()[start:start + n] for each (start, n), then one event: a buffer
        of fixed regions (graph mode) copies only what a plan filled."""
        for start, n in ranges:  # a planner bug, not a user error: never copy past the buffers
            if start < 0 or start + n > self.dev.numel():
                raise ValueError(f"StagedUpload.upload: values [{start}, {start + n}) exceed the "
                                 f"{self.dev.numel()}-value buffers")
        turn = self._turn
        with self._on_device():  # (the copy and its event go on the buffer's device, in its context)
            stream = self._stream()
            if self._readers or self._copy_stream not in (None, stream):  # (one stream throughout: two tests)
                self._order_after_readers(stream)
            self._copy_stream = stream
            dev, host = self.dev.data_ptr(), self._hosts[turn].data_ptr()
            for start, n in ranges:
                if n:
                    self._copy(dev + 4 * start, host + 4 * start, 4 * n, stream)
            self._events[turn] = self._record(self._events[turn], stream)
        self._turn ^= 1

    def _order_after_readers(self, stream: int) -> None:
        """This copy, on `stream`, waits for the runs on other streams that may still read what it overwrites: those
        order_run saw, and the last copy's own stream (its runs needed no order_run)."""
        readers = self._readers - {stream}
        if self._copy_stream not in (None, stream):
            readers.add(self._copy_stream)
        for other in readers:
            self._events[2] = self._record(self._events[2], other)
            self._stream_wait(stream, self._events[2])
        self._readers.clear()

    def drain(self) -> None:
        """Wait for every copy this object enqueued, and the fence (before its buffers are freed)."""
        for event in self._events:
            if event is not None:
                self._wait(event)

    # -- the CUDA calls (HostOnlyUpload replaces these) ---------------------------------------------
    def _on_device(self):
        return on_device(self.device)

    def _stream(self) -> int:
        return current_stream_handle(self.device.index)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _alloc(self, n: int):
        ensure_context(self.device)
        return (torch.zeros(n, dtype=torch.int32, device=self.device),
                [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)])

    def _copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        drv = driver()
        check(drv.cuMemcpyHtoDAsync(dst, src, nbytes, drv.CUstream(stream)), f"cuMemcpyHtoDAsync(plan, {nbytes} B)")

    def _record(self, event, stream: int):
        drv = driver()
        if event is None:  # one event per buffer, re-recorded: creating one is a driver call
            event = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        check(drv.cuEventRecord(event, drv.CUstream(stream)), "cuEventRecord(plan upload)")
        return event

    def _wait(self, event) -> None:
        check(driver().cuEventSynchronize(event), "cuEventSynchronize(plan upload)")

    def _stream_wait(self, stream: int, event) -> None:
        drv = driver()
        check(drv.cuStreamWaitEvent(drv.CUstream(stream), event, 0), "cuStreamWaitEvent(plan upload)")

    def _event_ends(self) -> tuple:
        """(ready, destroy) for a dropped upload's events: functions that do not hold self. ready() asks nothing
        of the driver while this thread captures a graph (a query there would end the capture)."""
        drv = driver()
        ready = lambda e: (not torch.cuda.is_current_stream_capturing()  # noqa: E731
                           and drv.cuEventQuery(e)[0] == drv.CUresult.CUDA_SUCCESS)
        return ready, lambda e: check(drv.cuEventDestroy(e), "cuEventDestroy(plan upload)")


class HostOnlyUpload(StagedUpload):
    """StagedUpload without a GPU, for tests and host-cost timing: `dev` is host memory, the copy is
    a memmove, and `log` records ("record" | "wait", event id) in order."""

    def __init__(self, num_int32: int):
        self.log: list = []
        self.in_flight: set = set()  # events whose "copies" a test holds as not done (their buffers are held)
        self.stream, self.capturing = 0, False  # the current stream and whether it captures (tests set them)
        self._next_event = 0
        super().__init__(num_int32, torch.device("cpu"))

    def _on_device(self):
        return contextlib.nullcontext()

    def _stream(self) -> int:
        return self.stream  # (a test sets it: the stream a plan or run is on)

    def _capturing(self) -> bool:
        return self.capturing

    def _alloc(self, n: int):
        return torch.zeros(n, dtype=torch.int32), [torch.zeros(n, dtype=torch.int32) for _ in range(2)]

    def _copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def _record(self, event, stream: int):
        if event is None:
            event, self._next_event = self._next_event, self._next_event + 1
        self.log.append(("record", event))
        return event

    def _wait(self, event) -> None:
        self.log.append(("wait", event))

    def _stream_wait(self, stream: int, event) -> None:
        self.log.append(("stream waits", stream, event))

    def _event_ends(self) -> tuple:
        log, in_flight = self.log, self.in_flight
        return lambda e: e not in in_flight, lambda e: log.append(("destroy", e))

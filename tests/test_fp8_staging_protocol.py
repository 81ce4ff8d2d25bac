"""CPU model of the fp8 staging ring of the wgmma prefill producer (templates/batch_prefill_wgmma.cu.jinja).

Each producer thread copies tile t into staging slot (g0 + t) % F, F - 1 tiles ahead of the tile it
widens (its copies and the chunks it widens are different ones: the widening's mapping avoids bank
conflicts, KVTileLoader::widen_sw128), and arrives on the slot's `staged` barrier once its copies so
far have landed (cp.async.mbarrier.arrive.noinc); with TMA one thread also issues boxes that write every thread's
chunks and count against the same phase. Before each copy a barrier among the producer threads
(bar.sync 3) makes sure every thread is done widening the tile that was in the slot. The model runs
the kernel's index and parity arithmetic under random interleavings and checks that no thread reads a
chunk that holds another tile, no copy lands on a chunk a thread still reads, nothing deadlocks and no
waiter falls two phases behind. The 16-bit ring after the widening is tests/test_ring_protocol.py's.
"""
import random

import pytest

from test_ring_protocol import Barrier, interleave


class NamedBarrier:
    """bar.sync among n threads: generation g opens once all n have arrived at it."""

    def __init__(self, n: int):
        self.n, self.arrived, self.generation = n, 0, 0

    def sync(self):
        gen = self.generation
        self.arrived += 1
        if self.arrived == self.n:
            self.arrived, self.generation = 0, gen + 1
        while self.generation == gen:
            yield


def producer_thread(s, i, items, tma, named_barrier, past_end=False, widen_shift=1):
    """Producer thread i: copies chunk i of every slot (cp.async), or the copy engine's boxes (TMA: thread
    0 issues a whole tile), and widens chunk (i + widen_shift) % threads (0: its own copy). tiles_done runs
    on across items, as the kernel's ring does."""
    F, tiles_done, w = s["F"], 0, (i + widen_shift) % s["threads"]
    for n in items:
        g0 = tiles_done

        def load(t):
            if t >= n and not past_end:
                return  # those ring positions are the next item's
            g = g0 + t
            if tma:
                if i == 0:  # the box issuer: its bytes join the phase before any arrival of its own
                    s["staged"][g % F].expect_tx()
                    s["in_flight"].append(("tma", g))
            else:
                s["in_flight"].append((i, g))
            s["in_flight"].append(("arrive", i, g))  # noinc: fires once this thread's copies so far landed

        if named_barrier:
            yield from s["bar"].sync()
        for t in range(F - 1):
            load(t)
        for t in range(n):
            if t > 0 and named_barrier:
                yield from s["bar"].sync()
            load(t + F - 1)
            g = g0 + t
            while not s["staged"][g % F].ready((g // F) & 1, g // F):
                yield
            assert s["slot"][g % F][w] == g, "widened a chunk that holds another tile"
            s["readers"][g % F][w] += 1
            yield  # the widening's loads, spread over time
            assert s["slot"][g % F][w] == g, "a copy landed under the widening"
            s["readers"][g % F][w] -= 1
            yield
        tiles_done += n
    s["done"] += 1


def copy_engine(s, threads):
    """Lands copies and arrivals in issue order, at moments of its own (one thread's arrival never
    overtakes its copies; TMA boxes complete their bytes on the barrier)."""
    F = s["F"]
    while s["done"] < threads or s["in_flight"]:
        if s["in_flight"] and random.random() < 0.5:
            op = s["in_flight"].pop(0)
            if op[0] == "arrive":
                s["staged"][op[2] % F].arrive()
            else:
                owner, g = op
                chunks = range(threads) if owner == "tma" else [owner]
                for c in chunks:
                    assert s["readers"][g % F][c] == 0, "a copy landed on a chunk a thread still reads"
                    s["slot"][g % F][c] = g
                if owner == "tma":
                    s["staged"][g % F].complete_tx()
        yield


class StagedBarrier(Barrier):
    """An mbarrier with a transaction count: a phase also waits for the bytes expected in it."""

    def __init__(self, count: int):
        super().__init__(count)
        self.tx = 0

    def expect_tx(self):
        self.tx += 1

    def complete_tx(self):
        self.tx -= 1
        self._maybe_complete()

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == self.count and self.tx == 0:
            self.pending, self.completed = 0, self.completed + 1


def run(items, F, threads, tma, seed, named_barrier=True, past_end=False, widen_shift=1):
    random.seed(seed)
    s = {"F": F, "threads": threads, "staged": [StagedBarrier(threads) for _ in range(F)],
         "slot": [[-1] * threads for _ in range(F)], "readers": [[0] * threads for _ in range(F)], "in_flight": [],
         "done": 0, "bar": NamedBarrier(threads)}
    agents = [producer_thread(s, i, items, tma, named_barrier, past_end, widen_shift) for i in range(threads)]
    agents.append(copy_engine(s, threads))
    interleave(agents, seed)


@pytest.mark.parametrize("F", [2, 3, 4])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_staging_never_deadlocks_or_overwrites(F, tma, seed):
    rng = random.Random(seed)
    items = [rng.choice([0, 1, 2, 3, 7]) for _ in range(10)]  # empty items and ones longer than the ring
    run(items, F, threads=4, tma=tma, seed=seed)


def test_the_model_catches_refills_without_the_barrier():
    # a thread that widened only its own cp.async chunks would need no barrier (it overwrites only what it
    # has widened), but TMA boxes, and the widening's bank-conflict-free mapping, read and write other
    # threads' chunks: without bar.sync a copy lands under a slower thread's widening
    caught = {"cp.async": 0, "tma": 0}
    for seed in range(30):
        run([9, 4, 6], 2, threads=4, tma=False, seed=seed, named_barrier=False, widen_shift=0)  # never fails
        for name, tma in (("cp.async", False), ("tma", True)):
            try:
                run([9, 4, 6], 2, threads=4, tma=tma, seed=seed, named_barrier=False)
            except AssertionError as e:
                caught[name] += "under the widening" in str(e) or "still reads" in str(e) or "another tile" in str(e)
    assert caught["cp.async"] > 0 and caught["tma"] > 0


def test_the_model_catches_copies_past_the_items_tiles():
    # the cp.async version committed an empty group past the item's tiles; arriving there instead
    # completes phases that belong to the next item's tiles, so their waits open on stale chunks
    caught = 0
    for seed in range(20):
        try:
            run([3, 5, 2, 6], 3, threads=4, tma=False, seed=seed, past_end=True)
        except AssertionError as e:
            caught += "another tile" in str(e) or "pending" in str(e) or "two phases" in str(e) or "deadlock" in str(e)
    assert caught > 0

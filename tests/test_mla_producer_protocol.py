"""CPU model of the transposed wgmma MLA kernel's item loop with its producer warpgroup
(templates/mla_decode.cu.jinja, the kernel with `producer`): warpgroup 1 copies, warpgroup 0 computes.

Per item: the copier issues the first two tiles as cp.async groups and waits for them before the item's
first __syncthreads; later tiles refill stage t % 2 once the computing warpgroup released tile t - 2
(the empty mbarrier), each landing completing a phase of the stage's full mbarrier (cp.async.mbarrier.arrive
.noinc, which fires once all of the thread's earlier copies landed). After the tiles, __syncthreads, the
rows' finish, __syncthreads; then the output is staged in fp32 over every stage (warpgroup 0 writes it),
__syncthreads, every thread reads it back, __syncthreads. Thread 0 re-arms both mbarrier pairs each item.

Under random interleavings the model checks what racecheck reports as hazards on this kernel (perf-notes,
eighty-fifth section): no copy lands in a stage a warpgroup still reads, no tile is read before it
landed, the staging tile is written only when no copy is in flight and nothing reads a stage, and read
back only while it holds this item's rows; mbarriers are re-armed only with no arrival on its way; no deadlock.
Each negative control drops one ordering and must fail.
"""
import pytest

from barrier_model import run_schedule

STAGES = 2


class MBarrier:
    """An mbarrier of one expected arrival (a warpgroup's 128 threads move as one agent here): each arrival
    completes a phase."""

    def __init__(self):
        self.completed = 0

    def arrive(self):
        self.completed += 1

    def passed(self, phase: int) -> bool:  # try_wait.parity for the waiter's phase index
        assert self.completed <= phase + 1, "a waiter two phases behind: the parity would alias"
        return self.completed == phase + 1


def issue(s, slot, item, t, tracked):
    assert s["readers"][slot] == 0, f"tile {t} of item {item} copied into stage {slot} while it is read"
    assert s["staged_readers"] == 0, "a copy into the staging tile while it is read back"
    s["seq"] += 1
    s["stage"][slot] = ("flight", item, t)
    s["flight"].append((s["seq"], slot, item, t, tracked))


def copy_engine(s):
    """Lands the copier's copies in any order; a noinc arrival fires once every earlier copy has landed."""
    while not (s["done"][0] and s["done"][1]):
        if s["flight"] and s["rng"].random() < 0.5:
            seq, slot, item, t, tracked = s["flight"].pop(s["rng"].randrange(len(s["flight"])))
            s["stage"][slot] = ("landed", item, t)
            if tracked == "mbar":
                s["arrivals"].append((seq, slot))
        for seq, slot in sorted(s["arrivals"]):
            if all(f[0] > seq for f in s["flight"]):
                s["arrivals"].remove((seq, slot))
                s["full"][slot].arrive()
        yield
    assert not s["flight"] and not s["arrivals"], "copies issued and never waited for"
    s["done"][2] = True


def read_back_staging(s, item):
    assert all(st == ("staged", item) for st in s["stage"]), f"read back {s['stage']} as item {item}'s rows"
    s["staged_readers"] += 1
    yield
    s["staged_readers"] -= 1


def copier(s, items):
    bug = s["skip"]
    for item, n in enumerate(items):
        for slot in range(min(n, STAGES)):
            issue(s, slot, item, slot, "group")
            yield
        while bug != "group_wait" and any(f[4] == "group" for f in s["flight"]):
            yield  # cp_async_wait<0>: its own groups
        yield from s["cta_barrier"](1)
        for t in range(STAGES, n):
            slot, phase = t % STAGES, t // STAGES - 1
            while not s["empty"][slot].passed(phase):
                yield
            issue(s, slot, item, t, "mbar")
            yield
        yield from s["cta_barrier"](1)  # the tiles are done
        yield from s["cta_barrier"](1)  # the rows' factors are written
        yield from s["cta_barrier"](1)  # (store_staged_rows) every element is staged
        yield from read_back_staging(s, item)
        if bug != "last_barrier":
            yield from s["cta_barrier"](1)  # q, the row state and the stages are rewritten by the next item
    s["done"][1] = True


def computer(s, items, early_scores):
    bug = s["skip"]
    for item, n in enumerate(items):
        # thread 0 re-arms the barriers: no arrival of the last item may still be on its way to them (the next
        # item's first tiles may already fly: cp.async groups, which arrive on no barrier)
        pending = s["arrivals"] or any(f[4] == "mbar" for f in s["flight"])
        assert not pending, "mbarriers re-armed with a copy's arrival still to come"
        s["full"], s["empty"] = [MBarrier() for _ in range(STAGES)], [MBarrier() for _ in range(STAGES)]
        yield from s["cta_barrier"](0)

        def take(t):  # wait for tile t (the first two landed before the item's first barrier), start reading it
            slot = t % STAGES
            while t >= STAGES and bug != "full_wait" and not s["full"][slot].passed(t // STAGES - 1):
                yield
            assert s["stage"][slot] == ("landed", item, t), f"tile {t} read as {s['stage'][slot]}"
            s["readers"][slot] += 1

        def landed(t):  # mbar_test: S^T(t + 1) goes early only where its tile has landed
            return t < STAGES or s["full"][t % STAGES].passed(t // STAGES - 1)

        reading = False  # tile t's S^T issued already (early scores)
        for t in range(n):
            if not reading:
                yield from take(t)
            yield  # softmax(t), P.V(t) in flight
            reading = early_scores and t + 1 < n and landed(t + 1)
            if reading:
                yield from take(t + 1)  # S^T(t + 1) behind P.V(t)
            if bug == "early_release" and t + STAGES < n:
                s["empty"][t % STAGES].arrive()  # released before P.V(t) retired
            yield
            s["readers"][t % STAGES] -= 1  # P.V(t) retired: tile t's stage is free
            if bug != "early_release" and t + STAGES < n:
                s["empty"][t % STAGES].arrive()
        yield from s["cta_barrier"](0)
        yield from s["cta_barrier"](0)
        assert not s["flight"], "the staging tile written over a copy in flight"
        assert not any(s["readers"]) and s["staged_readers"] == 0, "the staging tile written over a read"
        s["stage"] = [("staged", item)] * STAGES  # write_output: fp32 rows over every stage
        yield
        yield from s["cta_barrier"](0)
        yield from read_back_staging(s, item)
        yield from s["cta_barrier"](0)
    s["done"][0] = True


ITEMS = [[5, 1, 0, 2, 9], [3, 3, 3], [1, 2, 0, 0, 7, 4], [12], [0, 6, 1]]


def run(items, seed, early_scores, skip=None):
    s = {"bars": {}, "skip": skip, "done": [False, False, False], "stage": [None] * STAGES,
         "readers": [0] * STAGES, "staged_readers": 0, "flight": [], "arrivals": [], "seq": 0,
         "full": [MBarrier() for _ in range(STAGES)], "empty": [MBarrier() for _ in range(STAGES)]}
    run_schedule(s, [lambda s: computer(s, items, early_scores), lambda s: copier(s, items), copy_engine], seed)


@pytest.mark.parametrize("early_scores", [False, True])
@pytest.mark.parametrize("items", ITEMS)
def test_every_interleaving_keeps_the_stages_and_the_staging_tile_apart(items, early_scores):
    for seed in range(60):
        run(items, seed, early_scores)


@pytest.mark.parametrize("skip", ["group_wait", "full_wait", "early_release", "last_barrier"])
def test_each_dropped_ordering_is_caught(skip):
    """The model is not vacuous: without the copier's wait for its first tiles, the computing warpgroup's wait
    for a refill, the release after P.V, or the item's last __syncthreads, some schedule fails."""
    failures = 0
    for seed in range(60):
        for items in ITEMS:
            try:
                run(items, seed, True, skip)
            except AssertionError:
                failures += 1
    assert failures > 0

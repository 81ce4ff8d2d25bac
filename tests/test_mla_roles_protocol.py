"""CPU model of the wgmma MLA "roles" schedule's named-barrier protocol (templates/mla_decode.cu.jinja,
run_item_roles): warpgroup 0 computes S, the softmax and P.V for the first kDvW0 dims; warpgroup 1
copies the tiles, each stage in two parts as their readers finish, and runs P.V for the other dims. Four named barriers of count 256 (one warpgroup arrives, the other waits).

Under many random interleavings the model checks that no schedule deadlocks; that every read sees
the tile, P and rescale factors of the step it belongs to; that no copy lands in a stage and no P
is written while the other warpgroup still reads it; and that a barrier phase is always completed
by one arrival of each warpgroup (bar.arrive does not wait, so a warpgroup arriving twice on the
same barrier before the other waits would complete the phase by itself: the hazard named barriers
invite). Reads and the asynchronous copies are modelled as intervals the other side can interleave.

Warpgroup 1 may refill by the copy engine (tma): the even split's whole tile, or a split refill's
second part (its first stays cp.async). The boxes land whenever the engine (a third agent) gets to
them, completing a phase of the stage's mbarrier; both warpgroups wait on it for such a tile, each with
its own parity bits, while kBarFull is still announced for every tile (for the cp.async part). A phase
completed twice before its waiter looked would deadlock the model.
"""
import pytest

from barrier_model import NamedBarrier, arrive, run_schedule, sync

FULL, P, PFREE, STAGE = 1, 2, 3, 4
LO, HI = 0, 1  # a stage's parts: the rope and warpgroup 0's P.V dims; warpgroup 1's P.V dims


def wait_engine(s, wg, t):
    """mbarrier.try_wait.parity on tile t's stage, for a copy-engine tile (templates/mla/
    normal_wgmma.cu.jinja, tma_wait_tile): passes once the phase of this warpgroup's parity completed."""
    if not s["tma"](t) or (s["skip"] == "engine" and wg == 0):
        return
    st = t % 2
    parity = (s["parity"][wg] >> st) & 1
    while (s["engine_phases"][st] & 1) == parity:
        yield
    s["parity"][wg] ^= 1 << st


def copy_engine(s):
    """The TMA unit: lands the boxes of an issued tile at some later step (any order across stages)."""
    while not (s["done"][0] and s["done"][1]):
        if s["inflight"] and s["rng"].random() < 0.5:
            st, item, t, parts = s["inflight"].pop(s["rng"].randrange(len(s["inflight"])))
            for part in parts:
                s["stage"][st][part] = ("ready", item, t)
            s["engine_phases"][st] += 1
        yield
    assert not s["inflight"], "copy-engine tiles issued and never waited for"
    s["done"][2] = True


def scores_warpgroup(s, items):
    """Warpgroup 0 (all its warps run the same sequence)."""
    for item, n in enumerate(items):
        yield from s["cta_barrier"](0)
        for t in range(n):
            yield from sync(s, FULL, 0)
            yield from wait_engine(s, 0, t)
            st = t % 2
            assert s["stage"][st] == [("ready", item, t)] * 2, f"S({t}) read {s['stage'][st]}"
            s["readers"][st][LO] += 1  # S(t): Q . K(t)^T, every column block
            s["readers"][st][HI] += 1
            yield
            s["readers"][st][HI] -= 1
            yield  # softmax
            if t > 0:
                yield from sync(s, PFREE, 0)
            assert s["p_readers"] == 0, "P overwritten while warpgroup 1's P.V reads it"
            s["p"] = (item, t)  # P(t) and the rescale factors
            arrive(s, P, 0)
            yield  # P.V(t), dims [0, kDvW0): still reading part LO (with P from registers it is issued
            # before the kBarPFree wait and P's store: it reads no shared P, only part LO, held since S)
            assert s["stage"][st][LO] == ("ready", item, t)
            s["readers"][st][LO] -= 1
            arrive(s, STAGE, 0)
        if n > 0:
            yield from sync(s, PFREE, 0)
    s["done"][0] = True


def copy_warpgroup(s, items, split_refill):
    """Warpgroup 1: the copies (a stage refilled in two parts; split_refill: the first under its own
    P.V) and P.V for dims [kDvW0, 512)."""

    def issue(item, t, parts=(LO, HI)):
        st = t % 2
        for part in parts:
            assert s["readers"][st][part] == 0, f"tile {t} part {part} copied into stage {st} while it is read"
            s["stage"][st][part] = ("loading", item, t)

    def land(item, t):  # cp.async.wait_group: this warpgroup's copies of tile t (the engine's land on their own)
        for part in (LO,) if s["tma"](t) and split_refill else () if s["tma"](t) else (LO, HI):
            s["stage"][t % 2][part] = ("ready", item, t)

    def issue_engine(item, t, parts):
        st = t % 2
        for part in parts:
            assert s["readers"][st][part] == 0, f"tile {t}'s boxes issued into stage {st} part {part} while it is read"
            s["stage"][st][part] = ("loading", item, t)
        s["inflight"].append((st, item, t, parts))

    for item, n in enumerate(items):
        yield from s["cta_barrier"](1)
        for t in range(min(n, 2)):
            issue(item, t)
        yield
        if n > 0:
            land(item, 0)  # cp.async.wait_group (1 if two groups fly, else 0), then the proxy fence
            arrive(s, FULL, 1)
        for t in range(n):
            st = t % 2
            yield from wait_engine(s, 1, t)  # (before its P.V's wgmmas: the wait is a loop)
            yield from sync(s, P, 1)
            assert s["p"] == (item, t), f"P.V({t}) read P {s['p']}"
            assert s["stage"][st][HI] == ("ready", item, t)
            s["p_readers"] += 1  # P.V(t), dims [kDvW0, 512): in flight while the next tile is announced
            s["readers"][st][HI] += 1
            yield
            if t + 1 < n:
                land(item, t + 1)  # the only copies in flight
                arrive(s, FULL, 1)
                yield
            early = split_refill and t + 2 < n
            if early:
                yield from sync(s, STAGE, 1)
                issue(item, t + 2, (LO,))  # under this warpgroup's P.V(t)
                yield
            s["p_readers"] -= 1
            s["readers"][st][HI] -= 1
            arrive(s, PFREE, 1)
            if not early:
                yield from sync(s, STAGE, 1)
            if t + 2 < n and s["tma"](t + 2):
                issue_engine(item, t + 2, (HI,) if early else (LO, HI))
            elif t + 2 < n:
                issue(item, t + 2, (HI,) if early else (LO, HI))
    s["done"][1] = True


def run(items, seed, skip=None, split_refill=True, tma=lambda t: False):
    """tma(t): whether tile t (from 2 on, a function of its position alone, as tile_by_tma) goes by
    the copy engine (split_refill: its second part)."""
    s = {"bars": {b: NamedBarrier() for b in (FULL, P, PFREE, STAGE)}, "stage": [[None, None], [None, None]],
         "readers": [[0, 0], [0, 0]], "p": None, "p_readers": 0, "done": [False, False, False], "skip": skip,
         "tma": lambda t: t >= 2 and tma(t), "inflight": [], "engine_phases": [0, 0], "parity": [0, 0]}
    run_schedule(s, [lambda s: scores_warpgroup(s, items), lambda s: copy_warpgroup(s, items, split_refill),
                     copy_engine], seed)


@pytest.mark.parametrize("split_refill", [True, False])
@pytest.mark.parametrize("items", [[1], [2], [3], [7], [0], [0, 3, 1, 0, 5], [2, 2, 2], [9, 1]])
def test_roles_protocol_never_deadlocks_or_races(items, split_refill):
    for seed in range(300):
        run(items, seed, split_refill=split_refill)


@pytest.mark.parametrize("split_refill", [True, False])
@pytest.mark.parametrize("skipped", [STAGE, PFREE, P])
def test_model_catches_a_missing_wait(skipped, split_refill):
    """The model is not vacuous: if the waiting side of one barrier did not wait (kBarStage: a copy
    lands in a stage warpgroup 0 still reads; kBarPFree: P is rewritten under warpgroup 1's P.V;
    kBarP: warpgroup 1 reads a stale P), some random schedule fails."""
    with pytest.raises(AssertionError):
        for seed in range(300):
            run([6], seed, skip=skipped, split_refill=split_refill)


TMA_PATTERNS = {"every": lambda t: True, "even": lambda t: t % 2 == 0, "two_of_three": lambda t: t % 3 != 1}


@pytest.mark.parametrize("split_refill", [True, False])
@pytest.mark.parametrize("pattern", sorted(TMA_PATTERNS))
@pytest.mark.parametrize("items", [[3], [7], [0, 3, 1, 0, 5], [2, 2, 2], [9, 1], [4, 6]])
def test_copy_engine_tiles_mixed_with_cp_async_ones(items, pattern, split_refill):
    for seed in range(300):
        run(items, seed, split_refill=split_refill, tma=TMA_PATTERNS[pattern])


@pytest.mark.parametrize("split_refill", [True, False])
def test_model_catches_a_missing_copy_engine_wait(split_refill):
    """Not vacuous: warpgroup 0 reading a copy-engine tile without its mbarrier wait meets a stage
    (part) still loading in some schedule."""
    with pytest.raises(AssertionError):
        for seed in range(300):
            run([6], seed, skip="engine", split_refill=split_refill, tma=TMA_PATTERNS["every"])

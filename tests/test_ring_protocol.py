"""CPU model of the prefill producer/consumer mbarrier protocol (templates/batch_prefill_wgmma.cu.jinja).

The GPU tests can only show that a schedule happened to work; this model runs the same index and
parity arithmetic as the kernel under many random interleavings and checks that no schedule
deadlocks, that a consumer always reads the tile (and Q) it expects, and that the producer never
overwrites a stage or Q that a consumer warp still reads. mbarrier semantics as PTX defines them:
a phase completes when its expected arrivals are in; try_wait.parity(p) succeeds once the phase
of parity p has completed, so a waiter more than one phase behind would alias (checked too).
Both rings: the shared one (K and V of a stage fill and free together) and the split one (head_dim
256: two K slots and three V slots, each on barriers of its own, K freed an iteration before V; fp8
K/V at head_dim 128: two and two, V widened from staging once P.V of its slot's last tile retired).
"""
import random

import pytest


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def ready(self, parity: int, phase: int) -> bool:
        """try_wait.parity for the waiter's intended phase index `phase` (parity = phase & 1)."""
        assert parity == phase & 1
        assert self.completed <= phase + 1, "a waiter two phases behind: the parity would alias"
        return self.completed == phase + 1


def producer(s, items, stages, persistent, q_for_empty=False, wait_empty=True, k_ahead=False):
    """The producer warpgroup as one agent (its 128 threads run the same sequence). Each thread
    issues a tile's copies and a cp.async.mbarrier.arrive on the stage's full barrier, which fires
    once its copies (and all its earlier ones, Q included) have landed: the copy engine agent below.
    A split ring issues K(t), then V(t) (k_ahead: K(t), then V(t-1), and the item's last V after its
    loop), each into its own slot after waiting on its own empty barrier."""
    tiles_done = q_loads = 0
    for k, n in enumerate(items):
        if n > 0 or q_for_empty:  # only items with tiles load Q, and only they count q_empty's phases
            if persistent and q_loads > 0:
                while not s["q_empty"].ready((q_loads - 1) & 1, q_loads - 1):
                    yield
            assert s["q_readers"] == 0, "Q overwritten while a consumer warp reads it"
            s["q"] = k
            q_loads += 1
        if k_ahead:
            order = [x for t in range(1, n) for x in (("K", t), ("V", t - 1))]
            order = [("K", 0)] + order + [("V", n - 1)] if n > 0 else []
        else:
            order = [(mat, t) for t in range(n) for mat in s["mats"]]
        for mat, t in order:
            g = tiles_done + t
            n_slots = s["slots"][mat]
            if g >= n_slots and wait_empty:
                bar, phase = s["empty"][mat][g % n_slots], g // n_slots - 1
                while not bar.ready(phase & 1, phase):
                    yield
            assert s["readers"][mat][g % n_slots] == 0, "stage overwritten while a consumer warp reads it"
            s["stage"][mat][g % n_slots] = g
            s["in_flight"].append((mat, g))
            yield
        tiles_done += n
    s["producer_done"] = True


def copy_engine(s, stages):
    """Lands the issued copies in order (an arrival waits for all of a thread's earlier copies) at
    moments of its own, each completing its matrix's full-barrier phase."""
    while not (s["producer_done"] and not s["in_flight"]):
        if s["in_flight"]:
            mat, g = s["in_flight"].pop(0)
            s["full"][mat][g % s["slots"][mat]].arrive()
        yield


def consumer(s, items, stages, persistent, q_for_empty=False, q_early=0, v_early=False, k_ahead=False,
             k_early=False):
    """One consumer warp (8 of them arrive on empty[] and q_empty); q_early > 0 releases Q that many
    S products before the item's last, v_early frees a split ring's V(t) as it lands, k_early (with
    k_ahead) its K(t+1) as S(t+1) is issued (bugs the model must catch). The shared ring reads stage t
    from S(t) to P.V(t); a split ring reads K(t) until step 3 of iteration t (k_ahead: until S(t)
    retired, freed there before softmax(t)), and V(t) from there until P.V(t) retired, an iteration later."""
    split = s["mats"] == ("K", "V")
    k_mat, v_mat = s["mats"][0], s["mats"][-1]
    tiles_done = 0
    for k, n in enumerate(items):
        g0 = tiles_done

        def wait_full(mat, t):
            g, n_slots = g0 + t, s["slots"][mat]
            while not s["full"][mat][g % n_slots].ready((g // n_slots) & 1, g // n_slots):
                yield
            assert s["stage"][mat][g % n_slots] == g, "read a stage that holds another tile"
            s["readers"][mat][g % n_slots] += 1

        def unread(mat, t):
            s["readers"][mat][(g0 + t) % s["slots"][mat]] -= 1

        def free(mat, t):
            s["empty"][mat][(g0 + t) % s["slots"][mat]].arrive()

        def release(mat, t):
            unread(mat, t)
            free(mat, t)

        def release_q():  # the item's last S is done: Q is free (persistent: the producer may reload it)
            s["q_readers"] -= 1
            if persistent:
                s["q_empty"].arrive()

        if n > 0:
            yield from wait_full(k_mat, 0)
            assert s["q"] == k, "read another item's Q"
            s["q_readers"] += 1
            yield  # S(0)
            if max(1, n - q_early) == 1:  # S products done: 1
                release_q()
            if split and k_ahead:
                release("K", 0)
        for t in range(n):
            if split:  # step 3: P.V(t-1) retired (and S(t), where K(t) is still held)
                if not k_ahead:
                    release("K", t)
                if t > 0:
                    (unread if v_early else release)("V", t - 1)
            elif t > 0:
                release("KV", t - 1)
            if t + 1 < n:
                yield from wait_full(k_mat, t + 1)
                assert s["q"] == k, "S(t+1) read another item's Q"
            if split:
                yield from wait_full("V", t)
                if v_early:  # the bug: V(t) freed with K(t), before P.V(t) even ran
                    free("V", t)
            if t + 1 < n:
                if split and k_early:  # the bug: K(t+1) freed while S(t+1) still reads it
                    free("K", t + 1)
                yield  # S(t+1) in flight under P.V(t)
                if t + 2 == max(1, n - q_early):
                    release_q()
                if split and k_ahead:  # S(t+1) retired
                    (unread if k_early else release)("K", t + 1)
            yield
        if n > 0:
            (unread if v_early else release)(v_mat, n - 1)
        elif persistent and q_for_empty:  # the first version: every item arrived, empty or not
            s["q_empty"].arrive()
        tiles_done += n


def interleave(agents, seed):
    """Steps randomly chosen agents (generators that yield while they wait) until all are done."""
    rng, live, steps = random.Random(seed), list(agents), 0
    while live:
        agent = rng.choice(live)
        try:
            next(agent)
        except StopIteration:
            live.remove(agent)
        steps += 1
        assert steps < 200_000, f"deadlock: {len(live)} agents still waiting"


def run(items, stages, warps, persistent, seed, q_for_empty=False, wait_empty=True, q_early=0, split=False,
        v_early=False, v_slots=None, k_ahead=False, k_early=False):
    """split: K in `stages` slots, V in v_slots (default stages + 1, the kernel's) slots."""
    slots = {"K": stages, "V": v_slots or stages + 1} if split else {"KV": stages}
    mats = tuple(slots)
    s = {"mats": mats, "slots": slots, "full": {m: [Barrier(1) for _ in range(n)] for m, n in slots.items()},
         "empty": {m: [Barrier(warps) for _ in range(n)] for m, n in slots.items()},
         "q_empty": Barrier(warps), "stage": {m: [None] * n for m, n in slots.items()},
         "readers": {m: [0] * n for m, n in slots.items()}, "q": None, "q_readers": 0,
         "in_flight": [], "producer_done": False}
    agents = [producer(s, items, stages, persistent, q_for_empty, wait_empty, k_ahead), copy_engine(s, stages)]
    agents += [consumer(s, items, stages, persistent, q_for_empty, q_early, v_early, k_ahead, k_early)
               for _ in range(warps)]
    interleave(agents, seed)
    assert all(r == 0 for m in mats for r in s["readers"][m]) and s["q_readers"] == 0


@pytest.mark.parametrize("stages,split,v_slots,k_ahead", [
    (3, False, None, False), (4, False, None, False), (6, False, None, False), (2, True, None, False),
    (3, True, None, False), (1, True, None, False), (2, True, 2, False),
    (2, True, 2, True), (2, True, None, True), (1, True, 2, True)])  # k_ahead: K a tile ahead of V (192/128)
@pytest.mark.parametrize("seed", range(6))
def test_persistent_ring_never_deadlocks_or_overwrites(stages, split, v_slots, k_ahead, seed):
    rng = random.Random(seed)
    items = [rng.choice([0, 1, 2, 5, 9]) for _ in range(12)]  # empty items and ones longer than the ring
    run(items, stages, warps=8, persistent=True, seed=seed, split=split, v_slots=v_slots, k_ahead=k_ahead)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("stages,split,k_ahead", [(3, False, False), (2, True, False), (2, True, True)])
def test_one_item_per_cta(n, stages, split, k_ahead):
    for seed in range(4):
        run([n], stages=stages, warps=8, persistent=False, seed=seed, split=split, k_ahead=k_ahead)


def caught(items, needles, stages=3, **bug):
    """Seeds (of 20) in which the model, run with a deliberate protocol bug, fails an assertion naming it."""
    n = 0
    for seed in range(20):
        try:
            run(items, stages=stages, warps=8, persistent=True, seed=seed, **bug)
        except AssertionError as e:
            n += any(needle in str(e) for needle in needles)
    return n


def test_the_model_catches_the_first_q_empty_rule():
    # the kernel's first version arrived on q_empty for empty items too: a warp through an empty item
    # then completed the phase a slower warp had not, and the producer overwrote Q under it
    assert caught([5, 0, 3, 0, 0, 4], ("Q overwritten", "another item's Q"), q_for_empty=True) > 0


def test_the_model_catches_a_producer_that_does_not_wait_for_free_stages():
    assert caught([9, 4], ("stage overwritten", "holds another tile"), wait_empty=False) > 0


def test_the_model_catches_q_released_before_the_last_product():
    # Q is released right after S(n-1), the item's last read of it (not at the item's end, so the next
    # item's Q loads under the last tile and the epilogue); one product earlier is a race
    assert caught([4, 3, 5, 2], ("Q overwritten", "another item's Q"), q_early=1) > 0


def test_the_model_catches_a_split_ring_that_frees_v_with_k():
    # V(t) stays taken until P.V(t) retired; freed as it lands, the producer refills it under the
    # product when V has as many slots as K. (At the kernel's one more V slot the K ring alone keeps
    # the producer far enough behind: V(t+3) follows K(t+3), which waits for S(t+1).)
    assert caught([9, 4], ("stage overwritten", "holds another tile"), stages=2, split=True, v_early=True,
                  v_slots=2) > 0



def test_the_model_catches_a_split_ring_that_frees_k_before_its_s_retired():
    # K(t+1) is freed as S(t+1) retires (the wait that ends step 5), a softmax before step 3; freed as S(t+1)
    # is issued, the producer refills the slot under the product
    assert caught([9, 4], ("stage overwritten", "holds another tile"), stages=2, split=True, v_slots=2, k_ahead=True,
                  k_early=True) > 0


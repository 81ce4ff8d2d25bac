"""CPU model of the protocol designed for a "seesaw" wgmma MLA schedule (docs/perf-notes.md, next
steps: MLA compute-bound), checked before the kernel is written, as the roles schedule's was
(tests/test_mla_roles_protocol.py).

Two consumer warpgroups alternate tiles: warpgroup w owns the tiles t = w (mod 2), stage w and
output dims [256w, 256w + 256). For its tile t it issues S(t) (reads K(t) from stage w), reads the
running max m(t-1) that the other warpgroup published, computes P(t), writes it into stage w's
rope column block (free once S(t) has read it: P is [64 rows][64 tokens], the block's shape),
publishes m(t), alpha(t) and l(t) in slot t % 2, then accumulates P(t) V(t) for its dims from
registers. The other warpgroup adds P(t) V(t) for its dims from shared memory. A stage is refilled
by its owner (tile t + 2) only after both warpgroups have read tile t.

Named barriers of count 256 (one warpgroup arrives, the other waits), one per direction:
  READY_w   w arrives once P(t), m(t), alpha(t), l(t) of its tile t are written; 1 - w waits before
            it reads them (its softmax of t + 1 and its half of P(t) V(t)).
  RELEASE_w w arrives once it has read the other warpgroup's tile t (V half and P(t)); 1 - w waits
            before copying tile t + 2 into that stage. Arrived only when tile t + 2 exists, so
            arrivals and waits pair up within an item.

Under many random interleavings (wgmma reads and copies are intervals) the model checks: no
deadlock; every read sees the tile, P and statistics of its step; no copy lands in a stage and no
statistics slot is rewritten while read; every barrier phase completes with one arrival of each
warpgroup, and none is left half-complete at the CTA barrier between items. Each wait, skipped in
turn, makes some schedule fail (the model is not vacuous).
"""
import pytest

from barrier_model import NamedBarrier, arrive, run_schedule, sync

READY = (0, 1)  # READY_w: barrier ids per arriving warpgroup
RELEASE = (2, 3)


def read_interval(s, key, idx):
    """An asynchronous read (a wgmma operand): others may interleave while it is in flight."""
    s[key][idx] += 1
    yield
    s[key][idx] -= 1


def warpgroup(s, w, items):
    other = 1 - w

    def issue_copy(item, t):
        st = t % 2
        assert s["readers"][st] == 0, f"tile {t} copied into stage {st} while it is read"
        s["stage"][st] = ("loading", item, t)
        s["p"][st] = None  # the rope block is overwritten too

    def add_other_half(item, t, n):
        """P(t) V(t) for this warpgroup's dims, tile t being the other warpgroup's."""
        yield from sync(s, READY[other], w)
        st = t % 2
        assert s["stats"][st] == (item, t), f"alpha({t}) read {s['stats'][st]}"
        yield from read_interval(s, "stat_readers", st)  # O_w *= alpha(t)
        assert s["stage"][st] == ("ready", item, t), f"V({t}) read {s['stage'][st]}"
        assert s["p"][st] == (item, t), f"P({t}) read {s['p'][st]}"
        yield from read_interval(s, "readers", st)  # O_w += P(t) V(t)[:, half w], both from stage st
        if t + 2 < n:
            arrive(s, RELEASE[w], w)  # the owner may refill the stage

    for item, n in enumerate(items):
        yield from s["cta_barrier"](w)
        if w < n:
            issue_copy(item, w)
        for t in range(n):
            if t % 2 != w:
                yield from add_other_half(item, t, n)
                continue
            st = w
            if s["stage"][st] == ("loading", item, t):  # cp.async.wait_group + proxy fence: own copy
                s["stage"][st] = ("ready", item, t)
            assert s["stage"][st] == ("ready", item, t), f"S({t}) read {s['stage'][st]}"
            yield from read_interval(s, "readers", st)  # S(t) = Q K(t)^T, K with its rope block
            if t > 0:  # softmax(t) reads m(t-1), published with P(t-1): add_other_half waited READY
                assert s["stats"][(t - 1) % 2] == (item, t - 1), f"m({t - 1}) read {s['stats'][(t - 1) % 2]}"
                yield from read_interval(s, "stat_readers", (t - 1) % 2)
            assert s["readers"][st] == 0, "P written into the rope block while the stage is read"
            s["p"][st] = (item, t)  # P(t) into stage w's rope block (S(t) has retired)
            assert s["stat_readers"][t % 2] == 0, "a statistics slot rewritten while read"
            s["stats"][t % 2] = (item, t)
            arrive(s, READY[w], w)
            yield from read_interval(s, "readers", st)  # O_w = alpha(t) O_w + P(t) V(t)[:, half w]
            if t + 2 < n:
                yield from sync(s, RELEASE[other], w)  # the other warpgroup has read tile t
                issue_copy(item, t + 2)
        yield  # epilogue: O_w / l(n - 1) for this warpgroup's dims
    s["done"][w] = True


def run(items, seed, skip=None):
    s = {"bars": {b: NamedBarrier() for b in READY + RELEASE}, "stage": [None, None], "p": [None, None],
         "readers": [0, 0], "stats": [None, None], "stat_readers": [0, 0], "done": [False, False], "skip": skip}
    run_schedule(s, [lambda s: warpgroup(s, 0, items), lambda s: warpgroup(s, 1, items)], seed)


@pytest.mark.parametrize("items", [[1], [2], [3], [4], [7], [0], [0, 3, 1, 0, 5], [2, 2, 2], [9, 1], [1, 1, 1]])
def test_seesaw_protocol_never_deadlocks_or_races(items):
    for seed in range(300):
        run(items, seed)


@pytest.mark.parametrize("skipped", READY + RELEASE)
def test_model_catches_a_missing_wait(skipped):
    with pytest.raises(AssertionError):
        for seed in range(300):
            run([7], seed, skip=skipped)

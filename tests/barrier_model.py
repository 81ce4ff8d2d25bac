"""Pieces shared by the CPU models of the wgmma MLA schedules' named-barrier protocols
(test_mla_roles_protocol.py, test_mla_seesaw_protocol.py): warpgroups (and, where one is modelled,
the copy engine) are generators that yield wherever another may interleave, and a random scheduler
runs them."""
from __future__ import annotations

import random


class NamedBarrier:
    """bar.arrive / bar.sync with count 256: a phase completes when both warpgroups are in."""

    def __init__(self):
        self.members, self.generation = [], 0

    def join(self, wg: int) -> int:
        assert wg not in self.members, f"warpgroup {wg} reached a barrier twice in one phase"
        self.members.append(wg)
        gen = self.generation
        if len(self.members) == 2:
            self.members, self.generation = [], self.generation + 1
        return gen

    def passed(self, gen: int) -> bool:
        return self.generation > gen


def sync(s, bar, wg):
    """bar.sync; s["skip"] names a barrier whose waiting side does not wait (the negative controls)."""
    gen = s["bars"][bar].join(wg)
    if bar == s["skip"]:
        return
    while not s["bars"][bar].passed(gen):
        yield


def arrive(s, bar, wg):
    s["bars"][bar].join(wg)


def run_schedule(s, agents, seed: int) -> None:
    """Random interleaving of the two warpgroups; s["cta_barrier"] is installed first (__syncthreads
    between items: every named barrier must be idle there). Fails on deadlock or a phase left open."""
    rng = random.Random(seed)
    s["cta"] = NamedBarrier()

    def cta_barrier(wg):
        gen = s["cta"].join(wg)
        if s["cta"].passed(gen):  # the last one in: the other warpgroup waits here too
            assert all(not b.members for b in s["bars"].values()), "a named barrier phase left half-complete"
        while not s["cta"].passed(gen):
            yield

    s["cta_barrier"] = cta_barrier
    s["rng"] = rng
    gens = [agent(s) for agent in agents]
    live = list(range(len(agents)))
    for _ in range(200000):
        if not live:
            break
        wg = rng.choice(live)
        try:
            next(gens[wg])
        except StopIteration:
            live.remove(wg)
    assert all(s["done"]), f"deadlock: {s}"
    assert all(not b.members for b in s["bars"].values()), "a named barrier phase left half-complete"

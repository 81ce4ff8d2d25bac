"""Timing model of the wgmma MLA decode schedules (h128: 64 query rows per CTA, one CTA per SM, two
KV stages of 64 tokens x 576): two warpgroups, one tensor-core queue, copies that land L cycles after
they are issued. It replays each schedule's order of issues, waits, barriers and copies (roles as in
templates/mla/normal_wgmma.cu.jinja; the seesaw orders as on branch next/mla-seesaw) and reports the
steady-state cycles per tile, so orders can be ranked before one is written for the GPU. Calibrated
against the eighth session's measurements (roles = seesaw "other first", as measured: 651 vs 652 us;
seesaw "S first" 10% slower than roles, as measured: 715 vs 652 us) at copy_latency ~3200 and
softmax ~2500 (docs/perf-notes.md).

    python tools/mla_schedule_sim.py [--copy-latency 3200] [--softmax 2500]

Costs (cycles; docs/perf-notes.md, MLA sections): S = Q.K^T of a tile on the tensor cores ~1150 (the
shared-memory port at 128 B/clk), P.V of one 256-dim half ~512, issuing one tile's cp.async copies
~400, P stores ~200; the softmax (issue-bound, spread over hundreds of instructions in ncu) and the
copy latency are the calibrated values. The queue runs wgmma batches in issue order across both
warpgroups (one tensor pipe per SM). Named barriers pair one arrive with one sync.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class Costs:
    s: int = 1150
    pv_half: int = 512
    softmax: int = 2500  # calibrated (module docstring)
    copy_issue: int = 400
    p_store: int = 200
    copy_latency: int = 3200  # calibrated
    bar: int = 30


@dataclass
class Sim:
    costs: Costs
    clock: list = field(default_factory=lambda: [0, 0])  # each warpgroup's time
    tc_free: int = 0
    done: dict = field(default_factory=dict)  # wgmma batch -> completion time
    landed: dict = field(default_factory=dict)  # tile -> landing time
    arrivals: dict = field(default_factory=dict)  # (barrier, phase) -> arrival time

    def issue(self, wg: int, name, dur: int) -> None:
        start = max(self.tc_free, self.clock[wg])
        self.tc_free = start + dur
        self.done[name] = self.tc_free

    def copy(self, wg: int, tile: int) -> None:
        self.clock[wg] += self.costs.copy_issue
        self.landed[tile] = self.clock[wg] + self.costs.copy_latency


def run(schedule, tiles: int, costs: Costs) -> float:
    """Cycles per tile over the second half of `tiles` (the pipeline filled). The warpgroup whose next
    step can happen earliest always moves first, so the tensor-core queue sees issues in time order."""
    sim = Sim(costs)
    progs = [schedule(sim, wg, tiles) for wg in (0, 1)]
    pending = [None, None]  # what each warpgroup waits for: (kind, key)
    mark, live = {}, {0, 1}
    tables = {"wgmma": sim.done, "copy": sim.landed, "bar": sim.arrivals}

    def ready_at(wg):
        if pending[wg] is None:
            return sim.clock[wg]
        kind, key = pending[wg]
        if key not in tables[kind]:
            return None  # not issued / arrived yet: the other warpgroup has to move first
        return max(sim.clock[wg], tables[kind][key]) + (costs.bar if kind == "bar" else 0)

    while live:
        ready = {wg: ready_at(wg) for wg in live}
        movable = [wg for wg in live if ready[wg] is not None]
        if not movable:
            raise RuntimeError(f"deadlock: {pending}")
        wg = min(movable, key=lambda w: ready[w])
        sim.clock[wg], pending[wg] = ready[wg], None
        try:
            step = next(progs[wg])
        except StopIteration:
            live.discard(wg)
            continue
        if step[0] == "mark":
            mark[step[1]] = sim.clock[wg]
        else:
            pending[wg] = step
    half = tiles // 2
    return (mark[("tile", tiles - 1)] - mark[("tile", half)]) / (tiles - 1 - half)


def roles(sim: Sim, wg: int, n: int, early_s: bool = False):
    """Warpgroup 0: S, softmax, its P.V half; warpgroup 1: the copies and the other half. early_s:
    S(t+1) issued before softmax(t), as FA3 overlaps within a warpgroup (a second S register set in
    warpgroup 0), warpgroup 1 announcing each tile as it lands instead of under its P.V. Not built:
    with two stages the copy of tile t+2 starts only once P.V(t) freed its stage, and the early S(t+2)
    then waits for it (ninth session: slower than roles at every copy latency tried)."""
    c = sim.costs
    if wg == 1:
        sim.copy(1, 0)
        sim.copy(1, 1)
        yield ("copy", 0)
        sim.arrivals[("full", 0)] = sim.clock[1]
    for t in range(n):
        if wg == 0:
            if not early_s or t == 0:
                yield ("bar", ("full", t))  # kBarFull: warpgroup 1 saw tile t land
                sim.issue(0, ("S", t), c.s)
            yield ("wgmma", ("S", t))
            if early_s and t + 1 < n:  # S(t + 1) on the tensor cores while this warpgroup runs softmax(t)
                yield ("bar", ("full", t + 1))
                sim.issue(0, ("S", t + 1), c.s)
            sim.clock[0] += c.softmax + c.p_store
            sim.arrivals[("P", t)] = sim.clock[0]
            sim.issue(0, ("PV0", t), c.pv_half)
            yield ("wgmma", ("PV0", t))
            sim.arrivals[("stage", t)] = sim.clock[0]
            yield ("mark", ("tile", t))
        else:
            if early_s and t + 1 < n:
                yield ("copy", t + 1)
                sim.arrivals[("full", t + 1)] = sim.clock[1]
            yield ("bar", ("P", t))
            sim.issue(1, ("PV1", t), c.pv_half)
            if not early_s and t + 1 < n:  # announces tile t + 1 under its P.V
                yield ("copy", t + 1)
                sim.arrivals[("full", t + 1)] = sim.clock[1]
            yield ("wgmma", ("PV1", t))
            yield ("bar", ("stage", t))
            if t + 2 < n:
                sim.copy(1, t + 2)


def softmax_and_own_pv(sim: Sim, wg: int, t: int):
    """A seesaw warpgroup's own tile t once S(t) is issued: its softmax, READY, P(t).V(t) for its dims."""
    c = sim.costs
    yield ("wgmma", ("S", t))
    sim.clock[wg] += c.softmax + c.p_store
    sim.arrivals[("ready", t)] = sim.clock[wg]
    yield ("mark", ("tile", t))
    sim.issue(wg, ("PV", t), c.pv_half)
    yield ("wgmma", ("PV", t))


def seesaw(sim: Sim, wg: int, n: int, other_first: bool):
    """Each warpgroup S and softmax of its tiles t = wg (mod 2); the other's previous tile added to its
    dims. other_first: the branch's version 3 (the other's tile issued before S(t)), else version 2
    (S(t) first; the other's tile waited, and its stage released, before the softmax)."""
    c = sim.costs
    if wg < n:
        sim.copy(wg, wg)
    for t in range(wg, n, 2):
        if t > 0 and other_first:
            yield ("bar", ("ready", t - 1))
            sim.issue(wg, ("PVo", t - 1, wg), c.pv_half)
        yield ("copy", t)
        sim.issue(wg, ("S", t), c.s)
        if t > 0 and not other_first:
            yield ("bar", ("ready", t - 1))
            yield ("wgmma", ("S", t))
            sim.issue(wg, ("PVo", t - 1, wg), c.pv_half)
        if t > 0:
            yield ("wgmma", ("PVo", t - 1, wg))
            sim.arrivals[("release", t - 1)] = sim.clock[wg]
        yield from softmax_and_own_pv(sim, wg, t)
        if t + 2 < n:
            yield ("bar", ("release", t))
            sim.copy(wg, t + 2)


def seesaw_halves(sim: Sim, wg: int, n: int):
    """Version 2's order (S(t) first) with each stage refilled in two parts, as FlashMLA's per-box TMA
    copies allow: the owner's V half and the rope block (5 of 9 column blocks) once its own reads of
    tile t are done, the other half once the other warpgroup released it; S(t + 2) runs on the first
    part while the second lands (the copy's fixed latency, then its bytes: `copy_latency` splits as
    half latency, half streaming for a whole tile)."""
    c = sim.costs
    fixed, stream = c.copy_latency // 2, c.copy_latency // 2

    def copy_part(part, t, ninths):
        sim.clock[wg] += c.copy_issue * ninths // 9
        sim.landed[(part, t)] = sim.clock[wg] + fixed + stream * ninths // 9

    if wg < n:
        copy_part("A", wg, 5)
        copy_part("B", wg, 4)
    for t in range(wg, n, 2):
        yield ("copy", ("A", t))
        sim.issue(wg, ("SA", t), c.s * 5 // 9)
        yield ("copy", ("B", t))
        sim.issue(wg, ("S", t), c.s * 4 // 9)
        if t > 0:
            yield ("bar", ("ready", t - 1))
            yield ("wgmma", ("S", t))
            sim.issue(wg, ("PVo", t - 1, wg), c.pv_half)
            yield ("wgmma", ("PVo", t - 1, wg))
            sim.arrivals[("release", t - 1)] = sim.clock[wg]
        yield from softmax_and_own_pv(sim, wg, t)
        if t + 2 < n:
            copy_part("A", t + 2, 5)
            yield ("bar", ("release", t))
            copy_part("B", t + 2, 4)


SCHEDULES = {
    "roles": roles,
    "roles, early S": lambda sim, wg, n: roles(sim, wg, n, early_s=True),
    "seesaw, S first (v2)": lambda sim, wg, n: seesaw(sim, wg, n, other_first=False),
    "seesaw, other first (v3)": lambda sim, wg, n: seesaw(sim, wg, n, other_first=True),
    "seesaw, copies in 2 parts": seesaw_halves,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-latency", type=int, default=Costs.copy_latency)
    ap.add_argument("--softmax", type=int, default=Costs.softmax)
    ap.add_argument("--tiles", type=int, default=200)
    args = ap.parse_args()
    costs = Costs(copy_latency=args.copy_latency, softmax=args.softmax)
    for name, schedule in SCHEDULES.items():
        print(f"{name:26} {run(schedule, args.tiles, costs):7.0f} cycles per tile")


if __name__ == "__main__":
    main()

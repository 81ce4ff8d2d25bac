"""The issues' performance targets read against a results file: one row a target, with its measured value, the
read ceiling under it where one applies, and whether it is met. report.py renders the table at the top of
docs/benchmarks/README.md, so the record and its verdicts cannot drift apart.

The ceiling is the `roofline` suite's fastest pure read at the case's byte count: each roofline kernel's
least-squares line (time = fixed + bytes / rate) evaluated there, the fastest kernel taken. A bandwidth target
above it asks an attention kernel to read faster than a kernel that only reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Target:
    issue: int
    suite: str
    case: str
    metric: str          # "gbps" / "tflops" / "us" of `impl`, or "speedup" / "overhead" of `impl` against `ref`
    bound: float
    impl: str = "attnforge"
    ref: Optional[str] = None      # speedup: ref's time / impl's; overhead: impl's time / ref's - 1
    ref_case: Optional[str] = None  # ref's case, where it is another one (default: the same)

    @property
    def higher_is_better(self) -> bool:
        return self.metric in ("gbps", "tflops", "speedup")

    def describe(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        if self.metric == "speedup":
            return f"{self.impl} >= {self.bound:g}x {self.ref}"
        if self.metric == "overhead":
            return f"{self.impl} <= {self.bound:.0%} over {self.ref}"
        unit = {"gbps": "GB/s", "tflops": "TFLOP/s", "us": "us"}[self.metric]
        return f"{self.impl} {sign} {self.bound:g} {unit}"


# "every case" at 4500 GB/s: the cases the issue gives no target of their own (skew, pages 1 and 64, fp8 KV)
DECODE_CASES = ("B1 L131072", "B16 L8192", "B64 L4096", "B256 L1024", "B16 L65536", "B64 Lrand")
MLA_H128 = ("h128 B16 L65536", "h128 B64 L8192", "h128 B128 L4096", "h128 B1 L131072")
MOD_CASES = ("softcap decode B16 L8192", "alibi decode B16 L8192", "window4096 decode B16 L8192",
             "softcap prefill B1 S8192", "alibi prefill B1 S8192", "window4096 prefill B1 S8192")

TARGETS = (
    # #3
    *(Target(3, "decode", c, "gbps", 4500.0) for c in DECODE_CASES),
    Target(3, "decode", "B64 Lrand page1", "gbps", 4400.0),
    Target(3, "decode", "B64 Lrand page64", "gbps", 4400.0),
    Target(3, "decode", "B16 L8192 fp8kv", "gbps", 4300.0),
    Target(3, "decode", "skew 1x65536+127x512", "speedup", 7.0, ref="flashinfer-tc"),
    Target(3, "decode", "plan B256", "us", 50.0, impl="attnforge-plan"),
    # #4
    Target(4, "mla", "h16 B16 L65536", "gbps", 4400.0),
    Target(4, "mla", "h16 B1 L131072", "gbps", 3500.0),
    *(Target(4, "mla", c, "tflops", 650.0) for c in MLA_H128),
    # #5: a modifier costs at most 5% over the same kernel without it; the document mask 1.5x Flex
    *(Target(5, "mods", c, "overhead", 0.05, ref="attnforge-plain") for c in MOD_CASES),
    Target(5, "mods", "document-mask B1 S16384", "speedup", 1.5, ref="flex"),
    # #6
    Target(6, "prefill", "B1 S8192", "tflops", 680.0),
    Target(6, "prefill", "B1 S32768", "tflops", 650.0),
    Target(6, "prefill", "ragged 16 random 128-8192", "tflops", 600.0),
    Target(6, "prefill", "B1 S8192 paged16", "overhead", 0.05, ref="attnforge-ragged-kv"),
)


def _rows_by_key(rows) -> dict:
    return {(r["suite"], r["case"], r["impl"]): r for r in rows}


def measured(t: Target, rows) -> Optional[float]:
    """The target's value in `rows` (None where a row it needs is missing)."""
    by = _rows_by_key(rows)
    r = by.get((t.suite, t.case, t.impl))
    if r is None:
        return None
    if t.ref is None:
        return r.get(t.metric)
    ref = by.get((t.suite, t.ref_case or t.case, t.ref))
    if ref is None:
        return None
    return ref["us"] / r["us"] if t.metric == "speedup" else r["us"] / ref["us"] - 1.0


def fit(points) -> tuple[float, float]:
    """(fixed us, rate GB/s) of the least-squares line us = fixed + bytes / rate through (bytes, us) points:
    a roofline kernel's line (bench_roofline notes it; read_ceiling_gbps evaluates it)."""
    x, y = np.array(points, dtype=np.float64).T
    slope, fixed = np.polyfit(x, y, 1)  # us per byte, us
    return float(fixed), float(1e-3 / slope)


def read_ceiling_gbps(nbytes: float, rows) -> Optional[float]:
    """The fastest roofline kernel's rate at `nbytes` (its fitted line there), or None without roofline rows."""
    lines = {}
    for r in rows:
        if r["suite"] == "roofline" and r.get("gbps"):
            lines.setdefault(r["impl"], []).append((r["gbps"] * r["us"] * 1e3, r["us"]))
    times = [fixed + nbytes / (rate * 1e3) for fixed, rate in (fit(p) for p in lines.values() if len(p) >= 2)]
    return nbytes / (min(times) * 1e3) if times else None


def best_peer(t: Target, rows) -> Optional[tuple[str, float]]:
    """The best peer's (impl, value) on the target's own measure, in the same suite and case, or None: a bandwidth
    or TFLOP/s target reads the fastest row not ours; an overhead target against attnforge-plain reads each peer's
    own cost, `<peer>` over `<peer>-plain` (the mods suite times both), the smallest taken. Speedup and time
    targets are measured against a peer already, or have none."""
    case_rows = [r for r in rows
                 if r["suite"] == t.suite and r["case"] == t.case and not r["impl"].startswith("attnforge")]
    if t.metric in ("gbps", "tflops"):
        values = [(r["impl"], r[t.metric]) for r in case_rows if r.get(t.metric)]
        return max(values, key=lambda iv: iv[1]) if values else None
    if t.metric == "overhead" and t.ref == "attnforge-plain":
        by_impl = {r["impl"]: r for r in case_rows}
        costs = [(impl, r["us"] / by_impl[impl + "-plain"]["us"] - 1.0) for impl, r in by_impl.items()
                 if impl + "-plain" in by_impl]
        return min(costs, key=lambda iv: iv[1]) if costs else None
    return None


def verdicts(rows) -> list[dict]:
    """One dict a target: the target, its value (None: not measured), the best peer's (impl, value) on the same
    measure where one is measured, the read ceiling where it is a bandwidth target, and met (None: not
    measured)."""
    out = []
    for t in TARGETS:
        value = measured(t, rows)
        ceiling = None
        if t.metric == "gbps" and value is not None:
            r = _rows_by_key(rows)[(t.suite, t.case, t.impl)]
            ceiling = read_ceiling_gbps(r["gbps"] * r["us"] * 1e3, rows)
        met = None if value is None else (value >= t.bound if t.higher_is_better else value <= t.bound)
        out.append({"target": t, "value": value, "peer": best_peer(t, rows), "ceiling": ceiling, "met": met})
    return out


def _fmt(metric: str, v: Optional[float]) -> str:
    if v is None:
        return "not measured"
    if metric == "overhead":
        return f"{v:+.1%}"
    if metric == "speedup":
        return f"{v:.2f}x"
    return f"{v:.1f}" if metric == "us" else f"{v:.0f}"


def table(rows) -> str:
    """The markdown table report.py puts first in the benchmarks README."""
    lines = ["| issue | suite | case | target | measured | best peer | read ceiling | met |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts(rows):
        t = v["target"]
        ceiling = f"{v['ceiling']:.0f} GB/s" if v["ceiling"] else ""
        peer = f"{_fmt(t.metric, v['peer'][1])} {v['peer'][0]}" if v["peer"] else ""
        met = {None: "–", True: "yes", False: "**no**"}[v["met"]]
        lines.append(f"| #{t.issue} | {t.suite} | {t.case} | {t.describe()} | {_fmt(t.metric, v['value'])} | "
                     f"{peer} | {ceiling} | {met} |")
    return "\n".join(lines)

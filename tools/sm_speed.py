"""Is the per-SM speed of a decode kernel a property of the SM? Reads several `benchmarks/trace_decode.py
--json` files (one per process: CTA placement differs between processes) and prints, per case, each
run's spread of per-SM cycles per tile (the mean over the SM's CTAs), the correlation of those rates
between runs, and how often a CTA lands on the same SM.

    python tools/sm_speed.py tr1.json tr2.json tr3.json
"""
from __future__ import annotations

import json
import sys

import numpy as np


def per_sm_rates(case: dict) -> dict[int, float]:
    """SM id -> mean cycles per tile of its CTAs that had tiles."""
    pc = case["per_cta"]
    sm, span, tiles = np.array(pc["sm"]), np.array(pc["span_cycles"], float), np.array(pc["tiles"], float)
    rates: dict[int, list[float]] = {}
    for s, c, t in zip(sm, span, tiles):
        if t > 0:
            rates.setdefault(int(s), []).append(c / t)
    return {s: float(np.mean(v)) for s, v in rates.items()}


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    for i, first in enumerate(runs[0]):
        rates = [per_sm_rates(r[i]) for r in runs]
        sms = sorted(set.intersection(*(set(r) for r in rates)))
        table = np.array([[r[s] for s in sms] for r in rates])
        corr = np.corrcoef(table)
        pairs = [f"{a + 1}-{b + 1} {corr[a, b]:.2f}" for a in range(len(runs)) for b in range(a + 1, len(runs))]
        placements = [np.array(r[i]["per_cta"]["sm"]) for r in runs]
        same = [f"{(placements[0] == p).mean():.2f}" for p in placements[1:]]
        print(f"{first['case']}: {len(sms)} SMs; spread max/min {np.round(table.max(1) / table.min(1), 3).tolist()}; "
              f"correlation {', '.join(pairs)}; CTAs on the same SM as run 1: {', '.join(same)}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Quest GQA 32/8 (the `quest` suite's default int4 row) under several decode tilings, timed in rotation:
the whole step and the decode over the selected pages alone, beside our dense decode of the same cache.
Rows: `default` (whole items: BatchDecode(whole_items=True), as QuestDecode asks), `split` (whole_items=False:
the default tiling of three CTAs per SM), and the given tile x stages x warps.

The subset decode reads 128 equal items (16 requests x 8 KV heads x 4096 tokens). At three CTAs per SM
the planner cuts each into three chunks (384 CTAs) and one chunk of each merges the three; at one CTA
per SM (deeper pipelines, 192 KB of stages) each CTA reads one whole item and nothing merges.

    python benchmarks/bench_quest_tilings.py [--out X.json] [64x6x4 128x3x8 ...]
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_quest import BUDGET, L, PAGE, int4_case, planned_quest  # noqa: E402
from harness import time_interleaved, time_us  # noqa: E402

from attnforge import BatchDecode  # noqa: E402

TILINGS = ["128x2x8", "64x3x4"]  # beside the default (whole items) and the three-CTAs-per-SM kernel


def main(argv: list[str]) -> None:
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    given = [a for a in argv if a not in ("--out", out_path)]
    spec, index, cache, indptr, indices, last, q = int4_case(["--heads", "32/8"])
    out = torch.empty_like(q)
    dense = BatchDecode(spec)
    dense.plan(indptr, indices, last, page_size=PAGE)
    dense_us = time_us(lambda: dense.run(q, cache, out=out))
    steps, subsets, shapes = {}, {}, {}
    for tiling in [None, "split"] + (given or TILINGS):
        kw = {} if tiling is None else {"whole_items": False} if tiling == "split" else dict(
            zip(("tile_kv", "num_stages", "num_warps"), (int(x) for x in tiling.split("x"))))
        quest = planned_quest(spec, index, indptr, indices, last, **kw)
        quest.run(q, cache, out=out)  # the decode's page table now holds a selection
        k, ctas = quest.decode.planned_kernel
        label = "default" if tiling is None else tiling
        shapes[label] = {"tile_kv": k.tile_kv, "stages": k.num_stages, "warps": k.num_warps,
                         "ctas": ctas, "pipeline": spec.pipeline}
        steps[label] = (lambda qd=quest: qd.run(q, cache, out=out))
        subsets[label] = (lambda qd=quest: qd.decode.run(q, cache, out=out))
    step_us, subset_us = time_interleaved(steps), time_interleaved(subsets)
    rows = {label: {**shapes[label], "step_us": step_us[label], "subset_us": subset_us[label],
                    "x_dense": dense_us / step_us[label]} for label in steps}
    print(f"dense B16 L{L}: {dense_us:.1f} us; budget {BUDGET}")
    for label, r in rows.items():
        print(f"{label:10s} t{r['tile_kv']}s{r['stages']}w{r['warps']} {r['ctas']:4d} CTAs: step {r['step_us']:.2f} us "
              f"({r['x_dense']:.2f}x), subset decode {r['subset_us']:.2f} us")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"dense_us": dense_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Exploration (not a suite): the Quest GQA step (the `quest` suite's int4 case) as two half batches on
two streams inside one CUDA graph, so one half's select and decode can run under the other's scoring,
timed in rotation against the one-batch step. Variants: `halves-gated` (the second half's scoring
waits for the first's), `halves-gated-nopdl` (the same, decodes launched without PDL, so their waiting
CTAs do not hold the SMs), `halves-after-select` (the second half's scoring waits for the first's select), `halves-free` (both
halves start at once), `halves-serial` (one stream: what
halving costs). Prints one JSON line per variant.

    python benchmarks/bench_quest_overlap.py [--heads 32/8]
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge.sparse import QuestDecode  # noqa: E402
from bench_quest import B, BUDGET, L, PAGE, int4_case  # noqa: E402
from harness import time_interleaved  # noqa: E402


def half_quest(spec, index, indptr, indices, rows, pdl=True):
    """A QuestDecode planned for requests `rows` (a contiguous range) of the case's page table."""
    b = len(rows)
    lo, hi = int(indptr[rows[0]]), int(indptr[rows[-1] + 1])
    quest = QuestDecode(spec, index, budget_tokens=BUDGET, page_size=PAGE, max_batch_size=b,
                        max_num_pages=hi - lo, max_pages_per_request=L // PAGE, use_cuda_graph=True)
    quest.decode.launch_after_own_kernel = pdl
    quest.plan(indptr[rows[0]:rows[-1] + 2] - lo, indices[lo:hi], np.full(b, PAGE, dtype=np.int32))
    return quest


def step(quest, q, cache, out):
    quest._select(quest.scores(q))
    quest.decode.run(q, cache, out=out)


def main() -> None:
    spec, index, cache, indptr, indices, last, q = int4_case(sys.argv)
    hq, hkv = spec.num_qo_heads, spec.num_kv_heads
    whole = half_quest(spec, index, indptr, indices, list(range(B)))
    h = B // 2
    first, second = list(range(h)), list(range(h, B))
    a, b = half_quest(spec, index, indptr, indices, first), half_quest(spec, index, indptr, indices, second)
    a_np, b_np = (half_quest(spec, index, indptr, indices, r, pdl=False) for r in (first, second))
    out = torch.empty_like(q)
    qa, qb, oa, ob = q[:h], q[h:], out[:h], out[h:]
    side = torch.cuda.Stream()

    def two_streams(qa_, qb_, gate):
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # the fork
        scores = qa_.scores(qa)
        if gate == "scoring":
            side.wait_stream(main)  # the second half's scoring starts after the first's
        qa_._select(scores)
        if gate == "select":
            side.wait_stream(main)  # ... after the first's select
        with torch.cuda.stream(side):
            step(qb_, qb, cache, ob)
        qa_.decode.run(qa, cache, out=oa)
        main.wait_stream(side)

    def serial():
        step(a, qa, cache, oa)
        step(b, qb, cache, ob)

    variants = {"whole": lambda: step(whole, q, cache, out), "halves-gated": lambda: two_streams(a, b, "scoring"),
                "halves-gated-nopdl": lambda: two_streams(a_np, b_np, "scoring"),
                "halves-after-select": lambda: two_streams(a, b, "select"),
                "halves-free": lambda: two_streams(a, b, None), "halves-serial": serial}
    ref = None
    for name, fn in variants.items():  # every variant computes the same outputs
        fn()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        else:
            print(json.dumps({"check": name, "max_abs_diff": float((out.float() - ref.float()).abs().max())}))
    times = time_interleaved(variants, calls=5, reps=30)
    for name, us in times.items():
        print(json.dumps({"case": f"h{hq}/{hkv} B{B} L{L} budget{BUDGET}", "variant": name, "us": round(us, 2)}))


if __name__ == "__main__":
    main()

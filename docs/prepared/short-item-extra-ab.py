"""A/B for the skew lead (docs/perf-notes.md, state item 0): short items padded by scheduler.SHORT_ITEM_EXTRA stream
positions on plans with an item longer than a span (planner only: the same kernel), each extra against 0, in one
process, in rotation, three rounds, on the decode suite's cases with such items. Run from the repo root with
PYTHONPATH=$PWD; writes $OUT/short_extra.json. Predicted: skew -2..-4% at an extra of 24-48 (the trace: CTAs of six
short items exit ~5 us after those holding one chunk of the long request), the others within +-0.5%."""
import json
import os
import sys

import torch
sys.path.insert(0, "benchmarks")
from bench_decode import HKV, HQ, D, cases, paged_inputs
from harness import time_interleaved
from attnforge import AttentionSpec, BatchDecode, scheduler
EXTRAS = [0, 24, 48, 72]
WANT = ("skew 1x65536+127x512", "B64 Lrand", "B64 Lrand page1", "B1 L131072", "B64 Lrand page64")
res = {}
sel = [c for c in cases() if c[0] in WANT]
for rnd in range(3):
    for case, lengths, page_size, kv_dtype, layout in sel:
        q, cache, indptr, indices, last = paged_inputs(lengths, page_size, kv_dtype, layout)
        fns, outs = {}, {}
        for e in EXTRAS:
            scheduler.SHORT_ITEM_EXTRA = e
            w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, kv_dtype=kv_dtype,
                                          kv_layout=layout), max_batch_size=256)
            w.plan(indptr, indices, last, page_size=page_size)
            o = torch.full_like(q, float("nan")); outs[e] = o
            fns[f"e{e}"] = (lambda w=w, o=o: w.run(q, cache, out=o))
        scheduler.SHORT_ITEM_EXTRA = 0
        t = time_interleaved(fns)
        d = max(float((outs[e].float() - outs[0].float()).abs().max()) for e in EXTRAS)
        nan = any(bool(outs[e].isnan().any()) for e in EXTRAS)
        print(f"r{rnd} {case}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()) + f"; max diff {d:.1e} nan {nan}",
              flush=True)
        res.setdefault(case, []).append(t)
        del q, cache, fns, outs
        torch.cuda.empty_cache()
json.dump(res, open(f"{os.environ.get('OUT', '/tmp')}/short_extra.json", "w"), indent=1)

"""Where a Hopper prefill work item spends its time (debug): the kernel
built with trace=True stamps SM cycles per item (consumer thread 0; template batch_prefill_wgmma),
and this script prints per-case medians of each phase, the interior and last tile, and the gap
between consecutive items on one SM (launch and drain of the CTA before).

    python benchmarks/trace_prefill.py [--json out.json]
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchPrefill  # noqa: E402
from attnforge.kernels import prefill as kprefill  # noqa: E402
from trace_capture import build_traced, capture, save_json_if_asked  # noqa: E402
from bench_prefill import HKV, HQ, D, ragged  # noqa: E402

build_traced(kprefill.PrefillKernel)


def trace_case(name, lengths, **kw):
    q, k, v, indptr = ragged(lengths)
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True),
                     **kw)
    w.plan(indptr, indptr)
    host, ms = capture(w, lambda: w.run(q, (k, v)))
    n = w._plan["num_work"]
    t = host[:8 * n].reshape(n, 8).astype(np.int64)
    ok = (t[:, 0] > 0) & (t[:, 6] > 0)
    t = t[ok]
    tiles, sm = t[:, 7] & 0xFFFFFFFF, t[:, 7] >> 32
    e = t[:, :7]
    d = {"setup": e[:, 1] - e[:, 0], "wait_tile0": e[:, 2] - e[:, 1], "s0": e[:, 3] - e[:, 2],
         "loop_but_last": e[:, 4] - e[:, 3], "last_tile": e[:, 5] - e[:, 4], "epilogue": e[:, 6] - e[:, 5]}
    item_total = e[:, 6] - e[:, 0]
    interior = d["loop_but_last"][tiles > 1] / (tiles[tiles > 1] - 1)
    gaps = []
    for s_id in np.unique(sm):
        sel = np.argsort(e[sm == s_id, 0])
        starts, ends = e[sm == s_id, 0][sel], e[sm == s_id, 6][sel]
        gaps += list(starts[1:] - ends[:-1])
    cycles_per_sm = [int((e[sm == s, 6].max() - e[sm == s, 0].min())) for s in np.unique(sm)]
    ghz = np.median(cycles_per_sm) / (ms * 1e6)
    out = {"case": name, "kw": {k: str(v) for k, v in kw.items()}, "items": int(n), "kernel_ms": ms,
           "est_ghz": float(ghz), "tiles_mean": float(tiles.mean()),
           "median_cycles": {k: float(np.median(v)) for k, v in d.items()},
           "mean_cycles": {k: float(np.mean(v)) for k, v in d.items()},
           "interior_tile_median": float(np.median(interior)) if len(interior) else None,
           "item_total_mean": float(item_total.mean()), "gap_median": float(np.median(gaps)) if gaps else None,
           "gap_mean": float(np.mean(gaps)) if gaps else None,
           "sum_item_cycles_per_sm_mean": float(np.mean([item_total[sm == s].sum() for s in np.unique(sm)])),
           "span_cycles_per_sm_mean": float(np.mean(cycles_per_sm))}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    # the default kernel is persistent; "cta-per-item" is one CTA per work item
    results = [trace_case("B16 S2048", [2048] * 16), trace_case("B16 S2048 cta-per-item", [2048] * 16, persistent=False),
               trace_case("B1 S8192", [8192]), trace_case("B1 S8192 cta-per-item", [8192], persistent=False),
               trace_case("ragged 16", torch.randint(128, 8193, (16,)).tolist())]
    save_json_if_asked(results)

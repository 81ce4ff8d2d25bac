"""Where a Hopper prefill work item spends its time (debug): the kernel
built with trace=True stamps SM cycles per item (consumer thread 0; template batch_prefill_wgmma),
and this script prints per-case medians of each phase, the interior and last tile, and the gap
between consecutive items on one SM (launch and drain of the CTA before).

    python benchmarks/trace_prefill.py [--json out.json]
    python benchmarks/trace_prefill.py --tiles [--split-dims] [--fields pingpong=True,persistent=True] [--json out.json]
        (one interior tile's phases per consumer warpgroup: softmax, P.V wait and pack, tile wait,
        ping-pong turn, issue and S wait; --split-dims: suite prefill_split_dims's 192/128 cases)
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
from bench_prefill import HKV, HQ, D, cases, ragged  # noqa: E402


def trace_case(name, lengths, **kw):
    q, k, v, indptr = ragged(lengths)
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True),
                     **kw)
    w.plan(indptr, indptr)
    hosts, ms = capture(w, lambda: w.run(q, (k, v)), symbols=("af_trace", "af_cta_trace"))
    host, n = hosts["af_trace"], w._plan["num_work"]
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
           "span_cycles_per_sm_mean": float(np.mean(cycles_per_sm)),
           "ctas": cta_tail(hosts["af_cta_trace"][:2 * w._plan["grid"]].reshape(-1, 2).astype(np.int64))}
    print(json.dumps(out, indent=1))
    return out


TILE_PHASES = {"softmax": (0, 1), "pv_wait_and_pack": (1, 2), "tile_wait": (2, 3), "turn_wait": (3, 4),
               "issue_and_s_wait": (4, 5), "whole": (0, 5)}


def trace_tiles(name, lengths, dims=(D, D), heads=(HQ, HKV), **kw):
    """One interior tile of every long enough item (af_tile_trace), per consumer warpgroup: median
    cycles of each phase, and how far warpgroup 1's tile starts after warpgroup 0's. dims: (qk, vo) head
    dims; heads: (qo, kv)."""
    if (dims, heads) == ((D, D), (HQ, HKV)):
        q, k, v, indptr = ragged(lengths)
    else:
        n = sum(lengths)
        q = torch.randn(n, heads[0], dims[0], device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, heads[1], dims[0], device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, heads[1], dims[1], device="cuda", dtype=torch.bfloat16)
        indptr = np.concatenate([[0], np.cumsum(lengths)])
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim_qk=dims[0],
                                   head_dim_vo=dims[1], causal=True), **kw)
    w.plan(indptr, indptr)
    hosts, ms = capture(w, lambda: w.run(q, (k, v)), symbols=("af_trace", "af_tile_trace"))
    n = w._plan["num_work"]
    out = {"case": name, "kw": {k_: str(v_) for k_, v_ in kw.items()}, "kernel_ms": ms,
           **summarize_tile_stamps(hosts["af_tile_trace"][:16 * n].reshape(n, 2, 8).astype(np.int64))}
    print(json.dumps(out, indent=1))
    return out


def cta_tail(ns: np.ndarray) -> dict:
    """ns [CTAs, 2]: each CTA's first-item start and last store (GPU-wide ns). The launch's load
    imbalance: how long after the first CTA's start the CTAs end (mean, spread, last), and the share of
    CTA-time idle before the last CTA ends (SMs a persistent grid leaves idle at its tail)."""
    ns = ns[(ns[:, 0] > 0) & (ns[:, 1] > 0)]
    if not len(ns):
        return {}
    t0 = ns[:, 0].min()
    end = (ns[:, 1] - t0) / 1e3
    return {"count": int(len(ns)), "start_spread_us": float((ns[:, 0].max() - t0) / 1e3),
            "end_us": {"first": float(end.min()), "p10": float(np.percentile(end, 10)),
                       "median": float(np.median(end)), "mean": float(end.mean()), "last": float(end.max())},
            "idle_tail_share": float(1 - end.mean() / end.max())}


def summarize_tile_stamps(st: np.ndarray) -> dict:
    """st [items, 2 warpgroups, 8 stamps]: per warpgroup, the sampled tiles (all six stamps written) and
    each phase's median; and the median of warpgroup 1's tile start minus warpgroup 0's on the same item."""
    out = {}
    for wg in (0, 1):
        e = st[:, wg]
        e = e[np.all(e[:, :6] > 0, axis=1)]
        out[f"wg{wg}"] = {"tiles": int(len(e)),
                          **{p: float(np.median(e[:, b] - e[:, a])) if len(e) else None for p, (a, b) in TILE_PHASES.items()}}
        if len(e) and np.all(e[:, 6] > 0):  # a split ring with K ahead stamps between its two waits
            out[f"wg{wg}"].update(k_wait=float(np.median(e[:, 6] - e[:, 2])),
                                  v_wait=float(np.median(e[:, 3] - e[:, 6])))
        # ... and the producer stamps when it issued K(t+1)'s and V(t)'s copies: how long before this warpgroup
        # began waiting for them
        issued = st[:, :, 7]
        rows = np.all(st[:, wg, :6] > 0, axis=1) & np.all(issued > 0, axis=1)
        if rows.any():
            out[f"wg{wg}"].update(k_issued_before_wait=float(np.median(st[rows, wg, 2] - issued[rows, 0])),
                                  v_issued_before_wait=float(np.median(st[rows, wg, 2] - issued[rows, 1])))
    both = np.all(st[:, :, :6] > 0, axis=(1, 2))
    out["wg1_start_after_wg0"] = float(np.median(st[both, 1, 0] - st[both, 0, 0])) if both.any() else None
    return out


def kw_option() -> dict:
    """`--fields pingpong=True,persistent=True`: BatchPrefill arguments (harness.kernel_fields)."""
    from harness import kernel_fields
    return kernel_fields(sys.argv[sys.argv.index("--fields") + 1]) if "--fields" in sys.argv else {}


if __name__ == "__main__":
    build_traced(kprefill.PrefillKernel)  # every prefill module this process builds: traced (not on import)
if __name__ == "__main__" and "--tiles" in sys.argv and "--split-dims" in sys.argv:
    # python benchmarks/trace_prefill.py --tiles --split-dims [--fields ...]: suite prefill_split_dims's cases
    from bench_prefill_split_dims import CASES, DQK, DVO
    save_json_if_asked([trace_tiles(f"d{DQK}x{DVO} h{h} B{b} S{n}", [n] * b, (DQK, DVO), (h, h), **kw_option())
                        for h, b, n in CASES])
elif __name__ == "__main__" and "--tiles" in sys.argv:
    # python benchmarks/trace_prefill.py --tiles [--fields pingpong=True,persistent=True] [--json out.json]
    save_json_if_asked([trace_tiles(c, lens, **kw_option()) for c, lens in (("B1 S8192", [8192]), ("B1 S32768", [32768]),
                                                                            ("B16 S2048", [2048] * 16))])
elif __name__ == "__main__":
    # the default kernel is persistent; "cta-per-item" is one CTA per work item
    results = [trace_case("B16 S2048", [2048] * 16), trace_case("B16 S2048 cta-per-item", [2048] * 16, persistent=False),
               trace_case("B1 S8192", [8192]), trace_case("B1 S8192 cta-per-item", [8192], persistent=False),
               trace_case("ragged 16 random 128-8192", dict(cases())["ragged 16 random 128-8192"]),
               trace_case("B1 S32768", [32768])]
    save_json_if_asked(results)

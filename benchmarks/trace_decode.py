"""Where batch decode's time goes (debug): the kernel built with trace=True stamps SM cycles per CTA
and work item (thread 0; template batch_decode), and this script prints, per case, the CTAs' start
spread (launch) and exit spread in %globaltimer ns, their spans in cycles, and per-item phases:
prologue (first tiles issued, Q staged), tiles, finish (rows or partial written) and merge.

    python benchmarks/trace_decode.py [--json out.json]    (ATTNFORGE_BENCH_DECODE_CASES filters;
    ATTNFORGE_TRACE_DECODE_HEADS=32/4 traces another head layout than the suite's 32/8;
    ATTNFORGE_TRACE_DECODE_Q_LEN=4 traces verify steps of that many tokens a request, and
    ATTNFORGE_TRACE_DECODE_TILING=32,3,2 an explicit tile_kv, num_stages, num_warps)
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchDecode  # noqa: E402
from attnforge.kernels import decode as kdecode  # noqa: E402
from trace_capture import build_traced, capture, exit_by_class, save_json_if_asked  # noqa: E402
import bench_decode  # noqa: E402
from bench_decode import D, cases, paged_inputs  # noqa: E402

if os.environ.get("ATTNFORGE_TRACE_DECODE_HEADS"):  # passed to paged_inputs below (its defaults are fixed)
    bench_decode.HQ, bench_decode.HKV = map(int, os.environ["ATTNFORGE_TRACE_DECODE_HEADS"].split("/"))

Q_LEN = int(os.environ.get("ATTNFORGE_TRACE_DECODE_Q_LEN", "1"))  # tokens a request (a verify step past 1)
_TILING = os.environ.get("ATTNFORGE_TRACE_DECODE_TILING")
TILING = dict(zip(("tile_kv", "num_stages", "num_warps"), map(int, _TILING.split(",")))) if _TILING else {}
ITEMS = 32  # trace slots per CTA (the template's)
build_traced(kdecode.DecodeKernel)


def trace_case(name, lengths, page_size, kv_dtype, layout):
    q, cache, indptr, indices, last = paged_inputs(lengths, page_size, kv_dtype, layout, hq=bench_decode.HQ,
                                                   hkv=bench_decode.HKV)
    spec = AttentionSpec(num_qo_heads=bench_decode.HQ, num_kv_heads=bench_decode.HKV, head_dim_qk=D, kv_dtype=kv_dtype,
                         kv_layout=layout)
    w = BatchDecode(spec, max_batch_size=max(256, len(lengths)), max_q_len=Q_LEN, **TILING)
    w.plan(indptr, indices, last, page_size=page_size, q_len=Q_LEN)
    if Q_LEN > 1:  # request b's token t at row b * Q_LEN + t
        q = torch.randn(len(lengths) * Q_LEN, *q.shape[1:], device=q.device, dtype=q.dtype)
    out = torch.empty_like(q)
    host, ms = capture(w, lambda: w.run(q, cache, out=out))
    t = host.reshape(-1, ITEMS, 8).astype(np.int64)
    entry = t[:, ITEMS - 1, 7]
    ctas = np.nonzero(entry)[0]
    items = t[ctas, :ITEMS - 1]
    used = items[:, :, 0] > 0
    meta = items[:, :, 5]
    tiles, merged, partial = meta & 0xFFFF, (meta >> 16) & 1, (meta >> 17) & 1
    sm = meta >> 32
    e = items[:, :, :5]
    ends = np.where(used, e[:, :, 4], 0).max(axis=1)
    # clock64 is per SM: compare CTAs only with others on their SM (spans), never across SMs
    spans = ends - entry[ctas]
    first_item = e[:, 0, 0] - entry[ctas]
    ph = {"prologue": e[:, :, 1] - e[:, :, 0], "tiles": e[:, :, 2] - e[:, :, 1], "finish": e[:, :, 3] - e[:, :, 2],
          "merge": e[:, :, 4] - e[:, :, 3]}
    per_tile = ph["tiles"][used & (tiles > 0)] / tiles[used & (tiles > 0)]
    res = {"case": name + (f" q{Q_LEN}" if Q_LEN > 1 else ""), "kernel": w.planned_kernel[0].name, "kernel_ms": ms,
           "ctas": int(len(ctas)), "items": int(used.sum()),
           "items_per_cta_max": int(used.sum(axis=1).max()), "split_items": int((partial[used] > 0).sum()),
           "merges": int((merged[used] > 0).sum()), "tiles_mean": float(tiles[used].mean()),
           "span_cycles": {"median": float(np.median(spans)), "max": float(spans.max()), "min": float(spans.min())},
           "entry_to_first_item_median": float(np.median(first_item)),
           "phase_mean_cycles": {k: float(v[used].mean()) for k, v in ph.items()},
           "merge_mean_when_merging": float(ph["merge"][used & (merged > 0)].mean()) if merged.any() else 0.0,
           # the merging CTA's count (barriers, fences, atomic) and then its merge_item ([6]: the split)
           "count_then_merge_mean_cycles": [float((items[:, :, 6] - e[:, :, 3])[used & (merged > 0)].mean()),
                                            float((e[:, :, 4] - items[:, :, 6])[used & (merged > 0)].mean())]
           if merged.any() else None,
           "tile_median_cycles": float(np.median(per_tile)) if len(per_tile) else None,
           "sms": int(len(np.unique(sm[used])))}
    g_entry, g_exit = t[ctas, ITEMS - 1, 6], t[ctas, ITEMS - 1, 5]  # %globaltimer (ns), comparable across SMs
    res["global_ns"] = {"entry_spread": float(g_entry.max() - g_entry.min()),
                        "exit_spread": float(g_exit.max() - g_exit.min()),
                        "tail_after_median_exit": float(g_exit.max() - np.median(g_exit)),
                        "first_entry_to_last_exit": float(g_exit.max() - g_entry.min())}
    # per CTA (for attributing the tail offline): SM, exit (ns after the first entry), tiles, merge cycles
    res["per_cta"] = {"sm": sm[:, 0].tolist(), "exit_ns": (g_exit - g_entry.min()).tolist(),
                      "tiles": np.where(used, tiles, 0).sum(axis=1).tolist(),
                      "items": used.sum(axis=1).tolist(), "span_cycles": spans.tolist(),
                      "merge_cycles": np.where(used & (merged > 0), ph["merge"], 0).sum(axis=1).tolist()}
    # the tail by kind of CTA: how many items it ran and whether it merged a split item (the merge of
    # an item's chunks runs at the kernel's end, so mergers exit last: seventh session of 2026-11-30)
    res["exit_by_class_us"] = exit_by_class(g_exit - g_entry.min(), used.sum(axis=1), (used & (merged > 0)).any(axis=1))
    # an estimate of the SM clock: the median CTA span over the kernel's event time (includes launch)
    res["est_ghz_lower_bound"] = float(np.median(spans) / (ms * 1e6))
    print(json.dumps({k: v for k, v in res.items() if k != "per_cta"}, indent=1))
    return res


if __name__ == "__main__":
    save_json_if_asked([trace_case(c[0], *c[1:]) for c in cases() if "fp8" not in c[0]])

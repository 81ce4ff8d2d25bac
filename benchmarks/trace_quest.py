"""Where a Quest step's time goes (debug): the suite's GQA case (h32/8 B16 L65536, budget 4096, int4
summaries) run once with traced kernels (template variable `trace`), and per kernel of the step the
CTAs' entry (placement: PDL places a kernel's CTAs before its predecessor ends), the end of their
wait for the prior grid, and their exit, in us after the first qsplit CTA's entry (%globaltimer);
the select kernel's phases in SM cycles; the decode kernel's item phases as trace_decode.py counts them.
The step runs as one CUDA-graph replay (as the suite times it): no host gaps between the kernels.

    python benchmarks/trace_quest.py [--json out.json] [--heads 32/32] [--tiling 64x6x4]

--tiling: the subset decode's tile_kv x stages x warps (benchmarks/bench_quest_tilings.py).
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge.kernels import decode as kdecode, quest as kquest  # noqa: E402
from bench_quest import B, L, PAGE, int4_case, planned_quest  # noqa: E402
from harness import prepare  # noqa: E402
from trace_capture import build_traced, read_trace, save_json_if_asked, trace_buffer  # noqa: E402

KERNELS = ("qsplit", "score", "select")
DECODE_ITEMS = 32  # trace slots per CTA in batch_decode's trace


def spread(ns: np.ndarray, t0: int) -> dict:
    us = (ns - t0) / 1e3
    return {k: round(float(f(us)), 2) for k, f in (("min", np.min), ("median", np.median), ("max", np.max))}


def quest_kernel_times(qt: np.ndarray, t0: int) -> dict:
    """Per Quest kernel: CTAs placed, their wait's end (where they wait) and exits."""
    res = {}
    for k, name in enumerate(KERNELS):
        ran = qt[k, :, 0] > 0
        if not ran.any():
            continue
        res[name] = {"ctas": int(ran.sum()), "entry": spread(qt[k, ran, 0], t0),
                     "exit": spread(qt[k, ran & (qt[k, :, 2] > 0), 2], t0)}
        waited = ran & (qt[k, :, 1] > 0)
        if waited.any():
            res[name]["after_wait"] = spread(qt[k, waited, 1], t0)
        if name == "score" and (ran & (qt[k, :, 3] > 0)).any():  # the page loop's first step done
            res[name]["first_step"] = spread(qt[k, ran & (qt[k, :, 3] > 0), 3], t0)
        landed = ran & (qt[k, :, 4] > 0) if name == "qsplit" else None
        if landed is not None and landed.any():  # the CTAs with rows: their first row's loads, their exits
            res[name]["rows_loaded"] = spread(qt[k, landed, 4], t0)
            res[name]["rows_entry"] = spread(qt[k, landed, 0], t0)
            res[name]["rows_exit"] = spread(qt[k, landed, 2], t0)
    return res


def select_phases(qt: np.ndarray) -> dict:
    """SM cycles between the select's stamps, mean over its CTAs (a skipped pass leaves its stamps 0)."""
    sel = qt[2, qt[2, :, 15] > 0]
    if not len(sel):
        return {}
    c = sel[:, 3:16].astype(np.float64)
    # stamps 11-13 are a third pass's, or a rank's (candidates in, ranked) and the write-out's counts
    names = (["keys"] + [f"pass{k} {p}" for k in range(2) for p in ("histogram", "bin", "end")]
             + ["pass2 histogram | rank candidates", "pass2 bin | rank", "pass2 end | write-out counts",
                "position scan", "write_out"])
    with np.errstate(invalid="ignore"):
        steps = np.diff(np.where(c > 0, c, np.nan), axis=1)
        out = {n: round(float(np.nanmean(v)), 1) if np.isfinite(v).any() else None for n, v in zip(names, steps.T)}
    out["entry_to_exit"] = float((c[:, 12] - c[:, 0]).mean())
    return out


def select_stamps(qt: np.ndarray) -> list:
    """Per select CTA, its SM-cycle stamps [3..15] counted from its entry; -1 where a phase did not run."""
    sel = qt[2, qt[2, :, 15] > 0]
    return np.where(sel[:, 3:16] > 0, sel[:, 3:16] - sel[:, 3:4], -1).tolist()


def decode_times(dt: np.ndarray, t0: int) -> dict:
    """The decode kernel's CTAs: placement and exits, its first item's phases (SM cycles, as
    trace_decode.py counts them), exits by kind and the per-CTA data for offline attribution."""
    d = dt.reshape(-1, DECODE_ITEMS, 8)
    entry = d[:, DECODE_ITEMS - 1, 6]
    ctas = np.nonzero(entry)[0]
    g_entry, g_exit = entry[ctas], d[ctas, DECODE_ITEMS - 1, 5]
    res = {"ctas": int(len(ctas)), "entry": spread(g_entry, t0), "exit": spread(g_exit, t0)}
    first, meta = d[ctas, 0, :5], d[ctas, 0, 5]
    worked = first[:, 0] > 0
    if worked.any():  # start (before the wait) -> Q staged, first tiles issued -> tiles -> finish -> merge
        ph = np.diff(first[worked], axis=1).mean(axis=0)
        res["first_item_cycles_mean"] = dict(zip(("to_tiles_issued", "tiles", "finish", "merge"),
                                                 (round(float(x), 1) for x in ph)))
    merged = worked & (((meta >> 16) & 1) > 0)
    late = g_entry > np.median(g_entry) + 1000  # placed once the select's SMs were free
    exits = (g_exit - t0) / 1e3
    kinds = {"idle": ~worked, "worked": worked & ~late & ~merged, "worked, merged": worked & ~late & merged,
             "placed late": worked & late & ~merged, "placed late, merged": worked & late & merged}
    res["exit_by_kind_us"] = {k: {"ctas": int(m.sum()), "mean": round(float(exits[m].mean()), 2),
                                  "max": round(float(exits[m].max()), 2)} for k, m in kinds.items() if m.any()}
    res["per_cta"] = {"sm": (meta >> 32).tolist(), "entry_ns": (g_entry - t0).tolist(),
                      "exit_ns": (g_exit - t0).tolist(), "merged": merged.astype(int).tolist()}
    return res


def main() -> None:
    build_traced(kquest.QuestScoreKernel)  # every Quest and decode module this process builds: traced
    build_traced(kdecode.DecodeKernel)
    spec, index, cache, indptr, indices, last, q = int4_case(sys.argv)
    hq, hkv = spec.num_qo_heads, spec.num_kv_heads
    tiling = sys.argv[sys.argv.index("--tiling") + 1] if "--tiling" in sys.argv else None
    kw = dict(zip(("tile_kv", "num_stages", "num_warps"), (int(x) for x in tiling.split("x")))) if tiling else {}
    quest = planned_quest(spec, index, indptr, indices, last, **kw)
    out = torch.empty_like(q)
    run = prepare(lambda: quest.run(q, cache, out=out), calls=1)  # one step in a CUDA graph, as the suite times it
    buffers = [trace_buffer(quest.kernel, quest.device), trace_buffer(quest.decode.planned_kernel[0], quest.device)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    qt, dt = (read_trace(*b).astype(np.int64) for b in buffers)
    qt = qt.reshape(3, 4096, 16)
    t0 = int(qt[0, qt[0, :, 0] > 0, 0].min())
    res = {"case": f"h{hq}/{hkv} B{B} L{L} budget{quest.budget_pages * PAGE}",
           "event_us": start.elapsed_time(end) * 1e3, **quest_kernel_times(qt, t0), "decode": decode_times(dt, t0)}
    res["select"]["cycles_mean"] = select_phases(qt)
    res["select"]["stamps"] = select_stamps(qt)
    shown = {k: ({a: b for a, b in v.items() if a != "per_cta"} if isinstance(v, dict) else v) for k, v in res.items()}
    print(json.dumps(shown, indent=1))
    save_json_if_asked([res])


if __name__ == "__main__":
    main()

"""Where a Quest step's time goes (debug): the suite's GQA case (h32/8 B16 L65536, budget 4096, int4
summaries) run once with traced kernels (template variable `trace`), and per kernel of the step the
CTAs' entry (placement: PDL places a kernel's CTAs before its predecessor ends), the end of their
wait for the prior grid, and their exit, in us after the first qsplit CTA's entry (%globaltimer);
the select kernel's phases in SM cycles; the decode kernel's item phases as trace_decode.py counts them.
The step runs as one CUDA-graph replay (as the suite times it): no host gaps between the kernels.

    python benchmarks/trace_quest.py [--json out.json] [--heads 32/32]
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec  # noqa: E402
from attnforge.jit import loader, registry  # noqa: E402
from attnforge.kernels import decode as kdecode, quest as kquest  # noqa: E402
from attnforge.sparse import QuestIndex, channel_scales  # noqa: E402
from bench_quest import B, D, L, PAGE, case_inputs, planned_quest  # noqa: E402
from harness import prepare  # noqa: E402
from trace_capture import build_traced, exit_by_class, save_json_if_asked  # noqa: E402

build_traced(kquest.QuestScoreKernel)
build_traced(kdecode.DecodeKernel)
KERNELS = ("qsplit", "score", "select")
DECODE_ITEMS = 32  # trace slots per CTA in batch_decode's trace


def trace_array(kernel, device) -> tuple[int, int]:
    lib = registry.get_library(kernel, kernel.module, device)
    return loader.check(loader.driver().cuLibraryGetGlobal(lib.library, b"af_trace"), "cuLibraryGetGlobal(af_trace)")


def read(dptr: int, size: int) -> np.ndarray:
    host = np.zeros(size // 8, dtype=np.uint64)
    loader.check(loader.driver().cuMemcpyDtoH(host.ctypes.data, dptr, size), "cuMemcpyDtoH")
    return host.astype(np.int64)


def spread(ns: np.ndarray, t0: int) -> dict:
    us = (ns - t0) / 1e3
    return {"min": round(float(us.min()), 2), "median": round(float(np.median(us)), 2), "max": round(float(us.max()), 2)}


def main() -> None:
    hq, hkv = (int(x) for x in (sys.argv[sys.argv.index("--heads") + 1] if "--heads" in sys.argv else "32/8").split("/"))
    cache, indptr, indices, last, kmin, kmax, q = case_inputs(hq, hkv)
    pages = B * L // PAGE
    index = QuestIndex(pages, hkv, D, device="cuda", dtype="int4", scale=channel_scales(cache[:, 0], "int4"))
    index.assign(kmin, kmax)
    quest = planned_quest(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D), index, indptr, indices, last)
    out = torch.empty_like(q)
    run = prepare(lambda: quest.run(q, cache, out=out), calls=1)  # one step in a CUDA graph, as the suite times it
    arrays = [trace_array(quest.kernel, quest.device), trace_array(quest.decode.kernel, quest.device)]
    for dptr, size in arrays:
        loader.check(loader.driver().cuMemsetD8(dptr, 0, size), "cuMemsetD8")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    qt, dt = (read(*a) for a in arrays)
    qt = qt.reshape(3, 4096, 16)
    res = {"case": f"h{hq}/{hkv} B{B} L{L} budget{quest.budget_pages * PAGE}", "event_us": start.elapsed_time(end) * 1e3}
    t0 = int(qt[0, qt[0, :, 0] > 0, 0].min())
    for k, name in enumerate(KERNELS):
        ran = qt[k, :, 0] > 0
        res[name] = {"ctas": int(ran.sum()), "entry": spread(qt[k, ran, 0], t0), "exit": spread(qt[k, ran & (qt[k, :, 2] > 0), 2], t0)}
        waited = ran & (qt[k, :, 1] > 0)
        if waited.any():
            res[name]["after_wait"] = spread(qt[k, waited, 1], t0)
    sel = qt[2, qt[2, :, 15] > 0]
    if len(sel):  # SM cycles between the select's stamps, mean over its CTAs
        c = sel[:, 3:16].astype(np.float64)
        names = ["keys"] + [f"pass{k} {p}" for k in range(3) for p in ("histogram", "bin", "end")] + ["scans", "write_out"]
        steps = np.diff(np.where(c > 0, c, np.nan), axis=1)  # a skipped pass leaves its stamps at 0
        res["select"]["cycles_mean"] = {n: round(float(np.nanmean(v)), 1) for n, v in zip(names, steps.T)}
        res["select"]["cycles_mean"]["entry_to_exit"] = float((c[:, 12] - c[:, 0]).mean())
    d = dt.reshape(-1, DECODE_ITEMS, 8)
    entry = d[:, DECODE_ITEMS - 1, 6]
    ctas = np.nonzero(entry)[0]
    g_entry, g_exit = entry[ctas], d[ctas, DECODE_ITEMS - 1, 5]
    res["decode"] = {"ctas": int(len(ctas)), "entry": spread(g_entry, t0), "exit": spread(g_exit, t0)}
    first = d[ctas, 0, :5]
    has = first[:, 0] > 0
    if has.any():  # the first item: start (before the wait) -> Q staged and first tiles issued -> tiles -> finish -> merge
        ph = np.diff(first[has], axis=1)
        res["decode"]["first_item_cycles_mean"] = dict(zip(("to_tiles_issued", "tiles", "finish", "merge"),
                                                          (round(float(x), 1) for x in ph.mean(axis=0))))
    meta = d[ctas, 0, 5]
    worked = first[:, 0] > 0
    merged = worked & (((meta >> 16) & 1) > 0)
    late = g_entry > np.median(g_entry) + 1000  # placed after the select's SMs freed
    res["decode"]["exit_by_class_us"] = exit_by_class(g_exit - t0, late.astype(int) + 2 * worked, merged)  # 2 + late: worked
    res["decode"]["per_cta"] = {"sm": (meta >> 32).tolist(), "entry_ns": (g_entry - t0).tolist(),
                                "exit_ns": (g_exit - t0).tolist(), "merged": merged.astype(int).tolist()}
    print(json.dumps({k: ({a: b for a, b in v.items() if a != "per_cta"} if isinstance(v, dict) else v)
                      for k, v in res.items()}, indent=1))
    save_json_if_asked([res])


if __name__ == "__main__":
    main()

"""Decode launch shapes beside the default, timed in rotation per case: fewer persistent CTAs per SM
(longer spans: fewer chunk fills, partial states and merges, but fewer bytes in flight), head splits
for MQA-sized groups and for groups of 8-16 (smaller items: shorter merges, each tile read by more
items), the other pipeline than the shape's default, wider KV tiles ("grid"); and spans aligned to
equal items ("align": scheduler.plan_stream(align_equal_items=True), one chunk a span). The thirteenth session's span sweep
showed every case slowing as chunks multiply (MQA 32/1 most: +26% at twice the chunks); this asks
the converse. Prints one line per case and writes the rows as JSON to the path given.

    python benchmarks/bench_decode_grid.py grid|align [out.json]   (ATTNFORGE_BENCH_GRID_CASES="h32/1,fp8" filters)
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from attnforge import AttentionSpec, BatchDecode, scheduler  # noqa: E402
from bench_decode import kv_bytes, paged_inputs  # noqa: E402
from harness import time_interleaved  # noqa: E402

L16 = [8192] * 16
GRIDS = [{"ctas_per_sm": 2}, {"ctas_per_sm": 1}]
# name: (lengths, (Hq, Hkv), kv dtype, [BatchDecode overrides beside the default])
CASES = {
    "h32/8 B16 L8192": (L16, (32, 8), "bf16", GRIDS),
    "h32/4 B16 L8192": (L16, (32, 4), "bf16", GRIDS + [{"pipeline": "normal"}, {"head_splits": 2}]),
    "h32/2 B16 L8192": (L16, (32, 2), "bf16", GRIDS + [{"pipeline": "transposed"}, {"head_splits": 2},
                                                       {"head_splits": 4}]),
    "h32/1 B16 L8192": (L16, (32, 1), "bf16", GRIDS + [{"head_splits": 1}, {"head_splits": 2, "ctas_per_sm": 2},
                                                       {"tile_kv": 32, "num_warps": 2}, {"head_splits": 4},
                                                       {"head_splits": 8}]),
    "h64/1 B16 L8192": (L16, (64, 1), "bf16", GRIDS + [{"head_splits": 1}, {"head_splits": 8}]),
    "fp8 h32/8 B16 L8192": (L16, (32, 8), "fp8_e4m3", [{"ctas_per_sm": 3}, {"ctas_per_sm": 2}]),
    "skew 1x65536+127x512": ([65536] + [512] * 127, (32, 8), "bf16", GRIDS),
    "B256 L1024": ([1024] * 256, (32, 8), "bf16", GRIDS),
}
ALIGN = [{"align_equal_items": True}]
ALIGN_CASES = {name: (*CASES[name][:3], ALIGN) for name in ("h32/8 B16 L8192", "h32/4 B16 L8192", "h32/2 B16 L8192",
                                                            "h32/1 B16 L8192")}
ALIGN_CASES.update({"B1 L131072": ([131072], (32, 8), "bf16", ALIGN),
                    "B16 L65536": ([65536] * 16, (32, 8), "bf16", ALIGN),
                    "fp8 h32/8 B16 L8192": (L16, (32, 8), "fp8_e4m3", ALIGN)})


class AlignedDecode(BatchDecode):
    """Plans with align_equal_items=True (what a default flip would run)."""

    def _plan_stream(self, kv_begin, kv_end, items_per_request):
        return scheduler.plan_stream(kv_begin, kv_end, items_per_request, self.num_ctas, align_equal_items=True)


def label(kw: dict) -> str:
    return "default" if not kw else ",".join(f"{k}={v}" for k, v in kw.items())


def main(which: str, out_path: str | None) -> None:
    keep = os.environ.get("ATTNFORGE_BENCH_GRID_CASES")
    rows = []
    for name, (lengths, (hq, hkv), kv_dtype, variants) in (ALIGN_CASES if which == "align" else CASES).items():
        if keep and not any(k in name for k in keep.split(",")):
            continue
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype=kv_dtype)
        q, cache, indptr, indices, last = paged_inputs(lengths, 16, kv_dtype, hq=hq, hkv=hkv)
        runs = {}
        for kw in [{}] + variants:
            kw = dict(kw)
            cls = AlignedDecode if kw.pop("align_equal_items", False) else BatchDecode
            pipeline = kw.pop("pipeline", None)  # the other pipeline than the shape's default
            w = cls(dataclasses.replace(spec, pipeline=pipeline) if pipeline else spec,
                    max_batch_size=max(256, len(lengths)), **kw)
            if pipeline:
                kw["pipeline"] = pipeline
            w.plan(indptr, indices, last, page_size=16)
            spans = w._plan["work"].num_spans
            runs[f"{label(kw) if cls is BatchDecode else 'aligned'} [{w.planned_kernel[1]} CTAs, {spans} spans, "
                 f"{w.kernel.head_splits} splits]"] = (
                lambda w=w, q=q, cache=cache: w.run(q, cache))
        times = time_interleaved(runs)
        nbytes = kv_bytes(lengths, kv_dtype) * hkv // 8
        print(f"{name}: " + ", ".join(f"{k} {t:.2f} us" for k, t in times.items()), flush=True)
        rows += [{"suite": f"decode_{which}", "case": name, "impl": k, "us": round(t, 2),
                  "gbps": round(nbytes / t / 1e3, 1), "tflops": None} for k, t in times.items()]
        del runs, q, cache
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "grid", sys.argv[2] if len(sys.argv) > 2 else None)

"""Decode tilings at B16 L8192 (GQA 32/8, page 16), each case's variants timed in rotation: the default
against explicit (tile_kv, stages, warps), for the shapes whose default was chosen by a few points
(fp8 at d128), never swept (fp8 at d64) or set by shared memory alone (d256: a 64-token tile of
16-bit K and V leaves room for one CTA per SM). Prints one line per case.

    python benchmarks/bench_decode_tilings.py [d64-bf16|d64-fp8|d128-fp8|d256-fp8|d256-bf16 ...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attnforge import AttentionSpec, BatchDecode  # noqa: E402
from benchmarks.harness import time_interleaved  # noqa: E402
from tests.helpers import make_paged_case  # noqa: E402

# 32-token tiles of two warps: 2-4 CTAs per SM at d256 where a 64-token tile of four warps fits 1-2
CASES = {  # name: (head_dim, kv_dtype, [(tile_kv, stages, warps), ...] beside the default)
    "d64-bf16": (64, "bf16", [(64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 2, 8)]),  # 4 CTAs of 34 KB: never swept
    "d64-fp8": (64, "fp8_e4m3", [(64, 3, 4), (64, 4, 4), (128, 2, 8)]),  # widened in shared memory: never swept
    "d128-fp8": (128, "fp8_e4m3", [(64, 4, 4)]),
    "d256-fp8": (256, "fp8_e4m3", [(64, 4, 4), (32, 2, 2), (32, 3, 2), (32, 4, 2)]),
    "d256-bf16": (256, "bf16", [(64, 2, 4), (32, 3, 2)]),  # the default: (32, 2, 2); (64, 2, 4) was
    "d256-bf16-mqa": (256, "bf16", [(64, 2, 4)]),  # 64 heads per KV head, normal pipeline: the default (64, 2, 8)
}


def main(names: list[str]) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in names or list(CASES):
        d, kv_dtype, tilings = CASES[name]
        heads = {"num_qo_heads": 64, "num_kv_heads": 1, "pipeline": "normal"} if name.endswith("mqa") else \
            {"pipeline": "transposed"}  # GQA 32/8 otherwise
        spec = AttentionSpec(kv_dtype=kv_dtype, head_dim_qk=d, **heads)
        q, cache, (indptr, indices, last), _ = make_paged_case(spec, [8192] * 16, 16, seed=0)
        runs = {}
        for tiling in [None] + tilings:
            kw = {} if tiling is None else dict(zip(("tile_kv", "num_stages", "num_warps"), tiling))
            w = BatchDecode(spec, **kw)
            w.plan(indptr, indices, last, page_size=16)
            label = "default" if tiling is None else "t{}s{}w{}".format(*tiling)
            runs[f"{label} ({w.planned_kernel[1] // sms} CTAs/SM)"] = (lambda w=w, q=q, cache=cache: w.run(q, cache))
        t = time_interleaved(runs)
        kv_bytes = 16 * 8192 * spec.num_kv_heads * d * 2 * (1 if kv_dtype == "fp8_e4m3" else 2)
        print(f"{name} B16 L8192: " + ", ".join(f"{k} {v:.1f} us ({kv_bytes / v / 1e3:.0f} GB/s)" for k, v in t.items()))


if __name__ == "__main__":
    main(sys.argv[1:])

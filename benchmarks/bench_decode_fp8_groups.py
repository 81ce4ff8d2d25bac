"""fp8 KV decode at one token a request for groups of 9-16 query heads a KV head: the normal pipeline (what
'auto' picks for such groups: one m16 tile of heads, the fp8 tile widened to 16 bits through shared memory)
against the transposed one (two n8 head tiles, the tile widened in registers once for both, since the
seventy-fourth session), each variant timed in rotation. Outputs are compared with the normal pipeline's.

    python benchmarks/bench_decode_fp8_groups.py [--out X.json]
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import paged_inputs  # noqa: E402
from harness import time_interleaved  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402


def cases() -> list:
    """(name, query heads, KV heads, request lengths): d128, 16-token pages."""
    rand = torch.randint(512, 16384, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return [("32/2 B64 L8192", 32, 2, [8192] * 64), ("128/8 B16 L8192", 128, 8, [8192] * 16),
            ("96/8 B32 L4096", 96, 8, [4096] * 32), ("64/4 B32 L8192", 64, 4, [8192] * 32),
            ("32/2 B1 L131072", 32, 2, [131072]), ("32/2 B64 Lrand", 32, 2, rand)]


def variants(hq: int, hkv: int) -> dict:
    def spec(pipeline):
        return AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, kv_dtype="fp8_e4m3", pipeline=pipeline)
    return {"normal": BatchDecode(spec("normal")), "transposed": BatchDecode(spec("transposed")),
            "transposed-split": BatchDecode(spec("transposed"), whole_items=False)}


def main(argv: list[str]) -> None:
    results = {}
    for name, hq, hkv, lengths in cases():
        torch.manual_seed(0)
        q, cache, indptr, indices, last = paged_inputs(lengths, 16, "fp8_e4m3", "NHD", hq, hkv, 128)
        ws, runs, outs = variants(hq, hkv), {}, {}
        for label, w in ws.items():
            w.plan(indptr, indices, last, page_size=16)
            outs[label] = torch.full_like(q, float("nan"))  # poisoned: a row never written shows as NaN
            runs[label] = (lambda w=w, o=outs[label]: w.run(q, cache, out=o))
        times = time_interleaved(runs)
        diff = {k: (o.float() - outs["normal"].float()).abs().max().item() for k, o in outs.items()}
        kv_bytes = sum(lengths) * hkv * 128 * 2  # fp8: one byte a K or V element
        results[name] = {label: {"us": us, "gbps": kv_bytes / us / 1e3, "kernel": ws[label].planned_kernel[0].name,
                                 "ctas": ws[label].planned_kernel[1],
                                 "max_diff_vs_normal": diff[label]}
                         for label, us in times.items()}
        print(f"{name}: " + ", ".join(f"{k} {v['us']:.1f} us ({v['gbps']:.0f} GB/s, diff {v['max_diff_vs_normal']:.1e})"
                                      for k, v in results[name].items()), flush=True)
        del q, cache
    if "--out" in argv:
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

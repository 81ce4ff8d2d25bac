"""Suite `decode_sweep`: tile/stage/pipeline configurations on a few decode cases (for perf-notes).
ATTNFORGE_BENCH_DECODE_CASES picks the cases (any of bench_decode's) and ATTNFORGE_BENCH_SWEEP_CONFIGS
the configurations, as tile x stages x warps: "64x2x4,128x2x8"."""
from __future__ import annotations

import os

import torch

from attnforge import AttentionSpec, BatchDecode
from bench_decode import HKV, HQ, D, cases, kv_bytes, paged_inputs
from harness import Report, time_us

CONFIGS = [(64, 3, 4), (64, 2, 4), (64, 4, 4), (128, 2, 8), (128, 3, 8)]
CASES = ("B16 L8192", "B64 Lrand page1", "B16 L8192 fp8kv", "B256 L1024")


def configs() -> list[tuple[int, int, int]]:
    given = os.environ.get("ATTNFORGE_BENCH_SWEEP_CONFIGS")
    return [tuple(int(x) for x in c.split("x")) for c in given.split(",")] if given else CONFIGS


def run(report: Report, peers: bool = False) -> None:
    chosen = os.environ.get("ATTNFORGE_BENCH_DECODE_CASES")  # cases() already kept only those
    for case, lengths, page_size, kv_dtype, layout in cases():
        if not chosen and case not in CASES:
            continue
        q, cache, indptr, indices, last = paged_inputs(lengths, page_size, kv_dtype, layout)
        for pipeline in ("normal", "transposed"):
            spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, kv_dtype=kv_dtype,
                                 pipeline=pipeline)
            for tile, stages, warps in configs():
                try:
                    w = BatchDecode(spec, max_batch_size=256, tile_kv=tile, num_stages=stages, num_warps=warps)
                except ValueError as e:
                    report.note(f"{case} {pipeline} t{tile}s{stages}w{warps}: {e}")
                    continue
                w.plan(indptr, indices, last, page_size=page_size)
                out = torch.empty_like(q)
                report.add("decode_sweep", case, f"attnforge-{pipeline}-t{tile}s{stages}w{warps}",
                           time_us(lambda: w.run(q, cache, out=out)), kv_bytes(lengths, kv_dtype))
        del q, cache

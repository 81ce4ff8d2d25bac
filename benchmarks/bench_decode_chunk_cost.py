"""Suite `decode_chunk_cost`: the planner's fixed cost per chunk (scheduler.CHUNK_FIXED_COST, in
token-equivalents: it sets how finely the work stream cuts items) swept on decode cases with few,
many and skewed items. Rows attnforge-c<cost>; the library's value is the one measured best here."""
from __future__ import annotations

import os

import torch

from attnforge import AttentionSpec, BatchDecode, scheduler
from attnforge.jit import registry
from bench_decode import HKV, HQ, D, cases, kv_bytes, paged_inputs
from harness import Report, prepare, time_interleaved

COSTS = [int(c) for c in os.environ.get("ATTNFORGE_SWEEP_CHUNK_COSTS", "16,32,64,128,256").split(",")]
CASES = ("B1 L131072", "B16 L8192", "B256 L1024", "B64 Lrand", "skew 1x65536+127x512")


def prepare_with_cost(fn, calls, use_graph):
    """Capture each variant's graph with its own kernel: the in-process registry keys kernels by their
    spec and tiling, not by this constant, so it is emptied before each variant's first launch."""
    scheduler.CHUNK_FIXED_COST = fn.cost
    registry.clear()
    return prepare(fn, calls, use_graph)


def run(report: Report, peers: bool = False) -> None:
    default = scheduler.CHUNK_FIXED_COST
    # the cascade's suffix level, and the shape of Quest's decode over the chosen pages (GQA case)
    extra = [("B256 L512", [512] * 256, 16, "bf16", "NHD"), ("B16 L4096", [4096] * 16, 16, "bf16", "NHD")]
    try:
        for case, lengths, page_size, kv_dtype, layout in [c for c in cases() if c[0] in CASES] + extra:
            q, cache, indptr, indices, last = paged_inputs(lengths, page_size, kv_dtype, layout)
            fns = {}
            for cost in COSTS:
                scheduler.CHUNK_FIXED_COST = cost  # read by plan() and by the kernel's template
                w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D), max_batch_size=256)
                w.plan(indptr, indices, last, page_size=page_size)
                fn = (lambda w=w, out=torch.empty_like(q), q=q, cache=cache: w.run(q, cache, out=out))
                fn.cost = cost
                fns[f"attnforge-c{cost}"] = fn
            for name, us in time_interleaved(fns, prepare_fn=prepare_with_cost).items():
                report.add("decode_chunk_cost", case, name, us, kv_bytes(lengths, kv_dtype))
            outs = [fn.__defaults__[1] for fn in fns.values()]  # each variant's last replay wrote its out
            worst = max(float((o.float() - outs[0].float()).abs().max()) for o in outs)
            report.note(f"decode_chunk_cost {case}: largest difference between the variants' outputs {worst:.2e}")
            del q, cache, fns
            torch.cuda.empty_cache()
    finally:
        scheduler.CHUNK_FIXED_COST = default

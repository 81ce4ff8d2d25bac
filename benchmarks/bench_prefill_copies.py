"""Suite `prefill_copies`: how the Hopper prefill kernel's producer copies K/V tiles, per page size
and for ragged K/V: TMA boxes (`tma=True`: whole pages, or whole tiles of ragged K/V) against cp.async
rows (`tma=False`), GQA 32/8 d128 bf16 causal, one 8192-token request (pages shuffled). Rows
attnforge-tma and attnforge-cp-async, timed in rotation."""
from __future__ import annotations

import numpy as np
import torch

import attnforge
from attnforge import AttentionSpec, BatchPrefill
from bench_prefill import HKV, HQ, D, causal_flops
from harness import Report, time_interleaved, time_us

LENGTH = 8192
PAGE_SIZES = (8, 16, 32, 64, 128)


def compare_copies(report, case, spec, flops, plan_args, plan_kw, q, kv) -> None:
    """attnforge-tma against attnforge-cp-async on one case (kv: a paged cache or a (k, v) pair), in rotation."""
    fns = {}
    for name, tma in (("attnforge-tma", True), ("attnforge-cp-async", False)):
        w = BatchPrefill(spec, tma=tma)
        w.plan(*plan_args, **plan_kw)
        fns[name] = lambda w=w: w.run(q, kv)
    for name, us in time_interleaved(fns, calls=2, reps=10).items():
        report.add("prefill_copies", case, name, us, None, flops)


def run(report: Report, peers: bool = False) -> None:
    spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True)
    q = torch.randn(LENGTH, HQ, D, device="cuda", dtype=torch.bfloat16)
    flops = causal_flops([LENGTH])
    for page in PAGE_SIZES:
        n_pages = LENGTH // page
        cache = torch.randn(n_pages, 2, page, HKV, D, device="cuda", dtype=torch.bfloat16)
        perm = np.random.default_rng(0).permutation(n_pages)
        compare_copies(report, f"B1 S{LENGTH} paged{page}", spec, flops, ([0, LENGTH], [0, n_pages], perm, [page]),
                       {"page_size": page}, q, cache)
        del cache
        torch.cuda.empty_cache()
    k = torch.randn(LENGTH, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    compare_copies(report, f"B1 S{LENGTH} ragged", spec, flops, ([0, LENGTH], [0, LENGTH]), {}, q, (k, v))
    # the one-shot API on SDPA-layout [1, H, L, D] tensors (its K/V path differs from ragged K/V),
    # not causal: for an A/B of source trees (tools/ab_bench.sh), one row
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    report.add("prefill_copies", f"attention() B1 S{LENGTH} not causal", "attnforge",
               time_us(lambda: attnforge.attention(qd, kd, vd, enable_gqa=True), calls=2, reps=10), None,
               4 * D * HQ * LENGTH * LENGTH)


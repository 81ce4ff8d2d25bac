"""Suite `verify_fp8_rows`: fp8 verify steps whose work items span two m16 tiles at d128 (24-30 rows: groups 3, 5
and 6 at 4-8 tokens a request), the shapes ptxas gave 182-183 registers where shared memory plans 3 CTAs an SM
(111th session). Since then `DecodeKernel.registers_needed` holds them to 168 registers (a little stack) so 3 CTAs
fit. Rows, timed in rotation on the same pages: `attnforge` (3 CTAs an SM) and `attnforge-2cta` (the same kernel
on a grid of 2 an SM, `ctas_per_sm=2`: what planning by ptxas's own count would have given, less its spills).
Outputs of the two rows are compared: the same kernel, but the two grids split KV at different points, so they agree
to rounding, not bit for bit (an H100 run, 112th session: 3 CTAs an SM 28% faster in every case).

    python benchmarks/bench_verify_fp8_rows.py [--out X.json] [case names...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D, HKV, kv_bytes, paged_inputs  # noqa: E402  (kv_bytes counts GQA x/8 at d128)
from harness import Report, fresh_allocator, standalone, time_poisoned_outputs  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402

SUITE, PAGE, BATCH, LENGTH = "verify_fp8_rows", 16, 64, 4096
# (name, group, tokens a request): every shape the CPU scan found over the plan
CASES = [("g3 q8", 3, 8), ("g5 q5", 5, 5), ("g5 q6", 5, 6), ("g6 q4", 6, 4), ("g6 q5", 6, 5)]


def run(report: Report, names: tuple = ()) -> None:
    for name, group, q_len in CASES:
        if names and name not in names:
            continue
        torch.manual_seed(0)
        hq, lengths = HKV * group, [LENGTH] * BATCH
        _, cache, indptr, indices, last = paged_inputs(lengths, PAGE, "fp8_e4m3", "NHD", hq, HKV, D)
        q = torch.randn(BATCH * q_len, hq, D, device="cuda", dtype=torch.bfloat16)
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=HKV, head_dim_qk=D, kv_dtype="fp8_e4m3")
        ws = {impl: BatchDecode(spec, max_batch_size=BATCH, max_q_len=q_len, whole_items=False, **kw)
              for impl, kw in (("attnforge", {}), ("attnforge-2cta", {"ctas_per_sm": 2}))}
        for w in ws.values():
            w.plan(indptr, indices, last, page_size=PAGE, q_len=q_len)
        kernel, ctas = ws["attnforge"].planned_kernel
        report.note(f"{SUITE} {name}: {kernel.name} x {ctas} CTAs")
        time_poisoned_outputs(report, SUITE, f"{name} B{BATCH} L{LENGTH}",
                              {impl: (lambda o, w=w: w.run(q, cache, out=o)) for impl, w in ws.items()}, q,
                              kv_bytes(lengths, "fp8_e4m3"))
        del q, cache
        fresh_allocator()


if __name__ == "__main__":
    standalone(run, sys.argv[1:])

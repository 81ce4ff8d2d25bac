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

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D, HKV  # noqa: E402  (8 KV heads, d128)
from bench_verify_fp8_split import run_cases  # noqa: E402
from harness import Report, standalone  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402

SUITE, BATCH, LENGTH = "verify_fp8_rows", 64, 4096  # (pages of 16 tokens: bench_verify_fp8_split.run_cases)
# (name, group, tokens a request): every shape the CPU scan found over the plan
CASES = [("g3 q8", 3, 8), ("g5 q5", 5, 5), ("g5 q6", 5, 6), ("g6 q4", 6, 4), ("g6 q5", 6, 5)]


def wrappers(group: int, q_len: int, batch: int) -> dict:
    """The suite's two rows: the same kernel at 3 CTAs an SM (the plan) and on a grid of 2."""
    spec = AttentionSpec(num_qo_heads=HKV * group, num_kv_heads=HKV, head_dim_qk=D, kv_dtype="fp8_e4m3")
    return {impl: BatchDecode(spec, max_batch_size=batch, max_q_len=q_len, whole_items=False, **kw)
            for impl, kw in (("attnforge", {}), ("attnforge-2cta", {"ctas_per_sm": 2}))}


def run(report: Report, names: tuple = ()) -> None:
    run_cases(report, SUITE, [(name, group, q_len, BATCH, LENGTH) for name, group, q_len in CASES], wrappers, names)


if __name__ == "__main__":
    standalone(run, sys.argv[1:])

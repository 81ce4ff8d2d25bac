"""Suite `verify_fp8_widen`: fp8 verify steps on the normal pipeline (items past the transposed pipeline's 16 rows
go there by default) with K and V widened by a shared-memory pass into a 16-bit tile against widened in registers
after ldmatrix (`DecodeKernel.normal_widen_in_registers`: no 16-bit copy, no second barrier a tile, 32 KB less
shared memory, fp16 MMAs; the default past 16 rows since the 113th session, which measured it 19-31% faster on an
H100). Rows, timed in rotation on the same pages: `attnforge` (the default), and the normal pipeline's
`attnforge-smem-widen` and `attnforge-regwiden`. Each row's output is compared with the default's.

    python benchmarks/bench_verify_fp8_widen.py [--out X.json] [case names...]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D, HKV, kernel_twin  # noqa: E402  (8 KV heads, d128)
from bench_verify_fp8_split import run_cases  # noqa: E402
from harness import Report, standalone  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402

SUITE = "verify_fp8_widen"  # (pages of 16 tokens: bench_verify_fp8_split.run_cases)
# (name, group, tokens a request, batch, length): GQA 64/8 at 3, 4 and 8 tokens (24-64 rows), 32/8 at 5 and 8,
# 128/8 at 4, groups 3 and 5 (the register-held shapes), and 9-16 rows, transposed by default: 32/8 at 4 tokens
# (7.8% slower there than the normal pipeline widened in registers, 113th session), 64/8 at 2, 128/8 at 1 (decode
# itself) and 32/8 at 3 (12 rows): whether the default should move below 16 rows; and 56/8 at 7 and 72/8 at 6 (49 and
# 54 rows), two of the six shapes whose kernels, held to 168 registers for 3 CTAs, spill 40-80 bytes (stored once,
# reloaded in the main loop; 113th session's scan), where the shared-memory pass runs 2 CTAs without spills.
# The 114th session (H100) read every 9-16-row case 7.7-8.2% faster on the normal pipeline widened in registers
# than on the transposed default, so it asks about fewer rows too: plain decode at 32/8 and 64/8 (4 and 8 rows: the
# decode suite's fp8 case is 32/8) and 16/8 at 4 tokens; and 32/8 at 4 tokens on B16 L16384 (128 items, about one
# an SM), where the transposed default plans its one-CTA whole-item kernel; and 256/8 at 1 token (group 32: two
# items of 16 heads a KV head, as fp8 MQA-sized groups at d128 run, transposed by default). Since the 115th session
# the default runs d128's 9-16-row items on the normal pipeline but keeps the transposed kernel's whole-item plans:
# 128/8 at 1 token on B16 L16384 (one item an SM) and B1 L131072 (8 items cut into 16 chunks) time those against
# the normal kernel's split plan
CASES = [("g8 q4", 8, 4, 64, 4096), ("g8 q4 L8192", 8, 4, 16, 8192), ("g8 q3", 8, 3, 64, 4096),
         ("g8 q8", 8, 8, 64, 4096), ("g4 q8", 4, 8, 64, 4096), ("g4 q5", 4, 5, 64, 4096), ("g16 q4", 16, 4, 32, 4096),
         ("g3 q8", 3, 8, 64, 4096), ("g5 q5", 5, 5, 64, 4096), ("g4 q4", 4, 4, 64, 4096), ("g8 q2", 8, 2, 64, 4096),
         ("g16 q1", 16, 1, 64, 4096), ("g4 q3", 4, 3, 64, 4096), ("g7 q7", 7, 7, 64, 4096), ("g9 q6", 9, 6, 64, 4096),
         ("g4 q1", 4, 1, 64, 4096), ("g8 q1", 8, 1, 64, 4096), ("g2 q4", 2, 4, 64, 4096),
         ("g4 q4 B16", 4, 4, 16, 16384), ("g32 q1", 32, 1, 32, 4096), ("g16 q1 B16", 16, 1, 16, 16384),
         ("g16 q1 B1", 16, 1, 1, 131072)]


def wrappers(group: int, q_len: int, batch: int) -> dict:
    """The suite's rows for one shape: BatchDecode wrappers, the default first. Past 16 rows the default is one of
    the two normal rows (the same kernel twice: the rotation's noise floor)."""
    kw = dict(num_qo_heads=HKV * group, num_kv_heads=HKV, head_dim_qk=D, kv_dtype="fp8_e4m3")
    normal = AttentionSpec(**kw, pipeline="normal")
    rows = {"attnforge": BatchDecode(AttentionSpec(**kw), max_batch_size=batch, max_q_len=q_len)}
    for impl, in_registers in (("attnforge-smem-widen", False), ("attnforge-regwiden", True)):
        twin = kernel_twin({"normal_widen_in_registers": in_registers})
        # (the split plan on that kernel: no whole-item twins, which at 9-16 rows run the transposed kernel)
        rows[impl] = twin(normal, max_batch_size=batch, max_q_len=q_len, whole_items=False)
    return rows


def run(report: Report, names: tuple = ()) -> None:
    run_cases(report, SUITE, CASES, wrappers, names)


if __name__ == "__main__":
    standalone(run, sys.argv[1:])

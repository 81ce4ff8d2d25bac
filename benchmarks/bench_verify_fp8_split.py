"""Suite `verify_fp8_split`: fp8 verify steps whose items pass the transposed pipeline's 16 rows (GQA groups of
3-16 at 3-8 tokens a request, d128). They run on the normal pipeline, which widens fp8 K and V through shared
memory once for all of an item's rows. The alternative measured here: split each item's heads (head_splits) so
every item keeps at most 16 rows on the transposed pipeline, which widens in registers, while the items of a KV
head reread its pages from L2. Rows, timed in rotation on the same pages: `attnforge` (the default, normal) and
`attnforge-hs<N>` (the transposed pipeline at N items a KV head). Each row's output is compared with the default's.
112th session, H100: every split lost, the fewest by 19-79%: a KV head's items run back to back on the work
stream, so each rereads its pages from DRAM (as the seventy-third session found for the same split).

    python benchmarks/bench_verify_fp8_split.py [--out X.json] [case names...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D, HKV, kv_bytes, paged_inputs  # noqa: E402  (8 KV heads, d128)
from harness import Report, fresh_allocator, standalone, time_poisoned_outputs  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402

SUITE, PAGE = "verify_fp8_split", 16
# (name, group, tokens a request, batch, length, items a KV head to time on the transposed pipeline)
CASES = [("g4 q8", 4, 8, 64, 4096, (2, 4)), ("g8 q4", 8, 4, 64, 4096, (2, 4)), ("g8 q4 L8192", 8, 4, 16, 8192, (2,)),
         ("g8 q3", 8, 3, 64, 4096, (2,)), ("g8 q8", 8, 8, 64, 4096, (4, 8)), ("g6 q4", 6, 4, 64, 4096, (2, 3, 6)),
         ("g3 q8", 3, 8, 64, 4096, (3,)), ("g4 q5", 4, 5, 64, 4096, (2,)), ("g16 q4", 16, 4, 32, 4096, (4, 8)),
         ("g5 q5", 5, 5, 64, 4096, (5,))]


def wrappers(group: int, q_len: int, batch: int, splits: tuple) -> dict:
    """The suite's rows for one shape: BatchDecode wrappers, the default first."""
    spec = AttentionSpec(num_qo_heads=HKV * group, num_kv_heads=HKV, head_dim_qk=D, kv_dtype="fp8_e4m3")
    rows = {"attnforge": BatchDecode(spec, max_batch_size=batch, max_q_len=q_len)}
    for hs in splits:  # (explicit head_splits: the pipeline for the split item's rows, spec_for_rows)
        rows[f"attnforge-hs{hs}"] = BatchDecode(spec, max_batch_size=batch, max_q_len=q_len, head_splits=hs)
    return rows


def run_cases(report: Report, suite: str, cases: list, make_wrappers, names: tuple) -> None:
    """fp8 verify steps of `cases` (name, group, tokens a request, batch, length, *more), each on fresh pages:
    make_wrappers(group, tokens, batch, *more) -> {impl: BatchDecode}, planned, noted and timed in rotation with
    poisoned outputs compared with the first impl's (harness.time_poisoned_outputs)."""
    for name, group, q_len, batch, length, *more in cases:
        if names and name not in names:
            continue
        torch.manual_seed(0)
        lengths = [length] * batch
        _, cache, indptr, indices, last = paged_inputs(lengths, PAGE, "fp8_e4m3", "NHD", HKV * group, HKV, D)
        q = torch.randn(batch * q_len, HKV * group, D, device="cuda", dtype=torch.bfloat16)
        ws = make_wrappers(group, q_len, batch, *more)
        for impl, w in ws.items():
            w.plan(indptr, indices, last, page_size=PAGE, q_len=q_len)
            kernel, ctas = w.planned_kernel
            report.note(f"{suite} {name} {impl}: {kernel.name} x {ctas} CTAs")
        case = " ".join(name.split()[:2]) + f" B{batch} L{length}"
        time_poisoned_outputs(report, suite, case, {impl: (lambda o, w=w: w.run(q, cache, out=o))
                                                    for impl, w in ws.items()}, q, kv_bytes(lengths, "fp8_e4m3"))
        del q, cache
        fresh_allocator()


def run(report: Report, names: tuple = ()) -> None:
    run_cases(report, SUITE, CASES, wrappers, names)


if __name__ == "__main__":
    standalone(run, sys.argv[1:])

"""Suite `decode_fp8_groups`: fp8 KV decode at one token a request for groups of more than 8 query heads a KV
head, on 16-token pages. The normal pipeline puts one m16 tile of heads on the MMA's M side and widens the fp8
tile to 16 bits through shared memory at d64 and d256, in registers after ldmatrix at d128 (since the 113th
session); the transposed one holds two n8 head tiles and widens each K/V fragment in registers once for both
(since the seventy-fourth session; at d64 since the seventy-sixth). Groups past 16 run on both as items of 16 heads
(head_splits). 'auto' picks transposed for groups 9-16 at d64 and d256 and multiples of 16 at d64, and normal for
groups past 8 at d128 (since the 115th session; spec.default_pipeline); this suite keeps the other pipeline beside
it, timed in rotation, and FlashInfer's tensor-core decode on the same pages.

Rows: `attnforge` (auto), `attnforge-normal` / `attnforge-transposed` (the pipeline auto did not pick),
`flashinfer-tc` (groups up to 16: FlashInfer 0.2.14 segfaulted on fp8 MQA). GB/s counts the fp8 KV bytes read
once, so MQA's items of 16 heads, which read their KV head's tokens once each, read 2-4x that. Outputs of the two
pipelines are compared.

    python benchmarks/bench_decode_fp8_groups.py [--out X.json] [case names...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import flashinfer_decode_us, paged_inputs  # noqa: E402
from harness import Report, fresh_allocator, standalone, time_interleaved  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402

SUITE, PAGE = "decode_fp8_groups", 16


def cases() -> list:
    """(name, query heads, KV heads, head dim, request lengths)."""
    rand = torch.randint(512, 16384, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return [("32/2 B64 L8192", 32, 2, 128, [8192] * 64), ("128/8 B16 L8192", 128, 8, 128, [8192] * 16),
            ("96/8 B32 L4096", 96, 8, 128, [4096] * 32), ("32/2 B1 L131072", 32, 2, 128, [131072]),
            ("32/2 B64 Lrand", 32, 2, 128, rand), ("d64 32/2 B64 L8192", 32, 2, 64, [8192] * 64),
            ("d256 32/2 B64 L4096", 32, 2, 256, [4096] * 64), ("mqa 32/1 B64 L8192", 32, 1, 128, [8192] * 64),
            ("mqa 32/1 B1 L131072", 32, 1, 128, [131072]), ("mqa 64/1 B32 L4096", 64, 1, 128, [4096] * 32),
            ("d64 96/8 B32 L4096", 96, 8, 64, [4096] * 32), ("d64 32/2 B1 L131072", 32, 2, 64, [131072]),
            ("d64 mqa 32/1 B64 L8192", 32, 1, 64, [8192] * 64)]


def wrappers(hq: int, hkv: int, d: int) -> dict:
    """impl -> BatchDecode: the default, and the pipeline it did not pick (items of 16 heads past 16)."""
    def spec(pipeline):
        return AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=d, kv_dtype="fp8_e4m3",
                             pipeline=pipeline)
    auto = spec("auto")
    other = "normal" if auto.pipeline == "transposed" else "transposed"
    return {"attnforge": BatchDecode(auto), f"attnforge-{other}": BatchDecode(spec(other))}


def run(report: Report, peers: bool = True, names: tuple = ()) -> None:
    """names (or ATTNFORGE_BENCH_DECODE_FP8_CASES="mqa 32/1 B64 L8192,..."): a subset of the cases."""
    names = names or tuple(filter(None, os.environ.get("ATTNFORGE_BENCH_DECODE_FP8_CASES", "").split(",")))
    for name, hq, hkv, d, lengths in cases():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        q, cache, indptr, indices, last = paged_inputs(lengths, PAGE, "fp8_e4m3", "NHD", hq, hkv, d)
        nbytes = sum(lengths) * hkv * d * 2  # fp8: one byte a K or V element
        ws, runs, outs = wrappers(hq, hkv, d), {}, {}
        for impl, w in ws.items():
            w.plan(indptr, indices, last, page_size=PAGE)
            outs[impl] = torch.full_like(q, float("nan"))  # poisoned: a row never written shows as NaN
            runs[impl] = (lambda w=w, o=outs[impl]: w.run(q, cache, out=o))
        for impl, us in time_interleaved(runs).items():
            report.add(SUITE, name, impl, us, nbytes)
        (a, wa), (b, _) = ws.items()
        diff = (outs[a].float() - outs[b].float()).abs().max().item()
        report.note(f"{SUITE} {name}: default {wa.planned_kernel[0].name} x {wa.planned_kernel[1]} CTAs; "
                    f"max |{a} - {b}| = {diff:.1e}")
        if peers and hq // hkv > 16:  # (one case's segfault ends the whole run: not tried again)
            report.note(f"flashinfer on {SUITE} {name}: left out; FlashInfer 0.2.14's tensor-core decode killed the "
                        f"process (segfault, exit 139) on fp8 MQA 32/1 d128 (seventy-fifth session)")
        elif peers:
            try:
                us = flashinfer_decode_us(q, cache, indptr, indices, last, PAGE, hq=hq, hkv=hkv, d=d)
                report.add(SUITE, name, "flashinfer-tc", us, nbytes)
            except Exception as e:  # a peer that cannot run a shape is a note, not a failed suite
                report.note(f"flashinfer on {SUITE} {name}: {type(e).__name__}: {str(e)[:160]}")
        del q, cache
        fresh_allocator()


if __name__ == "__main__":
    standalone(run, sys.argv[1:])

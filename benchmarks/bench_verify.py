"""Suite `verify`: speculative decoding's verification step. Each request brings q_len query tokens (the
last accepted token and its drafts), causal among themselves and end-aligned to its paged KV (GQA 32/8,
head_dim 128, bf16, 16-token pages). `attnforge` runs it as a decode of several tokens a request
(BatchDecode(max_q_len=q_len): a work item holds the group's heads for every token; `-normal` forces that
pipeline; `-no-whole-items` never takes the plan-time whole-item kernels, kernels.decode.whole_item_tilings);
the `attnforge-prefill*` rows as a batch prefill (BatchPrefill, which packs heads and tokens into
a 128-row or 64-row tile); FlashInfer as its paged prefill (fa2, fa3). fp8 rows read e4m3 pages (scales 1).

GB/s counts the KV bytes read, as the decode suite does: at these shapes the step streams the cache, so
`attnforge-decode-q1` (one query token a request, the same pages) is the byte floor's measured stand-in,
timed in the same rotation.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode, BatchPrefill
from bench_decode import kv_bytes, paged_inputs
from harness import Report, flashinfer_workspace, time_interleaved, time_us

HQ, HKV, D, PAGE = 32, 8, 128, 16


def cases():
    """(name, q_len, kv lengths, kv dtype); ATTNFORGE_BENCH_VERIFY_CASES="B64 q4 L4096,..." runs a subset."""
    rand = torch.randint(512, 16384, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    out = [("B64 q4 L4096", 4, [4096] * 64, "bf16"), ("B16 q8 L8192", 8, [8192] * 16, "bf16"),
           ("B128 q2 L2048", 2, [2048] * 128, "bf16"), ("B32 q4 Lrand", 4, rand, "bf16"),
           ("B64 q4 L4096 fp8kv", 4, [4096] * 64, "fp8_e4m3")]
    keep = os.environ.get("ATTNFORGE_BENCH_VERIFY_CASES")
    return [c for c in out if c[0] in keep.split(",")] if keep else out


def run(report: Report, peers: bool = True) -> None:
    spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True)
    for case, q_len, lengths, kv_dtype in cases():
        torch.manual_seed(0)
        q1, cache, kv_indptr, kv_indices, last = paged_inputs(lengths, PAGE, kv_dtype)
        q = torch.randn(len(lengths) * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        qo_indptr = np.arange(len(lengths) + 1, dtype=np.int32) * q_len
        nbytes = kv_bytes(lengths, kv_dtype)
        fns = {}
        for name, pipeline, whole in (("attnforge", "auto", None), ("attnforge-decode-normal", "normal", None),
                                      ("attnforge-no-whole-items", "auto", False)):
            dspec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, pipeline=pipeline,
                                  kv_dtype=kv_dtype)
            w = BatchDecode(dspec, max_batch_size=256, max_q_len=q_len, whole_items=whole)
            w.plan(kv_indptr, kv_indices, last, page_size=PAGE, q_len=q_len)
            fns[name] = (lambda w: lambda: w.run(q, cache))(w)
        pspec = dataclasses.replace(spec, kv_dtype=kv_dtype)
        for name, kw in (("attnforge-prefill", {}), ("attnforge-prefill-mma", {"backend": "mma"})):
            w = BatchPrefill(pspec, **kw)
            w.plan(qo_indptr, kv_indptr, kv_indices, last, page_size=PAGE)
            fns[name] = (lambda w: lambda: w.run(q, cache))(w)
        dec = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, kv_dtype=kv_dtype),
                          max_batch_size=256)
        dec.plan(kv_indptr, kv_indices, last, page_size=PAGE)
        fns["attnforge-decode-q1"] = lambda: dec.run(q1, cache)
        for name, us in time_interleaved(fns, calls=5, reps=20).items():
            report.add("verify", case, name, us, nbytes)
        if peers:
            bench_flashinfer(report, case, q, cache, qo_indptr, kv_indptr, kv_indices, last, nbytes)


def bench_flashinfer(report, case, q, cache, qo_indptr, kv_indptr, kv_indices, last, nbytes):
    try:
        import flashinfer
    except Exception as e:
        report.note(f"flashinfer unavailable: {e}")
        return
    ws = flashinfer_workspace()
    dev = lambda a: torch.as_tensor(np.asarray(a), device="cuda", dtype=torch.int32)  # noqa: E731
    for backend in ("fa2", "fa3"):
        try:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(dev(qo_indptr), dev(kv_indptr), dev(kv_indices), dev(last), HQ, HKV, D, PAGE, causal=True,
                   q_data_type=torch.bfloat16, kv_data_type=cache.dtype)
            report.add("verify", case, f"flashinfer-{backend}", time_us(lambda: w.run(q, cache)), nbytes)
        except Exception as e:
            report.note(f"flashinfer-{backend} on {case}: {type(e).__name__}: {str(e)[:160]}")

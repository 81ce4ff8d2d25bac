"""Suite `prefill_split_dims`: DeepSeek-V3's prefill before absorption, keys 192 wide (128 nope + 64 rope) and
values 128, MHA, bf16, causal, ragged K/V. Cases `d192x128 h{H} B{B} S{L}`: 128 heads (one GPU) and 16 (TP8).
TFLOP/s of the causal half, 2 (192 + 128) FLOPs a head a visible pair. Peers in the same run: FlashInfer's
ragged prefill (fa2, fa3) and cuDNN SDPA (which takes a V narrower than K)."""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchPrefill
from bench_prefill import bench_flashinfer
from harness import Report, kernel_twins, sdpa_backends, time_interleaved, time_sdpa_peers

DQK, DVO = 192, 128
CASES = ((128, 1, 8192), (16, 1, 32768), (16, 8, 4096))  # (heads, batch, length)


def run(report: Report, peers: bool = True) -> None:
    for h, b, length in CASES:
        case = f"d{DQK}x{DVO} h{h} B{b} S{length}"
        flops = b * 2 * (DQK + DVO) * h * length * (length + 1) / 2
        q = torch.randn(b * length, h, DQK, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b * length, h, DQK, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b * length, h, DVO, device="cuda", dtype=torch.bfloat16)
        indptr = np.arange(b + 1) * length
        spec = AttentionSpec(family="prefill", num_qo_heads=h, num_kv_heads=h, head_dim_qk=DQK, head_dim_vo=DVO,
                             causal=True)
        # ATTNFORGE_BENCH_SPLIT_DIMS_TWINS="kv_tile=128,num_stages=2;...": BatchPrefill arguments, one
        # `attnforge-twin<i>` row each, timed in rotation with the default
        wrappers = {"attnforge": BatchPrefill(spec)}
        for i, fields in enumerate(kernel_twins("ATTNFORGE_BENCH_SPLIT_DIMS_TWINS")):
            wrappers[f"attnforge-twin{i}"] = BatchPrefill(spec, **fields)
        for w in wrappers.values():
            w.plan(indptr, indptr)
        fns = {name: (lambda w=w: w.run(q, (k, v))) for name, w in wrappers.items()}
        for name, us in time_interleaved(fns, calls=2, reps=10).items():
            report.add("prefill_split_dims", case, name, us, None, flops)
        if not peers:
            continue
        bench_flashinfer(report, case, q, k, v, indptr, flops, suite="prefill_split_dims")
        dense = [t.view(b, length, h, -1).transpose(1, 2).contiguous() for t in (q, k, v)]
        time_sdpa_peers(report, "prefill_split_dims", case, *dense, True, sdpa_backends("cudnn-sdpa"), None, flops,
                        calls=2, reps=10)


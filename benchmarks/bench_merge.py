"""Suite `merge`: attnforge.merge_states vs the same merge written in torch."""
from __future__ import annotations

import torch

import attnforge
from harness import Report, time_us


def torch_merge(v, s):
    lse = torch.logsumexp(s, dim=1)
    w = torch.exp(s - lse[:, None]).nan_to_num(0.0)
    return (w[..., None] * v.float()).sum(1).to(v.dtype), lse


def run(report: Report) -> None:
    for n, states, h, d in ((4096, 2, 32, 128), (1024, 8, 32, 128), (256, 16, 128, 512)):
        v = torch.randn(n, states, h, d, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(n, states, h, device="cuda")
        out = torch.empty(n, h, d, device="cuda", dtype=torch.bfloat16)
        nbytes = v.numel() * 2 + s.numel() * 4 + out.numel() * 2 + n * h * 4
        case = f"N{n} S{states} H{h} D{d}"
        report.add("merge", case, "attnforge", time_us(lambda: attnforge.merge_states(v, s, out=out)), nbytes)
        report.add("merge", case, "torch", time_us(lambda: torch_merge(v, s)), nbytes)

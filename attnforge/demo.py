"""`python -m attnforge demo`: spec -> build -> run on the GPU -> check against the reference."""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from . import reference
from .jit import builder as jit_build
from .kernels import module_for_attention
from .spec import AttentionSpec


def main() -> int:
    spec = AttentionSpec(family="decode", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128,
                         q_dtype="bf16", kv_layout="NHD", logits_soft_cap=30.0)
    print(f"spec: {spec.name}  (hash {spec.content_hash[:12]})")
    t0 = time.perf_counter()
    path = jit_build.build(module_for_attention(spec))
    print(f"built in {time.perf_counter() - t0:.2f} s (0 s means it came from the cache)")
    print(f"cubin: {path}")
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: the kernel was compiled and cached, but there is no GPU to run it on.")
        return 0
    from .decode import BatchDecode
    torch.manual_seed(0)
    page_size, lengths = 16, [1, 17, 1000, 8191]
    pages = [-(-L // page_size) for L in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = np.random.default_rng(0).permutation(int(indptr[-1]))
    last = np.array([L - (n - 1) * page_size for L, n in zip(lengths, pages)])
    cache = torch.randn(int(indptr[-1]), 2, page_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(len(lengths), 32, 128, device="cuda", dtype=torch.bfloat16)
    wrapper = BatchDecode(spec)
    wrapper.plan(indptr, indices, last, page_size=page_size)
    out = wrapper.run(q, cache)
    torch.cuda.synchronize()
    worst = 0.0
    per = reference.gather_paged(cache[:, 0], cache[:, 1], "NHD", indptr, indices, last, page_size)
    for b, (k, v) in enumerate(per):
        ref, _ = reference.attention(q[b:b + 1], k, v, logits_soft_cap=spec.logits_soft_cap)
        err = ((out[b].double() - ref[0]).norm() / ref[0].norm()).item()
        worst = max(worst, err)
    print(f"GPU: {torch.cuda.get_device_name()}; batch decode of lengths {lengths}")
    print(f"relative error vs float64 reference: {worst:.2e} ({'OK' if worst < 1e-2 else 'TOO LARGE'})")
    return 0 if worst < 1e-2 and math.isfinite(worst) else 1

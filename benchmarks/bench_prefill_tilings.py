"""Prefill schedules at B1 S8192 causal (GQA 32/8, bf16, ragged K/V), each case's variants timed in
rotation: the default against the ping-pong of the consumer warpgroups, one CTA per item, other KV
tiles and stage counts, every Nth exponential on the FMA pipe (fma_exp_every). For the shapes
whose default was chosen at d128: at d64 the exponentials
(one MUFU op per score) take as long as the two GEMMs, so the ping-pong that lost at d128 (+8.5%)
may win there; d256 has run two consumer warpgroups only since the split ring. One line per case.

    python benchmarks/bench_prefill_tilings.py [d64|d128|d256|d128-softcap|d64-softcap|d128-alibi ...]
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attnforge import AttentionSpec, BatchPrefill  # noqa: E402
from benchmarks.harness import time_interleaved  # noqa: E402

L = 8192
# name: (head_dim, spec extras, [BatchPrefill overrides beside the default])
CASES = {
    "d64": (64, {}, [{"pingpong": True}, {"persistent": False}, {"num_stages": 4}, {"kv_tile": 64, "num_stages": 4},
                     {"fma_exp_every": 0}, {"fma_exp_every": 2}, {"fma_exp_every": 4}]),
    "d128": (128, {}, [{"pingpong": True}, {"num_stages": 2}, {"fma_exp_every": 4}, {"fma_exp_every": 8}]),
    "d128-softcap": (128, {"logits_soft_cap": 30.0}, [{"pingpong": True}, {"fma_exp_every": 0}, {"fma_exp_every": 2},
                                                      {"fma_exp_every": 8}]),
    "d64-softcap": (64, {"logits_soft_cap": 30.0}, [{"fma_exp_every": 0}, {"fma_exp_every": 2}, {"fma_exp_every": 8}]),
    "d128-alibi": (128, {"score_mod": "alibi"}, []),
    "d256": (256, {}, [{"pingpong": True}, {"persistent": False}]),
}


def label(kw: dict) -> str:
    return "default" if not kw else ",".join(f"{k}={v}" for k, v in kw.items())


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        d, extras, variants = CASES[name]
        if extras.get("score_mod") == "alibi":
            from attnforge import mods
            from attnforge.mods.alibi import default_slopes
            extras = {**extras, "score_mod": mods.alibi(default_slopes(32, "cuda"))}
        spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, head_dim_qk=d, causal=True, **extras)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(L, h, d, generator=g).bfloat16().cuda() for h in (32, 8, 8))
        indptr = np.array([0, L])
        runs = {}
        for kw in [{}] + variants:
            w = BatchPrefill(spec, **kw)
            w.plan(indptr, indptr)
            runs[label(kw)] = (lambda w=w: w.run(q, (k, v)))
        t = time_interleaved(runs, calls=2, reps=10)
        flops = 4 * d * 32 * L * (L + 1) / 2
        print(f"{name} B1 S{L}: " + ", ".join(f"{n} {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s)" for n, us in t.items()))


if __name__ == "__main__":
    main(sys.argv[1:])

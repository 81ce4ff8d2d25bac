"""Causal prefill for `ncu --kernel-name batch_prefill_wgmma_kernel --launch-skip 3 --launch-count 1`:
B1 S8192 by default, or B16 S2048 (short items: the largest gap to fa3, 390 vs 577 TFLOP/s).

    python benchmarks/profile_prefill.py [softcap|alibi|window4096] [--short]
    (a score modifier of the mods suite; --short: the B16 S2048 case)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchPrefill  # noqa: E402
from bench_prefill import HKV, HQ, D, ragged  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
mod = None
if args:
    from bench_mods import the_mods  # noqa: E402
    mod = the_mods()[args[0]]
q, k, v, indptr = ragged([2048] * 16 if "--short" in sys.argv else [8192])
w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True,
                               score_mod=mod))
w.plan(indptr, indptr)
for _ in range(5):
    w.run(q, (k, v))
torch.cuda.synchronize()

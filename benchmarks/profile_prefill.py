"""B1 S8192 causal prefill, for `ncu --kernel-name batch_prefill_wgmma_kernel --launch-skip 3 --launch-count 1`.

    python benchmarks/profile_prefill.py [softcap|alibi|window4096]   (a score modifier of the mods suite)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchPrefill  # noqa: E402
from bench_prefill import HKV, HQ, D, ragged  # noqa: E402

mod = None
if len(sys.argv) > 1:
    from bench_mods import the_mods  # noqa: E402
    mod = the_mods()[sys.argv[1]]
q, k, v, indptr = ragged([8192])
w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True,
                               score_mod=mod))
w.plan(indptr, indptr)
for _ in range(5):
    w.run(q, (k, v))
torch.cuda.synchronize()

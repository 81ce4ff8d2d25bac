"""One prefill case on one implementation (attnforge's default, or FlashInfer's fa3), for ncu side by side:

    ncu --kernel-name regex:"batch_prefill_wgmma_kernel|Prefill" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
        python benchmarks/profile_prefill_peers.py "B1 S32768" flashinfer-fa3

The case names are bench_prefill.cases()'s; the implementations clocks_under_load.impls()'s.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill import cases  # noqa: E402
from clocks_under_load import impls  # noqa: E402

case, impl = sys.argv[1], sys.argv[2]
lengths = dict(cases())[case]
fn = impls(case, lengths, only=impl)[impl]
for _ in range(4):
    fn()
torch.cuda.synchronize()

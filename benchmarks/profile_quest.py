"""The Quest suite's default row (int4 summaries; `--heads 32/8`, the default, or `--heads 32/32`) run as
one CUDA-graph step 5 times, for ncu, e.g. the select's stall reasons inside the step:
`ncu --graph-profiling node --kernel-name regex:quest_(select|score)_kernel --launch-skip 3 --launch-count 2
--section WarpStateStats --section SourceCounters python benchmarks/profile_quest.py`."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quest import int4_case, planned_quest  # noqa: E402
from harness import prepare  # noqa: E402

spec, index, cache, indptr, indices, last, q = int4_case(sys.argv)
quest = planned_quest(spec, index, indptr, indices, last)
out = torch.empty_like(q)
run = prepare(lambda: quest.run(q, cache, out=out), calls=1)  # the step as the suite times it
for _ in range(5):
    run()
torch.cuda.synchronize()

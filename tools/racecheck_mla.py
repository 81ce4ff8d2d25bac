"""One MLA decode plan of 400 short requests (several items a persistent CTA), run twice, for compute-sanitizer:
    compute-sanitizer --tool racecheck python3 tools/racecheck_mla.py CONFIG     (PYTHONPATH=repo root)
CONFIG: pw_es (the transposed wgmma kernel's default at 16 heads: producer warpgroup, early S^T), pw (producer
only), one_wg (one warpgroup, no mbarriers), roles64 (the normal pipeline's roles kernel). Prints the kernel and
whether the two runs agree bitwise."""
import sys

import numpy as np
import torch

sys.path.insert(0, "tests")
from attnforge import BatchMLADecode  # noqa: E402
from test_mla_gpu import make_case, mla_spec  # noqa: E402

CONFIGS = {"pw_es": (16, "transposed", None), "pw": (16, "transposed", {"producer": True, "early_scores": False}),
           "one_wg": (16, "transposed", {"producer": False}), "roles64": (64, "normal", None)}

if len(sys.argv) != 2 or sys.argv[1] not in CONFIGS:
    sys.exit(f"racecheck_mla.py: expected one CONFIG of {sorted(CONFIGS)}, got {sys.argv[1:]}")
heads, pipeline, fields = CONFIGS[sys.argv[1]]
spec = mla_spec(heads, pipeline)
lengths = np.random.default_rng(1).integers(1, 300, 400).tolist()
q_nope, q_pe, caches, (indptr, indices, last), _ = make_case(spec, lengths, 64, seed=1)
w = BatchMLADecode(spec, max_batch_size=1024, **({"backend": "wgmma", "kernel_fields": fields} if fields else {}))
w.plan(indptr, indices, last, page_size=64)
first = w.run(q_nope, q_pe, *caches).clone()
second = w.run(q_nope, q_pe, *caches)
torch.cuda.synchronize()
print(sys.argv[1], w.kernel.module().name, "equal" if torch.equal(first, second) else "DIFFER")

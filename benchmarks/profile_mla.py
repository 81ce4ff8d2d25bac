"""One MLA case, for `ncu --kernel-name mla_decode_kernel --launch-skip 3 --launch-count 1`.
python benchmarks/profile_mla.py [heads] [pipeline] [backend] [schedule] (default 16 auto auto auto: the
bandwidth-bound case, B64 L8192, with the default kernel for it)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import BatchMLADecode  # noqa: E402
from bench_mla import PAGE, inputs  # noqa: E402

heads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
q_nope, q_pe, kv, indptr, indices, last = inputs(heads, 64, 8192)
pipeline = sys.argv[2] if len(sys.argv) > 2 else "auto"
backend = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "auto" else None
schedule = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "auto" else None
w = BatchMLADecode(num_qo_heads=heads, pipeline=pipeline, backend=backend, schedule=schedule)
w.plan(indptr, indices, last, page_size=PAGE)
for _ in range(5):
    w.run(q_nope, q_pe, kv[..., :512], kv[..., 512:])
torch.cuda.synchronize()

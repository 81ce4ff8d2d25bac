"""One decode case, B16 L8192 page 16, for `ncu --kernel-name batch_decode_kernel --launch-skip 3 --launch-count 1`.

    python benchmarks/profile_decode.py [fp8] [mqa] [d64]   (fp8: e4m3 KV, the suite's B16 L8192 fp8kv case;
                                                           mqa: 32 query heads on one KV head, head_dims' h32/1
                                                           case; d64: head_dim 64)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchDecode  # noqa: E402
from bench_decode import paged_inputs  # noqa: E402

lengths = [8192] * 16
kv_dtype = "fp8_e4m3" if "fp8" in sys.argv[1:] else "bf16"
hkv = 1 if "mqa" in sys.argv[1:] else 8
d = 64 if "d64" in sys.argv[1:] else 128
q, cache, indptr, indices, last = paged_inputs(lengths, 16, kv_dtype, "NHD", 32, hkv, d)
w = BatchDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=hkv, head_dim_qk=d, kv_dtype=kv_dtype))
w.plan(indptr, indices, last, page_size=16)
for _ in range(5):
    w.run(q, cache)
torch.cuda.synchronize()

"""The Quest bench's GQA case (B16 L65536 page 16, budget 4096, fp8 summaries), run 5 times, for
`ncu --kernel-name regex:quest_(select|score)_kernel --launch-skip 3 --launch-count 2`."""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec  # noqa: E402
from attnforge.sparse import QuestDecode, QuestIndex  # noqa: E402
from bench_quest import B, BUDGET, D, L, PAGE  # noqa: E402

hq, hkv = 32, 8
pages = B * L // PAGE
cache = torch.empty(pages, 2, PAGE, hkv, D, device="cuda", dtype=torch.bfloat16).normal_()
indices = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).numpy().astype(np.int32)
indptr = (np.arange(B + 1) * (L // PAGE)).astype(np.int32)
kmin, kmax = cache[:, 0].amin(dim=1), cache[:, 0].amax(dim=1)
index = QuestIndex(pages, hkv, D, device="cuda", dtype=torch.float8_e4m3fn,
                   scale=float(torch.maximum(kmin.abs().max(), kmax.abs().max())) / 448)
index.assign(kmin, kmax)
quest = QuestDecode(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D), index, budget_tokens=BUDGET,
                    page_size=PAGE, max_batch_size=B, max_num_pages=pages, max_pages_per_request=L // PAGE)
quest.plan(indptr, indices, np.full(B, PAGE, dtype=np.int32))
q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    quest.run(q, cache)
torch.cuda.synchronize()

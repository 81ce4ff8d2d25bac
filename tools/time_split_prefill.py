"""Time prefill plans that split KV (few query tiles against long KV), for an A/B of how split plans store their
partial states (float32 since the hundred-and-eighth session: perf-notes). One JSON line a case: us (median of
the harness's rounds), slots, and the partial-output and KV bytes.
    PYTHONPATH=$PWD python3 tools/time_split_prefill.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import time_us  # noqa: E402

from attnforge import AttentionSpec, BatchPrefill  # noqa: E402

# (name, query heads, kv heads, head dim, causal, query lengths, kv lengths): a cascade's shared level (256
# queries on a 32K prefix), chunked prefill's last chunks, and fuzz seed 917's shape
CASES = [("shared 256 x 32768", 32, 8, 128, False, [256], [32768]),
         ("B4 q64 x 16384 causal", 32, 8, 128, True, [64] * 4, [16384] * 4),
         ("d256 MHA2 187/641 + 64/3000", 2, 2, 256, True, [187, 64], [641, 3000])]


def main() -> None:
    for name, hq, hkv, d, causal, qo_lens, kv_lens in CASES:
        spec = AttentionSpec(family="prefill", num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, causal=causal)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(sum(qo_lens), hq, d, generator=g).bfloat16().cuda()
        k, v = (torch.randn(sum(kv_lens), hkv, d, generator=g).bfloat16().cuda() for _ in range(2))
        qo, kv = (np.concatenate([[0], np.cumsum(x)]) for x in (qo_lens, kv_lens))
        w = BatchPrefill(spec)
        w.plan(qo, kv)
        slots = w._plan["num_slots"]
        us = time_us(lambda: w.run(q, (k, v)), use_graph=False)  # (a split run allocates its partial buffers)
        print(json.dumps({"case": name, "us": round(us, 2), "slots": slots, "kernel": w._plan["kernel"].module().name,
                          "kv_bytes": 2 * k.numel() * 2, "partial_rows_bytes_16bit": q.numel() * slots * 2}))


if __name__ == "__main__":
    main()

"""Host-side cost of BatchDecode.plan on a machine without a GPU: the CUDA calls (copy, event, stream,
pinned memory) are replaced by HostOnlyUpload, so this times the numpy and Python part alone. The GPU number is the
decode suite's `plan B256` row; the difference is what the driver calls cost there.

    python tools/plan_host_cost.py [--profile]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from attnforge import AttentionSpec
from attnforge.decode import BatchDecode


def b256_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode suite's `plan B256` case: 256 requests of 1024 tokens, page 16 (CSR arrays)."""
    pages = np.full(256, 1024 // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    return indptr, np.arange(indptr[-1], dtype=np.int32), np.full(256, 16, dtype=np.int32)


def main() -> None:
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))  # HostOnlyUpload buffers
    indptr, indices, last = b256_table()
    for _ in range(50):
        w.plan(indptr, indices, last, page_size=16)
    times = []
    for _ in range(500):
        t = time.perf_counter()
        w.plan(indptr, indices, last, page_size=16)
        times.append(time.perf_counter() - t)
    print(f"plan B256, host side (CUDA stubbed): median {np.median(times) * 1e6:.1f} us")
    if "--profile" in sys.argv:
        profile(lambda: w.plan(indptr, indices, last, page_size=16), 300)


def profile(fn, calls: int) -> None:
    """cProfile's 12 costliest functions over `calls` calls of fn."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

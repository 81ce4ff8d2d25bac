"""Host-side cost of BatchDecode.plan (CSR arrays and a block table), BatchMLADecode.plan and BatchPrefill.plan on a
machine without a GPU: the CUDA calls (copy, event, stream, pinned memory) are replaced by HostOnlyUpload, so this
times the numpy and Python part alone. The GPU numbers are the decode suite's `plan B256` row and suite host's
`prefill plan q16 kv512`; the difference is what the driver calls cost there.

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
    us = median_us(lambda: w.plan(indptr, indices, last, page_size=16))
    print(f"plan B256, host side (CUDA stubbed): median {us:.1f} us")
    if "--profile" in sys.argv:
        profile(lambda: w.plan(indptr, indices, last, page_size=16), 300)
    block_table_plans(w)
    mla_plans()
    prefill_plans()


def timed(fn, n: int = 2000) -> tuple[float, float]:
    """(min, median) of n calls of fn in us, after 50 untimed ones (tools/plan_gpu_cost.py too)."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6, float(np.median(times)) * 1e6


def median_us(fn, calls: int = 500) -> float:
    return timed(fn, calls)[1]


def block_table_plans(w) -> None:
    """The same decode wrapper planned from vLLM's form: B256 in a table of 2048 slots (a 32K-token context at
    16-token pages), equal and random lengths."""
    rng = np.random.default_rng(0)
    table = np.arange(256 * 2048, dtype=np.int32).reshape(256, 2048)
    for name, lens in (("equal 1024", np.full(256, 1024)), ("random 1-8191", rng.integers(1, 8192, size=256))):
        us = median_us(lambda: w.plan(seq_lens=lens, block_table=table, page_size=16))
        print(f"plan B256 from a 2048-slot block table, {name}, host side (CUDA stubbed): median {us:.1f} us")


def mla_plans() -> None:
    """BatchMLADecode.plan (h16, 64-token pages) of a batch whose items are cut and of one whose are not."""
    from attnforge.mla import BatchMLADecode
    w = BatchMLADecode.host_only(AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                               head_dim_vo=512))
    for b, length in ((64, 8192), (128, 512)):
        pages = length // 64
        indptr = (np.arange(b + 1) * pages).astype(np.int32)
        args = (indptr, np.arange(b * pages, dtype=np.int32), np.full(b, 64, dtype=np.int32))
        us = median_us(lambda: w.plan(*args, page_size=64))
        print(f"MLA plan h16 B{b} L{length}, host side (CUDA stubbed): median {us:.1f} us")


def prefill_plans() -> None:
    """BatchPrefill.plan on a host-only wrapper (device "cpu"), GQA 32/8, d128, causal, 132 SMs: a short
    ragged chunk (suite host's row), a B8 paged batch of mixed lengths (the persistent grid's trades), and two
    batches of many rounds (the greedy's and the trades' per-round work: 138 and 62 rounds)."""
    from attnforge import BatchPrefill
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True), device="cpu")
    w._num_sms = 132  # (asked of the GPU otherwise)
    rng = np.random.default_rng(0)
    q8 = rng.integers(64, 512, size=8)
    kv8 = q8 + rng.integers(0, 4096, size=8)
    pages = -(-kv8 // 16)
    kvp = np.concatenate([[0], np.cumsum(pages)])
    lens = np.random.default_rng(0).integers(128, 8192, size=16)  # (many rounds of the persistent grid)
    ragged = np.concatenate([[0], np.cumsum(lens)])
    cases = {"ragged q16 kv512": ((np.array([0, 16]), np.array([0, 512])), {}),
             "paged B8 mixed": ((np.concatenate([[0], np.cumsum(q8)]), kvp, np.arange(kvp[-1]), kv8 - (pages - 1) * 16),
                                {"page_size": 16}),
             "ragged 16 random 128-8192": ((ragged, ragged), {}),
             "B16 S2048": ((np.arange(17) * 2048, np.arange(17) * 2048), {})}
    for name, (args, kw) in cases.items():
        for _ in range(20):
            w.plan(*args, **kw)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            w.plan(*args, **kw)
            times.append(time.perf_counter() - t)
        print(f"prefill plan {name}, host side (CUDA stubbed): median {np.median(times) * 1e6:.1f} us")
        if "--profile" in sys.argv:
            profile(lambda: w.plan(*args, **kw), 200)


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

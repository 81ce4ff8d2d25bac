"""fp8 decode, d128 and d256 (GQA 32/8, B16 L8192, page 16): the default tiling against four stages
(the default before the eleventh session), timed in rotation. Prints one line per case."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attnforge import AttentionSpec, BatchDecode  # noqa: E402
from benchmarks.harness import time_interleaved  # noqa: E402
from tests.helpers import make_paged_case  # noqa: E402


def main() -> None:
    for d in (128, 256):
        spec = AttentionSpec(kv_dtype="fp8_e4m3", head_dim_qk=d, pipeline="transposed")
        q, cache, (indptr, indices, last), _ = make_paged_case(spec, [8192] * 16, 16, seed=0)
        runs = {}
        for name, kw in (("default", {}), ("four-stages", {"num_stages": 4})):
            w = BatchDecode(spec, **kw)
            w.plan(indptr, indices, last, page_size=16)
            runs[name] = (lambda w=w: w.run(q, cache))
        t = time_interleaved(runs)
        kv_bytes = 16 * 8192 * 8 * d * 2
        print(f"fp8 d{d} B16 L8192: " + ", ".join(f"{k} {v:.1f} us ({kv_bytes / v / 1e3:.0f} GB/s)" for k, v in t.items()))


if __name__ == "__main__":
    main()

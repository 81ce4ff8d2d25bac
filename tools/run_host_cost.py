"""Host-side cost of BatchDecode.run on a machine without a GPU: the library, the launch, the device checks and
the device guard are stubbed, so this times run()'s Python alone (its checks, the params, the memo's keys). The
GPU host's number is suite `host`'s `decode B1 L512 run` row; the difference is what the driver calls cost there.

    python tools/run_host_cost.py [--profile]
"""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

from attnforge import AttentionSpec, checks
from attnforge.decode import BatchDecode
from attnforge.jit import registry


class NoLaunch:
    def __getitem__(self, name):
        return self

    def launch(self, *args, **kwargs) -> None:
        pass


def host_wrapper() -> BatchDecode:
    """A host-only B1 L512 decode (GQA 32/8, d128, page 16), planned, with host buffers where run() reads
    device ones."""
    registry.get_library = lambda *a, **k: NoLaunch()
    checks.check_cuda = lambda *a, **k: None
    torch.cuda.device = lambda d: contextlib.nullcontext()
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    w.pdl, w.launch_after_own_kernel = True, False
    w._partial_o, w._partial_lse, w._merge_count = torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    w.plan(np.array([0, 32], np.int32), np.arange(32, dtype=np.int32), np.array([16], np.int32), page_size=16)
    return w


def main() -> None:
    w = host_wrapper()
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.randn(32, 2, 16, 8, 128, dtype=torch.bfloat16)
    for _ in range(100):
        w.run(q, cache)
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        w.run(q, cache)
        times.append(time.perf_counter() - t)
    print(f"run B1 L512, host side (CUDA stubbed): median {np.median(times) * 1e6:.1f} us")
    if "--profile" in sys.argv:
        from plan_host_cost import profile  # (this folder is on sys.path when run as a script)
        profile(lambda: w.run(q, cache), 2000)


if __name__ == "__main__":
    main()

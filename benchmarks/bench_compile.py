"""Suite `compile`: what torch.compile costs around attnforge's decode (attnforge/ops.py).

- `host B1 L512`: host time a call, many calls back to back on a decode so small that the host sets the
  pace: the eager run, the same run compiled by inductor (its custom op dispatched from the compiled graph),
  and compiled with mode="reduce-overhead" (inductor replays a CUDA graph: one launch a call), with the
  cache a global of the compiled function or one of its inputs.
- `B16 L8192`: device time a call (the suites' graph replay) of the eager and the compiled run: the same
  kernel, so the same time.
"""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode
from harness import host_us, time_interleaved

HQ, HKV, D, PAGE = 32, 8, 128, 16


def paged_batch(batch: int, length: int, graph_mode: bool):
    pages = -(-length // PAGE)
    cache = torch.randn(batch * pages, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV), use_cuda_graph=graph_mode,
                    max_batch_size=batch, max_num_pages=batch * pages)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages
    w.plan(indptr, np.arange(batch * pages, dtype=np.int32), np.full(batch, length - (pages - 1) * PAGE, np.int32),
           page_size=PAGE)
    return w, q, cache


def run(report, peers: bool = True) -> None:
    torch._dynamo.reset()
    w, q, cache = paged_batch(1, 512, graph_mode=False)
    g, _, _ = paged_batch(1, 512, graph_mode=True)
    case = "host B1 L512"
    report.add("compile", case, "attnforge", host_us(lambda q, c: w.run(q, c), q, cache))
    report.add("compile", case, "attnforge-compiled",
               host_us(torch.compile(lambda q, c: w.run(q, c), fullgraph=True), q, cache))
    # the cache a global of the compiled function (as an engine's is), or one of its inputs
    report.add("compile", case, "attnforge-compiled-graphs",
               host_us(torch.compile(lambda q: g.run(q, cache), fullgraph=True, mode="reduce-overhead"), q))
    report.add("compile", case, "attnforge-compiled-graphs-cache-input",
               host_us(torch.compile(lambda q, c: g.run(q, c), fullgraph=True, mode="reduce-overhead"), q, cache))
    w, q, cache = paged_batch(16, 8192, graph_mode=False)
    nbytes = cache.numel() * cache.element_size()
    compiled = torch.compile(lambda: w.run(q, cache), fullgraph=True)
    times = time_interleaved({"attnforge": lambda: w.run(q, cache), "attnforge-compiled": compiled})
    for impl, us in times.items():
        report.add("compile", "B16 L8192", impl, us, nbytes)

"""Where BatchDecode.plan's time goes on a GPU host: the whole call (min / median of fresh calls),
each CUDA call it makes timed alone, and a cProfile of plan() by function. Compare with
tools/plan_host_cost.py (the numpy and Python part on any machine).

    PYTHONPATH=. python tools/plan_gpu_cost.py
"""
from __future__ import annotations

import cProfile
import gc
import pstats

import torch

from attnforge import AttentionSpec
from attnforge.decode import BatchDecode
from attnforge.jit.loader import driver
from plan_host_cost import b256_table, timed  # tools/ (the script's own directory)


def main() -> None:
    w = BatchDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=256)
    indptr, indices, last = b256_table()
    plan = lambda: w.plan(indptr, indices, last, page_size=16)  # noqa: E731
    torch.cuda.synchronize()
    gc.collect()
    print("plan B256 whole call: min %.1f us, median %.1f us" % timed(plan, 500))
    drv, up = driver(), w._upload
    stream = up._stream()
    event = up._events[0]
    nbytes = 4 * (w._offsets["kv_indices"][0] + len(indices))  # what one plan of this batch copies
    parts = {
        "torch.cuda.current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(w.device).cuda_stream,
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "drv.CUstream(int)": lambda: drv.CUstream(stream),
        "cuMemcpyHtoDAsync (one plan)": lambda: drv.cuMemcpyHtoDAsync(up.dev.data_ptr(), up._hosts[0].data_ptr(),
                                                                  nbytes, drv.CUstream(stream)),
        "cuEventRecord": lambda: drv.cuEventRecord(event, drv.CUstream(stream)),
        "cuEventQuery (done)": lambda: drv.cuEventQuery(event),
        "cuEventSynchronize (done)": lambda: drv.cuEventSynchronize(event),
        "paged.from_csr": lambda: __import__("attnforge.paged", fromlist=["x"]).from_csr(indptr, indices, last, 16),
    }
    for name, fn in parts.items():
        torch.cuda.synchronize()
        print(f"  {name:44s} min %.2f us, median %.2f us" % timed(fn))
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        plan()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()

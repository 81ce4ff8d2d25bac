"""What the two trace scripts (trace_prefill.py, trace_decode.py) share: kernels built with the
template's `trace=True` (SM-cycle stamps into the __device__ array `af_trace`), and one timed run
whose stamps come back to the host."""
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from attnforge.jit import loader, registry


def build_traced(kernel_cls) -> None:
    """Make every module kernel_cls builds in this process a traced one (its own cache entry)."""
    plain = kernel_cls.module

    def traced_module(self):
        m = plain(self)
        return dataclasses.replace(m, name=m.name + "_trace", context={**m.context, "trace": True})
    kernel_cls.module = traced_module


def trace_buffer(kernel, device, symbol: str = "af_trace") -> tuple[int, int]:
    """(device pointer, bytes) of the traced module's __device__ array `symbol`, zeroed."""
    lib = registry.get_library(kernel, kernel.module, device)
    drv = loader.driver()
    dptr, size = loader.check(drv.cuLibraryGetGlobal(lib.library, symbol.encode()), f"cuLibraryGetGlobal({symbol})")
    loader.check(drv.cuMemsetD8(dptr, 0, size), "cuMemsetD8")
    return dptr, size


def read_trace(dptr: int, size: int) -> np.ndarray:
    """af_trace back on the host, as uint64."""
    host = np.zeros(size // 8, dtype=np.uint64)
    loader.check(loader.driver().cuMemcpyDtoH(host.ctypes.data, dptr, size), "cuMemcpyDtoH")
    return host


def capture(wrapper, run, symbols: tuple = ("af_trace",)):
    """(af_trace as uint64, the run's milliseconds): warm-up, zero the stamps, one timed run(), read back.
    With more symbols (the template's other trace arrays): ({symbol: uint64 array}, milliseconds)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    # the kernel the plan launches (decode may run its whole-item kernel: BatchDecode.planned_kernel)
    kernel = wrapper.planned_kernel[0] if hasattr(type(wrapper), "planned_kernel") else wrapper.kernel
    buffers = {name: trace_buffer(kernel, wrapper.device, name) for name in symbols}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    hosts = {name: read_trace(*b) for name, b in buffers.items()}
    return (hosts["af_trace"] if symbols == ("af_trace",) else hosts), start.elapsed_time(end)


def exit_by_class(exit_ns: np.ndarray, n_items: np.ndarray, did_merge: np.ndarray) -> dict:
    """Per kind of CTA (items run, merged a split item or not): count, mean and latest exit in us."""
    out = {}
    for k in np.unique(n_items):
        for m in (False, True):
            sel = (n_items == k) & (did_merge == m)
            if sel.any():
                out[f"items {int(k)} merged {int(m)}"] = {"ctas": int(sel.sum()), "mean": float(exit_ns[sel].mean() / 1e3),
                                                         "max": float(exit_ns[sel].max() / 1e3)}
    return out


def save_json_if_asked(results: list) -> None:
    """`--json out.json` on the command line: the results go there too."""
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(results, indent=1))

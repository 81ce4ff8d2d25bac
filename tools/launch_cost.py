"""What one kernel launch costs the host, by path, on a GPU machine: LoadedKernel.launch (plain and PDL), the
raw cuda-python calls it makes, the same call through ctypes on libcuda, and the pieces around a wrapper's
launch (stream handle, device guard, allocations). An empty one-warp kernel with a 240-byte params struct (MLA
decode's size), 5000 calls back to back without a synchronisation, so a row is the host's enqueue cost unless the
GPU's launch rate caps it.

    PYTHONPATH=. python tools/launch_cost.py
"""
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from attnforge.jit import loader
from attnforge.jit.loader import LoadedLibrary, current_stream_handle, driver, pdl_launch_config, pdl_supported

NOOP = r'''
struct P { unsigned long long w[30]; };  // 240 bytes, as MLA's params
extern "C" __global__ void noop(P p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (p.w[0] == 12345ull && threadIdx.x == 0) p.w[1] = 1;
}
'''


def main() -> None:
    d = Path(tempfile.mkdtemp())
    (d / "k.cu").write_text(NOOP)
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(d / "k.cubin"), str(d / "k.cu")], check=True)
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    lib = LoadedLibrary(d / "k.cubin", ("noop",), dev)
    k = lib["noop"]
    loader.PDL_KERNELS = frozenset(set(loader.PDL_KERNELS) | {"noop"})  # (it waits for the prior grid first)

    class P(ctypes.Structure):
        _fields_ = [("w", ctypes.c_uint64 * 30)]
    params = P()
    drv = driver()
    res = {}

    def per_call(fn, n=5000):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        e = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        return round(e, 2)

    res["launch_plain"] = per_call(lambda: k.launch((1,), (32,), params))
    res["launch_pdl"] = per_call(lambda: k.launch((1,), (32,), params, pdl=True))
    h = current_stream_handle()
    arg_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    addr = ctypes.addressof(arg_ptrs)
    s = drv.CUstream(h)
    res["raw_cuLaunchKernel"] = per_call(lambda: drv.cuLaunchKernel(k.function, 1, 1, 1, 32, 1, 1, 0, s, addr, 0))
    cfg = pdl_launch_config((1, 1, 1), (32, 1, 1), 0, h)
    res["raw_cuLaunchKernelEx_pdl"] = per_call(lambda: drv.cuLaunchKernelEx(cfg, k.function, addr, 0))
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        fn = libcuda.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        fptr = int(k.function)
        res["ctypes_cuLaunchKernel"] = per_call(lambda: fn(fptr, 1, 1, 1, 32, 1, 1, 0, h, addr, None))
        assert fn(fptr, 1, 1, 1, 32, 1, 1, 0, h, addr, None) == 0
    except Exception as e:
        res["ctypes"] = repr(e)[:200]
    res["current_stream_handle"] = per_call(current_stream_handle)
    res["pdl_supported"] = per_call(pdl_supported)

    def ctx():
        with torch.cuda.device(dev):
            pass
    res["with_device"] = per_call(ctx)
    res["ctypes_array"] = per_call(lambda: (ctypes.c_void_p * 1)(ctypes.addressof(params)))
    res["torch_empty_small"] = per_call(lambda: torch.empty((1, 16, 512), dtype=torch.bfloat16, device=dev))
    res["params_copy"] = per_call(lambda: P.from_buffer_copy(params))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

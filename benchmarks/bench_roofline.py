"""Suite `roofline`: the read roofline under the decode targets (micro/read_stream.cu). One kernel streams a
buffer once with 16-byte loads, timed as the suites time decode (harness.time_us: 5 calls in a CUDA graph,
median of 20 replays), at the byte counts of the decode cases and with no bytes at all (case `empty launch`),
on 1, 2 and 4 CTAs of 512 threads an SM (`read-stream`: 16-byte loads), and by bulk copies through a ring of
shared memory (`bulk-copy`: one thread a CTA, 192 KB in flight an SM). A least-squares line through time = fixed + bytes / rate (a note)
gives the GPU's streaming rate and what a launch costs beside it, so a decode target in GB/s can be read
against what any kernel here reaches at that size. No peers: it is the ceiling they share.

    python benchmarks/run.py --suites roofline     (or: python benchmarks/bench_roofline.py)
"""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from harness import Report, time_us
from targets import fit

from attnforge.jit import arch, loader

SOURCE = Path(__file__).resolve().parent / "micro" / "read_stream.cu"
# the decode suite's KV bytes: fp8kv B16 L8192, B16 L8192 (and skew, B1 L131072), B64 L4096, B16 L65536
SIZES = (268_435_456, 536_870_912, 1_073_741_824, 4_294_967_296)
CTAS_PER_SM = (1, 2, 4)
BULK_STAGES, BULK_BYTES_PER_SM = 6, 192 << 10  # the bulk ring: 6 slots of 32 / 16 / 8 KB at 1 / 2 / 4 CTAs an SM
MAX_STAGES = 8  # micro/read_stream.cu's kMaxStages: the ring's barriers


class ReadParams(ctypes.Structure):  # the .cu's struct
    _fields_ = [("src", ctypes.c_void_p), ("n16", ctypes.c_uint64), ("sink", ctypes.c_void_p),
                ("chunk_bytes", ctypes.c_uint32), ("stages", ctypes.c_uint32)]


def build(directory: Path) -> Path:
    cubin = directory / "read_stream.cubin"
    subprocess.run([str(arch.nvcc_path()), "-arch=sm_90a", "-cubin", "-O3", "-o", str(cubin), str(SOURCE)], check=True)
    return cubin


def run(report: Report, peers: bool = True) -> None:  # (peers: the suites' signature; there are none)
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        lib = loader.LoadedLibrary(build(Path(tmp)), ("read_stream_kernel", "read_bulk_kernel"), device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    src = torch.randint(-2**31, 2**31 - 1, (max(SIZES) // 4,), dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    fits = []
    for name in ("read-stream", "bulk-copy"):
        for per_sm in CTAS_PER_SM:
            impl = f"{name} {per_sm} CTA/SM"
            chunk = BULK_BYTES_PER_SM // (BULK_STAGES * per_sm)

            def launcher(nbytes, grid=sms * per_sm, name=name, chunk=chunk):
                params = ReadParams(src.data_ptr(), nbytes // 16, sink.data_ptr(), chunk, BULK_STAGES)
                if name == "read-stream":
                    return lambda: lib["read_stream_kernel"].launch((grid,), (512,), params)
                return lambda: lib["read_bulk_kernel"].launch((grid,), (32,), params, smem=BULK_STAGES * chunk)
            report.add("roofline", "empty launch", impl, time_us(launcher(0)))
            points = [(n, time_us(launcher(n))) for n in SIZES]
            for n, us in points:
                report.add("roofline", f"read {n >> 20} MiB", impl, us, n)
            fixed, rate = fit(points)
            fits.append(f"{impl} {fixed:.2f} us + bytes / {rate:.0f} GB/s")
    report.note("roofline fits (time = fixed + bytes / rate, least squares over the four sizes): " + "; ".join(fits))


if __name__ == "__main__":
    run(Report())

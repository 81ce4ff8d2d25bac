"""What slows a warpgroup's wgmmas on an SM: the other warpgroup's, or tiles landing? (micro/wgmma_overlap.cu)

The MLA roles kernel's S takes 1739 cycles a tile against 1152 of tensor work, and its period grew when
a producer warpgroup let the two consumers' streams overlap more (perf-notes, thirty-first section).
This times, on every SM at once (one CTA each, as the roles kernel runs; --ctas for fewer), a batch of
S-like wgmmas (36 x m64n64k16 from shared memory) in warpgroup 0 beside warpgroup 1's S-like or P.V-like
batches (4 x m64n256k16) or copies of 72 KB tiles from DRAM (cp.async along rows, TMA boxes by column
block, cp.async by column block: "copy*"): each alone, both overlapped, and strictly alternated. Prints
median SM cycles a batch (a pair of batches where both ran) and writes them as JSON with --json.

    python benchmarks/micro_wgmma_overlap.py [--batches 200] [--ctas N] [--prefill] [--json out.json]

--prefill times the Hopper prefill kernel's products instead (head_dim 128: S = 8 x m64n128k16 from shared
memory, P.V the same with P from registers; 512 tensor cycles each at peak): how long one consumer
warpgroup's S takes on an idle tensor pipe and beside the other's S or P.V (the tile trace has S taking
730-1160 cycles from issue to done in the kernel, perf-notes thirty-third section).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from attnforge import codegen
from attnforge.jit import arch, loader, tma

SOURCE = Path(__file__).resolve().parent / "micro" / "wgmma_overlap.cu"
TILE = 64 * 576 * 2  # one [64 x 576] bf16 operand
RING_BYTES = 600 << 20  # the copies' ring, all CTAs together: ~10x the H200's 60 MB L2
SMEM = 3 * TILE + 1024 + 8  # three [64 x 576] bf16 tiles, the 1024-byte alignment slack, kind 3's mbarrier
KINDS = ((0, "S beside S"), (1, "S beside P.V"), (2, "S beside copy"), (3, "S beside TMA"), (4, "S beside copy*"))
# --prefill: the Hopper prefill kernel's products at head_dim 128 (8 x m64n128k16 each), warpgroup 0's S
PREFILL_KINDS = ((5, "pS beside pS"), (6, "pS beside pP.V"))
WG0, WG1, ALTERNATE = 1, 2, 4


class OverlapParams(ctypes.Structure):  # the .cu's struct: a 64-byte aligned tensor map first, 192 bytes in all
    _fields_ = [("map", ctypes.c_ubyte * 128), ("cycles", ctypes.c_void_p), ("sink", ctypes.c_void_p),
                ("src", ctypes.c_void_p), ("batches", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("kind1", ctypes.c_int32), ("ring", ctypes.c_int32), ("kind0", ctypes.c_int32),
                ("pad", ctypes.c_ubyte * 20)]


def build(directory: Path) -> Path:
    cubin = directory / "wgmma_overlap.cubin"
    subprocess.run([str(arch.nvcc_path()), "-arch=sm_90a", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
                    f"-I{codegen.include_dir()}", "-o", str(cubin), str(SOURCE)], check=True)
    return cubin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    # fewer CTAs than SMs: the copies' latency rather than DRAM's rate (the MLA kernel at h128 reads ~2.4 TB/s)
    ap.add_argument("--ctas", type=int, default=0, help="CTAs (one an SM); 0: every SM")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill kernel's S and P.V (d128) instead of MLA's: S on an idle pipe and beside the other's")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        lib = loader.LoadedLibrary(build(Path(tmp)), ("wgmma_overlap_kernel", "wgmma_overlap_prefill_kernel"), device)
    kernel = lib["wgmma_overlap_prefill_kernel" if args.prefill else "wgmma_overlap_kernel"]
    ctas = args.ctas or torch.cuda.get_device_properties(device).multi_processor_count
    cycles = torch.zeros(ctas, 2, dtype=torch.int64, device=device)
    sink = torch.zeros(256, device=device)
    ring = -(-RING_BYTES // (ctas * TILE))  # tiles a CTA copies from in turn
    src = torch.ones(ctas * ring * TILE // 2, dtype=torch.bfloat16, device=device)
    pages = ctas * ring  # kind 3: the ring as a paged cache of 64-token pages, boxes as the MLA kernel's
    box, why = tma.paged_kv_box(576, 1, 64, pages, 64 * 576, 576, 64 * 576, 2, 64)
    assert box is not None, why
    tmap = tma.encode(src.view(pages, 64, 576), dataclasses.replace(box, l2_promotion=128))
    results = []
    kind0 = 5 if args.prefill else 0
    for kind1, label in (PREFILL_KINDS if args.prefill else KINDS):
        for mode, name in ((WG0, "warpgroup 0 alone"), (WG1, "warpgroup 1 alone"), (WG0 | WG1, "overlapped"),
                           (WG0 | WG1 | ALTERNATE, "alternated")):
            for _ in range(2):  # the first launch warms clocks and the instruction cache
                cycles.fill_(-1)
                params = OverlapParams((ctypes.c_ubyte * 128).from_buffer_copy(tmap), cycles.data_ptr(),
                                       sink.data_ptr(), src.data_ptr(), args.batches, mode, kind1, ring, kind0)
                kernel.launch((ctas,), (256,), params, smem=SMEM)
                torch.cuda.synchronize()
            c = cycles.float() / args.batches
            row = {"pair": label, "mode": name, "wg0": c[:, 0].median().item(), "wg1": c[:, 1].median().item()}
            # the pair's time a batch: overlapped, the later warpgroup; alternated, warpgroup 0's loop holds both
            row["pair_cycles"] = max(row["wg0"], row["wg1"]) if mode & WG0 and mode & WG1 else row["wg0"] or row["wg1"]
            results.append(row)
            print(f"{label:13s} {name:18s} wg0 {row['wg0']:8.1f}  wg1 {row['wg1']:8.1f}  cycles a batch "
                  f"(pair: {row['pair_cycles']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The sw128 tile format and wgmma descriptors, checked on the host against the hardware's rules.

nvcc compiles a host program over the same header functions the kernels use (AF_HOST_DEVICE);
Python models the 128B swizzle independently: within a 1024-byte-aligned atom of 8 rows x 128 bytes,
address bits 4-6 are XORed with bits 7-9 (PTX ISA, shared-memory matrix layouts).
"""
import shutil

import pytest

from helpers import run_host_program

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")

PROGRAM = r"""
#include <cstdio>
#include "attnforge/wgmma.cuh"
using namespace attnforge;
int main() {
  for (int rows : {64, 128})
    for (int row = 0; row < rows; ++row)
      for (int chunk = 0; chunk < 16; ++chunk) std::printf("o %d %d %d %d\n", rows, row, chunk, sw128_offset(row, chunk, rows));
  for (unsigned base : {0x18400u, 0x30000u})  // the second near the top of a 228 KB window
    for (int rows : {64, 128})
      for (int k = 0; k < 8; ++k)
        std::printf("d %u %d %d %llu %llu\n", base, rows, k, (unsigned long long)sw128_kmajor_desc(base, rows, k),
                    (unsigned long long)sw128_mnmajor_desc(base, rows, k));
}
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    return run_host_program(PROGRAM, tmp_path_factory.mktemp("sw128")).split("\n")


def hw_swizzle(addr):  # the hardware's 128B swizzle of a byte address inside an aligned atom
    return addr ^ (((addr >> 7) & 7) << 4)


def test_sw128_tile_is_the_hardware_128b_swizzle(output):
    seen = {}
    for line in output:
        if line.startswith("o "):
            rows, row, chunk, off = map(int, line.split()[1:])
            block, c = divmod(chunk, 8)  # 64-column blocks of [rows][128 bytes]
            assert off == block * rows * 128 + hw_swizzle(row * 128 + c * 16), (rows, row, chunk)
            seen.setdefault(rows, set()).add(off)
    assert {r: len(v) for r, v in seen.items()} == {64: 64 * 16, 128: 128 * 16}  # a bijection onto the tile


def _fields(desc):
    return {"start": (desc & 0x3FFF) << 4, "lbo": ((desc >> 16) & 0x3FFF) << 4, "sbo": ((desc >> 32) & 0x3FFF) << 4,
            "base_offset": (desc >> 49) & 7, "swizzle": desc >> 62}


def test_descriptors_step_through_the_tile(output):
    """desc_advance steps the start address by one add to the low word: shared addresses stay below
    2^18, so the 14-bit field never carries into the reserved bits around it (checked here too)."""
    reserved = (0x3 << 14) | (0x3 << 30) | (0x7 << 46) | (0x1FFF << 49)
    seen = 0
    for line in output:
        if not line.startswith("d "):
            continue
        base, rows, k, kmajor, mnmajor = map(int, line.split()[1:])
        seen += 1
        assert kmajor & reserved == 0 and mnmajor & reserved == 0, (base, rows, k)
        km, mn = _fields(kmajor), _fields(mnmajor)
        # K-major (Q, K): k16 step k is 32 bytes into 64-column block k // 4; 8-row groups 1024 bytes apart
        assert km == {"start": base + (k // 4) * rows * 128 + (k % 4) * 32, "lbo": 16, "sbo": 1024,
                      "base_offset": 0, "swizzle": 1}
        # MN-major (V): k16 step k is rows 16k.., the next 64 N columns one block (rows * 128 bytes) on
        assert mn == {"start": base + k * 16 * 128, "lbo": rows * 128, "sbo": 1024, "base_offset": 0, "swizzle": 1}
    assert seen == 2 * 2 * 8

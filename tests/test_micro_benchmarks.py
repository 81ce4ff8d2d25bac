"""The microbenchmarks' CUDA sources build for sm_90a (CI has nvcc; they run only on a GPU)."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_wgmma_overlap_builds(tmp_path):
    import micro_wgmma_overlap
    cubin = micro_wgmma_overlap.build(tmp_path)
    assert b"wgmma_overlap_kernel" in cubin.read_bytes() and b"wgmma_overlap_prefill_kernel" in cubin.read_bytes()

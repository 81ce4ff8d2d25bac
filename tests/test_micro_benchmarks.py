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


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_read_stream_builds(tmp_path):
    import bench_roofline
    cubin = bench_roofline.build(tmp_path)
    assert b"read_stream_kernel" in cubin.read_bytes() and b"read_bulk_kernel" in cubin.read_bytes()


def test_bulk_ring_divides_every_size():
    import bench_roofline
    for per_sm in bench_roofline.CTAS_PER_SM:
        chunk = bench_roofline.BULK_BYTES_PER_SM // (bench_roofline.BULK_STAGES * per_sm)
        assert chunk % 16 == 0 and all(n % chunk == 0 for n in bench_roofline.SIZES)  # the kernel's contract
        assert bench_roofline.BULK_STAGES * chunk <= 227 << 10  # an SM's shared memory for one CTA
    assert 1 <= bench_roofline.BULK_STAGES <= bench_roofline.MAX_STAGES
    assert f"kMaxStages = {bench_roofline.MAX_STAGES};" in bench_roofline.SOURCE.read_text()


@pytest.mark.parametrize("fixed_us, gbps", [(4.5, 4400.0), (0.0, 3000.0), (12.0, 4800.0)])
def test_roofline_fit_recovers_the_line(fixed_us, gbps):
    import bench_roofline
    fixed, rate = bench_roofline.fit([(n, fixed_us + n / (gbps * 1e3)) for n in bench_roofline.SIZES])
    assert fixed == pytest.approx(fixed_us, abs=1e-6) and rate == pytest.approx(gbps, rel=1e-9)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_racecheck_reproducer_builds(tmp_path):
    """tools/racecheck_subset_barrier.cu (docs/measuring.md, racecheck): an executable for sm_90a
    whose kernel holds the barriers it models (a named barrier among a subset, an mbarrier hand-over, a named
    barrier's arrive / sync hand-over)."""
    import subprocess
    src = Path(__file__).resolve().parents[1] / "tools" / "racecheck_subset_barrier.cu"
    ptx = tmp_path / "repro.ptx"
    subprocess.run(["nvcc", "-arch=sm_90a", "-ptx", "-o", str(ptx), str(src)], check=True, capture_output=True)
    text = ptx.read_text()
    assert "bar.sync 1, 128" in text and "mbarrier.test_wait.shared.b64" in text and "item_loop" in text
    assert "bar.arrive 2, 256" in text and "bar.sync 2, 256" in text
    subprocess.run(["nvcc", "-arch=sm_90a", "-o", str(tmp_path / "repro"), str(src)], check=True, capture_output=True)

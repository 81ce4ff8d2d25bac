"""Suite `plan`: the host cost of BatchDecode.plan alone (the decode suite's `plan B256` row), for a
device call that re-measures plan() without the decode kernels."""
from bench_decode import bench_plan


def run(report, peers: bool = True) -> None:
    bench_plan(report)

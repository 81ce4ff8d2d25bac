"""Split every GPU test into N groups of about equal cost, for one device call that runs them side by side
(tools/gpu_session.sh's TEST_GROUPS: one pytest process a group). A group holds whole test functions, so the
kernels one function builds are compiled by one process; a function's cost is its parametrizations times its
file's weight (the MLA file's tests ran about 3x a decode test's time: its 97 other tests once filled a 450 s
group alone, seventy-fifth session). Largest first onto the lightest group.

    python tools/gpu_test_groups.py [N [PATH...]]     (prints the groups, ';'-separated, for TEST_GROUPS)
    TEST_GROUPS="$(python3 tools/gpu_test_groups.py 14)" BENCH=0 bash tools/gpu_session.sh
PATHs (test files or directories; default tests) narrow the split to their GPU tests, for a call with less
device time than the whole suite needs.
"""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

FILE_WEIGHTS = {"tests/test_mla_gpu.py": 3.0, "tests/test_prefill_gpu.py": 2.0, "tests/test_fuzz_gpu.py": 2.0}


def gpu_test_ids(root: str = ".", paths: tuple[str, ...] = ("tests",)) -> list[str]:
    """Node ids of every test marked gpu under `paths` (collected without running)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *paths], cwd=root, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def function_of(node_id: str) -> str:
    """file::function of a node id (its parametrization dropped)."""
    return node_id.split("[", 1)[0]


def groups(node_ids: list[str], n: int) -> list[list[str]]:
    """n lists of file::function ids, each function in one, balanced by weighted parametrizations."""
    counts = Counter(function_of(i) for i in node_ids)
    cost = {f: c * FILE_WEIGHTS.get(f.split("::", 1)[0], 1.0) for f, c in counts.items()}
    bins: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for f in sorted(cost, key=lambda f: (-cost[f], f)):
        k = loads.index(min(loads))
        bins[k].append(f)
        loads[k] += cost[f]
    return [sorted(b) for b in bins if b]


def main(argv: list[str]) -> None:
    usage = "usage: python tools/gpu_test_groups.py [N [PATH...]]   (N >= 1 groups, default 14; PATHs under tests/)"
    if argv and (not argv[0].isdigit() or int(argv[0]) < 1):
        sys.exit(f"{usage}; got {' '.join(argv)!r}")
    missing = [p for p in argv[1:] if not Path(p).exists()]
    if missing:
        sys.exit(f"{usage}; no such test path: {' '.join(missing)} (run from the repository root)")
    n = int(argv[0]) if argv else 14
    print(";".join(" ".join(g) for g in groups(gpu_test_ids(paths=tuple(argv[1:]) or ("tests",)), n)))


if __name__ == "__main__":
    main(sys.argv[1:])

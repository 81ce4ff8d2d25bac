"""tools/gpu_test_groups.py: every GPU test lands in exactly one group, whole functions, balanced by cost."""
import runpy
from collections import Counter

tool = runpy.run_path("tools/gpu_test_groups.py", run_name="lib")


def test_groups_partition_the_functions_and_balance_their_cost():
    ids = [f"tests/test_a_gpu.py::test_{k}[{p}]" for k in range(9) for p in range(k + 1)]
    ids += [f"tests/test_mla_gpu.py::test_m{k}" for k in range(4)]  # weight 3 each
    groups = tool["groups"](ids, 4)
    functions = [f for g in groups for f in g]
    assert sorted(functions) == sorted({tool["function_of"](i) for i in ids})  # each function once
    counts = Counter(tool["function_of"](i) for i in ids)
    cost = {f: c * tool["FILE_WEIGHTS"].get(f.split("::")[0], 1.0) for f, c in counts.items()}
    loads = [sum(cost[f] for f in g) for g in groups]
    assert max(loads) - min(loads) <= max(cost.values())  # (largest first onto the lightest group)
    assert tool["function_of"]("tests/x.py::test_y[a-b[1]]") == "tests/x.py::test_y"


def test_every_collected_gpu_test_is_in_one_group():
    ids = tool["gpu_test_ids"]()
    assert len(ids) > 500 and any("test_mla_gpu.py" in i for i in ids)  # (the suite's GPU tests, not a few)
    groups = tool["groups"](ids, 14)
    assert len(groups) == 14
    placed = Counter(f for g in groups for f in g)
    assert set(placed) == {tool["function_of"](i) for i in ids} and set(placed.values()) == {1}


def test_a_bad_group_count_gets_the_usage_not_a_traceback():
    import subprocess
    import sys
    for args in (["--help"], ["0"], ["00"], ["3", "4"]):
        run = subprocess.run([sys.executable, "tools/gpu_test_groups.py", *args], capture_output=True, text=True)
        assert run.returncode == 1 and "usage: python tools/gpu_test_groups.py [N]" in run.stderr, args
        assert "Traceback" not in run.stderr

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
    for args, why in ((["--help"], "got '--help'"), (["0"], "got '0'"), (["00"], "got '00'"),
                      (["3", "4"], "no such test path: 4")):
        run = subprocess.run([sys.executable, "tools/gpu_test_groups.py", *args], capture_output=True, text=True)
        assert run.returncode == 1 and "usage: python tools/gpu_test_groups.py [N [PATH...]]" in run.stderr, args
        assert why in run.stderr and "Traceback" not in run.stderr, args


def test_paths_narrow_the_split_to_their_gpu_tests():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "tools/gpu_test_groups.py", "3", "tests/test_decode_verify_gpu.py",
                          "tests/test_cascade.py"], capture_output=True, text=True, check=True)
    functions = {f for g in run.stdout.strip().split(";") for f in g.split()}
    files = {f.split("::")[0] for f in functions}
    assert files == {"tests/test_decode_verify_gpu.py", "tests/test_cascade.py"}, files
    every = {tool["function_of"](i) for i in tool["gpu_test_ids"](paths=("tests/test_decode_verify_gpu.py",))}
    assert every and every <= functions and len(run.stdout.strip().split(";")) == 3

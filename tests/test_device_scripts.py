"""The device-call scripts run only on the GPU machine, where a slip costs device time: each parses, and
tools/on_h200.sh picks its script by the GPU's name (a fake nvidia-smi on PATH here)."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "docs" / "prepared").glob("*.sh")) + sorted((ROOT / "tools").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_test_a_script_names_exists(script):
    """A test id a script names (tests/x.py::test_y) that no longer exists would make pytest collect nothing
    there, and the call would spend its device time on the rest."""
    ids = re.findall(r"(tests/[\w/]+\.py)::(\w+)", script.read_text())
    for path, name in ids:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{script.name}: {path}::{name}"


@pytest.mark.parametrize("patch", sorted((ROOT / "docs" / "prepared").glob("*.patch")), ids=lambda p: p.name)
def test_a_prepared_patch_applies_to_this_tree(patch):
    """A call script applies its patch first and stops if it does not apply: when main moves under a patch, this
    fails here, not on the GPU machine (regenerate the patch from a branch)."""
    out = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def run_on(tmp_path, gpu_name, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{gpu_name}'\n")
    smi.chmod(0o755)
    for name in ("record", "other"):
        (tmp_path / f"{name}.sh").write_text(f'echo "ran {name} TESTS=$TESTS"\n')
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TESTS": "0", **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "on_h200.sh")], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True)


def test_on_h200_runs_the_record_only_on_an_h200(tmp_path):
    out = run_on(tmp_path, "NVIDIA H200", IF_H200="record.sh", ELSE="other.sh")
    assert out.returncode == 0 and "ran record TESTS=0" in out.stdout and "ran other" not in out.stdout
    out = run_on(tmp_path, "NVIDIA H100 80GB HBM3", IF_H200="record.sh", ELSE="other.sh")
    assert "ran other TESTS=0" in out.stdout and "ran record" not in out.stdout
    out = run_on(tmp_path, "NVIDIA H100 80GB HBM3", IF_H200="record.sh")
    assert out.returncode == 0 and "ran" not in out.stdout and "nothing run" in out.stdout


def test_the_changed_tests_call_selects_each_new_gpu_test():
    """call7's -k expression must keep selecting the GPU tests it exists for: a renamed test would drop out of it
    silently and the call would pass without running it."""
    script = (ROOT / "docs" / "prepared" / "call7-changed-gpu-tests.sh").read_text()
    assignments = "\n".join(line for line in script.splitlines() if line.startswith("CHANGED="))
    selection = subprocess.run(["bash", "-c", assignments + '\necho "$CHANGED"'], capture_output=True,
                               text=True, check=True).stdout.strip()  # (the script builds it over two lines)
    files = ["tests/test_prefill_gpu.py", "tests/test_input_fuzz_gpu.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *files, "-k", selection], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for wanted in ("test_functional_attention_takes_sdpas_attn_mask",
                   "test_attn_mask_calls_on_two_streams_each_read_their_own_mask",
                   "test_functional_attention_with_bool_and_byte_tables_matches_sdpa",
                   "test_library_mods_in_prefill[every_operation-None]", "attention-dropout_p:training-value",
                   "attention-attn_mask:expanded", "attention-kernel_options:dict",
                   "test_a_flex_call_carries_over_with_its_positional_arguments_and_return_aux"):
        assert wanted in out.stdout, f"{wanted} is not selected by {selection!r}"


def test_the_record_call_runs_the_suites_named_and_plan_and_host_by_default(tmp_path):
    """call4 records each suite of SUITES (default "plan host") into its own JSON, on an H200 only."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, body in (("nvidia-smi", "echo 'NVIDIA H200'"), ("python3", f'echo "$*" >> {tmp_path}/calls'),
                       ("timeout", f'echo "$1" >> {tmp_path}/limits; shift; exec "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = ROOT / "docs" / "prepared" / "call4-plan-host-record.sh"

    def suites_run(**env):
        (tmp_path / "calls").unlink(missing_ok=True)
        subprocess.run(["bash", str(script)], cwd=ROOT, check=True, capture_output=True,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), **env})
        calls = (tmp_path / "calls").read_text().splitlines()
        return [c.split("--suites ")[1].split()[0] for c in calls]

    assert suites_run() == ["plan", "host"]
    assert suites_run(SUITES="plan host cascade") == ["plan", "host", "cascade"]
    (tmp_path / "limits").unlink()  # a caller's START: the suites get what is left of the call's 570 s
    suites_run(SUITES="cascade", START=str(int(time.time()) - 100))
    assert 465 <= int((tmp_path / "limits").read_text()) <= 470


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_the_exact_max_call_records_on_an_h200_and_fuzzes_new_seeds_elsewhere(tmp_path, gpu):
    """call8: on an H200 exact_max's GPU tests, then the record of suites cascade, plan and host; elsewhere (its
    H100 checks already ran) only the GPU fuzz at new seeds, one process a family, and no suite."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    fake_python = f'echo "seeds=${{ATTNFORGE_TEST_FUZZ_SEEDS:-}} $*" >> {tmp_path}/calls'
    for name, body in (("nvidia-smi", f"echo '{gpu}'"), ("python3", fake_python)):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    subprocess.run(["bash", str(ROOT / "docs" / "prepared" / "call8-exact-max.sh")], cwd=ROOT, check=False,
                   capture_output=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out)})
    calls = (tmp_path / "calls").read_text().splitlines()
    tests = [c for c in calls if " -m pytest" in c]
    exact = [c for c in tests if "test_exact_max_rounds_peaked_rows_as_the_mma_kernel tests/test_cascade.py" in c]
    suites = [c.split("--suites ")[1].split()[0] for c in calls if "--suites" in c]
    if "H200" in gpu:
        assert len(tests) == len(exact) == 1 and suites == ["cascade", "plan", "host"], calls
    else:
        fuzz = [c for c in tests if "test_fuzz_gpu.py::test_random_" in c]
        assert len(fuzz) == 7 and not exact and not suites, calls
        assert all(c.startswith("seeds=1760:1910 ") for c in fuzz), fuzz


def test_the_small_rows_call_names_cases_of_its_suite():
    """A case name the suite does not hold is skipped silently by run_cases, so a typo would time nothing."""
    import runpy
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        cases = {c[0] for c in runpy.run_path(str(ROOT / "benchmarks" / "bench_verify_fp8_widen.py"))["CASES"]}
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = (ROOT / "docs" / "prepared" / "call10-fp8-small-rows.sh").read_text()
    named = re.findall(r'"(g\d+ q\d+(?: [BL]\d+)?)"', script)
    assert len(named) == 8 and set(named) <= cases, (named, sorted(cases))

"""tools/gpu_session.sh's memcheck: each group of its default tests is a sanitizer process of its own without host
backtraces, every id in them names collected GPU tests, and a group the time does not reach is said, not silently
dropped."""
import os
import re
import runpy
import subprocess
from pathlib import Path

SCRIPT = Path("tools/gpu_session.sh").read_text()
groups_tool = runpy.run_path("tools/gpu_test_groups.py", run_name="lib")


def memcheck_part() -> str:
    """The script's MEMCHECK_GROUPS, sanitizer_groups() and memcheck() alone (the rest runs the demo and the
    tests)."""
    return re.search(r"^MEMCHECK_GROUPS=.*?^memcheck\(\) \{.*?^}\n", SCRIPT, re.M | re.S).group(0)


def default_groups() -> list:
    text = re.search(r'^MEMCHECK_GROUPS="(.*?)"', SCRIPT, re.M | re.S).group(1)
    return [group.split() for group in text.split(";")]


SUMMARY = 'echo "========= ERROR SUMMARY: 0 errors"'


def run_memcheck(tmp_path, timeout_s: int, body: str = SUMMARY, tool: str = "", env_extra: dict | None = None,
                 rc: int = 0) -> tuple[str, list]:
    """memcheck() with a compute-sanitizer that records its pytest arguments, then runs `body` (bash; $n is the
    process's number, from 1): (its log, one line per process). memcheck() must return `rc`."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nn=$(wc -l < {calls})\n{body}\n')
    fake.chmod(0o755)
    part = tmp_path / "memcheck.sh"
    part.write_text(memcheck_part())
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), SANITIZE_TIMEOUT=str(timeout_s))
    for knob in ("SANITIZE_TESTS", "SANITIZE_TOOL", "SANITIZE_GROUPS"):
        env.pop(knob, None)
    if tool:
        env["SANITIZE_TOOL"] = tool
    env.update(env_extra or {})
    run = subprocess.run(["bash", "-c", f"source {part}; memcheck"], env=env, capture_output=True, text=True)
    assert run.returncode == rc, run.stdout + run.stderr
    log = run.stdout
    assert (out / f"{tool or 'memcheck'}.log").read_text() == log
    return log, calls.read_text().splitlines() if calls.exists() else []


def test_each_group_runs_in_a_process_of_its_own(tmp_path):
    log, calls = run_memcheck(tmp_path, 60)
    groups = default_groups()
    assert len(groups) >= 4 and log.startswith(f"memcheck exit 0 ({len(groups)} groups)")
    assert [c.split()[-len(g):] for c, g in zip(calls, groups)] == groups and len(calls) == len(groups)
    # (the host backtrace, the default, keeps every CUDA call's Python frames and their tensors alive)
    assert all("--show-backtrace device" in c for c in calls)


def test_sanitize_groups_picks_groups_by_their_1_based_index(tmp_path):
    groups = default_groups()
    log, calls = run_memcheck(tmp_path, 60, env_extra={"SANITIZE_GROUPS": f"{len(groups)},2"})
    assert log.startswith("memcheck exit 0 (2 groups)")
    assert [c.split()[-len(g):] for c, g in zip(calls, (groups[-1], groups[1]))] == [groups[-1], groups[1]]
    assert len(calls) == 2


def test_sanitize_groups_out_of_range_runs_nothing(tmp_path):
    """An index past the list would make an empty group, and pytest given no ids runs every GPU test; a list with
    no index would run no group and read as a clean run."""
    n = len(default_groups())
    cases = {"0": "1,0", "past": f"1,{n + 1}", "word": "1,two", "octal": "1,08", "none": ",", "blank": " "}
    for name, value in cases.items():
        where = tmp_path / name
        where.mkdir()
        log, calls = run_memcheck(where, 60, env_extra={"SANITIZE_GROUPS": value}, rc=2)
        got = value if name in ("none", "blank") else value.split(",")[1]
        assert calls == [], name
        assert f"expected comma-separated indices 1..{n} of the groups" in log and f"got '{got}'" in log, name
        assert "e.g. SANITIZE_GROUPS=5,6" in log, name


def test_a_bad_sanitize_groups_stops_the_call_before_its_demo_and_tests(tmp_path):
    """The whole script with SANITIZE=1 and a bad SANITIZE_GROUPS exits 2 with the reason before it runs anything
    (nvidia-smi, python3 and the sanitizer are stubs that record a call); a good value gets past the check."""
    bin_dir, out, calls = tmp_path / "bin", tmp_path / "out", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "python3", "compute-sanitizer", "cuobjdump"):
        (bin_dir / tool).write_text(f'#!/bin/bash\necho {tool} >> "{calls}"\n')
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), SANITIZE="1",
               SANITIZE_GROUPS="0", BENCH="0", SASS="0", TESTS="tests/test_merge_gpu.py", SANITIZE_TIMEOUT="1")
    for knob in ("SANITIZE_TESTS", "SANITIZE_TOOL", "SANITIZE_PARALLEL", "TEST_GROUPS"):
        env.pop(knob, None)
    run = subprocess.run(["bash", "tools/gpu_session.sh"], env=env, capture_output=True, text=True)
    assert run.returncode == 2 and not calls.exists(), run.stdout + run.stderr
    assert "SANITIZE_GROUPS: expected comma-separated indices" in run.stdout and "got '0'" in run.stdout
    run = subprocess.run(["bash", "tools/gpu_session.sh"], env=dict(env, SANITIZE_GROUPS="1"), capture_output=True,
                         text=True)
    assert "nvidia-smi" in calls.read_text().split() and "python3" in calls.read_text().split(), run.stdout


def test_a_group_out_of_time_is_reported(tmp_path):
    log, calls = run_memcheck(tmp_path, 2)
    assert calls == [] and log.startswith("memcheck exit 124")
    assert "no time left for: tests/test_merge_gpu.py" in (tmp_path / "out" / "memcheck.head").read_text()


def test_a_sanitizer_dead_at_its_start_is_tried_once_more(tmp_path):
    """A sanitizer killed by a signal before pytest printed a line is run again, once; one that dies after tests
    printed, or dies again, is reported with its exit status."""
    banner = 'echo "========= COMPUTE-SANITIZER"'
    first_dies = f'{banner}; [ $n = 1 ] && exit 139; echo "..."; {SUMMARY}'
    log, calls = run_memcheck(tmp_path, 60, first_dies)
    groups = default_groups()
    assert log.startswith("memcheck exit 0") and len(calls) == len(groups) + 1 and calls[0] == calls[1]
    assert "tried again: tests/test_merge_gpu.py" in log
    for name, body in (("after tests printed", f'{banner}; echo "..."; [ $n = 1 ] && exit 139; {SUMMARY}'),
                       ("twice", f'{banner}; [ $n -le 2 ] && exit 139; {SUMMARY}')):
        where = tmp_path / name.replace(" ", "_")
        where.mkdir()
        log, calls = run_memcheck(where, 60, body)
        assert log.startswith("memcheck exit 139"), name
        assert len(calls) == len(groups) + (name == "twice"), name


def test_another_sanitizer_tool_runs_the_same_groups_into_its_own_log(tmp_path):
    """SANITIZE_TOOL=initcheck: each group under `--tool initcheck`, its log initcheck.log, where an uninitialized
    read is counted like memcheck's invalid accesses."""
    read = 'echo "========= Uninitialized __global__ memory read of size 4 bytes"'
    log, calls = run_memcheck(tmp_path, 60, f'[ $n = 2 ] && {{ {read}; exit 3; }}; {SUMMARY}', tool="initcheck")
    groups = default_groups()
    assert len(calls) == len(groups) and all(c.startswith("--tool initcheck ") for c in calls)
    assert log.startswith(f"initcheck exit 3 ({len(groups)} groups)")
    assert "1 ========= Uninitialized __global__ memory read" in log
    assert not (tmp_path / "out" / "memcheck.log").exists()


def test_each_groups_summary_and_a_failing_groups_reports_are_named_by_its_tests(tmp_path):
    """The log gives each group's error summary under its first test id, and the head holds each failing group's
    own first reports: initcheck's 436 / 420 / 104 errors in three groups (ninety-fifth session) came back with
    the first group's reports alone, so the other two counts could not be traced to a kernel."""
    body = ('echo "========= COMPUTE-SANITIZER"; [ $n -ge 2 ] && [ $n -le 3 ] && { echo "=== report of process $n"; '
            'echo "========= ERROR SUMMARY: $n errors"; exit 3; }; ' + SUMMARY)
    log, calls = run_memcheck(tmp_path, 60, body, tool="initcheck")
    groups = default_groups()
    lines = [x for x in log.splitlines() if " <- " in x]
    assert len(lines) == len(groups) == len(calls)
    for n, (line, group) in enumerate(zip(lines, groups), 1):
        want = f"exit 3, ========= ERROR SUMMARY: {n} errors" if n in (2, 3) else \
            "exit 0, ========= ERROR SUMMARY: 0 errors"
        assert line == f"{want} <- {group[0]} (+{len(group) - 1} more)", line
    head = (tmp_path / "out" / "initcheck.head").read_text()
    assert head.index(f"=== group {groups[1][0]} ") < head.index("report of process 2") < \
        head.index(f"=== group {groups[2][0]} ") < head.index("report of process 3")
    assert groups[0][0] not in head and not (tmp_path / "out" / "initcheck.errors").exists()


def test_every_id_names_collected_gpu_tests():
    collected = groups_tool["gpu_test_ids"]()
    for group in default_groups():
        for test_id in group:  # a file, a function, or one parametrization
            assert any(i == test_id or i.startswith(test_id + "[") or i.startswith(test_id + "::")
                       for i in collected), f"{test_id}: no collected GPU test (renamed?)"


def test_the_script_exits_1_only_where_a_test_failed(tmp_path):
    """The script's last lines print the test summary, and its exit status says whether a test failed (it used
    to be the status of a grep that found no failure line: 1 when every test passed)."""
    tail = SCRIPT[SCRIPT.index("# the test summary last"):]
    for log, status in (("3 passed in 1.0s\n", 0), ("FAILED tests/x.py::t - boom\n1 failed, 2 passed\n", 1)):
        (tmp_path / "pytest.log").write_text(log)
        done = subprocess.run(["bash", "-c", tail], env=dict(os.environ, OUT=str(tmp_path)), capture_output=True,
                              text=True)
        assert done.returncode == status, (log, done.stdout, done.stderr)
        assert done.stdout.startswith("== tests: ")


def session_with_stub_tests(tmp_path, test_groups: str) -> tuple[subprocess.Popen, Path]:
    """tools/gpu_session.sh with TEST_GROUPS, its own process group, and a python3 whose pytest sleeps for a group
    naming 'slow', fails one naming 'bad' and passes the rest (nvidia-smi a stub too)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho stub-gpu\n")
    (bin_dir / "python3").write_text(
        '#!/bin/bash\n[ "$2" = attnforge ] && { echo demo; exit 0; }\n'
        'case "$*" in *slow*) sleep 60;; *bad*) echo "FAILED $9::t - boom"; echo "1 failed in 0.1s"; exit 1;; esac\n'
        'echo "3 passed in 0.1s"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), TEST_GROUPS=test_groups,
               BENCH="0", SASS="0", SANITIZE="0", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(["bash", "tools/gpu_session.sh"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, out


def test_test_groups_logs_fold_into_one_file_as_each_group_ends(tmp_path):
    """Each group's tail lands in $OUT/pytest.log when the group ends, under its index, exit status and first id,
    and no per-group file is left in $OUT (at most 8 files come back from a device call)."""
    proc, out = session_with_stub_tests(tmp_path, "tests/a.py;tests/bad.py;tests/b.py tests/c.py")
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout  # a group failed
    log = (out / "pytest.log").read_text()
    for head in ("== group 0, exit 0: tests/a.py (+0 more)", "== group 1, exit 1: tests/bad.py (+0 more)",
                 "== group 2, exit 0: tests/b.py (+1 more)"):
        assert head in log, log
    assert "FAILED tests/bad.py::t - boom" in log and log.count("3 passed") == 2
    assert sorted(p.name for p in out.iterdir()) == ["demo.log", "gpu.txt", "pytest.log"]
    assert not list(tmp_path.glob("pytest-groups.*")), "the working folder is removed"


def test_a_session_cut_off_still_returns_the_groups_that_ended(tmp_path):
    """The hundred-and-thirteenth session's call 1 ran past its limit with fourteen per-group logs in $OUT, and
    only the first came back. Now a session killed while one group still runs holds the others' results."""
    import signal
    import time
    proc, out = session_with_stub_tests(tmp_path, "tests/a.py;tests/slow.py;tests/b.py")
    log = out / "pytest.log"
    deadline = time.time() + 30
    while time.time() < deadline and not (log.exists() and log.read_text().count("3 passed") == 2):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    text = log.read_text()
    assert "== group 0, exit 0: tests/a.py" in text and "== group 2, exit 0: tests/b.py" in text, text
    assert "slow" not in text
    assert len(list(out.iterdir())) <= 8

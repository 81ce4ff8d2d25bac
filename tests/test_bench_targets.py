"""benchmarks/targets.py: the issues' targets read against a results file (the README's first table), on the host."""
import json
from pathlib import Path

import pytest

from test_bench_report import load_benchmark

RECORD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "h200.json"


def row(suite, case, impl, us, gbps=None, tflops=None):
    return {"suite": suite, "case": case, "impl": impl, "us": us, "gbps": gbps, "tflops": tflops}


def roofline_rows(fixed_us: float, rate_gbps: float, impl="read-stream"):
    """Rows of a roofline kernel whose time is exactly fixed + bytes / rate."""
    out = []
    for mib in (256, 512, 1024, 4096):
        nbytes = mib << 20
        us = fixed_us + nbytes / (rate_gbps * 1e3)
        out.append(row("roofline", f"read {mib} MiB", impl, us, gbps=nbytes / (us * 1e3)))
    return out


def test_read_ceiling_is_the_fastest_kernels_line_at_the_byte_count():
    t = load_benchmark("targets")
    rows = roofline_rows(3.0, 4500.0) + roofline_rows(4.0, 4600.0, impl="bulk-copy")
    nbytes = 1 << 30
    best_us = min(3.0 + nbytes / 4.5e6, 4.0 + nbytes / 4.6e6)
    assert t.read_ceiling_gbps(nbytes, rows) == pytest.approx(nbytes / (best_us * 1e3), rel=1e-9)
    # small sizes favour the smaller fixed cost: the other kernel wins there
    small = 16 << 20
    assert t.read_ceiling_gbps(small, rows) == pytest.approx(small / ((3.0 + small / 4.5e6) * 1e3), rel=1e-9)
    assert t.read_ceiling_gbps(nbytes, [row("decode", "B1", "attnforge", 1.0, gbps=1.0)]) is None


def test_verdicts_of_each_kind_of_target():
    t = load_benchmark("targets")
    Target = t.Target
    rows = [row("decode", "B16 L8192", "attnforge", 100.0, gbps=4400.0),
            row("decode", "skew", "attnforge", 130.0), row("decode", "skew", "flashinfer-tc", 905.0),
            row("mods", "alibi", "attnforge", 106.0), row("mods", "alibi", "attnforge-plain", 100.0),
            row("decode", "plan", "attnforge-plan", 49.0)]
    checks = {
        Target(3, "decode", "B16 L8192", "gbps", 4300.0): (4400.0, True),
        Target(3, "decode", "B16 L8192", "gbps", 4500.0): (4400.0, False),
        Target(3, "decode", "skew", "speedup", 7.0, ref="flashinfer-tc"): (905.0 / 130.0, False),
        Target(5, "mods", "alibi", "overhead", 0.05, ref="attnforge-plain"): (0.06, False),
        Target(5, "mods", "alibi", "overhead", 0.07, ref="attnforge-plain"): (0.06, True),
        Target(3, "decode", "plan", "us", 50.0, impl="attnforge-plan"): (49.0, True),
        Target(3, "decode", "B64 L4096", "gbps", 4500.0): (None, None),  # no row: not measured, not failed
        Target(3, "decode", "skew", "speedup", 7.0, ref="cudnn-sdpa"): (None, None),
    }
    for target, (value, met) in checks.items():
        assert t.measured(target, rows) == (pytest.approx(value) if value is not None else None), target
    orig = t.TARGETS
    try:
        t.TARGETS = tuple(checks)
        got = [(v["value"], v["met"]) for v in t.verdicts(rows)]
        table = t.table(rows)
    finally:
        t.TARGETS = orig
    assert [m for _, m in got] == [m for _, m in checks.values()]
    assert table.count("**no**") == 3 and table.count("| yes |") == 3 and table.count("not measured") == 2
    assert "+6.0%" in table and "6.96x" in table


def test_every_target_is_measured_in_the_record():
    """A case renamed in a suite, or a target naming a case the suites do not run, would leave a target
    'not measured' forever: every target finds its rows in docs/benchmarks/h200.json."""
    t = load_benchmark("targets")
    rows = json.loads(RECORD.read_text())["rows"]
    missing = [v["target"] for v in t.verdicts(rows) if v["value"] is None]
    assert not missing
    assert {v["target"].issue for v in t.verdicts(rows)} == {3, 4, 5, 6}


def test_readme_shows_the_targets_table_of_the_record():
    t = load_benchmark("targets")
    readme = (RECORD.parent / "README.md").read_text()
    assert t.table(json.loads(RECORD.read_text())["rows"]) in readme
    assert readme.index("## The issues' targets") < readme.index("## Batch decode")


def test_best_peer_reads_each_target_on_its_own_measure():
    t = load_benchmark("targets")
    Target = t.Target
    rows = [row("prefill", "B1", "attnforge", 10.0, tflops=670.0),
            row("prefill", "B1", "flashinfer-fa3", 9.9, tflops=675.0),
            row("prefill", "B1", "flashinfer-fa2", 18.0, tflops=370.0),
            row("prefill", "B1", "attnforge-mma", 5.0, tflops=900.0),
            row("mods", "softcap", "attnforge", 126.0), row("mods", "softcap", "attnforge-plain", 100.0),
            row("mods", "softcap", "flashinfer-fa3", 127.0), row("mods", "softcap", "flashinfer-fa3-plain", 100.0),
            row("mods", "softcap", "flex", 212.0), row("mods", "softcap", "flex-plain", 100.0),
            row("mods", "alibi", "attnforge", 114.0), row("mods", "alibi", "attnforge-plain", 100.0),
            row("mods", "alibi", "flex", 90.0),  # no flex-plain row: no cost to read
            row("decode", "skew", "attnforge", 130.0), row("decode", "skew", "flashinfer-tc", 905.0)]
    # the fastest row not ours (an attnforge ablation faster than every peer is not a peer)
    assert t.best_peer(Target(6, "prefill", "B1", "tflops", 680.0), rows) == ("flashinfer-fa3", 675.0)
    # a modifier's cost: each peer's own, the smallest
    impl, cost = t.best_peer(Target(5, "mods", "softcap", "overhead", 0.05, ref="attnforge-plain"), rows)
    assert impl == "flashinfer-fa3" and cost == pytest.approx(0.27)
    assert t.best_peer(Target(5, "mods", "alibi", "overhead", 0.05, ref="attnforge-plain"), rows) is None
    assert t.best_peer(Target(3, "decode", "skew", "speedup", 7.0, ref="flashinfer-tc"), rows) is None
    assert t.best_peer(Target(6, "prefill", "B2", "tflops", 680.0), rows) is None
    orig = t.TARGETS
    try:
        t.TARGETS = (Target(6, "prefill", "B1", "tflops", 680.0),
                     Target(5, "mods", "softcap", "overhead", 0.05, ref="attnforge-plain"))
        table = t.table(rows)
    finally:
        t.TARGETS = orig
    assert "| 670 | 675 flashinfer-fa3 |" in table and "| +26.0% | +27.0% flashinfer-fa3 |" in table

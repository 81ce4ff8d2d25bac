"""benchmarks/report.py: merging a partial run into the results of record (host only)."""
import importlib.util
import json
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


def load_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(suite, case, impl, us):
    return {"suite": suite, "case": case, "impl": impl, "us": us, "gbps": None, "tflops": None}


def test_merge_replaces_measured_cases_and_keeps_the_rest(tmp_path):
    record = {"gpu": "H200", "date": "2026-11-01", "versions": {"torch": "a"}, "notes": ["old"],
              "rows": [row("decode", "B1", "attnforge", 1.0), row("mla", "h16", "attnforge", 9.0),
                       row("mla", "h16", "flashinfer-fa3", 7.0), row("mla", "h128", "attnforge", 3.0)]}
    new = {"gpu": "H200", "date": "2026-11-29", "versions": {"torch": "b", "flashinfer": "x"}, "notes": ["rmse"],
           "rows": [row("mla", "h16", "attnforge", 5.0), row("quest", "h32", "attnforge", 2.0)]}
    (tmp_path / "record.json").write_text(json.dumps(record))
    (tmp_path / "new.json").write_text(json.dumps(new))
    load_report().merge(str(tmp_path / "new.json"), into=str(tmp_path / "record.json"))
    got = json.loads((tmp_path / "record.json").read_text())
    # h16 is replaced whole (its fa3 row from the older run goes too); h128, not re-measured, stays
    assert sorted((r["suite"], r["case"], r["us"]) for r in got["rows"]) == [
        ("decode", "B1", 1.0), ("mla", "h128", 3.0), ("mla", "h16", 5.0), ("quest", "h32", 2.0)]
    assert got["notes"] == ["old", "[mla, quest] rmse"]
    assert got["date"] == "2026-11-29" and got["versions"] == {"torch": "b", "flashinfer": "x"}


def test_table_shows_bandwidth_and_flops():
    r = {**row("mla", "h128", "attnforge", 100.0), "gbps": 600.0, "tflops": 150.0}
    text = load_report().table([r], "mla")
    assert "100.0 µs<br>600 GB/s<br>150 TFLOP/s" in text

"""The suites' allocator rule (harness.fresh_allocator): a case's inputs must not be carved from the blocks a
larger case just freed (head_dims h32/4 read 10% slower on such inputs: docs/measuring.md). On the host: the
suites are run with their GPU parts replaced by recorders, and the order of events is checked."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class CaseStarted(Exception):
    pass


def test_fresh_allocator_collects_synchronizes_and_empties(monkeypatch):
    import gc
    import harness
    calls = []
    monkeypatch.setattr(gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(harness.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    harness.fresh_allocator()
    assert calls == ["collect", "synchronize", "empty_cache"]  # the cache is emptied after the frees land


@pytest.mark.parametrize("case", ["decode_case", "prefill_case"])
def test_each_head_dims_case_starts_from_an_emptied_allocator(case, monkeypatch):
    import bench_head_dims
    from harness import Report

    def first(*_):
        raise CaseStarted
    monkeypatch.setattr(bench_head_dims, "fresh_allocator", first)
    monkeypatch.setattr(bench_head_dims.torch, "randn", lambda *a, **k: pytest.fail("allocated before emptying"))
    with pytest.raises(CaseStarted):
        getattr(bench_head_dims, case)(Report(), 128, False, 32, 4)


def test_decode_cases_after_dense_peers_start_from_an_emptied_allocator(monkeypatch):
    import bench_decode
    from harness import Report
    events = []
    monkeypatch.setattr(bench_decode, "fresh_allocator", lambda: events.append("fresh"))
    monkeypatch.setattr(bench_decode, "paged_inputs", lambda *a, **k: events.append("inputs") or ())
    monkeypatch.setattr(bench_decode, "bench_attnforge", lambda *a, **k: None)
    monkeypatch.setattr(bench_decode, "bench_flashinfer", lambda *a, **k: None)
    monkeypatch.setattr(bench_decode, "bench_dense_peers", lambda *a, **k: events.append("dense"))
    monkeypatch.setenv("ATTNFORGE_BENCH_DECODE_CASES", "B16 L8192,B64 L4096,B64 Lrand,skew 1x65536+127x512")
    bench_decode.run(Report(), peers=True)
    assert events.count("dense") == 2 and events.count("inputs") == 4
    for i, e in enumerate(events):
        if e == "inputs" and i > 0:  # every case after the first finds the allocator emptied after the last frees
            assert events[i - 1] == "fresh", events


def test_benchmarks_readme_puts_the_tables_before_the_runs_notes(tmp_path, monkeypatch):
    import json
    import report
    record = {"gpu": "H200", "date": "2026-12-02", "versions": {"torch": "x"}, "notes": ["where the rows came from"],
              "rows": [{"suite": suite, "case": "c", "impl": "attnforge", "us": 1.0, "gbps": gbps, "tflops": tflops}
                       for suite, gbps, tflops in (("decode", 4000.0, None), ("prefill", None, 600.0),
                                                   ("head_dims", 4000.0, None))]}
    (tmp_path / "r.json").write_text(json.dumps(record))
    monkeypatch.setattr(report, "DOCS", tmp_path)
    report.main(str(tmp_path / "r.json"))
    text = (tmp_path / "README.md").read_text()
    assert text.index("## Head dims") < text.index("## Notes from the runs") < text.index("where the rows came from")

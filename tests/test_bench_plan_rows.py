"""Suite `plan`'s rows on the host: the decode wrapper's driver calls replaced by HostOnlyUpload (as
tools/plan_host_cost.py does), so the suite's code runs without a GPU and each row times the plan it names."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class Rows:
    def __init__(self):
        self.rows, self.notes = [], []

    def add(self, suite, case, impl, us, *rest):
        self.rows.append((suite, case, impl, us))

    def note(self, text):
        self.notes.append(text)


def test_plan_suite_times_the_csr_and_block_table_forms(monkeypatch):
    import bench_decode
    from attnforge.decode import BatchDecode
    planned = []

    def host_wrapper(spec, **kw):
        w = BatchDecode.host_only(spec)
        plan = w.plan
        monkeypatch.setattr(w, "plan", lambda *a, **k: planned.append(("table" if "block_table" in k else "csr",
                                                                        plan(*a, **k))))
        return w

    monkeypatch.setattr(bench_decode, "BatchDecode", host_wrapper)
    monkeypatch.setattr(bench_decode.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_decode, "fresh_process_probe_us", lambda: float("nan"))
    report = Rows()
    bench_decode.bench_plan(report)
    assert [r[:3] for r in report.rows] == [("decode", "plan B256", "attnforge-plan"),
                                            ("decode", "plan B256 block-table rand", "attnforge-plan")]
    assert all(np.isfinite(r[3]) and r[3] > 0 for r in report.rows)
    assert [form for form, _ in planned] == ["csr"] * 220 + ["table"] * 220  # 20 untimed and 200 timed calls a row
    assert report.notes and report.notes[0].startswith("plan B256: min")

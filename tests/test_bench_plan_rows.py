"""Suite `plan`'s rows on the host: the decode wrapper's driver calls replaced by HostOnlyUpload (as
tools/plan_host_cost.py does), so the suite's code runs without a GPU and each row times the plan it names."""
import sys
from pathlib import Path

import numpy as np
import torch

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


def test_dense_attention_rows_capture_each_route_and_restore_the_knob(monkeypatch):
    """`attnforge-dense` and `attnforge-dense-prefill` (decode suite, dense cases; at B16 L8192 their `-static`
    twins on a sliced cache and `-verify4` twins on 4 causal queries too): each variant runs attention() with the
    knob set its way, a row each, and the caller's setting comes back."""
    import os

    import attnforge
    import bench_decode
    seen = []
    monkeypatch.setattr(attnforge, "attention", lambda q, k, v, mask_mod, enable_gqa: seen.append(
        (os.environ["ATTNFORGE_ATTENTION_DECODE"], k.shape, k.stride(), k.is_contiguous(), q.shape[2],
         mask_mod is not None and bool(mask_mod(0, 0, torch.tensor(5), torch.tensor([4, 5, 6])).tolist() ==
                                       [True, True, False]))))
    monkeypatch.setattr(bench_decode, "time_interleaved", lambda fns: {name: (fn(), 10.0 + i)[1]
                                                                      for i, (name, fn) in enumerate(fns.items())})
    for before in (None, "0"):
        if before is None:
            monkeypatch.delenv("ATTNFORGE_ATTENTION_DECODE", raising=False)
        else:
            monkeypatch.setenv("ATTNFORGE_ATTENTION_DECODE", before)
        for case in ("B64 L4096", "B16 L8192"):  # (the second also on a sliced static cache, and a verify step)
            k = torch.randn(2, 3, 5, 8)
            report, seen[:] = Rows(), []
            bench_decode.bench_dense_attention(report, case, torch.randn(2, 6, 1, 8), k, k.clone(), 123)
            whole = (k.shape, k.stride(), True, 1, False)
            sliced = (k.shape, (3 * 10 * 8, 10 * 8, 8, 1), False, 1, False)
            verify = (k.shape, k.stride(), True, 4, True)
            routes = [("1", *whole), ("0", *whole)]
            routes += [("1", *sliced), ("0", *sliced), ("1", *verify), ("0", *verify)] if case == "B16 L8192" else []
            assert seen == routes and os.environ.get("ATTNFORGE_ATTENTION_DECODE") == before
            impls = ["attnforge-dense", "attnforge-dense-prefill"]
            impls += ["attnforge-dense-static", "attnforge-dense-static-prefill", "attnforge-dense-verify4",
                      "attnforge-dense-verify4-prefill"] if case == "B16 L8192" else []
            assert report.rows == [("decode", case, impl, 10.0 + i) for i, impl in enumerate(impls)]

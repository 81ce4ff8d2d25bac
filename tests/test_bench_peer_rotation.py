"""The prefill and mods suites time FlashInfer in the same rotation as attnforge (harness.time_interleaved): timed
one after another, the H200 record read fa3 level with us on B1 S8192, while in one rotation on an H100 it led by
1.1-3.6% (perf-notes, ninety-third session). On the host: the suites run with their GPU parts replaced by
recorders."""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class FakePrefill:
    def __init__(self, spec, **kw):
        self.kw = kw

    def plan(self, *a, **k):
        pass

    def run(self, q, kv):
        return torch.zeros(3)


def test_prefill_cases_time_flashinfer_in_attnforges_rotation(monkeypatch):
    import bench_prefill
    import harness
    from harness import Report
    rotations, checked = [], []
    monkeypatch.setattr(bench_prefill, "BatchPrefill", FakePrefill)
    monkeypatch.setattr(bench_prefill, "ragged", lambda lengths: (None, None, None, np.array([0, *np.cumsum(lengths)])))
    gaps = []  # the suite's rows are timed after an idle gap (harness.timing_method)
    monkeypatch.setattr(bench_prefill, "time_interleaved", lambda fns, **kw: rotations.append(sorted(fns)) or
                        gaps.append(harness._METHOD["gap_s"]) or {name: 1.0 for name in fns})
    monkeypatch.setattr(bench_prefill, "bench_dense", lambda *a, **k: None)
    monkeypatch.delenv("ATTNFORGE_BENCH_GAP_S", raising=False)

    def peers(report, case, q, k, v, indptr, want=None):
        checked.append(want is not None)  # our output goes along, for the peers' outputs to be checked against
        return {"flashinfer-fa2": lambda: None, "flashinfer-fa3": lambda: None}
    monkeypatch.setattr(bench_prefill, "flashinfer_ragged", peers)
    monkeypatch.setenv("ATTNFORGE_BENCH_PREFILL_CASES", "B16 S2048,ragged 16 random 128-8192")
    report = Report()
    bench_prefill.run(report, peers=True)
    assert checked == [True, True]
    assert gaps == [harness.COMPUTE_BOUND_GAP_S] * 2 and harness._METHOD["gap_s"] == 0.0
    assert report.notes[0] == f"timing: {harness.COMPUTE_BOUND_GAP_S:g} s of idle GPU before each timed run"
    assert len(rotations) == 2
    for names in rotations:
        assert {"attnforge", "attnforge-cta-per-item", "flashinfer-fa2", "flashinfer-fa3"} <= set(names)
    assert {(r["case"], r["impl"]) for r in report.rows} >= {("B16 S2048", "flashinfer-fa3"),
                                                            ("ragged 16 random 128-8192", "attnforge")}
    rotations.clear()
    bench_prefill.run(Report(), peers=False)  # --no-peers: our rows alone
    assert rotations and all(not any(n.startswith("flashinfer") for n in names) for names in rotations)


def test_a_peer_whose_output_differs_is_left_out_with_a_note():
    from bench_prefill import agrees
    from harness import Report
    report = Report()
    want = torch.randn(4, 2, 8)
    assert agrees(report, "peer", want + 0.01, want) and not report.notes
    assert not agrees(report, "peer", want + 1.0, want)
    assert report.notes and "peer" in report.notes[0] and "left out" in report.notes[0]


def test_mods_time_each_peer_with_and_without_its_mode_in_one_rotation(monkeypatch):
    import bench_mods
    from harness import Report
    rotations = []
    monkeypatch.setattr(bench_mods, "flashinfer_prefill", lambda backend, mode, indptr, ws=None: FakeWrapper(mode))
    monkeypatch.setattr(bench_mods, "time_interleaved", lambda fns, **kw: rotations.append(sorted(fns)) or
                        {name: 2.0 if name != "plain" else 1.0 for name in fns})
    monkeypatch.setattr(bench_mods.importlib_util, "find_spec", lambda name: object())
    monkeypatch.setattr(bench_mods.torch, "empty", lambda *a, **k: None)
    ours = {name: torch.full((2,), float(i)) for i, name in enumerate(["plain", "softcap", "alibi", "window4096"])}
    report = Report()
    bench_mods.bench_flashinfer_mods(report, None, None, None, [0, 8], ours)
    assert rotations == [sorted(modes) for modes in bench_mods.FLASHINFER_MODES.values()]
    rows = {(r["case"], r["impl"]) for r in report.rows}
    softcap = "softcap prefill B1 S8192"
    assert {(softcap, "flashinfer-fa3"), (softcap, "flashinfer-fa3-plain")} <= rows
    assert ("alibi prefill B1 S8192", "flashinfer-fa2") in rows
    assert not any(impl.startswith("flashinfer-fa3") for case, impl in rows if case.startswith("alibi"))


class FakeWrapper:
    """A FlashInfer wrapper whose output equals ours for its mode (bench_mods checks each against ours)."""
    OUT = {"plain": 0.0, "softcap": 1.0, "alibi": 2.0, "window4096": 3.0}

    def __init__(self, mode):
        self.mode = mode

    def run(self, q, k, v):
        return torch.full((2,), self.OUT[self.mode])


def test_a_paged_peer_is_checked_against_our_output_on_the_same_pages(monkeypatch):
    """flashinfer_paged(want=...): FlashInfer's paged prefill joins the rotation only where its output agrees
    with ours on the same pages (a stand-in module on the host; the suite passes each cache's own output)."""
    import types

    import bench_prefill
    from harness import Report
    outputs = []

    class PagedWrapper:
        def __init__(self, ws, layout, backend):
            self.backend = backend

        def plan(self, *args, **kw):
            assert kw["kv_data_type"] == torch.bfloat16 and kw["causal"]

        def run(self, q, cache):
            return outputs[-1]
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=PagedWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(bench_prefill, "flashinfer_workspace", lambda device="cuda": None)
    q, cache, want = torch.zeros(4, 2, 8), torch.zeros(2, 2, 16, 1, 8, dtype=torch.bfloat16), torch.randn(4, 2, 8)
    args = (q, cache, [0, 4], np.arange(2), [4])
    for got, kept in ((want + 0.01, True), (want + 1.0, False)):
        outputs.append(got)
        report = Report()
        fns = bench_prefill.flashinfer_paged(report, "B1 S8192 paged16", *args, want=want)
        assert (set(fns) == {"flashinfer-fa3"}) == kept
        assert bool(report.notes) != kept and all("paged on B1 S8192 paged16" in n for n in report.notes)
    assert set(bench_prefill.flashinfer_paged(Report(), "c", *args)) == {"flashinfer-fa3"}  # no want: not checked


def test_the_sustained_runs_plan_fa3_through_the_suites_wrapper(monkeypatch):
    """clocks_under_load's fa3 row is planned by bench_prefill.flashinfer_ragged_wrapper (the prefill and mods
    suites' own), with the heads and widths read from q, k and v."""
    import types

    import bench_prefill
    import clocks_under_load
    planned = []

    class FakeWrapper:
        def run(self, q, k, v):
            return "fa3 output"

    def wrapper(flashinfer, backend, indptr, hq, hkv, d, dv, ws=None, **plan_kw):
        planned.append((flashinfer.__name__, backend, list(indptr), hq, hkv, d, dv))
        return FakeWrapper()
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(bench_prefill, "flashinfer_ragged_wrapper", wrapper)
    monkeypatch.setattr(clocks_under_load, "BatchPrefill", FakePrefill)
    q, k, v = torch.zeros(10, 16, 192), torch.zeros(10, 4, 192), torch.zeros(10, 4, 128)
    impls = clocks_under_load.impls_of("case", None, q, k, v, [0, 10])
    assert sorted(impls) == ["attnforge", "flashinfer-fa3"]
    assert planned == [("flashinfer", "fa3", [0, 10], 16, 4, 192, 128)]
    assert impls["flashinfer-fa3"]() == "fa3 output"
    assert sorted(clocks_under_load.impls_of("case", None, q, k, v, [0, 10], only="attnforge")) == ["attnforge"]

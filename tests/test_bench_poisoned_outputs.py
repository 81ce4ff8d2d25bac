"""harness.time_poisoned_outputs, on the host with the timer replaced: each impl writes its own NaN-poisoned
output, every row is added, and the notes say how far each output is from the first impl's and what it left
unwritten (the verify suites' check that their rows computed the same thing)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_outputs_start_poisoned_and_the_notes_compare_them_with_the_first(monkeypatch):
    import harness
    timed = []

    def fake_rotation(runs):  # each run once, in order; "times" 11, 12, 13 us
        return {impl: (run(), timed.append(impl), 10.0 + len(timed))[2] for impl, run in runs.items()}
    monkeypatch.setattr(harness, "time_interleaved", fake_rotation)
    seen_poison = []

    def writer(value, rows):
        def f(out):
            seen_poison.append(bool(out.isnan().all()))  # the output arrives poisoned
            out[:rows] = value
        return f
    like = torch.zeros(4, 3)
    report = harness.Report()
    outs = harness.time_poisoned_outputs(report, "s", "c", {"a": writer(1.0, 4), "b": writer(1.25, 4),
                                                             "c": writer(1.0, 3)}, like, 1000)
    assert seen_poison == [True, True, True] and timed == ["a", "b", "c"]
    assert [(r["impl"], r["us"]) for r in report.rows] == [("a", 11.0), ("b", 12.0), ("c", 13.0)]
    assert outs["b"].eq(1.25).all() and outs["c"][3].isnan().all()
    notes = [n for n in report.notes if n.startswith("s c ")]
    assert notes == ["s c a: differs from a by at most 0.00e+00, 0 values unwritten",
                     "s c b: differs from a by at most 2.50e-01, 0 values unwritten",
                     "s c c: differs from a by at most nan, 3 values unwritten"]

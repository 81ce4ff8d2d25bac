"""benchmarks/report.py (merging a partial run into the results of record) and the harness's
interleaved timing, on the host."""
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPORT.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def load_report():
    return load_benchmark("report")


def row(suite, case, impl, us):
    return {"suite": suite, "case": case, "impl": impl, "us": us, "gbps": None, "tflops": None}


def merged(tmp_path, record: dict, new: dict) -> dict:
    """The record after report.merge of a newer results file (both written to tmp_path)."""
    (tmp_path / "record.json").write_text(json.dumps(record))
    (tmp_path / "new.json").write_text(json.dumps(new))
    load_report().merge(str(tmp_path / "new.json"), into=str(tmp_path / "record.json"))
    return json.loads((tmp_path / "record.json").read_text())


def test_merge_replaces_measured_cases_and_keeps_the_rest(tmp_path):
    record = {"gpu": "H200", "date": "2026-11-01", "versions": {"torch": "a"}, "notes": ["old"],
              "rows": [row("decode", "B1", "attnforge", 1.0), row("mla", "h16", "attnforge", 9.0),
                       row("mla", "h16", "flashinfer-fa3", 7.0), row("mla", "h128", "attnforge", 3.0)]}
    new = {"gpu": "H200", "date": "2026-11-29", "versions": {"torch": "b", "flashinfer": "x"}, "notes": ["rmse"],
           "rows": [row("mla", "h16", "attnforge", 5.0), row("quest", "h32", "attnforge", 2.0)]}
    got = merged(tmp_path, record, new)
    # h16 is replaced whole (its fa3 row from the older run goes too); h128, not re-measured, stays
    assert sorted((r["suite"], r["case"], r["us"]) for r in got["rows"]) == [
        ("decode", "B1", 1.0), ("mla", "h128", 3.0), ("mla", "h16", 5.0), ("quest", "h32", 2.0)]
    assert got["notes"] == ["old", "[mla, quest] rmse"]
    assert got["date"] == "2026-11-29" and got["versions"] == {"torch": "b", "flashinfer": "x"}
    # a later run without peers does not make the record's peer version "missing"
    newer = {**new, "versions": {"torch": "b", "flashinfer": "missing", "triton": "missing"}, "notes": []}
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    load_report().merge(str(tmp_path / "newer.json"), into=str(tmp_path / "record.json"))
    got = json.loads((tmp_path / "record.json").read_text())
    assert got["versions"] == {"torch": "b", "flashinfer": "x", "triton": "missing"}


def test_merge_drops_the_older_edition_of_a_note_a_run_writes_again(tmp_path):
    record = {"gpu": "H200", "date": "2026-11-01", "versions": {}, "rows": [row("mla", "h16", "attnforge", 9.0),
              row("mods", "x", "attnforge", 1.0)],
              "notes": ["[mla] accuracy h16 bf16: RMSE 1.698e-04", "[mla] legend written by hand",
                        "[mods] clock 1740 MHz", "[mla, mods] clock 1700 MHz", "global 1.5 s"]}
    new = {"gpu": "H200", "date": "2026-12-01", "versions": {}, "rows": [row("mla", "h16", "attnforge", 8.0)],
           "notes": ["accuracy h16 bf16: RMSE 2.1e-05", "clock 1695 MHz", "global 2 s"]}
    got = merged(tmp_path, record, new)["notes"]
    # mla was re-measured whole: its rewritten notes replace the old ones; mods was not (its note stays,
    # and so does one that also speaks of mods); unprefixed and hand-written notes stay
    assert got == ["[mla] legend written by hand", "[mods] clock 1740 MHz", "[mla, mods] clock 1700 MHz",
                   "global 1.5 s", "[mla] accuracy h16 bf16: RMSE 2.1e-05", "[mla] clock 1695 MHz", "[mla] global 2 s"]


def test_merge_of_some_cases_keeps_a_note_written_again_once(tmp_path):
    """A run of some of a suite's cases writes the suite's notes again (the accuracy RMSEs, the legend): the
    record keeps one of each; a note with other numbers is a new note beside the old one."""
    record = {"gpu": "H200", "date": "2026-11-01", "versions": {}, "rows": [row("mla", "h16", "attnforge", 9.0),
              row("mla", "h128", "attnforge", 3.0)], "notes": ["[mla] legend", "[mla] accuracy RMSE 1.7e-04"]}
    new = {"gpu": "H200", "date": "2026-12-01", "versions": {}, "rows": [row("mla", "h16", "attnforge", 8.0)],
           "notes": ["legend", "accuracy RMSE 1.7e-04", "accuracy RMSE 2.0e-04"]}
    got = merged(tmp_path, record, new)["notes"]
    assert got == ["[mla] legend", "[mla] accuracy RMSE 1.7e-04", "[mla] accuracy RMSE 2.0e-04"]


def test_table_shows_bandwidth_and_flops():
    r = {**row("mla", "h128", "attnforge", 100.0), "gbps": 600.0, "tflops": 150.0}
    text = load_report().table([r], "mla")
    assert "100.0 µs<br>600 GB/s<br>150 TFLOP/s" in text


def load_harness():
    return load_benchmark("harness")


def test_interleaved_timing_rotates_the_variants_so_drift_hits_all_alike():
    """A machine that slows down during the run (a clock ramp, a filling cache) must not rank
    variants by the order they were timed in: identical variants get medians one round apart."""
    harness = load_harness()
    clock, order = [0], []

    def timer(run):  # every timed run is slower than the one before it
        clock[0] += 1
        order.append(run())
        return 100.0 + clock[0]

    fns = {name: (lambda name=name: name) for name in ("a", "b", "c")}
    times = harness.time_interleaved(fns, reps=9, timer=timer, prepare_fn=lambda fn, calls, use_graph: fn)
    assert order[:6] == ["a", "b", "c", "b", "c", "a"]  # repetition r starts at variant r mod 3
    # within one round of each other (2 ticks); timed back to back the spread would be 2 x 9 ticks
    assert max(times.values()) - min(times.values()) <= len(fns) - 1
    assert all(order.count(name) == 9 for name in fns)


def fake_gpu_clock(harness, monkeypatch):
    """The harness's host clock, sleep and synchronize replaced: returns the event log, where a replay
    enqueued by settle or the timer appends its variant's name and sleeping appends ("idle", seconds);
    each replay advances the clock by 10 ms."""
    now, log = [0.0], []
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(harness.time, "sleep", lambda s: log.append(("idle", s)))
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)

    def replay_of(name):
        def run():
            now[0] += 0.010
            log.append(name)
        return run
    return log, replay_of


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_settling_replays_each_variant_untimed_before_its_timed_run(monkeypatch, how):
    """settle_s: about that long of the variant's own replays, queued back to back, right before each of its
    timed runs (so under a power cap it is timed at its own load's clock, not its predecessor's)."""
    harness = load_harness()
    log, replay_of = fake_gpu_clock(harness, monkeypatch)
    timed = []
    fns = {name: replay_of(name) for name in ("a", "b")}
    kw = {"settle_s": 0.05}
    if how == "environment":
        monkeypatch.setenv("ATTNFORGE_BENCH_SETTLE_S", "0.05")
        kw = {}
    harness.time_interleaved(fns, reps=2, timer=lambda run: timed.append(len(log)) or run() or 1.0,
                             prepare_fn=lambda fn, calls, use_graph: fn, **kw)
    # 0.05 s of 10 ms replays: one to measure, four more; then the timed one; variants in rotation
    assert log == ["a"] * 6 + ["b"] * 6 + ["b"] * 6 + ["a"] * 6
    assert timed == [5, 11, 17, 23]  # each timed run right after its own settling replays
    assert ("idle", 0.0) not in log


def test_a_gap_leaves_the_gpu_idle_before_each_timed_run(monkeypatch):
    harness = load_harness()
    log, replay_of = fake_gpu_clock(harness, monkeypatch)
    monkeypatch.setenv("ATTNFORGE_BENCH_GAP_S", "0.1")
    fns = {name: replay_of(name) for name in ("a", "b")}
    harness.time_interleaved(fns, reps=2, timer=lambda run: run() or 1.0, prepare_fn=lambda fn, calls, use_graph: fn)
    assert log == [("idle", 0.1), "a", ("idle", 0.1), "b", ("idle", 0.1), "b", ("idle", 0.1), "a"]
    log.clear()
    monkeypatch.delenv("ATTNFORGE_BENCH_GAP_S")  # unset: neither idles nor settles (the default method)
    harness.time_interleaved(fns, reps=1, timer=lambda run: run() or 1.0, prepare_fn=lambda fn, calls, use_graph: fn)
    assert log == ["a", "b"]


def test_a_suites_timing_method_reaches_time_us_and_the_environment_still_wins(monkeypatch):
    """timing_method(gap_s): time_us (a peer timed on its own) idles before each timed run like a rotation's rows,
    inside the block only; ATTNFORGE_BENCH_GAP_S, where set (0 too), wins over the suite's default."""
    harness = load_harness()
    log, replay_of = fake_gpu_clock(harness, monkeypatch)
    monkeypatch.setattr(harness, "prepare", lambda fn, calls, use_graph: fn)
    monkeypatch.setattr(harness, "time_run", lambda run, calls: run() or 1.0)
    monkeypatch.delenv("ATTNFORGE_BENCH_GAP_S", raising=False)
    with harness.timing_method(gap_s=0.1):
        harness.time_us(replay_of("peer"), reps=2)
        assert harness.method_note() == "timing: 0.1 s of idle GPU before each timed run"
        monkeypatch.setenv("ATTNFORGE_BENCH_GAP_S", "0")
        harness.time_us(replay_of("env"), reps=1)
        assert harness.method_note() == "timing: timed runs back to back, no gap, no settling"
        monkeypatch.delenv("ATTNFORGE_BENCH_GAP_S")
    harness.time_us(replay_of("after"), reps=1)
    assert log == [("idle", 0.1), "peer", ("idle", 0.1), "peer", "env", "after"]
    assert harness._METHOD == {"gap_s": 0.0, "settle_s": 0.0}  # restored on leaving the block


@pytest.mark.parametrize("text", ["-1", "abc", "nan", "61"])
def test_a_timing_knob_out_of_range_says_what_it_takes(monkeypatch, text):
    harness = load_harness()
    monkeypatch.setenv("ATTNFORGE_BENCH_SETTLE_S", text)
    with pytest.raises(ValueError, match=rf"ATTNFORGE_BENCH_SETTLE_S: expected seconds from 0 to 60, got '{text}'"):
        harness.time_interleaved({"a": lambda: None}, reps=1, timer=lambda run: 1.0,
                                 prepare_fn=lambda fn, calls, use_graph: fn)


def test_autosave_keeps_every_finished_case_of_a_run_cut_short(tmp_path, monkeypatch):
    harness = load_harness()
    monkeypatch.setattr(harness.torch.cuda, "get_device_name", lambda *a: "H200")
    out = tmp_path / "bench.json"
    report = harness.Report(autosave=(out, {"torch": "x"}))
    report.add("mla", "h16", "attnforge", 10.0)
    report.add("mla", "h16", "flashinfer-fa3", 8.0)
    assert not out.exists()  # h16 may still get rows
    report.add("mla", "h128", "attnforge", 30.0)  # h16 is complete: saved; h128 is not
    saved = json.loads(out.read_text())
    assert [(r["case"], r["impl"]) for r in saved["rows"]] == [("h16", "attnforge"), ("h16", "flashinfer-fa3")]


def test_ab_compare_takes_each_trees_median_over_rounds(tmp_path, capsys):
    """tools/ab_compare.py on an archive as tools/ab_bench.sh writes it (name.rN.json per tree and round)."""
    import io
    import tarfile

    spec = importlib.util.spec_from_file_location("ab_compare", REPORT.parents[1] / "tools" / "ab_compare.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    runs = {"base.r1.json": 10.0, "base.r2.json": 12.0, "base.r3.json": 11.0, "next.r1.json": 9.0,
            "next.r2.json": 9.9, "next.r3.json": 30.0}
    archive = tmp_path / "ab.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, us in runs.items():
            data = json.dumps({"rows": [row("prefill", "B1", "attnforge", us)]}).encode()
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("./base.r1.log")  # logs ride along and are ignored
        tar.addfile(info, io.BytesIO(b""))
    trees = ab.load(str(archive))
    assert sorted(trees) == ["base", "next"]
    assert sorted(trees["next"][("prefill", "B1", "attnforge")]) == [9.0, 9.9, 30.0]
    assert ab.main(str(archive), "base") == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill")][0]
    assert "11.00" in line and "9.90" in line and "-10.0%" in line  # medians 11 and 9.9: one outlier round ignored


def test_trace_scripts_build_traced_modules_of_their_own():
    """benchmarks/trace_capture.build_traced: every module the kernel class builds carries trace=True
    under its own name (its own cache entry), so a trace never reuses an untraced cubin."""
    mod = load_trace_capture()
    from attnforge import AttentionSpec
    from attnforge.kernels.decode import DecodeKernel
    plain = DecodeKernel.module
    try:
        mod.build_traced(DecodeKernel)
        m = DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=8)).module()
        assert m.name.endswith("_trace") and m.context["trace"] is True and "af_trace" in m.source
    finally:
        DecodeKernel.module = plain
    assert "af_trace" not in DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=8)).module().source


def test_decode_trace_splits_the_tail_by_kind_of_cta():
    """benchmarks/trace_capture.exit_by_class: exits (ns) grouped by items run and whether the CTA merged."""
    import numpy as np
    mod = load_trace_capture()
    out = mod.exit_by_class(np.array([100_000, 110_000, 130_000, 131_000]), np.array([1, 1, 2, 1]),
                            np.array([False, False, True, True]))
    assert out == {"items 1 merged 0": {"ctas": 2, "mean": 105.0, "max": 110.0},
                   "items 1 merged 1": {"ctas": 1, "mean": 131.0, "max": 131.0},
                   "items 2 merged 1": {"ctas": 1, "mean": 130.0, "max": 130.0}}


def load_trace_capture():
    return load_benchmark("trace_capture")


def test_trace_scripts_save_json_only_when_asked(tmp_path, monkeypatch):
    mod = load_trace_capture()
    target = tmp_path / "t.json"
    monkeypatch.setattr("sys.argv", ["trace_decode.py"])
    mod.save_json_if_asked([{"case": "a"}])
    assert not target.exists()
    monkeypatch.setattr("sys.argv", ["trace_decode.py", "--json", str(target)])
    mod.save_json_if_asked([{"case": "a"}])
    assert json.loads(target.read_text()) == [{"case": "a"}]


def test_traced_kernels_compile(tmp_path):
    """The trace builds (trace=True) of the decode, Hopper prefill, Quest and MLA kernels compile for sm_90a:
    they are only built on the GPU machine, where a broken one would cost a device call."""
    from attnforge import AttentionSpec, codegen
    from attnforge.kernels.decode import DecodeKernel
    from attnforge.kernels.prefill import PrefillKernel
    from attnforge.kernels.quest import QuestScoreKernel
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc (CI has it)")
    from attnforge.kernels.mla import MLADecodeKernel
    mla = AttentionSpec(family="mla_decode", num_qo_heads=128, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    for m in (DecodeKernel(AttentionSpec(num_qo_heads=32, num_kv_heads=8)).module(),
              PrefillKernel(AttentionSpec(family="prefill", causal=True), "wgmma").module(),
              QuestScoreKernel("bf16", "int4", 128, 8, 4).module(),
              MLADecodeKernel(mla, None, None, "wgmma", "roles").module(),
              MLADecodeKernel(dataclasses.replace(mla, num_qo_heads=16), None, None, "mma", None).module(),
              MLADecodeKernel(dataclasses.replace(mla, num_qo_heads=16, pipeline="transposed"), backend="wgmma").module()):
        src = tmp_path / f"{m.name}.cu"
        src.write_text(dataclasses.replace(m, context={**m.context, "trace": True}).source)
        subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
                        f"-I{codegen.include_dir()}", "-o", str(tmp_path / "k.cubin"), str(src)],
                       check=True, capture_output=True)
        assert b"af_trace" in (tmp_path / "k.cubin").read_bytes(), f"{m.name}: the trace buffer was compiled out"
        if "roles" in m.name or "_es_" in m.name:  # per-tile stamps (trace_mla.summarize_tiles / _transposed_tiles)
            assert b"af_tile_trace" in (tmp_path / "k.cubin").read_bytes()
        assert "af_trace" not in m.source  # the untraced build carries none of it


def test_sdpa_peers_time_each_backend_and_note_a_refusal():
    """harness.time_sdpa_peers (the suites' cuDNN / FA2 peers): a row per backend that runs, a note for
    one that refuses the shape (here cuDNN on CPU tensors), and the call actually computes attention."""
    import torch
    from torch.nn.attention import SDPBackend
    harness = load_harness()
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)  # GQA 4/2
    outs = []

    def timer(fn, calls, reps):
        outs.append(fn())
        return 1.5

    report = harness.Report()
    harness.time_sdpa_peers(report, "s", "c", q, k, v, True, {"math": SDPBackend.MATH, "cudnn-sdpa":
                            SDPBackend.CUDNN_ATTENTION}, nbytes=1e6, timer=timer)
    assert [(r["impl"], r["us"]) for r in report.rows] == [("math", 1.5)]
    assert len(report.notes) == 1 and report.notes[0].startswith("cudnn-sdpa on c: ")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    assert torch.allclose(outs[0], ref, atol=1e-5)
    assert set(harness.sdpa_backends("cudnn-sdpa", "fa2-sdpa")) == {"cudnn-sdpa", "fa2-sdpa"}


def load_trace_quest():
    return load_benchmark("trace_quest")


def test_quest_trace_reads_the_stamp_layout():
    """benchmarks/trace_quest.py's readers on stamps laid out as templates/quest_score.cu.jinja and
    batch_decode.cu.jinja write them: times in us after the first query-sums CTA, the select's phases in
    cycles (a skipped pass shows as None), decode CTAs by kind. Importing it builds nothing traced."""
    import numpy as np
    from attnforge.kernels.quest import QuestScoreKernel
    plain = QuestScoreKernel.module
    mod = load_trace_quest()
    assert QuestScoreKernel.module is plain  # the traced builds start in main()
    qt = np.zeros((3, 4096, 16), dtype=np.int64)
    qt[0, :4, 0], qt[0, :4, 2] = 1000, [1500, 1500, 1500, 3900]  # query sums: entry, exit (ns)
    qt[0, 3, 4] = 2400  # the one CTA with rows: its first row's loads landed
    qt[1, :2, 0], qt[1, :2, 1], qt[1, :2, 2] = 1400, 4600, [21000, 22000]  # scoring: entry, wait's end, exit
    qt[1, :2, 3] = [5000, 5400]  # scoring: its first step's summaries used
    qt[2, :2, 0], qt[2, :2, 1], qt[2, :2, 2] = 20000, 22000, 28000  # select: entry, wait's end, exit
    qt[2, :2, 3:16] = 100 + np.cumsum(np.full(13, 50))  # select cycles: every stamp 50 apart
    qt[2, 1, 11:14] = 0  # request 1 skipped its third pass
    times = mod.quest_kernel_times(qt, 1000)
    assert times["qsplit"]["exit"] == {"min": 0.5, "median": 0.5, "max": 2.9}
    assert times["qsplit"]["rows_loaded"]["max"] == 1.4 and times["qsplit"]["rows_exit"]["max"] == 2.9
    assert times["score"]["first_step"] == {"min": 4.0, "median": 4.2, "max": 4.4}
    assert times["score"]["after_wait"]["max"] == 3.6 and times["score"]["exit"]["max"] == 21.0
    assert times["select"]["exit"]["median"] == 27.0
    phases = mod.select_phases(qt)
    assert phases["keys"] == 50.0 and phases["pass2 histogram | rank candidates"] == 50.0
    assert phases["entry_to_exit"] == 600.0
    stamps = mod.select_stamps(qt)  # per CTA, from its entry; a skipped phase reads -1
    assert stamps[0][:3] == [0, 50, 100] and stamps[1][8:11] == [-1, -1, -1] and stamps[1][12] == 600
    qt[2, 0, 11:14] = 0  # neither request ran a third pass (nor a rank)
    assert mod.select_phases(qt)["pass2 bin | rank"] is None
    dt = np.zeros(8 * 32 * 4096, dtype=np.int64)
    d = dt.reshape(-1, 32, 8)
    d[:4, 31, 6] = [21000, 21100, 21200, 29000]  # entries (ns): the last placed late
    d[:4, 31, 5] = [90000, 95000, 96000, 94000]  # exits
    d[:3, 0, :5] = [10, 20, 30, 40, 50]  # CTAs 0-2 ran an item (cycle stamps); CTA 3 found none
    d[1, 0, 5] = (7 << 32) | (1 << 16)  # CTA 1 merged, on SM 7
    dec = mod.decode_times(dt, 1000)
    assert dec["exit_by_kind_us"] == {"idle": {"ctas": 1, "mean": 93.0, "max": 93.0},
                                      "worked": {"ctas": 2, "mean": 92.0, "max": 95.0},
                                      "worked, merged": {"ctas": 1, "mean": 94.0, "max": 94.0}}
    assert dec["first_item_cycles_mean"]["tiles"] == 10.0 and dec["per_cta"]["sm"][1] == 7


def test_quest_suite_runs_the_head_layouts_the_environment_keeps(monkeypatch):
    monkeypatch.syspath_prepend(str(REPORT.parent))  # the suite imports harness as run.py does
    mod = load_benchmark("bench_quest")
    monkeypatch.delenv("ATTNFORGE_BENCH_QUEST_HEADS", raising=False)
    assert mod.head_layouts() == [(32, 32), (32, 8)]
    monkeypatch.setenv("ATTNFORGE_BENCH_QUEST_HEADS", "32/8")
    assert mod.head_layouts() == [(32, 8)]


def test_decode_sweep_takes_its_configurations_from_the_environment(monkeypatch):
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_decode_sweep")
    monkeypatch.delenv("ATTNFORGE_BENCH_SWEEP_CONFIGS", raising=False)
    assert mod.configs() == mod.CONFIGS
    monkeypatch.setenv("ATTNFORGE_BENCH_SWEEP_CONFIGS", "64x2x4,128x3x8")
    assert mod.configs() == [(64, 2, 4), (128, 3, 8)]


def test_decode_kernel_twin_changes_both_kernels_of_the_wrapper(monkeypatch):
    from attnforge import AttentionSpec
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_decode")
    monkeypatch.delenv("ATTNFORGE_BENCH_DECODE_KERNEL_TWIN", raising=False)
    assert mod.kernel_twin_changes() == {}
    monkeypatch.setenv("ATTNFORGE_BENCH_DECODE_KERNEL_TWIN", "warp_rows=False, qk_chains=1")
    changes = mod.kernel_twin_changes()
    assert changes == {"warp_rows": False, "qk_chains": 1}
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128)
    plain, twin = mod.BatchDecode.host_only(spec), mod.kernel_twin(changes).host_only(spec)
    assert (plain.kernel.warp_rows, plain.kernel.qk_chains) == (True, 2)
    assert (twin.kernel.warp_rows, twin.kernel.qk_chains) == (False, 1)
    assert twin._whole is not None and (twin._whole.warp_rows, twin._whole.qk_chains) == (False, 1)
    assert twin.kernel.module().source != plain.kernel.module().source


def test_mla_trace_reads_the_stamp_layout(monkeypatch):
    """benchmarks/trace_mla.summarize on stamps laid out as templates/mla_decode.cu.jinja writes them:
    two CTAs, one with two items (the second split), one that found no item."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_mla")
    t = np.zeros((3, mod.ITEMS, 8), dtype=np.int64)
    for cta, (entry, g0) in enumerate([(1000, 50_000), (2000, 50_400), (3000, 50_200)]):
        t[cta, 31, 7], t[cta, 31, 4], t[cta, 31, 6] = entry, entry + 100, g0
    sm5 = 5 << 32  # both busy CTAs on SM 5 (the SM id rides in the item's word 5, above bit 32)
    t[0, 0, :6] = [1200, 1700, 11700, 11800, 12000, 10 | sm5]  # 10 tiles: prologue 500, tiles 10000
    t[0, 1, :6] = [12000, 12300, 16300, 16400, 16700, 4 | 1 << 17 | sm5]  # split: 4 tiles, a partial state
    t[1, 0, :6] = [2300, 2900, 8900, 9000, 9300, 6 | sm5]
    t[0, 31, 5], t[1, 31, 5], t[2, 31, 5] = 50_000 + 7850, 50_400 + 3650, 50_210
    r = mod.summarize(t, 0.01)
    assert (r["ctas"], r["busy_ctas"], r["items"], r["split_items"]) == (3, 2, 3, 1)
    assert r["wait_cycles_median"] == 100 and r["entry_to_first_item_median"] == 250
    assert r["phase_mean_cycles"] == {"prologue": 1400 / 3, "tiles": 20000 / 3, "finish": 100.0, "write": 800 / 3,
                                      "write_stage": 0.0, "write_store": 0.0, "write_sync": 0.0}
    assert r["tile_median_cycles"] == 1000 and r["est_ghz_median"] == 2.0
    assert r["global_ns"] == {"entry_spread": 400.0, "exit_spread": 3800.0, "first_entry_to_last_exit": 7850.0,
                              "exit_by_busy_ctas_on_sm": {"2": [4050.0, 5950.0, 7470.0, 7850.0]}}
    t[1, 0, 5] = 6 | 7 << 32  # the second CTA on an SM of its own
    by = mod.summarize(t, 0.01)["global_ns"]["exit_by_busy_ctas_on_sm"]
    assert by == {"1": [4050.0, 5950.0, 7470.0, 7850.0]}
    t[0, 0, 6:8] = [11850, 11950]  # the staged write's stamps: staged at +50, stores issued at +150
    write = mod.summarize(t, 0.01)["phase_mean_cycles"]
    assert (write["write_stage"], write["write_store"], write["write_sync"]) == (50 / 3, 100 / 3, 50 / 3)


def test_mla_trace_reads_the_transposed_tile_stamps(monkeypatch):
    """trace_mla.summarize_transposed_tiles on the early-scores transposed kernel's per-tile stamps: one CTA of
    8 tiles taken every 1000 cycles after a slow fill (tile 1 at +3000), each computed in 600, its refills
    issued 1500 cycles before use, 200 after the stage came back."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_mla")
    tt = np.zeros((2, mod.TILES, 8), dtype=np.int64)
    took = np.array([1000, 4000, 5000, 6000, 7000, 8000, 9000, 10000])
    tt[0, :8, 0], tt[0, :8, 1] = took, took + 600
    tt[0, 2:8, 5] = took[2:] - 1500  # refills (t >= 2 stages)
    tt[0, 2:8, 4] = took[2:] - 1700
    r = mod.summarize_transposed_tiles(tt)
    assert r["tiles_per_cta_median"] == 8 and r["period_t0_t1"] == 3000 and r["period_t1_t2"] == 1000
    assert (r["period_steady"], r["compute_steady"], r["wait_next_steady"]) == (1000, 600, 400)
    assert (r["issue_to_use_steady"], r["copier_issue"], r["last_tile_compute"]) == (1500, 200, 600)
    assert mod.summarize_transposed_tiles(np.zeros((1, mod.TILES, 8), dtype=np.int64)) == {}


def test_mla_trace_pair_entry_gaps_and_kernel_fields(monkeypatch):
    """trace_mla.pair_entry_gaps: how far apart the CTAs of each side-by-side group entered (CTA c is
    side c % S), over groups whose CTAs all ran; harness.kernel_fields parses the twins' syntax."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_mla")
    t = np.zeros((5, mod.ITEMS, 8), dtype=np.int64)
    t[:, 31, 6] = [1000, 1300, 2000, 2000, 0]  # pairs (0, 1) and (2, 3); CTA 4 has no partner
    assert mod.pair_entry_gaps(t, 2) == {"groups": 2, "p50": 150.0, "p90": 270.0, "p100": 300.0}
    assert mod.pair_entry_gaps(t, 1) == {}
    t[3, 31, 6] = 0  # a pair with a CTA that never stamped: left out
    assert mod.pair_entry_gaps(t, 2)["groups"] == 1
    harness = load_benchmark("harness")  # (the suites' twin rows: bench_mla's, bench_prefill's, clocks_under_load's)
    fields = harness.kernel_fields
    assert fields("tma=True, roles_w0_dims=128") == {"tma": True, "roles_w0_dims": 128} and fields("") == {}
    monkeypatch.setenv("ATTNFORGE_TEST_TWINS", "pingpong=True, persistent=True;;num_stages=2")
    assert harness.kernel_twins("ATTNFORGE_TEST_TWINS") == [{"pingpong": True, "persistent": True}, {"num_stages": 2}]
    assert harness.kernel_twins("ATTNFORGE_TEST_TWINS_UNSET") == []
    assert mod.kernel_fields("producer=False") == {"producer": False}  # trace_mla --fields: the same syntax


def test_prefill_tile_trace_phases(monkeypatch):
    """trace_prefill.summarize_tile_stamps: per consumer warpgroup, each phase of the sampled tile from
    its six stamps (items whose tile was not sampled, all zeros, left out), and warpgroup 1's offset."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_prefill")
    from attnforge import AttentionSpec
    from attnforge.kernels.prefill import PrefillKernel
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True)
    assert "af_trace" not in PrefillKernel(spec, "wgmma").module().source, "importing it traced every kernel"
    st = np.zeros((3, 2, 8), dtype=np.int64)
    st[0, 0, :6] = [100, 1100, 1300, 1500, 1550, 2500]  # softmax 1000, pack 200, tile 200, turn 50, S 950
    st[0, 1, :6] = [-1000 + x for x in (1100, 2800, 2950, 3100, 3150, 4000)]  # 1000 cycles before wg 0
    st[1, 0, :6] = [10, 1010, 1210, 1410, 1460, 2410]
    got = mod.summarize_tile_stamps(st)
    assert got["wg0"] == {"tiles": 2, "softmax": 1000.0, "pv_wait_and_pack": 200.0, "tile_wait": 200.0,
                          "turn_wait": 50.0, "issue_and_s_wait": 950.0, "whole": 2400.0}
    assert got["wg1"]["tiles"] == 1 and got["wg1"]["softmax"] == 1700.0 and got["wg1"]["whole"] == 2900.0
    assert got["wg1_start_after_wg0"] == 0.0  # item 0 only: 100 against 100
    st[0, 1, 0] = 50
    assert mod.summarize_tile_stamps(st)["wg1_start_after_wg0"] == -50.0
    assert "k_wait" not in got["wg0"]  # no stamp between the waits (not a split ring with K ahead)
    st[:2, 0, 6] = [1420, 1230]  # K(t+1) landed 120 and 20 cycles into the tile wait, V(t) 80 and 180 after
    got = mod.summarize_tile_stamps(st)["wg0"]
    assert (got["k_wait"], got["v_wait"]) == (70.0, 130.0) and "k_wait" not in mod.summarize_tile_stamps(st)["wg1"]
    assert "k_issued_before_wait" not in got  # no producer stamps
    st[0, :, 7] = [300, 1200]  # K(t+1)'s copies issued 1000 cycles before warpgroup 0's wait, V(t)'s 100
    got = mod.summarize_tile_stamps(st)
    assert (got["wg0"]["k_issued_before_wait"], got["wg0"]["v_issued_before_wait"]) == (1000.0, 100.0)
    assert got["wg1"]["k_issued_before_wait"] == -1000 + 2950 - 300  # from its own wait's start


def test_prefill_cta_tail(monkeypatch):
    """trace_prefill.cta_tail: CTA ends measured from the first CTA's start (GPU-wide ns; CTAs that ran no
    item, all zeros, left out), and the share of CTA-time idle before the last one ends."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_prefill")
    got = mod.cta_tail(np.array([[1000, 5000], [1100, 6000], [0, 0], [1050, 9000]]))
    assert got["count"] == 3 and got["start_spread_us"] == 0.1
    assert got["end_us"]["first"] == 4.0 and got["end_us"]["last"] == 8.0 and got["end_us"]["median"] == 5.0
    assert abs(got["idle_tail_share"] - (1 - (4 + 5 + 8) / 3 / 8)) < 1e-12
    assert mod.cta_tail(np.zeros((4, 2), dtype=np.int64)) == {}


def test_sustained_prefill_rows_become_a_record(monkeypatch, tmp_path):
    """clocks_under_load.write_record: the suites' results format (suite prefill_sustained, time and
    TFLOP/s as measured), each row's clock, power and temperature as a note, and the method's note."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("clocks_under_load")
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda *a: "H200")
    monkeypatch.setattr(mod, "versions", lambda: {"torch": "t"})
    rows = [{"case": "B1 S8192", "impl": "attnforge", "us": 941.66, "tflops": 583.9, "sm_mhz": 1740.0, "watts": 688.9,
             "temp_c": 47.0, "samples": 96, "event_reasons": ["0x4"]}]
    mod.write_record(rows, str(tmp_path / "r.json"), 1.5, 2)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["rows"] == [{"suite": "prefill_sustained", "case": "B1 S8192", "impl": "attnforge", "us": 941.66,
                            "gbps": None, "tflops": 583.9}]
    assert got["notes"][0].startswith("B1 S8192 attnforge: 1740 MHz, 689 W, 47 C") and "1.5 s" in got["notes"][1]
    assert got["gpu"] == "H200" and got["versions"] == {"torch": "t"}


def test_sustained_prefill_rotation_takes_kernel_twins(monkeypatch):
    """clocks_under_load.impls: each ATTNFORGE_BENCH_PREFILL_TWINS entry becomes BatchPrefill arguments
    (harness.kernel_fields) and an `attnforge-twin<i>` row in the rotation, planned like the default."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("clocks_under_load")
    made = []

    class Wrapper:  # records what the rotation built; nothing is compiled or launched
        def __init__(self, spec, **kw):
            self.kw, self.planned = kw, None
            made.append(self)

        def plan(self, qo, kv):
            self.planned = (list(qo), list(kv))

        def run(self, q, kv):
            return self.kw

    monkeypatch.setattr(mod, "BatchPrefill", Wrapper)
    monkeypatch.setattr(mod.bp, "ragged", lambda lengths: ("q", "k", "v", [0, *lengths]))
    monkeypatch.setenv("ATTNFORGE_BENCH_PREFILL_TWINS", "pingpong=True,persistent=True;num_stages=2")
    fns = mod.impls("B1 S8192", [8192], only="attnforge")
    assert list(fns) == ["attnforge", "attnforge-twin0", "attnforge-twin1"]
    assert [f() for f in fns.values()] == [{}, {"pingpong": True, "persistent": True}, {"num_stages": 2}]
    assert all(w.planned == ([0, 8192], [0, 8192]) for w in made)


def test_mla_tile_trace_steps(monkeypatch):
    """benchmarks/trace_mla.summarize_tiles on af_tile_trace stamps as the roles schedule writes them:
    steps are measured within a tile and to the next one; tiles without a successor are not counted."""
    import numpy as np
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("trace_mla")
    t = np.zeros((2, mod.TILES, 8), dtype=np.int64)
    for tile in range(3):  # CTA 0: three tiles, 4000 cycles apart
        base = 10_000 + 4000 * tile
        t[0, tile] = [base, base + 1200, base + 1900, base + 2600, base + 100, base + 2000, base + 2700, base + 3100]
    t[1, 0] = [5] * 8  # CTA 1: one tile, no successor
    r = mod.summarize_tiles(t)
    assert r["tiles"] == 2
    assert r["median_cycles"] == {"period": 4000.0, "wg0_S": 1200.0, "wg0_softmax_P": 700.0, "wg0_PV": 700.0,
                                  "wg0_waits_tile": 1400.0, "wg1_waits_P": 1900.0, "wg1_PV": 700.0,
                                  "wg1_copies": 400.0, "wg1_to_next": 1000.0, "P_handoff": 100.0}
    assert mod.summarize_tiles(np.zeros((1, mod.TILES, 8), dtype=np.int64)) == {}  # an mma.sync kernel: none



def test_mla_kernel_twins_parse_field_sets(monkeypatch):
    """ATTNFORGE_BENCH_MLA_KERNEL_TWINS: one attnforge-twin<i> row per set of MLADecodeKernel fields, each
    a kernel of its own (here h128's roles kernel with Q and P from shared memory, and 16 Q steps)."""
    from attnforge import AttentionSpec
    from attnforge.kernels.mla import MLADecodeKernel
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_mla")
    monkeypatch.delenv("ATTNFORGE_BENCH_MLA_KERNEL_TWINS", raising=False)
    assert mod.kernel_twins() == []
    monkeypatch.setenv("ATTNFORGE_BENCH_MLA_KERNEL_TWINS", "roles_q_steps=0, roles_pv_rs=False;roles_q_steps=16")
    twins = mod.kernel_twins()
    assert twins == [{"roles_q_steps": 0, "roles_pv_rs": False}, {"roles_q_steps": 16}]
    spec = AttentionSpec(family="mla_decode", num_qo_heads=128, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    sources = {MLADecodeKernel(spec, backend="wgmma", **fields).module().source for fields in [{}] + twins}
    assert len(sources) == 3


def test_mla_rows_env_keeps_only_the_named_rows(monkeypatch):
    """ATTNFORGE_BENCH_MLA_ROWS: an A/B round times only the rows it names (and, set, skips the RMSE kernels)."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_mla")
    rows = [("attnforge", 1), ("attnforge-pdl", 2), ("attnforge-twin0", 3)]
    monkeypatch.delenv("ATTNFORGE_BENCH_MLA_ROWS", raising=False)
    assert mod.selected_rows(rows) == rows
    monkeypatch.setenv("ATTNFORGE_BENCH_MLA_ROWS", "attnforge, attnforge-twin0")
    assert mod.selected_rows(rows) == [("attnforge", 1), ("attnforge-twin0", 3)]


def test_mla_shapes_env_adds_batch_shapes_at_16_heads(monkeypatch):
    """ATTNFORGE_BENCH_MLA_SHAPES: batch shapes at 16 heads beside the suite's (the crossover of the
    transposed kernel on long batches), selectable by ATTNFORGE_BENCH_MLA_CASES like any other."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_mla")
    monkeypatch.delenv("ATTNFORGE_BENCH_MLA_SHAPES", raising=False)
    monkeypatch.delenv("ATTNFORGE_BENCH_MLA_CASES", raising=False)
    plain = mod.cases()
    monkeypatch.setenv("ATTNFORGE_BENCH_MLA_SHAPES", "B8 L32768, B32 L16384")
    assert mod.cases() == plain + [("h16 B8 L32768", 16, 8, 32768), ("h16 B32 L16384", 16, 32, 16384)]
    monkeypatch.setenv("ATTNFORGE_BENCH_MLA_CASES", "h16 B32 L16384")
    assert mod.cases() == [("h16 B32 L16384", 16, 32, 16384)]


def test_mla_q_len_env_names_the_cases_and_checks_its_range(monkeypatch):
    """ATTNFORGE_BENCH_MLA_Q_LEN: every case with that many query tokens a request, named "<case> q<n>"
    (one token keeps the record's names); outside 1..4 it fails before any GPU work."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_mla")
    monkeypatch.delenv("ATTNFORGE_BENCH_MLA_Q_LEN", raising=False)
    assert mod.query_tokens() == 1 and mod.case_name("h16 B64 L8192", 1) == "h16 B64 L8192"
    monkeypatch.setenv("ATTNFORGE_BENCH_MLA_Q_LEN", "2")
    assert mod.query_tokens() == 2 and mod.case_name("h16 B64 L8192", 2) == "h16 B64 L8192 q2"
    for bad in ("5", "0", "two"):
        monkeypatch.setenv("ATTNFORGE_BENCH_MLA_Q_LEN", bad)
        with pytest.raises(ValueError, match=f"expected 1..4 query tokens a request, got '{bad}'; set it"):
            mod.query_tokens()


def test_mla_twin_rows_take_their_field_sets(monkeypatch):
    """bench_mla.twin_fields: each twin row's MLADecodeKernel fields (the default kernel's twins, the wgmma
    transposed kernel's twins, the one-warpgroup row); the rest take none."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_mla")
    twins, t_twins = [{"tma": True}, {"roles_q_steps": 4}], [{"kpe_batched": True}]
    assert mod.twin_fields("attnforge-twin1", twins, t_twins) == {"roles_q_steps": 4}
    assert mod.twin_fields("attnforge-wgmma-transposed-twin0", twins, t_twins) == {"kpe_batched": True}
    assert mod.twin_fields("attnforge-wgmma-transposed-1wg", twins, t_twins) == {"producer": False}
    assert mod.twin_fields("attnforge-wgmma-transposed", twins, t_twins) is None
    assert mod.twin_fields("attnforge", twins, t_twins) is None


def test_sustained_split_dims_cases_are_the_suites(monkeypatch):
    """clocks_under_load --split-dims: suite prefill_split_dims's cases under its names, with the FLOPs that suite
    counts (2 (192 + 128) a head a visible pair, causal half), built lazily (no tensor before its turn)."""
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("clocks_under_load")
    suite = load_benchmark("bench_prefill_split_dims")
    got = mod.split_dims_cases()
    assert [c for c, _, _ in got] == [f"d192x128 h{h} B{b} S{n}" for h, b, n in suite.CASES]
    for (_, flops, make), (h, b, n) in zip(got, suite.CASES):
        assert flops == b * 2 * (192 + 128) * h * n * (n + 1) / 2 and callable(make)


def test_verify_suite_cases_and_the_environment_subset(monkeypatch):
    monkeypatch.syspath_prepend(str(REPORT.parent))
    mod = load_benchmark("bench_verify")
    monkeypatch.delenv("ATTNFORGE_BENCH_VERIFY_CASES", raising=False)
    every = mod.cases()
    assert [c[0] for c in every] == ["B64 q4 L4096", "B16 q8 L8192", "B128 q2 L2048", "B32 q4 Lrand",
                                     "B64 q4 L4096 fp8kv"]
    for name, q_len, lengths, kv_dtype in every:
        assert ("fp8" in name) == (kv_dtype == "fp8_e4m3")
        batch = int(name.split()[0][1:])
        assert len(lengths) == batch and f"q{q_len}" in name and min(lengths) >= q_len
    assert mod.cases()[3][2] == every[3][2], "the random lengths are seeded"
    monkeypatch.setenv("ATTNFORGE_BENCH_VERIFY_CASES", "B16 q8 L8192,B32 q4 Lrand")
    assert [c[0] for c in mod.cases()] == ["B16 q8 L8192", "B32 q4 Lrand"]

"""Timing and reporting shared by every benchmark suite.

Timing: warm up, capture `calls` invocations in one CUDA graph, replay it, and take the median of
CUDA-event times over `reps` replays (divided by `calls`). Inputs should exceed the 60 MB L2 (or be
rotated by the caller) so every call reads from HBM. Variants of one case that are compared with each
other (our kernels' options) go through time_interleaved: timed in rotation, not one after another.
Output: one JSON format for all suites:
  {"gpu", "date", "versions", "rows": [{"suite", "case", "impl", "us", "gbps", "tflops"}]}
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

L2_BYTES = 60 * 2**20


def prepare(fn: Callable[[], object], calls: int = 5, use_graph: bool = True) -> Callable[[], None]:
    """Warm fn up and return a callable running it `calls` times: one CUDA-graph replay, or a loop."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if use_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = graph.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    run()
    torch.cuda.synchronize()
    return run


def time_run(run: Callable[[], None], calls: int) -> float:
    """One timed run (CUDA events), in microseconds per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def fresh_allocator() -> None:
    """Free what earlier cases left in torch's caching allocator, so a case's inputs get new segments as in a
    fresh process. Carved from a larger case's freed blocks, the same decode kernel read 10% slower for its whole
    timing (head_dims h32/4 right after the MHA case and its cuDNN peer: 77.4 us, 69.8-70.8 in every other
    place; forty-eighth session, call 3)."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def host_us(fn: Callable[..., object], *args, calls: int = 2000, warmup: int = 50) -> float:
    """Host wall time a call of fn(*args) over `calls` back-to-back calls (GPU synchronised around the loop),
    after `warmup` calls (which also compile, or record a graph, where fn does): for calls whose host side sets
    the pace."""
    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / calls


def time_us(fn: Callable[[], object], calls: int = 5, reps: int = 20, use_graph: bool = True) -> float:
    """time_interleaved of one variant: the same method (and gap or settling) as a rotation's rows."""
    return time_interleaved({"fn": fn}, calls, reps, use_graph)["fn"]


# A suite's timing method (timing_method() sets it; the environment's knobs, where set, win over it)
_METHOD = {"gap_s": 0.0, "settle_s": 0.0}

# Compute-bound suites (prefill, mods): under the 700 W cap a rotation with a kernel that draws more power a
# clock lowers the next one's clock; a 0.1 s idle gap before each timed run gave the ratios of sustained 2 s
# windows within 1% (ninety-seventh session, H100: fa3 +6.0% at B1 S32768 against +5.9% sustained; +18% without)
COMPUTE_BOUND_GAP_S = 0.1


@contextlib.contextmanager
def timing_method(gap_s: float = 0.0, settle_s: float = 0.0):
    """Within the block, time_interleaved and time_us default to this gap / settling (time_interleaved's
    arguments say what each does); ATTNFORGE_BENCH_GAP_S / ATTNFORGE_BENCH_SETTLE_S, where set, still win."""
    before = dict(_METHOD)
    _METHOD.update(gap_s=gap_s, settle_s=settle_s)
    try:
        yield
    finally:
        _METHOD.update(before)


def compute_bound_suite(run: Callable) -> Callable:
    """A suite's run(report, peers) with every row timed after an idle gap (COMPUTE_BOUND_GAP_S) and a note
    naming the method: compute-bound under a power cap, a rotation hands each kernel its predecessor's clock."""
    @functools.wraps(run)
    def gapped(report: "Report", peers: bool = True) -> None:
        with timing_method(gap_s=COMPUTE_BOUND_GAP_S):
            report.note(method_note())
            run(report, peers)
    return gapped


def method_in_force() -> tuple[float, float]:
    """(gap_s, settle_s): the environment's knobs where set, else timing_method()'s."""
    return (env_seconds("ATTNFORGE_BENCH_GAP_S", _METHOD["gap_s"]),
            env_seconds("ATTNFORGE_BENCH_SETTLE_S", _METHOD["settle_s"]))


def method_note() -> str:
    """The timing method in force, for a suite's notes."""
    gap, settle_for = method_in_force()
    parts = ([f"{gap:g} s of idle GPU before each timed run"] if gap else []) + \
        ([f"{settle_for:g} s of the variant's own untimed replays before each timed run"] if settle_for else [])
    return "timing: " + ("; ".join(parts) if parts else "timed runs back to back, no gap, no settling")


def time_interleaved(fns: dict, calls: int = 5, reps: int = 20, use_graph: bool = True,
                     timer: Optional[Callable[[Callable[[], None]], float]] = None,
                     prepare_fn: Optional[Callable] = None, settle_s: Optional[float] = None,
                     gap_s: Optional[float] = None) -> dict:
    """Median time per call of several variants of one case, timed in rotation: repetition r runs
    them starting from variant r mod n, so drift during the run (clocks, what the L2 holds, the
    previous variant's tail) falls on every variant alike instead of on whichever was timed first.
    Timed one after another, the same paged prefill case once ranked two launch orders both ways.
    Under a power cap a variant still starts at the clock the one before it left (a rotation with a
    higher-power kernel lowers the others' clocks); two ways to start each timed run from a state of its
    own (defaults: timing_method()'s, both off outside one; the environment's, where set, win):
      settle_s (ATTNFORGE_BENCH_SETTLE_S): first replay that variant back to back, untimed, for about this
        many seconds, so it is timed at the clock its own load settles to (as clocks_under_load.py);
      gap_s (ATTNFORGE_BENCH_GAP_S): first leave the GPU idle this long, so every variant starts from the
        clock an idle GPU returns to (as a peer timed alone)."""
    gap_in_force, settle_in_force = method_in_force()
    settle_s = settle_in_force if settle_s is None else settle_s
    gap_s = gap_in_force if gap_s is None else gap_s
    runs = {name: (prepare_fn or prepare)(fn, calls, use_graph) for name, fn in fns.items()}
    timer = timer or (lambda run: time_run(run, calls))
    names, times = list(runs), {name: [] for name in runs}
    for r in range(reps):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if settle_s > 0:
                settle(runs[name], settle_s)
            if gap_s > 0:
                torch.cuda.synchronize()
                time.sleep(gap_s)
            times[name].append(timer(runs[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def time_poisoned_outputs(report: "Report", suite: str, case: str, fns: dict, like: torch.Tensor,
                          nbytes: int) -> dict:
    """Times fns (impl -> f(out)) in rotation (time_interleaved), each writing its own NaN-poisoned output shaped
    like `like`, adds their rows, and notes how far each output is from the first impl's and how many values it
    left unwritten (poison: a row never written shows as NaN). Returns the outputs."""
    outs = {impl: torch.full_like(like, float("nan")) for impl in fns}
    runs = {impl: (lambda f=f, o=outs[impl]: f(o)) for impl, f in fns.items()}
    for impl, us in time_interleaved(runs).items():
        report.add(suite, case, impl, us, nbytes)
    first_impl = next(iter(fns))
    first = outs[first_impl].float()
    for impl, out in outs.items():
        report.note(f"{suite} {case} {impl}: differs from {first_impl} by at most "
                    f"{(out.float() - first).abs().max().item():.2e}, {int(out.isnan().sum())} values unwritten")
    return outs


def env_seconds(name: str, default: float = 0.0) -> float:
    """A duration knob of the timing method, in seconds (unset or empty: `default`)."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value > 60.0:
        raise ValueError(f"{name}: expected seconds from 0 to 60, got {text!r}; unset it for none")
    return value


def settle(run: Callable[[], None], seconds: float) -> None:
    """Replay `run` back to back for about `seconds`, untimed: one replay measures its length, then enough
    replays to fill the rest are queued at once, so the GPU never idles between them (a sync after each would
    let the clock recover in the gaps)."""
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - start, 1e-6)
    for _ in range(max(0, round(seconds / one) - 1)):
        run()
    torch.cuda.synchronize()


def flashinfer_workspace(device="cuda") -> torch.Tensor:
    """A FlashInfer wrapper's float workspace (256 MB, as FlashInfer's examples size it); one may serve several
    wrappers that run in turn."""
    return torch.empty(256 << 20, dtype=torch.uint8, device=device)


def kernel_fields(text: str) -> dict:
    """Kernel fields from ','-separated field=value (Python literals), e.g. "tma=True,roles_q_steps=4": the
    suites' twin rows (the default kernel with these fields changed, timed in rotation beside it)."""
    pairs = (item.split("=", 1) for item in filter(None, (x.strip() for x in text.split(","))))
    return {k.strip(): ast.literal_eval(v.strip()) for k, v in pairs}


def kernel_twins(env_var: str) -> list[dict]:
    """The twin rows an environment variable asks for: ';'-separated sets of kernel_fields, e.g.
    ATTNFORGE_BENCH_PREFILL_TWINS="pingpong=True,persistent=True;num_stages=2" (row attnforge-twin<i> is
    set i); unset or empty, none."""
    return [kernel_fields(x) for x in filter(None, os.environ.get(env_var, "").split(";"))]


def time_sdpa_peers(report: "Report", suite: str, case: str, q, k, v, causal: bool, backends: dict,
                    nbytes: Optional[float] = None, flops: Optional[float] = None, calls: int = 5, reps: int = 20,
                    timer: Optional[Callable] = None) -> None:
    """torch SDPA on q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D] (GQA) under each backend of `backends`
    ({impl name: SDPBackend}), one row each; a backend that refuses the shape is a note, not a failure."""
    from torch.nn.attention import sdpa_kernel
    timer = timer or time_us
    for impl, backend in backends.items():
        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        try:
            report.add(suite, case, impl, timer(fn, calls=calls, reps=reps), nbytes, flops)
        except Exception as e:
            report.note(f"{impl} on {case}: {type(e).__name__}: {str(e)[:120]}")


def sdpa_backends(*names: str) -> dict:
    """{"cudnn-sdpa": SDPBackend.CUDNN_ATTENTION, "fa2-sdpa": SDPBackend.FLASH_ATTENTION} restricted to names."""
    from torch.nn.attention import SDPBackend
    known = {"cudnn-sdpa": SDPBackend.CUDNN_ATTENTION, "fa2-sdpa": SDPBackend.FLASH_ATTENTION}
    return {n: known[n] for n in names}


class Report:
    """Rows and notes of one run. With `autosave` (path, versions), the file is rewritten each time a
    case is complete, so a run cut short by a time limit keeps every case it finished."""

    def __init__(self, autosave: Optional[tuple] = None):
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.autosave = autosave

    def add(self, suite: str, case: str, impl: str, us: float, nbytes: Optional[float] = None,
            flops: Optional[float] = None) -> None:
        if self.autosave and self.rows and (self.rows[-1]["suite"], self.rows[-1]["case"]) != (suite, case):
            self.write(*self.autosave)  # the previous case is complete
        row = {"suite": suite, "case": case, "impl": impl, "us": round(us, 2),
               "gbps": round(nbytes / us / 1e3, 1) if nbytes else None,
               "tflops": round(flops / us / 1e6, 1) if flops else None}
        self.rows.append(row)
        print(f"{suite:8s} {case:28s} {impl:24s} {us:10.1f} us  "
              f"{'' if row['gbps'] is None else str(row['gbps']) + ' GB/s'}"
              f"{'' if row['tflops'] is None else ' ' + str(row['tflops']) + ' TFLOP/s'}", flush=True)

    def note(self, text: str) -> None:
        print("note:", text, flush=True)
        self.notes.append(text)

    def write(self, path: Path, versions: dict) -> None:
        data = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                "versions": versions, "rows": self.rows, "notes": self.notes}
        Path(path).write_text(json.dumps(data, indent=1))


def standalone(run: Callable, argv: list[str]) -> None:
    """A suite file run as a script: `python bench_x.py [--out X.json] [case names...]` calls run(report,
    names=...) with the cases named (all where none are), saving the JSON after each case where --out is given."""
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    report = Report(autosave=(Path(out_path), versions()) if out_path else None)
    run(report, names=tuple(a for a in argv if a not in ("--out", out_path)))
    if out_path:
        report.write(*report.autosave)


def versions() -> dict:
    import attnforge
    from attnforge.jit import arch
    v = {"attnforge": attnforge.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
         "nvcc": arch.nvcc_version()}
    try:
        import cuda.bindings
        v["cuda-bindings"] = cuda.bindings.__version__
    except Exception:  # reported as missing rather than failing the run
        v["cuda-bindings"] = "missing"
    try:
        import flashinfer
        v["flashinfer"] = flashinfer.__version__
    except Exception:
        v["flashinfer"] = "missing"
    return v

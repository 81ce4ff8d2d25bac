"""Sustained prefill: each kernel run back to back for a few seconds while nvidia-smi samples the SM
clock and the board power, so a throughput gap can be split into clock (power or heat) and work.

The suite's timings replay 2-5 calls at a time between idle gaps, so a kernel that would throttle the
GPU over a long prefill can look faster there than under a server's steady load. Here each impl runs
`--seconds` at a time, in rotation (A B A B ...), and a row reports its sustained TFLOP/s with the
median SM clock and power over its windows (the first 0.3 s of each, the ramp, dropped).

    python benchmarks/clocks_under_load.py [--cases "B1 S32768,ragged 16 random 128-8192"]
        [--seconds 2] [--rounds 2] [--split-dims] [--out clocks.json]
    (--split-dims: suite prefill_split_dims's 192/128 cases instead; --out: the suites' results format, suite
    `prefill_sustained`, for `python benchmarks/report.py merge clocks.json`)

Needs nvidia-smi on PATH; FlashInfer's fa3 joins where it imports (PYTHONPATH=.anchors/flashinfer).
ATTNFORGE_BENCH_PREFILL_TWINS (as in bench_prefill: "pingpong=True;num_stages=2") adds an
`attnforge-twin<i>` row per kernel choice to the rotation, so a change is judged under the power cap too.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

import bench_prefill as bp
from attnforge import AttentionSpec, BatchPrefill
from harness import Report, kernel_twins, prepare, versions

QUERY = "clocks.sm,power.draw,temperature.gpu"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer drivers' name first
RAMP_S = 0.3  # samples this soon after an impl starts belong to the switch, not to it
SUITE = "prefill_sustained"


class Sampler:
    """nvidia-smi in loop mode; each line stamped with the host clock when it arrived."""

    def __init__(self, period_ms: int = 25):
        self.rows: list[tuple[float, list[str]]] = []
        query = QUERY
        for field in REASONS:  # the bitmask of why the clock is below its maximum, if this driver names it
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY},{field}", "--format=csv,noheader"],
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                query = f"{QUERY},{field}"
                break
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.rows.append((time.time(), [x.strip() for x in line.split(",")]))

    def window(self, t0: float, t1: float) -> list[list[str]]:
        return [r for t, r in self.rows if t0 + RAMP_S <= t <= t1]

    def stop(self):
        self.proc.terminate()


def impls(case: str, lengths: list[int], only: str = "") -> dict:
    """{name: fn} for one case of suite prefill: attnforge's default, and fa3 where FlashInfer imports (only:
    that one)."""
    q, k, v, indptr = bp.ragged(lengths)
    spec = AttentionSpec(family="prefill", num_qo_heads=bp.HQ, num_kv_heads=bp.HKV, head_dim_qk=bp.D, causal=True)
    return impls_of(case, spec, q, k, v, indptr, only)


def split_dims_cases() -> list:
    """Suite prefill_split_dims's cases (keys 192 wide, values 128, MHA): [(case, flops, impls thunk)]."""
    from bench_prefill_split_dims import CASES, DQK, DVO
    out = []
    for h, b, n in CASES:
        def make(h=h, b=b, n=n):
            q, k = (torch.randn(b * n, h, DQK, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(b * n, h, DVO, device="cuda", dtype=torch.bfloat16)
            spec = AttentionSpec(family="prefill", num_qo_heads=h, num_kv_heads=h, head_dim_qk=DQK, head_dim_vo=DVO,
                                 causal=True)
            return impls_of(f"d{DQK}x{DVO} h{h} B{b} S{n}", spec, q, k, v, [b_ * n for b_ in range(b + 1)])
        out.append((f"d{DQK}x{DVO} h{h} B{b} S{n}", b * 2 * (DQK + DVO) * h * n * (n + 1) / 2, make))
    return out


def impls_of(case: str, spec: AttentionSpec, q, k, v, indptr, only: str = "") -> dict:
    """{name: fn}: attnforge's default for the spec, its twins, and fa3 on the same ragged q, k, v."""
    w = BatchPrefill(spec)
    w.plan(indptr, indptr)
    out = {"attnforge": lambda: w.run(q, (k, v))}
    for i, fields in enumerate(kernel_twins("ATTNFORGE_BENCH_PREFILL_TWINS")):
        twin = BatchPrefill(spec, **fields)
        twin.plan(indptr, indptr)
        out[f"attnforge-twin{i}"] = lambda twin=twin: twin.run(q, (k, v))
    if only == "attnforge":
        return out
    try:
        import flashinfer
        fw = bp.flashinfer_ragged_wrapper(flashinfer, "fa3", indptr, q.shape[1], k.shape[1], k.shape[2], v.shape[2])
        out["flashinfer-fa3"] = lambda: fw.run(q, k, v)
    except Exception as e:  # noqa: BLE001 - a missing peer leaves attnforge's row
        print(f"fa3 unavailable on {case}: {type(e).__name__}: {str(e)[:120]}")
    return out


def sustain(run, seconds: float, calls: int) -> tuple[float, float, float]:
    """Replay `run` (calls kernels each) until `seconds` pass; (host start, host end, us per call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, n = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        run()
        n += 1
        if n % 8 == 0:  # keep the queue short, so the host clock tracks the GPU's
            end.record()
            end.synchronize()
    end.record()
    end.synchronize()
    return t0, time.time(), start.elapsed_time(end) * 1000.0 / (n * calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="B1 S8192,B1 S32768,B16 S2048,ragged 16 random 128-8192")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--split-dims", action="store_true", help="suite prefill_split_dims's 192/128 cases instead")
    a = ap.parse_args()
    wanted = a.cases.split(",")
    sampler = Sampler()
    rows = []
    todo = split_dims_cases() if a.split_dims else [
        (case, bp.causal_flops(lengths), lambda case=case, lengths=lengths: impls(case, lengths))
        for case, lengths in bp.cases() if case in wanted and "paged" not in case]
    for case, flops, make in todo:
        runs = {name: prepare(fn, 2) for name, fn in make().items()}
        got = {name: {"us": [], "mhz": [], "w": [], "temp": [], "reasons": set()} for name in runs}
        for r in range(a.rounds):
            names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
            for name in names:
                t0, t1, us = sustain(runs[name], a.seconds, 2)
                g = got[name]
                g["us"].append(us)
                for mhz, watts, temp, *reasons in sampler.window(t0, t1):
                    g["mhz"].append(float(mhz))
                    g["w"].append(float(watts))
                    g["temp"].append(float(temp))
                    g["reasons"].update(reasons)
        for name, g in got.items():
            med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
            row = {"case": case, "impl": name, "us": med(g["us"]), "tflops": flops / med(g["us"]) / 1e6,
                   "sm_mhz": med(g["mhz"]), "watts": med(g["w"]), "temp_c": med(g["temp"]),
                   "samples": len(g["mhz"]), "event_reasons": sorted(g["reasons"])}
            rows.append(row)
            print(f"{case:28s} {name:16s} {row['us']:9.1f} us {row['tflops']:6.1f} TFLOP/s  "
                  f"{row['sm_mhz']:6.0f} MHz {row['watts']:6.1f} W {row['temp_c']:4.0f} C  "
                  f"n={row['samples']} reasons={row['event_reasons']}", flush=True)
    sampler.stop()
    if a.out:
        write_record(rows, a.out, a.seconds, a.rounds)


def write_record(rows: list[dict], path: str, seconds: float, rounds: int) -> None:
    """The results format of every suite (harness.Report), suite `prefill_sustained`; each row's clock,
    power and temperature become a note (the table keeps time and TFLOP/s)."""
    report = Report()
    for r in rows:
        report.add(SUITE, r["case"], r["impl"], r["us"], None, r["tflops"] * r["us"] * 1e6)
        report.note(f"{r['case']} {r['impl']}: {r['sm_mhz']:.0f} MHz, {r['watts']:.0f} W, {r['temp_c']:.0f} C "
                    f"(medians of {r['samples']} samples; clock event reasons {', '.join(r['event_reasons'])})")
    report.note(f"each impl ran {seconds:g} s at a time, {rounds} rounds in rotation; the first {RAMP_S:g} s of each "
                f"window dropped; us is the mean over the windows' calls, median over rounds")
    report.write(Path(path), versions())


if __name__ == "__main__":
    main()

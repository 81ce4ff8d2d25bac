"""Render docs/benchmarks/README.md (tables) and decode.svg / prefill.svg (bar charts) from a results
JSON (default docs/benchmarks/h200.json). No plotting library needed: the SVG is written by hand."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is a folder of scripts, not a package
import targets  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def table(rows, suite):
    rows = [r for r in rows if r["suite"] == suite]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(r["case"], r["impl"]): r for r in rows}

    def fmt(r):
        if r is None:
            return "–"
        extra = [f"{r['gbps']:.0f} GB/s"] if r.get("gbps") else []
        extra += [f"{r['tflops']:.0f} TFLOP/s"] if r.get("tflops") else []
        return f"{r['us']:.1f} µs" + "".join(f"<br>{e}" for e in extra)
    out = ["| case | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
    out += [f"| {c} | " + " | ".join(fmt(cell.get((c, i))) for i in impls) + " |" for c in cases]
    return "\n".join(out)


def svg_bars(rows, suite, metric, title, path):
    rows = [r for r in rows if r["suite"] == suite and r.get(metric)]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i not in ("attnforge-normal",)]
    cell = {(r["case"], r["impl"]): r[metric] for r in rows}
    top = max(cell.values()) * 1.1
    w_case, bar, h, left, bottom = 95, 95 // (len(impls) + 1), 320, 60, 90
    width = left + w_case * len(cases) + 180
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + bottom + 40}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="18" font-size="14">{title}</text>']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = 30 + h - frac * h
        parts.append(f'<line x1="{left}" x2="{left + w_case * len(cases)}" y1="{y}" y2="{y}" stroke="#ddd"/>'
                     f'<text x="{left - 5}" y="{y + 4}" text-anchor="end">{top * frac:.0f}</text>')
    for ci, case in enumerate(cases):
        x0 = left + ci * w_case + 5
        for ii, impl in enumerate(impls):
            v = cell.get((case, impl))
            if v is None:
                continue
            bh = v / top * h
            parts.append(f'<rect x="{x0 + ii * bar}" y="{30 + h - bh:.1f}" width="{bar - 1}" height="{bh:.1f}" '
                         f'fill="{COLORS[ii % len(COLORS)]}"><title>{impl}: {v}</title></rect>')
        parts.append(f'<text transform="translate({x0 + 10},{30 + h + 12}) rotate(35)">{case}</text>')
    for ii, impl in enumerate(impls):
        y = 40 + ii * 16
        x = left + w_case * len(cases) + 15
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{COLORS[ii % len(COLORS)]}"/>'
                     f'<text x="{x + 15}" y="{y}">{impl}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def _stale_note(base: dict, new: dict):
    """A predicate for the record's notes that a newer run replaces: the older edition of a note the run
    writes again (the same text but for its numbers, e.g. an accuracy RMSE or a kernel's clock) about
    suites the run re-measured whole. Hand-written notes, and notes about cases it did not measure, stay."""
    def shape(text: str) -> str:
        return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", text)
    measured = {(r["suite"], r["case"]) for r in new["rows"]}
    whole = {s for s in {r["suite"] for r in new["rows"]}
             if all((r["suite"], r["case"]) in measured for r in base["rows"] if r["suite"] == s)}
    rewritten = {shape(n) for n in new.get("notes", [])}

    def stale(note: str) -> bool:
        m = re.fullmatch(r"\[([^\]]+)\] (.*)", note, re.S)
        return bool(m) and set(m.group(1).split(", ")) <= whole and shape(m.group(2)) in rewritten
    return stale


def merge(*sources: str, into: str = str(DOCS / "h200.json")) -> int:
    """Replace the record's rows of every (suite, case) a newer results file measured (all of that
    case's implementations: peers are only compared within one run); keep the rest. Each source's
    notes are kept, prefixed with the suites it measured (once: not again where the record holds the
    same note); its versions update the record's, except
    a peer it reports missing (a run without peers) over one the record knows."""
    base = json.loads(Path(into).read_text())
    for src in sources:
        new = json.loads(Path(src).read_text())
        suites = sorted({r["suite"] for r in new["rows"]})
        cases = {(r["suite"], r["case"]) for r in new["rows"]}
        stale = _stale_note(base, new)
        base["rows"] = [r for r in base["rows"] if (r["suite"], r["case"]) not in cases] + new["rows"]
        kept = [n for n in base.get("notes", []) if not stale(n)]
        # (a run of some cases writes the suite's notes again: an identical note is kept once)
        base["notes"] = kept + [n for n in (f"[{', '.join(suites)}] {n}" for n in new.get("notes", []))
                                if n not in kept]
        # a run without the peers reports them "missing": that does not unmeasure the rows kept
        base["versions"].update({k: v for k, v in new["versions"].items()
                                 if v != "missing" or k not in base["versions"]})
        base["date"] = max(base["date"], new["date"])
    Path(into).write_text(json.dumps(base, indent=1))
    return 0


def main(src: str = str(DOCS / "h200.json")) -> int:
    data = json.loads(Path(src).read_text())
    rows = data["rows"]
    svg_bars(rows, "decode", "gbps", "Batch decode, GQA 32/8, d128, bf16 (GB/s of KV read)", DOCS / "decode.svg")
    svg_bars(rows, "prefill", "tflops", "Prefill, causal, GQA 32/8, d128, bf16 (TFLOP/s)", DOCS / "prefill.svg")
    if any(r["suite"] == "mla" for r in rows):
        svg_bars(rows, "mla", "gbps", "MLA decode, 576/512, bf16, page 64 (GB/s of latent cache read)", DOCS / "mla.svg")
    v = data["versions"]
    lines = [
        "# Benchmarks on the H200",
        "",
        f"GPU: {data['gpu']} (132 SMs, HBM3e). Date: {data['date']}. Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "Method (`benchmarks/harness.py`): warm-up, 5 calls (prefill: 2) captured in one CUDA graph, median over 20 "
        "(prefill: 10) replays timed with CUDA events, divided by the calls. Decode data are several times the "
        "60 MB L2 (prefill, compute-bound, reads 100 MB and more); the first two merge cases read about 67 MB, so L2 may "
        "serve part of them. Peers ran in the same process on the same inputs: cuDNN and FlashAttention-2 through torch SDPA, "
        "FlexAttention (torch.compile), FlashInfer 0.2.14 (JIT, sm_90a). Decode GB/s counts the KV bytes read "
        "(fp8: bytes actually read); prefill TFLOP/s count the causal half. `attnforge` is the default pipeline for "
        "the shape; `attnforge-normal` / `attnforge-transposed` force one. MLA GB/s counts the latent cache read once "
        "(576 x 2 bytes per token) and TFLOP/s 2 x (576 + 512) FLOPs per head per token; Quest GB/s counts what each "
        "path must read (dense: all K and V; Quest: every page summary plus the selected pages' K and V); cascade GB/s "
        "the prefix once plus every request's own tokens. Regenerate with "
        "`python benchmarks/run.py --out docs/benchmarks/h200.json` on the GPU (or `bash tools/gpu_session.sh`, which "
        "runs the GPU tests and every suite in one call), then `python benchmarks/report.py`; "
        "`python benchmarks/report.py merge new.json` replaces only the (suite, case) pairs a partial run measured. "
        "Where each suite's rows came from (date, device call, code) and what changed since: the notes at the end. "
        "Since the ninety-seventh session the prefill and mods suites time every row after a 0.1 s idle gap, so that "
        "under the 700 W cap no kernel inherits the clock of the one before it (`docs/measuring.md`); a run so timed "
        "says so in a `timing:` note, and rows without one were timed back to back in rotation.",
        "",
        "## The issues' targets against this record",
        "",
        "Generated from the rows below (`benchmarks/targets.py`). The best peer is the fastest row not ours in the "
        "same case, on the target's measure (for a modifier's cost, the peer's own cost of the same modifier, where "
        "the suite timed the peer without and with it). The read ceiling is the `roofline` suite's fastest "
        "kernel that only reads, at the case's byte count: a bandwidth target above it asks more than a pure read gets.",
        "",
        targets.table(rows),
        "",
    ]
    titles = {"decode": "Batch decode (suite `decode`)",
              "decode_fp8_groups": "fp8 KV decode, groups of 9-16 and MQA (suite `decode_fp8_groups`)",
              "merge": "merge_states (suite `merge`)",
              "prefill": "Prefill (suite `prefill`)",
              "prefill_sustained": "Prefill under sustained load (`benchmarks/clocks_under_load.py`)",
              "prefill_copies": "K/V tile copies in prefill (suite `prefill_copies`)", "mods": "Score modifiers (suite `mods`)",
              "mla": "MLA decode (suite `mla`)", "quest": "Quest sparse decode (suite `quest`)",
              "cascade": "Shared-prefix cascade (suite `cascade`)", "vmm": "VirtualKVCache decode (suite `vmm`)",
              "head_dims": "Head dims 64, 128, 256 and head layouts (suite `head_dims`)",
              "append": "Writing new tokens into the KV cache (suite `append`)",
              "append_sizes": "The append's two kernels by size (suite `append_sizes`)",
              "prefill_split_dims": "Prefill, keys wider than values: 192/128 (suite `prefill_split_dims`)",
              "verify": "Speculative decoding's verification step (suite `verify`)",
              "verify_fp8_rows": "fp8 verify items over two m16 tiles (suite `verify_fp8_rows`)",
              "verify_fp8_widen": "fp8 verify on the normal pipeline: widened in shared memory or registers "
                                  "(suite `verify_fp8_widen`)",
              "verify_fp8_split": "fp8 verify items past 16 rows: normal, or split by heads (suite `verify_fp8_split`)",
              "roofline": "The read roofline: a kernel that only streams its bytes (suite `roofline`)",
              "compile": "Decode under torch.compile (suite `compile`: host time a call, then device time)",
              "host": "Host time of eager calls (suite `host`)"}
    for suite, title in titles.items():
        if any(r["suite"] == suite for r in rows):
            lines += [f"## {title}", ""]
            if suite in ("decode", "prefill", "mla"):
                lines += [f"![{suite}]({suite}.svg)", ""]
            lines += [table(rows, suite), ""]
    if data.get("notes"):  # after the tables: where each record came from, and what changed since
        lines += ["## Notes from the runs", ""] + [f"- {n}" for n in data["notes"]] + [""]
    (DOCS / "README.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":  # report.py [results.json] | report.py merge new.json [more.json ...]
    if sys.argv[1:2] == ["merge"]:
        sys.exit(merge(*sys.argv[2:]) or main())
    sys.exit(main(*sys.argv[1:]))

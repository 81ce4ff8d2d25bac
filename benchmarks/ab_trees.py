"""A/B of source trees on one GPU: each round runs the suites once per tree, in a fresh process per
tree and a rotated order, then the table gives each row's median over the rounds and the change
against the first tree. Clocks and the L2's state drift within a call; rotation spreads the drift
over every tree instead of charging it to whichever ran first.

    python benchmarks/ab_trees.py --trees main=abtrees/main,new=. --suites quest --rounds 3 --out ab/
    python benchmarks/ab_trees.py --compare ab/      # the table again, from the saved rounds

Each tree is a checkout of the package (its own templates and headers, so its own cache entries);
benchmarks/run.py of the tree runs with --no-peers unless --peers. Environment variables pass
through (e.g. ATTNFORGE_BENCH_DECODE_CASES).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_rounds(trees: dict, suites: str, rounds: int, out: Path, peers: bool, deadline_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names, t0 = list(trees), time.time()
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if time.time() - t0 > deadline_s:
                print(f"deadline reached before round {r} of {name}", flush=True)
                return
            tree = Path(trees[name]).resolve()
            cmd = [sys.executable, "benchmarks/run.py", "--suites", suites, "--out", str(out / f"{name}.r{r}.json")]
            env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            started = time.time()
            res = subprocess.run(cmd + ([] if peers else ["--no-peers"]), cwd=tree, env=env, capture_output=True,
                                 text=True)
            (out / f"{name}.r{r}.log").write_text(res.stdout + res.stderr)
            print(f"round {r} {name}: rc {res.returncode}, {time.time() - started:.0f} s", flush=True)


def compare(out: Path, names: list) -> str:
    """Rows: suite | case | impl | each tree's median us (rounds) | change vs the first tree."""
    times: dict = {}
    for f in sorted(out.glob("*.r*.json")):
        name = f.name.split(".r")[0]
        for row in json.loads(f.read_text())["rows"]:
            if row.get("us") is not None:
                times.setdefault((row["suite"], row["case"], row["impl"]), {}).setdefault(name, []).append(row["us"])
    names = names or sorted({n for v in times.values() for n in v})
    lines = ["| suite | case | impl | " + " | ".join(names) + " | " + " | ".join(f"{n} vs {names[0]}" for n in names[1:]) + " |",
             "|" + "---|" * (3 + 2 * len(names) - 1)]
    for key, by in times.items():
        med = {n: statistics.median(by[n]) for n in names if n in by}
        cells = [f"{med[n]:.2f} ({len(by[n])})" if n in med else "-" for n in names]
        base = med.get(names[0])
        diffs = [f"{100 * (med[n] / base - 1):+.2f}%" if base and n in med else "-" for n in names[1:]]
        lines.append("| " + " | ".join([*key, *cells, *diffs]) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", help="name=path,name=path (the first is the baseline)")
    ap.add_argument("--suites", default="quest")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="ab")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds: start no run after this")
    ap.add_argument("--compare", help="a saved --out folder: print its table")
    args = ap.parse_args()
    if args.compare:
        print(compare(Path(args.compare), []))
        return 0
    trees = dict(kv.split("=", 1) for kv in args.trees.split(","))
    run_rounds(trees, args.suites, args.rounds, Path(args.out), args.peers, args.deadline)
    table = compare(Path(args.out), list(trees))
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python benchmarks/run.py [--suites merge,decode] [--no-peers] [--out results.json]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, versions  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suites", default="merge,decode")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--out", default="bench.json")
    args = ap.parse_args()
    report = Report(autosave=(Path(args.out), versions()))
    for suite in args.suites.split(","):  # results are written after every case and every suite
        mod = __import__(f"bench_{suite}")
        try:
            mod.run(report, peers=not args.no_peers) if suite != "merge" else mod.run(report)
        except Exception as e:  # keep what was measured so far
            import traceback
            traceback.print_exc()
            report.note(f"suite {suite} stopped: {type(e).__name__}: {e}")
        report.write(*report.autosave)
    return 0


if __name__ == "__main__":
    sys.exit(main())

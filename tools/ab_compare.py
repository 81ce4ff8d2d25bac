"""Compare an A/B archive from tools/ab_bench.sh: per (suite, case, impl), each tree's median time over
its rounds, and each tree's change against the first tree named on the command line.

python tools/ab_compare.py ab.tgz [base-name]
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import tarfile
from collections import defaultdict


def load(archive: str) -> dict[str, dict[tuple, list[float]]]:
    """{tree: {(suite, case, impl): [us per round]}}"""
    trees: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            m = re.fullmatch(r"(?:\./)?(.+)\.r\d+\.json", member.name)
            if not m:
                continue
            for row in json.load(tar.extractfile(member))["rows"]:
                if row.get("us") is not None:
                    trees[m.group(1)][(row["suite"], row["case"], row["impl"])].append(row["us"])
    return trees


def main(archive: str, base: str | None = None) -> int:
    trees = load(archive)
    if not trees:
        print(f"no name.rN.json results in {archive}")
        return 1
    base = base or sorted(trees)[0]
    others = [t for t in sorted(trees) if t != base]
    print(f"{'suite':8} {'case':34} {'impl':26} {base:>10} " + " ".join(f"{t:>18}" for t in others))
    for key in sorted(trees[base]):
        b = statistics.median(trees[base][key])
        cells = []
        for t in others:
            if key in trees[t]:
                v = statistics.median(trees[t][key])
                cells.append(f"{v:10.2f} {100 * (v / b - 1):+6.1f}%")
            else:
                cells.append(f"{'-':>18}")
        print(f"{key[0]:8} {key[1][:34]:34} {key[2][:26]:26} {b:10.2f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""Racecheck's reports (analysis mode) grouped into classes, each known class named, a new one flagged:

    compute-sanitizer --tool racecheck ... > race.log 2>&1; python3 tools/racecheck_summary.py race.log [...]

A class is (access, function) of a report's first access and of the access it races with, function names without
templates, arguments or offsets: `store_staged_rows` for every instantiation of it. Exit status 1 when a class is
not in KNOWN, so a new kernel's hazards stand apart from the ones already read (docs/measuring.md)."""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

# The eighty-sixth session's reproducer (tools/racecheck_subset_barrier.cu) drew the same report classes from a kernel
# whose every pair of accesses a __syncthreads orders, once it also used a named barrier's arrive or an mbarrier.
TOOL_ACROSS_SYNCTHREADS = ("MLA transposed producer kernel: across __syncthreads, the tool's (its barrier epochs lose "
                           "track beside bar.arrive / mbarriers: the reproducer reports them too; eighty-sixth session)")

# Classes already read, with what they are (docs/perf-notes.md)
KNOWN = {
    ("Read", "roles_pv_tile", "Write", "roles_scores_tile"):
        "MLA roles kernel: red_max read before its bar.arrive, written after the other side's bar.sync "
        "(ordered by the named barrier's arrive, which racecheck does not model; ninth session)",
    ("Read", "store_staged_rows", "Write", "cp_async_16_at"):
        TOOL_ACROSS_SYNCTHREADS,
    ("Read", "store_staged_rows", "Write", "write_output"):
        TOOL_ACROSS_SYNCTHREADS,
    ("Write", "cp_async_16_at", "Read", "store_staged_rows"):
        TOOL_ACROSS_SYNCTHREADS,
}

_FIRST = re.compile(r"Race reported between (Read|Write) access at (.*)")
_OTHER = re.compile(r"^=+\s+and (Read|Write) access at (.*)")


def function_name(where: str) -> str:
    """'void store_staged_rows<float, ...>(...)+0x2b60 in kernel.cu:633' -> 'store_staged_rows'."""
    where = re.sub(r"^(void|static|inline)\s+", "", where.strip())
    name = re.split(r"[<(+\s]", where, maxsplit=1)[0]
    return name.rsplit("::", 1)[-1]


def classes(text: str) -> Counter:
    """Each report's (first access, its function, the other access, its function) pairs, counted once a report."""
    found: Counter = Counter()
    first = None
    seen: set = set()
    for line in text.splitlines():
        m = _FIRST.search(line)
        if m:
            first, seen = (m.group(1), function_name(m.group(2))), set()
            continue
        m = _OTHER.search(line)
        if m and first is not None:
            key = first + (m.group(1), function_name(m.group(2)))
            if key not in seen:
                seen.add(key)
                found[key] += 1
        elif not line.strip(" =") and first is not None:
            first = None  # a blank report line ends the report
    return found


def main(paths: list[str]) -> int:
    missing = [p for p in paths if not Path(p).is_file()]
    if not paths or missing:
        raise SystemExit(f"racecheck_summary.py: expected racecheck logs, got {missing or 'none'}; "
                         "pass the files compute-sanitizer --tool racecheck wrote")
    new = 0
    for path in paths:
        with open(path, errors="replace") as f:
            found = classes(f.read())
        print(f"{path}: {len(found)} classes (count: the reports that hold each)")
        for key, n in found.most_common():
            known = KNOWN.get(key)
            new += known is None
            print(f"  {n:4d}  {key[0]} {key[1]} / {key[2]} {key[3]}: {known or 'NEW'}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

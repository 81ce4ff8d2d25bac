"""Summarize ncu's per-instruction source page (`ncu -i rep --page source --csv --print-source sass`):
the instructions holding the most warp-stall samples, each with its nonzero stall reasons.

    python tools/stall_summary.py source.csv [top]
"""
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int = 40) -> None:
    rows = list(csv.reader(open(path, errors="replace")))
    at = next(i for i, r in enumerate(rows) if any(c.strip().startswith("Source") for c in r))
    header, body = rows[at], rows[at + 1:]
    samples = next(j for j, c in enumerate(header) if "Sampling (All" in c)
    source = next(j for j, c in enumerate(header) if c.strip().startswith("Source"))
    reasons = [j for j, c in enumerate(header) if c.startswith("stall_") and "Not Issued" not in c]
    body = [r for r in body if len(r) > max(samples, source)]
    total = sum(number(r[samples]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples")
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        why = ", ".join(f"{header[j][6:]} {r[j]}" for j in reasons if number(r[j]) > 0)
        print(f"{number(r[samples]):7.0f} {100 * number(r[samples]) / total:5.1f}%  {r[source].strip()[:72]:72s} {why}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))

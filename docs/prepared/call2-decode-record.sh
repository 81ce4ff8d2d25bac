#!/usr/bin/env bash
# The next device session's second call (carry .anchors): suite `decode` re-recorded with its peers (FlashInfer
# beside), as the seventy-sixth session left it (state item 0 of docs/perf-notes.md). Then, on this machine:
#   python3 benchmarks/report.py merge <files_at>/decode.json && python3 benchmarks/report.py
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
timeout 585 python3 benchmarks/run.py --suites decode --out "$OUT/decode.json" 2>&1 | grep -v "^attnforge:" \
  > "$OUT/bench.log"
grep -E "^decode" "$OUT/bench.log" | tail -n 60
echo "done at $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Suites `plan` (decode's `plan B256` row) and `host` (the prefill plan row) with their peers, on an H200 only (the
# record's rows are the H200's), when plan() or a run's host path changes. Carry .anchors (FlashInfer):
#   bash docs/prepared/call4-plan-host-record.sh     (on the GPU machine, repo root; logs and JSON under $OUT)
# SUITES (default "plan host") adds others, e.g. SUITES="plan host cascade"; START, a caller's start (date +%s).
# Each suite writes its own JSON, so a call cut short keeps the first. Then, on this machine, for each file:
#   python3 benchmarks/report.py merge <files_at>/<suite>.json && python3 benchmarks/report.py
set -u
start=${START:-$(date +%s)}  # (a caller that ran tests first passes its own start: the call's 600 s are shared)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt" | grep -q H200 || { echo "not an H200"; exit 0; }
for suite in ${SUITES:-plan host}; do
  PYTHONPATH=$PWD:$PWD/.anchors/flashinfer timeout $(( 570 - ($(date +%s) - start) )) python3 benchmarks/run.py \
    --suites $suite --out "$OUT/$suite.json" 2>&1 | grep -v "^attnforge:" > "$OUT/$suite.log"
  tail -n 20 "$OUT/$suite.log"
  echo "$suite done at $(( $(date +%s) - start )) s"
done

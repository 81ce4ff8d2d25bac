#!/usr/bin/env bash
# Suites `plan` (decode's `plan B256` row) and `host` (the prefill plan row) with their peers, on an H200 only (the
# record's rows are the H200's): plan()'s host time changed in the eighty-eighth session. Carry .anchors (FlashInfer):
#   bash docs/prepared/call4-plan-host-record.sh     (on the GPU machine, repo root; logs and JSON under $OUT)
# Then, on this machine: python3 benchmarks/report.py merge <files_at>/plan_host.json && python3 benchmarks/report.py
set -u
start=$(date +%s)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt" | grep -q H200 || { echo "not an H200"; exit 0; }
PYTHONPATH=$PWD:$PWD/.anchors/flashinfer timeout 570 python3 benchmarks/run.py \
  --suites plan,host --out "$OUT/plan_host.json" 2>&1 | grep -v "^attnforge:" > "$OUT/bench.log"
tail -n 40 "$OUT/bench.log"
echo "done at $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The prefill GPU tests of soft-cap and the running max, then suites `prefill` and `mods` re-recorded (carry
# .anchors): FlashInfer runs in our rotation, and mods has each peer's own cost of a modifier (perf-notes,
# ninety-third section). The record's rows are an H200's, so off an H200 it stops after the tests, unless CASES
# names prefill cases to check the suite's code on (not a record):
#   bash docs/prepared/call5-prefill-mods-record.sh                      (on the GPU machine, repo root)
#   CASES="B16 S2048,B1 S8192 paged16" bash docs/prepared/call5-prefill-mods-record.sh      (any GPU)
#   TESTS=0 SUITES=mods bash docs/prepared/call5-prefill-mods-record.sh       (no tests; one suite)
# Both suites time every row after a 0.1 s idle gap (harness.COMPUTE_BOUND_GAP_S). On an H100 (ninety-seventh
# session) four FlashInfer builds took 179 s, prefill 200 s and mods over 190 s: one suite a call.
# Then, on this machine, for each JSON: python3 benchmarks/report.py merge <files_at>/<suite>.json, and
# python3 benchmarks/report.py.
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
suites="${SUITES:-prefill mods}"
if ! grep -q H200 "$OUT/gpu.txt"; then
  suites=""; [ -n "${CASES:-}" ] && { export ATTNFORGE_BENCH_PREFILL_CASES="$CASES"; suites=prefill; }
fi
# FlashInfer builds a module per (backend, mode) at first use, minutes each for fa3: all at once, beside the GPU
# tests
# (prefill alone needs the two plain ones: 8 jobs each, ~80 s against ~180 s for four)
modes=("fa2 plain" "fa3 plain"); jobs=8
[[ "$suites" == *mods* ]] && { modes+=("fa2 alibi" "fa3 softcap"); jobs=4; }
if [ -n "$suites" ]; then
  for m in "${modes[@]}"; do
    MAX_JOBS=$jobs python3 benchmarks/bench_mods.py prebuild $m > "$OUT/prebuild-${m/ /-}.log" 2>&1 &
  done
fi
if [ "${TESTS:-1}" != 0 ]; then  # TESTS=0: the suites alone (their tests ran on this code already)
  timeout 300 python3 -m pytest -q -m gpu tests/test_prefill_gpu.py \
    -k "soft_cap or scaled_cores or row_max" > "$OUT/tests.log" 2>&1
  grep -E "passed|failed" "$OUT/tests.log" | tail -n 1; grep -E "^(FAILED|ERROR)" "$OUT/tests.log"
fi
wait
[ -n "$suites" ] || { echo "not an H200 and no CASES: nothing to record"; exit 0; }
tail -qn 1 "$OUT"/prebuild-*.log; echo "FlashInfer built at $(( $(date +%s) - start )) s"
for suite in $suites; do
  MAX_JOBS=16 timeout $(( 585 - ($(date +%s) - start) )) python3 benchmarks/run.py --suites $suite \
    --out "$OUT/$suite.json" 2>&1 | grep -v "^attnforge:" > "$OUT/$suite.log"
  grep -E "^$suite " "$OUT/$suite.log" | tail -n 40
  echo "$suite done at $(( $(date +%s) - start )) s"
done
python3 -c "
import json, sys
for f in sys.argv[1:]:
    for n in json.load(open(f)).get('notes', []): print('note:', n)
" "$OUT"/*.json

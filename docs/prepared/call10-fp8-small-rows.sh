#!/usr/bin/env bash
# fp8 items of 9-16 rows: the transposed default against the normal pipeline widened in registers (the default past
# 16 rows since the 113th session, which read g4 q4 7.8% faster on it than on the transposed default). Suite
# verify_fp8_widen's four cases of 9-16 rows (g4 q4, g8 q2, g16 q1 = plain decode at group 16, g4 q3 = 12 rows)
# and one past 16 rows (g8 q4) as the reference, in rotation; and g7 q7, g9 q6 (49 and 54 rows), whose kernels widened
# in registers spill 40-80 bytes at 3 CTAs an SM (stored once, reloaded in the main loop; shared-memory pass: 2 CTAs).
# Any GPU (~150 s with the builds). No carry. If the normal rows lead on every 16-row case, prepare spec_for_rows'
# fp8 threshold change; if smem-widen leads on g7 q7 or g9 q6, bound the default (perf-notes, Next steps 0).
#   bash docs/prepared/call10-fp8-small-rows.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/tests ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 benchmarks/bench_verify_fp8_widen.py --out "$OUT/verify_fp8_widen.json" \
  "g4 q4" "g8 q2" "g16 q1" "g4 q3" "g8 q4" "g7 q7" "g9 q6" > "$OUT/bench.log" 2>&1
echo "bench_verify_fp8_widen rc=$? at $(( $(date +%s) - start )) s"
grep -E " us |differs|x [0-9]+ CTAs" "$OUT/bench.log"

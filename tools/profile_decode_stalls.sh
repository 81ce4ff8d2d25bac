#!/usr/bin/env bash
# One device call: where batch decode's warps stall, instruction by instruction (ncu SourceCounters on
# benchmarks/profile_decode.py; the cubins carry -lineinfo). Writes the warp states and the top stalled
# instructions (tools/stall_summary.py) to $OUT. Usage: [ARGS=fp8] bash tools/profile_decode_stalls.sh
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --kernel-name batch_decode_kernel --launch-skip 3 --launch-count 1 \
  --section WarpStateStats --section SourceCounters -o /tmp/decode_stalls -f \
  python3 benchmarks/profile_decode.py ${ARGS:-} > "$OUT/ncu_run.log" 2>&1
ncu -i /tmp/decode_stalls.ncu-rep --section WarpStateStats --print-details all > "$OUT/warp_states.txt" 2>&1
ncu -i /tmp/decode_stalls.ncu-rep --page source --csv --print-source sass > /tmp/decode_sass.csv 2>> "$OUT/ncu_run.log"
python3 tools/stall_summary.py /tmp/decode_sass.csv 60 > "$OUT/stalls_sass.txt" 2>&1
# the same page with CUDA source lines beside the SASS (-lineinfo), to name the lines behind the top stalls
ncu -i /tmp/decode_stalls.ncu-rep --page source --csv --print-source cuda,sass > "$OUT/source_cuda_sass.csv" 2>> "$OUT/ncu_run.log" \
  || echo "cuda,sass source page not available in this ncu" >> "$OUT/ncu_run.log"
tail -n 25 "$OUT/warp_states.txt"; head -n 30 "$OUT/stalls_sass.txt"

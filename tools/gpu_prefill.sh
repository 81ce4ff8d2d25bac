#!/usr/bin/env bash
# One device call for prefill work: its GPU tests, SASS of the Hopper kernel, ncu, and the suite.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -rfE -p no:cacheprovider ${TESTS:-tests/test_prefill_gpu.py} 2>&1 | tail -n 80 > "$OUT/pytest.log"
tail -n 25 "$OUT/pytest.log"
f=$(ls -d $ATTNFORGE_CACHE_DIR/*/*/90a/prefill_wgmma_g4_d128_bf16_outbf16_causal_s3-* 2>/dev/null | head -1)
if [ -z "$f" ]; then python3 benchmarks/profile_prefill.py; f=$(ls -d $ATTNFORGE_CACHE_DIR/*/*/90a/prefill_wgmma_g4_d128_bf16_outbf16_causal_s3-* | head -1); fi
cuobjdump -sass "$f/kernel.cubin" > "$OUT/sass.txt" 2>&1; echo "HGMMA in SASS: $(grep -c HGMMA "$OUT/sass.txt")"
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 150 ncu --clock-control none --kernel-name batch_prefill_wgmma_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis python3 benchmarks/profile_prefill.py > "$OUT/ncu.log" 2>&1
  grep -vE "^==PROF==|^\s*$" "$OUT/ncu.log" | tail -n 100 > "$OUT/ncu.txt"
fi
export PYTHONPATH=$PWD/.anchors/flashinfer:$PYTHONPATH
ATTNFORGE_BENCH_PREFILL_ABLATION=${ATTNFORGE_BENCH_PREFILL_ABLATION:-128:3:ws,128:3:ws:pp} timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/run.py --suites ${SUITES:-prefill} --out "$OUT/bench.json" 2>&1 | tail -n 40 > "$OUT/bench.log"
cat "$OUT/bench.log"

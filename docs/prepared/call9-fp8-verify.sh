#!/usr/bin/env bash
# fp8 verify items over two m16 tiles held to 168 registers (111th session, 5a6e7e3; never run on a GPU): the
# verify GPU tests, the GPU fuzz's verify draws that loaded those shapes (seeds 1448, 1461, 1594, 1600; like every
# GPU test on Hopper they now fail on an OccupancyWarning), suite verify_fp8_rows (the five shapes at 3 CTAs an SM
# against the same kernel at 2), then memcheck on the fp8 verify tests. Any GPU (~300 s with the builds). No carry.
#   bash docs/prepared/call9-fp8-verify.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/tests ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_decode_verify_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "verify tests rc=$? at $(( $(date +%s) - start )) s"; tail -n 2 "$OUT/pytest.log"
ATTNFORGE_TEST_FUZZ_SEEDS=1435:1610 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/test_fuzz_gpu.py -k "random_verify and (1448 or 1461 or 1594 or 1600)" > "$OUT/fuzz.log" 2>&1
echo "fuzz rc=$?"; tail -n 2 "$OUT/fuzz.log"
timeout 90 python3 benchmarks/bench_verify_fp8_rows.py --out "$OUT/verify_fp8_rows.json" > "$OUT/bench.log" 2>&1
echo "bench_verify_fp8_rows rc=$?"; grep -E "us|differ" "$OUT/bench.log" | tail -n 15
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 --show-backtrace device \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_verify_gpu.py -k fp8 > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 3
echo "done at $(( $(date +%s) - start )) s"

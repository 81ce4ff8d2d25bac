#!/usr/bin/env bash
# fp8 on the normal pipeline widened in registers (DecodeKernel.normal_widen_in_registers, 112th session; never
# run on a GPU): its GPU test first (a failure stops the call before any timing), then suite verify_fp8_widen (the
# shared-memory widening against the option, in rotation), then fp8-normal-widen-default.patch applied (the option
# as the default past 16 rows an item) and, on it, the verify GPU tests, the GPU fuzz's verify draws at new seeds
# and memcheck on the fp8 verify tests. Any GPU (~450 s with the builds). No carry. Merge the patch only if the
# suite shows the option ahead.
#   bash docs/prepared/call10-fp8-widen.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/tests ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
NEW=tests/test_decode_verify_gpu.py::test_fp8_normal_pipeline_widened_in_registers
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "$NEW" > "$OUT/new.log" 2>&1
rc=$?; echo "new test rc=$rc at $(( $(date +%s) - start )) s"; tail -n 12 "$OUT/new.log"
[ "$rc" = 0 ] || exit 1
timeout 100 python3 benchmarks/bench_verify_fp8_widen.py --out "$OUT/verify_fp8_widen.json" > "$OUT/bench.log" 2>&1
echo "bench_verify_fp8_widen rc=$? at $(( $(date +%s) - start )) s"; grep -E " us |differs" "$OUT/bench.log" | tail -n 70
git apply docs/prepared/fp8-normal-widen-default.patch || { echo "the patch does not apply"; exit 1; }
timeout 160 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_decode_verify_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "verify tests (patched) rc=$? at $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/pytest.log"
ATTNFORGE_TEST_FUZZ_SEEDS=1760:1835 timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/test_fuzz_gpu.py -k random_verify > "$OUT/fuzz.log" 2>&1
echo "verify fuzz (patched) rc=$? at $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/fuzz.log"
timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 --show-backtrace device \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_verify_gpu.py -k fp8 > "$OUT/memcheck.log" 2>&1
echo "memcheck (patched) rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 3
git apply -R docs/prepared/fp8-normal-widen-default.patch
echo "done at $(( $(date +%s) - start )) s"

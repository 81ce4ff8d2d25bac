#!/usr/bin/env bash
# The 115th session's default: fp8 items of 9-16 rows at d128 (groups 9-16 and 16-head items at one token, verify
# steps of 9-16 rows) on the normal pipeline widened in registers, where the transposed kernel ran them (7.7-8.2%
# faster at B64 L4096, 35.6% on GQA 256/8's 16-head items; call10, H100). This call runs:
#   1. every GPU test in 14 groups on it (no sanitizer: the budget; ~330 s on a cold H100);
#   2. suite verify_fp8_widen where the default keeps the transposed kernel's whole-item plans: 128/8 at one token on
#      B16 L16384 (one item an SM) and B1 L131072 (8 items x 16 chunks), 32/8 at 4 tokens on B16 L16384, against the
#      normal kernel's split plan; and 128/8 at one token on B64 L4096 (now normal by default).
# Any GPU. No carry. Then: if the split plan leads where the transposed whole-item kernel runs, drop those tilings
# for d128 (kernels.decode.FP8_SIXTEEN_ROW_WHOLE_ITEM_TILING).
#   bash docs/prepared/call11-fp8-sixteen-rows-default.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
# DECODE_ONLY=1: the GPU test files that run decode kernels only (578 of 2402 tests), for a short budget
paths=""
[ "${DECODE_ONLY:-0}" = 1 ] && paths="tests/test_decode_gpu.py tests/test_decode_verify_gpu.py tests/test_fuzz_gpu.py
  tests/test_cascade.py tests/test_quest_gpu.py tests/test_quest_heads_gpu.py tests/test_ops_gpu.py
  tests/test_load_kernels_gpu.py tests/test_empty_batches_gpu.py tests/test_streams_gpu.py tests/test_merge_gpu.py
  tests/mods/test_mods_decode_gpu.py tests/test_softmax_invariants_gpu.py"
TEST_GROUPS="$(python3 tools/gpu_test_groups.py 14 $paths)" BENCH=0 SASS=0 SANITIZE=0 TEST_TIMEOUT=${TEST_TIMEOUT:-340} \
  bash tools/gpu_session.sh > "$OUT/session.log" 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
grep -hE '[0-9]+ (passed|failed)' "$OUT/pytest.log"; grep -hE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
export PYTHONPATH=$PWD:$PWD/tests MAX_JOBS=16
timeout 200 python3 benchmarks/bench_verify_fp8_widen.py --out "$OUT/verify_fp8_widen.json" \
  "g16 q1 B16" "g16 q1 B1" "g4 q4 B16" "g16 q1" > "$OUT/bench.log" 2>&1
echo "bench_verify_fp8_widen rc=$? at $(( $(date +%s) - start )) s"
grep -E " us |differs|x [0-9]+ CTAs|Error" "$OUT/bench.log"

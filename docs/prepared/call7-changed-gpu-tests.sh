#!/usr/bin/env bash
# For a session whose device budget runs low (a machine's start plus ~300 s): only the GPU tests of what changed
# after b4ee18a, the last code `pytest -m gpu` passed on (bool / byte tables, attention's attn_mask and dropout_p,
# the every_operation cases, the random modifier draws, Flex's positional call and return_aux), then memcheck on
# the prefill ones. No carry needed.
#   bash docs/prepared/call7-changed-gpu-tests.sh   (on the GPU machine, repo root; logs under $OUT)
# Superseded by call1-every-gpu-test.sh whenever that one fits.
set -u
start=$(date +%s)
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
CHANGED="every_operation or attn_mask or bool_and_byte or flex_call or attention- or random_decode or random_prefill"
CHANGED="$CHANGED or random_mla"
timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_gpu.py \
  tests/test_decode_gpu.py tests/test_mla_gpu.py tests/test_input_fuzz_gpu.py tests/test_fuzz_gpu.py \
  -k "$CHANGED" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"
tail -n 3 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
left=$(( ${TOTAL_S:-290} - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
  timeout "$left" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 --show-backtrace device \
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_gpu.py \
    -k "attn_mask or bool_and_byte or flex_call or every_operation" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 3
fi
echo "done at $(( $(date +%s) - start )) s"

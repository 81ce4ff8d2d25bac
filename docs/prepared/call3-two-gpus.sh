#!/usr/bin/env bash
# A call on two GPUs (kind nvidia-h100-x2 or nvidia-h200-x2; no carry needed): the two-GPU tests, which skip on one
# GPU and have never run, with the worker-thread tests beside them. Logs under $OUT.
#   bash docs/prepared/call3-two-gpus.sh      (on the GPU machine, repo root)
set -u
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=32 PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 540 python3 -m pytest -q -p no:cacheprovider --tb=short -rA tests/test_multi_gpu.py tests/test_threads_gpu.py \
  > "$OUT/two_gpus.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/two_gpus.log" | tail -30
grep -A30 "^___" "$OUT/two_gpus.log" | head -150

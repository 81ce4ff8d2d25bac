#!/usr/bin/env bash
# The next device session's first call (one `run`, carry .anchors): every GPU test in 14 balanced groups with
# memcheck beside them.
#   bash docs/prepared/call1-every-gpu-test.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
TEST_GROUPS="$(python3 tools/gpu_test_groups.py 14)" BENCH=0 SASS=0 SANITIZE=1 SANITIZE_PARALLEL=1 \
  SANITIZE_TIMEOUT=440 TEST_TIMEOUT=380 bash tools/gpu_session.sh > "$OUT/session.log" 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
grep -hE '[0-9]+ (passed|failed)' "$OUT/pytest.log"; grep -hE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
cat "$OUT/memcheck.log"; head -3 "$OUT/memcheck-memory.log"; sort -n "$OUT/memcheck-memory.log" | tail -4
echo "done at $(( $(date +%s) - start )) s"

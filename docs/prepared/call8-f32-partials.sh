#!/usr/bin/env bash
# prefill-f32-partials.patch (prefill plans that split KV write float32 partial states): apply it, run every GPU
# test on it (call1's 14 groups with memcheck beside them), then an A/B of split plans (tools/time_split_prefill.py,
# patch / main / patch / main) and the cascade suite without peers (patch, then main). No carry needed.
#   bash docs/prepared/call8-f32-partials.sh   (on the GPU machine, repo root; logs under $OUT; ~520 s)
set -u
start=$(date +%s)
patch_file=docs/prepared/prefill-f32-partials.patch
git apply "$patch_file" || { echo "the patch does not apply: stop"; exit 1; }
TEST_GROUPS="$(python3 tools/gpu_test_groups.py 14)" BENCH=0 SASS=0 SANITIZE=1 SANITIZE_PARALLEL=1 \
  SANITIZE_TIMEOUT=400 TEST_TIMEOUT=360 bash tools/gpu_session.sh > "$OUT/session.log" 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
grep -hE '[0-9]+ (passed|failed)' "$OUT/pytest.log"; grep -hE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
cat "$OUT/memcheck.log"
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
for side in patch main patch main; do  # (the call's 600 s: a side starts only with 60 s to spare)
  [ $(( $(date +%s) - start )) -lt 520 ] || { echo "no time for the $side side"; break; }
  if [ "$side" = main ]; then git apply -R "$patch_file"; fi
  timeout 60 python3 tools/time_split_prefill.py | sed "s/^/$side /" | tee -a "$OUT/split-ab.txt"
  if [ "$side" = main ]; then git apply "$patch_file"; fi
done
left=$(( 580 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  timeout $(( left / 2 )) python3 benchmarks/run.py --suites cascade --no-peers --out "$OUT/cascade-patch.json" \
    > "$OUT/cascade-patch.log" 2>&1; tail -n 6 "$OUT/cascade-patch.log"
  git apply -R "$patch_file"
  timeout $(( left / 2 )) python3 benchmarks/run.py --suites cascade --no-peers --out "$OUT/cascade-main.json" \
    > "$OUT/cascade-main.log" 2>&1; tail -n 6 "$OUT/cascade-main.log"
fi
echo "done at $(( $(date +%s) - start )) s"

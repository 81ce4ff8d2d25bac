#!/usr/bin/env bash
# The two prefill options of the ninety-third session (off by default, CPU-tested only), on any GPU (an H100
# serves: the A/Bs compare kernels in one rotation, not against a record):
#   1. their GPU tests, then memcheck and synccheck on the slow paths (S(t) issued again, the bar.red vote);
#   2. suite mods without peers: attnforge-bounded beside attnforge (soft-cap 50) and its fma_exp_every twins;
#   3. suite prefill without peers: speculative_max twins beside the default (B1 S8192, B16 S2048, ragged).
#   bash docs/prepared/call6-prefill-options.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu tests/test_prefill_gpu.py -k "bounded or speculative" > "$OUT/tests.log" 2>&1
grep -E "passed|failed" "$OUT/tests.log" | tail -n 1; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
echo "tests done at $(( $(date +%s) - start )) s"
for tool in memcheck synccheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 3 python3 -m pytest -q -m gpu tests/test_prefill_gpu.py \
    -k "speculative_max_against and (jump or rising) and (persistent or cta)" > "$OUT/$tool.log" 2>&1
  echo "$tool exit $?: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/$tool.log" | tr '\n' ' ')"
done
ATTNFORGE_BENCH_MODS_BOUNDED_TWINS="fma_exp_every=0;fma_exp_every=2;fma_exp_every=8" timeout 150 \
  python3 benchmarks/run.py --suites mods --no-peers --out "$OUT/mods.json" 2>&1 | grep -E "^mods .*prefill" \
  > "$OUT/mods.log"
cat "$OUT/mods.log"; echo "mods done at $(( $(date +%s) - start )) s"
ATTNFORGE_BENCH_PREFILL_TWINS="speculative_max=True;speculative_max=True,persistent=False" \
  ATTNFORGE_BENCH_PREFILL_CASES="B1 S8192,B16 S2048,ragged 16 random 128-8192" \
  timeout $(( 585 - ($(date +%s) - start) )) python3 benchmarks/run.py --suites prefill --no-peers \
  --out "$OUT/prefill_ab.json" 2>&1 | grep -E "^prefill " > "$OUT/prefill_ab.log"
cat "$OUT/prefill_ab.log"; echo "done at $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# exact_max (the Hopper prefill's row max without slack; the cascade's default since the 110th session): on an H200
# its GPU tests and the cascade's (every level kind), then the record of suites cascade, plan and host with peers
# (call4). Its H100 checks ran in the 111th session, so off an H200 it runs the GPU fuzz at new seeds instead
# (FUZZ_SEEDS, default 1760:1910, ~340 s on a warm machine). Carry .anchors (FlashInfer):
#   bash docs/prepared/call8-exact-max.sh     (on the GPU machine, repo root; logs and JSON under $OUT)
# Then, on this machine: python3 benchmarks/report.py merge <files_at>/cascade.json (and plan.json, host.json).
set -u
start=$(date +%s)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
F=tests/test_fuzz_gpu.py
NEW="tests/test_prefill_gpu.py::test_exact_max_rounds_peaked_rows_as_the_mma_kernel tests/test_cascade.py"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PYTHONPATH=$PWD:$PWD/tests timeout 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider $NEW > "$OUT/tests.log" 2>&1
  tail -n 5 "$OUT/tests.log"
  START=$start SUITES="cascade plan host" exec bash docs/prepared/call4-plan-host-record.sh
fi
FUZZ="$F::test_random_decode;$F::test_random_verify;$F::test_random_prefill;$F::test_random_prefill_split_dims"
FUZZ="$FUZZ;$F::test_random_mla;$F::test_random_cascade;$F::test_random_quest"
ATTNFORGE_TEST_FUZZ_SEEDS=${FUZZ_SEEDS:-1760:1910} TEST_GROUPS="$FUZZ" BENCH=0 SASS=0 TEST_TIMEOUT=480 \
  exec bash tools/gpu_session.sh

#!/usr/bin/env bash
# scratch: call 3 of the twenty-second session
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
python3 benchmarks/bench_prefill_tilings.py d64 d64-softcap d128-softcap 2>&1 | grep -v "^attnforge:" > $OUT/tilings.log
cat $OUT/tilings.log
SANITIZE=1 SANITIZE_PARALLEL=1 SANITIZE_TESTS="tests/test_prefill_gpu.py::test_exponentials_on_the_fma_pipe tests/test_prefill_gpu.py::test_alibi_steep_and_negative_slopes" \
  TEST_GROUPS="tests/test_prefill_gpu.py;tests/mods tests/test_cli.py tests/test_merge_gpu.py tests/test_cascade.py" \
  SUITES=mods,head_dims,prefill BENCH_TIMEOUT=330 bash tools/gpu_session.sh > $OUT/session.log 2>&1
grep -v "^attnforge:" $OUT/session.log | tail -n 75

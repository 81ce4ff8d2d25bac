#!/usr/bin/env bash
# Where the memcheck process's memory goes (eighty-third session: torch counted every test's tensors live after
# it, 47 GB by the 69th test, under compute-sanitizer). The same tests with the memory log, with and without
# memcheck, side by side: a step per test in both is a holder in attnforge or the tests (the log names the Python
# object holding the largest tensor); a step only under memcheck is the sanitizer's.
#   bash docs/prepared/call3-test-memory.sh      (on the GPU machine, repo root; ~2 min; logs under $OUT)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache PYTHONPATH=$PWD  # (the checkout, not installed there)
tests=(tests/test_merge_gpu.py tests/jit/test_upload_gpu.py
       "tests/test_prefill_gpu.py::test_persistent_ctas_walk_many_items")
( ATTNFORGE_TEST_MEMLOG=$OUT/plain-memory.log timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
    "${tests[@]}" > "$OUT/plain.log" 2>&1 ) &
( ATTNFORGE_TEST_MEMLOG=$OUT/memcheck-memory.log timeout 150 compute-sanitizer --tool memcheck --report-api-errors no \
    python3 -m pytest -m gpu -q -x -p no:cacheprovider "${tests[@]:0:2}" > "$OUT/memcheck.log" 2>&1 ) &
wait
tail -n 3 "$OUT/plain.log" "$OUT/memcheck.log"
for log in plain memcheck; do echo "== $log"; cut -c1-400 "$OUT/$log-memory.log" | awk 'NR % 3 == 0'; done

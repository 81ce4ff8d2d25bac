#!/usr/bin/env bash
# call 6 (scratch): GPU tests + memcheck of prefetch's Quest tests, A/B quest GQA main vs prefetch, trace
set -u
start=$(date +%s)
TREES="prefetch" TESTS_prefetch="tests/test_quest_gpu.py;tests/test_quest_heads_gpu.py tests/test_cascade.py" \
  ATTNFORGE_BENCH_QUEST_HEADS=32/8 SUITES=quest ROUNDS=5 LIMIT=${LIMIT:-330} bash tools/device_call.sh
mkdir -p /tmp/w/trace
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache PYTHONUNBUFFERED=1
(cd abtrees/prefetch && PYTHONPATH=$PWD timeout 60 python3 benchmarks/trace_quest.py --json /tmp/w/trace/prefetch.json > /tmp/w/trace/prefetch.txt 2>&1)
(cd abtrees/prefetch && PYTHONPATH=$PWD timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
   python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_quest_gpu.py -k "needle or crafted or replay" > /tmp/w/memcheck.txt 2>&1; echo "memcheck exit $?" >> /tmp/w/memcheck.txt)
tail -3 /tmp/w/memcheck.txt
echo "all done at $(( $(date +%s) - start )) s"

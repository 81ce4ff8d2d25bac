#!/usr/bin/env bash
# Whether racecheck's hazards on the transposed MLA kernel's producer warpgroup are the tool's (perf-notes, the
# eighty-fifth section): a minimal item loop under racecheck with and without a subset named barrier and an
# mbarrier (tools/racecheck_subset_barrier.cu), then the kernel itself with and without its producer.
# First, the prefill repeat test written after the eighty-fifth session's budget ended.
#   bash docs/prepared/call3-racecheck-repro.sh      (on the GPU machine, repo root; ~3 min after the start)
set -u
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache PYTHONPATH=$PWD
# (new, not yet run on a GPU)
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_gpu.py tests/test_mla_gpu.py \
  -k "repeated or heads_and_odd" 2>&1 | tail -3  # (and the MLA reference check, a shared helper since)
nvcc -arch=sm_90a -o /tmp/subset_barrier tools/racecheck_subset_barrier.cu || exit 1
for v in 0 1 2 3; do
  compute-sanitizer --tool racecheck /tmp/subset_barrier $v 2>&1 | grep -E "variant|RACECHECK SUMMARY"
done
for c in pw_es pw one_wg; do python3 tools/racecheck_mla.py $c; done > /dev/null  # builds, outside the sanitizer
for c in pw_es pw one_wg; do
  compute-sanitizer --tool racecheck --show-backtrace no python3 tools/racecheck_mla.py $c > "$OUT/race_$c.log" 2>&1
  grep -E "equal|DIFFER|RACECHECK SUMMARY" "$OUT/race_$c.log"
done
python3 tools/racecheck_summary.py "$OUT"/race_*.log  # known classes named, a new one flagged

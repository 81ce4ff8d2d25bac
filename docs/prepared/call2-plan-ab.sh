#!/usr/bin/env bash
# plan B256 on the GPU host: main against main + plan-zero-begins.patch, fresh processes in rotation (two orders),
# each pinned to one core (unpinned, a process read ~50 or ~75 us by where it ran: eighty-third session).
# Before the call (here):  bash tools/stage_trees.sh base=HEAD next=HEAD && (cd abtrees/next && git apply \
#   ../../docs/prepared/plan-zero-begins.patch)      then carry abtrees; delete abtrees/ before committing.
#   bash docs/prepared/call2-plan-ab.sh      (on the GPU machine, repo root; the lines under $OUT/plan_ab.txt)
set -u
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
whole_call() {  # one fresh process in tree $1: plan B256's whole call, min and median
  (cd "abtrees/$1" && PYTHONPATH=$PWD:$PWD/tools timeout 60 taskset -c 5 python3 -u tools/plan_gpu_cost.py 2>&1 |
    grep 'whole call')
}
for t in base next next base base next next base; do echo "$t: $(whole_call $t)"; done | tee "$OUT/plan_ab.txt"

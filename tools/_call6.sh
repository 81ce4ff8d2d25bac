#!/usr/bin/env bash
# call 6: the h16 rows of `mla` re-recorded with peers on the final planner (tile-aligned cuts)
set -u
export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache PYTHONUNBUFFERED=1
mkdir -p $OUT/res
ATTNFORGE_BENCH_MLA_CASES="h16 B16 L65536,h16 B64 L8192,h16 B128 L4096,h16 B1 L131072" \
  timeout 140 python3 benchmarks/run.py --suites mla --out $OUT/res/mla_h16.json > $OUT/res/mla_h16.log 2>&1
echo "exit $?"; grep -hE "^mla .*(attnforge |flashinfer-fa3|attnforge-wgmma-transposed )" $OUT/res/mla_h16.log

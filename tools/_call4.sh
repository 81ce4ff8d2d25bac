#!/usr/bin/env bash
# call 4: where h16's fixed cost goes: traces (the write's parts, the transposed kernel's tiles) and B1 scaling
set -u
R=/tmp/res; mkdir -p $R /tmp/attnforge-cache
cp -r .kcache/. /tmp/attnforge-cache/
T0=$(date +%s)
trap 'tar -czf $OUT/res.tgz -C /tmp res' EXIT
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/trace_mla.py --chained --json $R/trace.json "h16 B1 L131072" "h16 B64 L8192" "h16 B16 L65536" "h16 B128 L4096" "h8 B16 L65536" > $R/trace.log 2>&1
echo "trace done at $(( $(date +%s) - T0 )) s" >> $R/times.log
S="B1 L32768,B1 L65536,B1 L262144,B1 L524288,B2 L65536,B4 L32768,B8 L16384"
ATTNFORGE_BENCH_MLA_SHAPES="$S" ATTNFORGE_BENCH_MLA_ROWS=attnforge,attnforge-no-merge \
ATTNFORGE_BENCH_MLA_CASES="h16 B1 L131072,h16 ${S//,/,h16 }" \
  timeout 200 python3 benchmarks/run.py --suites mla --no-peers --out $R/scaling.json > $R/scaling.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $R/times.log

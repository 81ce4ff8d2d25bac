#!/usr/bin/env bash
# call 5: the MLA GPU file (reads_before_wait's tests among them; memcheck on two), then reads_before_wait's A/B rounds
set -u
R=/tmp/res; mkdir -p $R /tmp/attnforge-cache
cp -r .kcache/. /tmp/attnforge-cache/
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-550} - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/res.tgz -C /tmp res' EXIT
M="tests/test_mla_gpu.py"
TG="$M -k 'wgmma and roles and not graph and not bitwise and not producer';$M -k 'wgmma and not roles and not graph and not bitwise and not producer and not reads_before';$M -k 'graph or bitwise or producer';$M -k 'not (wgmma or graph or bitwise or producer or 16bit or reads_before)';$M -k '16bit or reads_before'"
OUT=$R/suite TEST_GROUPS="$TG" TEST_TIMEOUT=300 SANITIZE=1 SANITIZE_PARALLEL=1 SANITIZE_TIMEOUT=280 BENCH=0 SASS=0 \
  SANITIZE_TESTS="tests/test_mla_gpu.py::test_reads_before_wait_leave_the_outputs_bitwise[16-transposed-wgmma] tests/test_mla_gpu.py::test_reads_before_wait_leave_the_outputs_bitwise[16-normal-mma] tests/test_mla_gpu.py::test_long_request_split_across_ctas" \
  bash tools/gpu_session.sh > $R/suite.log 2>&1
echo "tests done at $(( $(date +%s) - T0 )) s" >> $R/times.log
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
for r in 1 2 3 4; do
  [ $(left) -lt 70 ] && break
  ATTNFORGE_BENCH_MLA_HEADS=8 ATTNFORGE_BENCH_MLA_TRANSPOSED_TWINS="reads_before_wait=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge-wgmma-transposed,attnforge-wgmma-transposed-twin0 \
  ATTNFORGE_BENCH_MLA_CASES="h16 B1 L131072,h16 B16 L65536,h16 B64 L8192,h16 B128 L4096,h8 B16 L65536,h8 B1 L131072" \
    timeout $(( $(left) / 2 )) python3 benchmarks/run.py --suites mla --no-peers --out $R/h16_$r.json > $R/bench_h16_$r.log 2>&1
  ATTNFORGE_BENCH_MLA_KERNEL_TWINS="reads_before_wait=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge,attnforge-twin0 ATTNFORGE_BENCH_MLA_HEADS=32,64 \
  ATTNFORGE_BENCH_MLA_CASES="h128 B1 L131072,h64 B1 L131072,h32 B1 L131072,h128 B16 L65536,h64 B16 L65536,h128 B64 L8192" \
    timeout $(left) python3 benchmarks/run.py --suites mla --no-peers --out $R/roles_$r.json > $R/bench_roles_$r.log 2>&1
  echo "round $r at $(( $(date +%s) - T0 )) s" >> $R/times.log
done
echo "all done at $(( $(date +%s) - T0 )) s" >> $R/times.log

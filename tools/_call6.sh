#!/usr/bin/env bash
# call 6: the MLA GPU file on the final defaults (reads_before_wait on), memcheck on three; then the mla rows
# whose kernels changed (h8-h64), FlashInfer beside them
set -u
R=/tmp/res; mkdir -p $R /tmp/attnforge-cache
cp -r .kcache/. /tmp/attnforge-cache/
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-500} - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/res.tgz -C /tmp res' EXIT
M="tests/test_mla_gpu.py"
TG="$M -k 'wgmma and roles and not graph and not bitwise and not producer';$M -k 'wgmma and not roles and not graph and not bitwise and not producer';$M -k 'graph or bitwise or producer';$M -k 'not (wgmma or graph or bitwise or producer or 16bit)';$M -k '16bit'"
OUT=$R/suite TEST_GROUPS="$TG" TEST_TIMEOUT=280 SANITIZE=1 SANITIZE_PARALLEL=1 SANITIZE_TIMEOUT=260 BENCH=0 SASS=0 \
  SANITIZE_TESTS="tests/test_mla_gpu.py::test_heads_and_odd_lengths tests/test_mla_gpu.py::test_long_request_split_across_ctas tests/test_mla_gpu.py::test_wgmma_backend[transposed-16]" \
  bash tools/gpu_session.sh > $R/suite.log 2>&1
echo "tests done at $(( $(date +%s) - T0 )) s" >> $R/times.log
export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
[ $(left) -gt 60 ] && ATTNFORGE_BENCH_MLA_CASES="h16 B16 L65536,h16 B64 L8192,h16 B128 L4096,h16 B1 L131072,h8 B16 L65536,h32 B16 L65536,h64 B16 L65536" \
  timeout $(left) python3 benchmarks/run.py --suites mla --out $R/mla.json > $R/bench_mla.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $R/times.log

#!/usr/bin/env bash
# call 2: l2_first_tiles' GPU tests (memcheck on one) and its A/B rounds; then h128 / h16 B1 with FlashInfer
set -u
R=/tmp/res; mkdir -p $R /tmp/attnforge-cache
cp -r .kcache/. /tmp/attnforge-cache/
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - T0) )); }
trap 'tar -czf $OUT/res.tgz -C /tmp res' EXIT
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $R/gpu.txt 2>&1
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 -m pytest -m gpu -q -p no:cacheprovider \
  "tests/test_mla_gpu.py::test_l2_first_tiles_read_the_cache_the_previous_decode_wrote[16-transposed-wgmma]" \
  "tests/test_mla_gpu.py::test_l2_first_tiles_leave_the_outputs_bitwise[128-normal-wgmma]" > /tmp/mc.log 2>&1 &
MC=$!
timeout 240 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mla_gpu.py -k "l2_first or pdl" > $R/tests.log 2>&1
wait $MC; echo "memcheck exit $?" >> $R/tests.log; grep -E "ERROR SUMMARY|passed|failed|Invalid" /tmp/mc.log | head >> $R/tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $R/times.log
for r in 1 2 3; do
  [ $(left) -lt 80 ] && break
  ATTNFORGE_BENCH_MLA_TRANSPOSED_TWINS="l2_first_tiles=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge-wgmma-transposed,attnforge-wgmma-transposed-twin0 \
  ATTNFORGE_BENCH_MLA_CASES="h16 B1 L131072,h16 B16 L65536,h16 B64 L8192,h16 B128 L4096,h8 B16 L65536" \
    timeout $(( $(left) / 2 )) python3 benchmarks/run.py --suites mla --no-peers --out $R/h16_$r.json > $R/bench_h16_$r.log 2>&1
  ATTNFORGE_BENCH_MLA_KERNEL_TWINS="l2_first_tiles=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge,attnforge-twin0 ATTNFORGE_BENCH_MLA_HEADS=32,64 \
  ATTNFORGE_BENCH_MLA_CASES="h128 B1 L131072,h64 B1 L131072,h32 B1 L131072,h128 B16 L65536,h64 B16 L65536" \
    timeout $(left) python3 benchmarks/run.py --suites mla --no-peers --out $R/roles_$r.json > $R/bench_roles_$r.log 2>&1
  echo "round $r at $(( $(date +%s) - T0 )) s" >> $R/times.log
done
if [ $(left) -gt 150 ]; then
  export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer
  ATTNFORGE_BENCH_MLA_ROWS=attnforge,attnforge-no-merge,flashinfer-fa3 ATTNFORGE_BENCH_MLA_CASES="h128 B1 L131072,h16 B1 L131072" \
    timeout $(left) python3 benchmarks/run.py --suites mla --out $R/peers.json > $R/bench_peers.log 2>&1
fi
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv >> $R/gpu.txt 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $R/times.log

#!/usr/bin/env bash
# call 1: the whole GPU suite on main (memcheck beside it); the p16 merge-bounds patch's tests in a copy
# beside it; then its A/B rounds and the MLA suite's accuracy loop
set -u
R=/tmp/res; mkdir -p $R /tmp/attnforge-cache
cp -r .kcache/. /tmp/attnforge-cache/
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - T0) )); }  # seconds before the tarball must be written
trap 'tar -czf $OUT/res.tgz -C /tmp res' EXIT
rm -rf /tmp/p16 && mkdir /tmp/p16 && tar --exclude=./.anchors -cf - . | tar -xf - -C /tmp/p16
(cd /tmp/p16 && git apply docs/prepared/mla-p16-merge-bounds.patch && git diff --stat) > $R/p16.log 2>&1
(cd /tmp/p16 && PYTHONPATH=/tmp/p16 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=4 timeout 300 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mla_gpu.py -k 16bit >> $R/p16.log 2>&1;
 PYTHONPATH=/tmp/p16 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 python3 -m pytest -m gpu -q -p no:cacheprovider "tests/test_mla_gpu.py::test_16bit_partial_states[128-normal-bfloat16]" > /tmp/p16mc.log 2>&1; echo "p16 memcheck exit $?" >> $R/p16.log; grep -E "ERROR SUMMARY|passed|failed" /tmp/p16mc.log >> $R/p16.log) &
D="tests/test_decode_gpu.py"; P="tests/test_prefill_gpu.py"; M="tests/test_mla_gpu.py"
DA="$D::test_pages_layouts_pipelines $D::test_pdl_launches_chained_on_their_own_outputs $D::test_fp8_warp_bands_match_the_cta_barrier_kernel_bitwise $D::test_s_accumulated_in_one_or_four_mma_chains $D::test_snapped_span_boundaries $D::test_slots_no_request_holds_may_hold_nan"
PA="$P::test_ragged $P::test_wgmma_tiling_overrides $P::test_d256_split_ring_schedules $P::test_wgmma_producer_paged $P::test_tma_paged_tiles"
TG="$M -k 'wgmma and roles and not graph and not bitwise and not producer';$M -k 'wgmma and not roles and not graph and not bitwise and not producer';$M -k 'graph or bitwise or producer';$M -k 'not (wgmma or graph or bitwise or producer or 16bit)';$M -k 16bit"
TG="$TG;$DA;$D --deselect ${DA// / --deselect };$PA;$P --deselect ${PA// / --deselect };tests/test_merge_gpu.py tests/test_quest_gpu.py tests/test_quest_heads_gpu.py;tests/mods/test_mods_decode_gpu.py tests/test_cascade.py tests/test_cli.py tests/kvcache/test_vmm_gpu.py"
OUT=$R/suite TEST_GROUPS="$TG" TEST_TIMEOUT=380 SANITIZE=1 SANITIZE_PARALLEL=1 SANITIZE_TIMEOUT=360 BENCH=0 SASS=0 bash tools/gpu_session.sh > $R/suite.log 2>&1
echo "suite done at $(( $(date +%s) - T0 )) s" >> $R/times.log
wait
echo "p16 done at $(( $(date +%s) - T0 )) s" >> $R/times.log
cd /tmp/p16
export PYTHONPATH=/tmp/p16 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
for r in 1 2 3; do
  [ $(left) -lt 60 ] && break
  ATTNFORGE_BENCH_MLA_KERNEL_TWINS="partial_16bit=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge,attnforge-twin0 ATTNFORGE_BENCH_MLA_HEADS=32,64 \
  ATTNFORGE_BENCH_MLA_CASES="h128 B1 L131072,h64 B1 L131072,h32 B1 L131072,h128 B16 L65536" \
    timeout $(( $(left) / 2 )) python3 benchmarks/run.py --suites mla --no-peers --out $R/roles_$r.json > $R/bench_roles_$r.log 2>&1
  ATTNFORGE_BENCH_MLA_TRANSPOSED_TWINS="partial_16bit=True" ATTNFORGE_BENCH_MLA_ROWS=attnforge-wgmma-transposed,attnforge-wgmma-transposed-twin0 \
  ATTNFORGE_BENCH_MLA_CASES="h16 B1 L131072,h16 B16 L65536" \
    timeout $(left) python3 benchmarks/run.py --suites mla --no-peers --out $R/h16_$r.json > $R/bench_h16_$r.log 2>&1
  echo "round $r at $(( $(date +%s) - T0 )) s" >> $R/times.log
done
cd - > /dev/null
export PYTHONPATH=$PWD
[ $(left) -gt 30 ] && ATTNFORGE_BENCH_MLA_CASES="h16 B128 L4096" timeout $(left) python3 benchmarks/run.py --suites mla --no-peers --out $R/acc.json > $R/bench_acc.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $R/times.log

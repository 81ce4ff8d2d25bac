#!/usr/bin/env bash
# One device call for branches staged by tools/stage_trees.sh: each tree's GPU tests (in parallel,
# through tools/gpu_session.sh), then an interleaved A/B of SUITES over main (.) and the trees, all
# under $W (default /tmp/w) for the caller to pack into $OUT. A round that cannot finish before the
# call's limit is not started (LIMIT seconds from the start).
# Usage (GPU machine, repo root), e.g.:
#   TREES="pos fence" TESTS_pos="tests/test_prefill_gpu.py" TESTS_fence="tests/test_decode_gpu.py" \
#     SUITES=prefill,mods ROUNDS=2 LIMIT=560 bash tools/device_call.sh
#   MEMCHECK_<name>="test ids" runs those tests of that tree under compute-sanitizer beside its tests.
#   main is abtrees/main where staged (the checkout on the device is whatever was checked out here), else .
#   then: tar czf $OUT/call.tgz -C /tmp/w .   (here: tar czf ab.tgz -C <files_at>/ab/raw . and
#   python tools/ab_compare.py ab.tgz)
set -u
start=$(date +%s); W=${W:-/tmp/w}
# a warm machine keeps /tmp between calls: start empty, or the last call's rounds join this one's
rm -rf "$W"; mkdir -p "$W/ab"
for name in ${TREES:-}; do
  var="TESTS_$name"; tests=${!var:-${TESTS:-}}
  [ -z "$tests" ] && continue
  mkdir -p "$W/$name"; mc="MEMCHECK_$name"
  (cd "abtrees/$name" && OUT="$W/$name" BENCH=0 SASS=0 TEST_GROUPS="$tests" SANITIZE_TESTS="${!mc:-}" \
    env ${!mc:+SANITIZE=1 SANITIZE_PARALLEL=1} bash tools/gpu_session.sh > "$W/$name/session.log" 2>&1) &
done
wait
echo "tests done at $(( $(date +%s) - start )) s"
grep -h "== tests" "$W"/*/session.log 2>/dev/null
if [ -n "${SUITES:-}" ]; then
  args=("main=."); [ -d abtrees/main ] && args=("main=abtrees/main")
  for name in ${AB_TREES-${TREES:-}}; do args+=("$name=abtrees/$name"); done  # AB_TREES: a subset
  # each round of one tree must fit before the limit: stop a minute short of it
  OUT="$W/ab" WORK="$W/ab/raw" ROUNDS=${ROUNDS:-2} DEADLINE=$((start + ${LIMIT:-560} - 60)) \
    BENCH_ARGS=${BENCH_ARGS---no-peers} bash tools/ab_bench.sh "${args[@]}"  # BENCH_ARGS= (set, empty): with peers
fi
echo "done at $(( $(date +%s) - start )) s"

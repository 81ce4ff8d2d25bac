#!/usr/bin/env bash
# One device call: GPU tests, SASS of the Hopper prefill kernel, optional memcheck and ncu, and the
# benchmarks; logs and JSON to $OUT.
# Usage (on the GPU machine, repo root): [TESTS=paths] [TEST_GROUPS='args;args'] [SUITES=a,b] [BENCH=0]
#   [SANITIZE=1 [SANITIZE_PARALLEL=1] [SANITIZE_TOOL=memcheck|initcheck|synccheck] [SANITIZE_GROUPS=5,6]]
#   [PROFILE=1]
# Split test groups by file or node id, not by -k: parametrized tests carry the keywords
# "parametrize" and "pytestmark", so -k tma selects nearly all of them (fifth session).
#   bash tools/gpu_session.sh [pytest-args...]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache TORCH_CUDA_ARCH_LIST=9.0a
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# memcheck's default tests, in groups (';'): a process each, so a group's time and log are its own. The same
# groups serve the other sanitizer tools (SANITIZE_TOOL; logs $OUT/<tool>.log). initcheck (reads of device
# memory nothing wrote) found 0 errors on 155 tests, most of these among them (perf-notes, ninety-second section),
# then reads in three of these groups (ninety-fifth section: decode's merge_item, around a chunk's LSEs), and 0
# in all six once decode's own workspace started zeroed (ninety-sixth section).
# --show-backtrace device: the host backtrace (the sanitizer's default, 'yes') keeps a reference to the Python
# frames of every CUDA call, and through them every test's tensors: one process ran out of memory at its 69th
# test (eighty-third and eighty-fourth sessions, perf-notes); a precise error still gets its device backtrace
MEMCHECK_GROUPS="tests/test_merge_gpu.py tests/test_decode_gpu.py::test_pages_layouts_pipelines
  tests/test_mla_gpu.py::test_heads_and_odd_lengths tests/test_decode_gpu.py::test_head_splits
  tests/test_decode_gpu.py::test_merge_of_many_chunks_in_passes_and_rounds[32-1-128-normal];
  tests/test_prefill_gpu.py::test_empty_kv_and_lengths_off_the_tiles
  tests/test_prefill_gpu.py::test_wgmma_producer_paged
  tests/test_prefill_gpu.py::test_split_kv_few_queries_against_long_kv
  tests/test_prefill_gpu.py::test_d256_split_ring_schedules;
  tests/test_prefill_gpu.py::test_persistent_ctas_walk_many_items;
  tests/test_mla_gpu.py::test_wgmma_backend[transposed-16] tests/test_mla_gpu.py::test_wgmma_backend[normal-128]
  tests/test_mla_gpu.py::test_merge_lanes_agree_with_one_lane
  tests/test_mla_gpu.py::test_long_request_split_across_ctas;
  tests/test_quest_gpu.py;
  tests/test_append_gpu.py::test_append_replays_in_a_cuda_graph
  tests/test_append_gpu.py::test_mla_append_matches_torch_indexing
  tests/test_decode_verify_gpu.py::test_draft_tokens_against_the_reference
  tests/test_decode_verify_gpu.py::test_long_requests_split_and_merged
  tests/test_cascade.py::test_cascade_equals_decode_over_concatenated_kv
  tests/test_cascade.py::test_cascade_graph_replay_after_replans"
# The sanitizer's groups into the array mgroups: MEMCHECK_GROUPS (or SANITIZE_TESTS), narrowed by SANITIZE_GROUPS,
# 1-based indices (e.g. 5,6). A bad value returns 2 with its reason in $OUT/<tool>.log: an index past the list
# would make an empty group (pytest given no ids runs every GPU test), a leading zero reads as octal in bash
# arithmetic, and a list with no index would run nothing and read as clean.
sanitizer_groups() {
  local list="${SANITIZE_TESTS:-$MEMCHECK_GROUPS}" tool=${SANITIZE_TOOL:-memcheck} picked=() i got=""
  IFS=';' read -ra mgroups <<< "${list//$'\n'/ }"  # (read stops at a newline)
  [ -n "${SANITIZE_GROUPS:-}" ] || return 0
  for i in ${SANITIZE_GROUPS//,/ }; do
    if [[ "$i" =~ ^[1-9][0-9]*$ ]] && [ "$i" -le ${#mgroups[@]} ]; then picked+=("${mgroups[i - 1]}")
    else got=$i; break; fi
  done
  [ ${#picked[@]} -gt 0 ] || got=${got:-$SANITIZE_GROUPS}
  if [ -n "$got" ]; then
    echo "SANITIZE_GROUPS: expected comma-separated indices 1..${#mgroups[@]} of the groups in MEMCHECK_GROUPS" \
      "(or SANITIZE_TESTS where set), e.g. SANITIZE_GROUPS=5,6; got '$got'" | tee "$OUT/$tool.log"
    return 2
  fi
  mgroups=("${picked[@]}")
}
memcheck() {
  local end=$(( $(date +%s) + ${SANITIZE_TIMEOUT:-200} )) status=0 rc group try tool=${SANITIZE_TOOL:-memcheck}
  sanitizer_groups || return 2
  # working files outside $OUT: at most 8 files come back from a device call, and a call cut off by its limit
  # still returns the groups' summaries ($OUT/<tool>.groups, a line as each group ends)
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/sanitizer.XXXXXX")
  : > "$work/$tool.full"; : > "$OUT/$tool.groups"; : > "$work/$tool.errors"
  for group in "${mgroups[@]}"; do  # (in turn, each with the time left; `timeout 0` would never stop)
    [ $(( end - $(date +%s) )) -lt 5 ] && { echo "$tool: no time left for: $group"; status=124; break; } \
      >> "$work/$tool.full"
    # a second try only where the sanitizer died by a signal before pytest printed a line (seen once: exit 139
    # beside fourteen test processes, ninety-first section of perf-notes); a crash once tests ran stands as it is
    for try in 1 2; do
      # the memory torch holds after each test (ATTNFORGE_TEST_MEMLOG: tests/conftest.py)
      ATTNFORGE_TEST_MEMLOG="$OUT/$tool-memory.log" timeout $(( end - $(date +%s) )) \
        compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 --show-backtrace device \
        python3 -m pytest -m gpu -q -x -p no:cacheprovider $group \
        > "$work/$tool.group" 2>&1
      rc=$?; cat "$work/$tool.group" >> "$work/$tool.full"
      [ $rc -ge 128 ] && [ $rc -ne 137 ] && ! grep -qv '^=========' "$work/$tool.group" && [ $try = 1 ] \
        && [ $(( end - $(date +%s) )) -ge 5 ] || break
      echo "$tool: the sanitizer died at its start (exit $rc), tried again: $group" >> "$work/$tool.full"
    done
    [ $rc -ne 0 ] && status=$rc
    # each group's summary under its first test id, and a failing group's first reports under the same name, so a
    # count in the log can be traced to its tests (the whole output's head showed the first group's alone)
    set -- $group
    local summary; summary=$(grep -h "ERROR SUMMARY" "$work/$tool.group" | tail -n 1)
    echo "exit $rc, ${summary:-no summary} <- $1 (+$(( $# - 1 )) more)" >> "$OUT/$tool.groups"
    [ $rc -ne 0 ] && { echo "=== group $1 (+$(( $# - 1 )) more): exit $rc"; head -c 6000 "$work/$tool.group"; echo; } \
      >> "$work/$tool.errors"
  done
  echo "$tool exit $status (${#mgroups[@]} groups)" > "$OUT/$tool.log"
  grep -E "Program hit|Invalid|Uninitialized|out of bounds|ERROR SUMMARY|passed|failed|tried again" \
    "$work/$tool.full" | sort | uniq -c | sort -rn | head -30 >> "$OUT/$tool.log"
  cat "$OUT/$tool.groups" >> "$OUT/$tool.log"; rm -f "$OUT/$tool.groups"
  # the head: each failing group's first reports where any group failed, else the first groups' output (at most 8
  # files come back from a device call, so no file of its own)
  if [ -s "$work/$tool.errors" ]; then head -c 30000 "$work/$tool.errors"; else head -c 20000 "$work/$tool.full"; fi \
    > "$OUT/$tool.head"
  rm -rf "$work"
  cat "$OUT/$tool.log"
}
# a bad SANITIZE_GROUPS stops the call here, before its demo and tests, not after them
if [ "${SANITIZE:-0}" = 1 ]; then sanitizer_groups || exit 2; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m attnforge demo 2>&1 | tee "$OUT/demo.log"
# SANITIZE_PARALLEL=1: memcheck beside the test processes (both mostly wait on nvcc), not after them
if [ "${SANITIZE:-0}" = 1 ] && [ "${SANITIZE_PARALLEL:-0}" = 1 ]; then memcheck > /dev/null 2>&1 & fi
if [ -n "${TEST_GROUPS:-}" ]; then
  # TEST_GROUPS="args1;args2;...": one pytest process per group of pytest arguments, in parallel (GPU
  # tests are mostly JIT-compile bound); at most 8 files come back from $OUT, so the logs fold into one
  # each group's tail goes into $OUT/pytest.log as the group ends, so a call cut off by its limit still returns
  # the groups that finished (the hundred-and-thirteenth session's call lost all fourteen: the logs sat in $OUT,
  # fourteen files, until the last group ended)
  IFS=';' read -ra groups <<< "$TEST_GROUPS"
  work=$(mktemp -d "${TMPDIR:-/tmp}/pytest-groups.XXXXXX"); : > "$OUT/pytest.log"
  for i in "${!groups[@]}"; do
    (eval "timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -rfE -p no:cacheprovider $* ${groups[$i]}" \
       > "$work/pytest.$i.log" 2>&1
     rc=$?; set -- ${groups[$i]}
     { echo "== group $i, exit $rc: $1 (+$(( $# - 1 )) more)"; tail -n 40 "$work/pytest.$i.log"; } > "$work/tail.$i"
     flock "$work/lock" cat "$work/tail.$i" >> "$OUT/pytest.log") &
  done
  wait
  rm -rf "$work"
else
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "$@" ${TESTS:-tests} 2>&1 | tail -n 150 > "$OUT/pytest.log"
  tail -n 40 "$OUT/pytest.log"
fi
wait  # a parallel memcheck
[ "${SANITIZE_PARALLEL:-0}" = 1 ] && cat "$OUT/${SANITIZE_TOOL:-memcheck}.log"
# SASS of the default Hopper prefill kernel (B1 S8192 shape), to check wgmma ordering and registers
# (SASS=0 skips it: tools/device_call.sh's trees, whose tests may not build that kernel)
if [ "${SASS:-1}" = 1 ]; then
  f=$(ls -d $ATTNFORGE_CACHE_DIR/*/*/90a/prefill_wgmma_g4_d128_bf16_outbf16_causal_ws_pers_tma_s3-* 2>/dev/null | head -1)
  if [ -z "$f" ]; then python3 benchmarks/profile_prefill.py > /dev/null; f=$(ls -d $ATTNFORGE_CACHE_DIR/*/*/90a/prefill_wgmma_g4_d128_bf16_outbf16_causal_ws_pers_tma_s3-* | head -1); fi
  cuobjdump -sass "$f/kernel.cubin" > "$OUT/sass_prefill.txt" 2>&1; echo "HGMMA in prefill SASS: $(grep -c HGMMA "$OUT/sass_prefill.txt")"
fi
if [ "${SANITIZE:-0}" = 1 ] && [ "${SANITIZE_PARALLEL:-0}" = 0 ]; then memcheck; fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 150 ncu --clock-control none --kernel-name batch_decode_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats python3 benchmarks/profile_decode.py > "$OUT/ncu.log" 2>&1
  grep -vE "^==PROF==|^\s*$" "$OUT/ncu.log" | tail -n 120
  timeout 150 ncu --clock-control none --kernel-name mla_decode_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section SchedulerStats python3 benchmarks/profile_mla.py > "$OUT/ncu_mla.log" 2>&1
  grep -vE "^==PROF==|^\s*$" "$OUT/ncu_mla.log" | tail -n 80 > "$OUT/ncu_mla.txt"
  timeout 150 ncu --clock-control none --kernel-name batch_prefill_wgmma_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \
    --section ComputeWorkloadAnalysis python3 benchmarks/profile_prefill.py > "$OUT/ncu_prefill.log" 2>&1
  grep -vE "^==PROF==|^\s*$" "$OUT/ncu_prefill.log" | tail -n 100 > "$OUT/ncu_prefill.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
  export PYTHONPATH=$PWD/.anchors/flashinfer:$PYTHONPATH
  all=decode,decode_fp8_groups,merge,mods,prefill,mla,quest,cascade,vmm,head_dims,verify,roofline
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/run.py --suites ${SUITES:-$all} --out "$OUT/bench.json" \
    ${BENCH_ARGS:-} 2>&1 | tail -n 80 > "$OUT/bench.log"
  cat "$OUT/bench.log"
fi
# the test summary last, so it survives a long benchmark log in the output tail
echo "== tests: $(grep -hE '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tr '\n' ' ')"
! grep -hE "^(FAILED|ERROR)" "$OUT/pytest.log"  # the exit status: 1 where a test failed, 0 where none did

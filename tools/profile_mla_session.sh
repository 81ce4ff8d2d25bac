#!/usr/bin/env bash
# One device call: ncu of the MLA decode kernels (mma.sync and wgmma, both pipelines) on B64 L8192,
# for the stall and pipe-utilisation picture behind docs/perf-notes.md. Logs to $OUT.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# CFGS="heads pipeline backend [schedule];...": the default is the kernels the next steps target
IFS=';' read -ra cfgs <<< "${CFGS:-16 normal mma;128 normal wgmma roles;128 normal wgmma symmetric;16 transposed wgmma}"
for cfg in "${cfgs[@]}"; do
  set -- $cfg; name="ncu_mla_h$1_$2_$3${4:+_$4}"
  timeout ${NCU_TIMEOUT:-120} ncu --clock-control none --kernel-name mla_decode_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics smsp__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait \
    python3 benchmarks/profile_mla.py "$@" > "$OUT/$name.full" 2>&1
  grep -vE "^==PROF==|^\s*$|^\s*-+\s*-+" "$OUT/$name.full" | grep -vE "^    (OPT|INF)|^          " | tail -n 110 > "$OUT/$name.txt"
  rm -f "$OUT/$name.full"; echo "== $name"; head -c 200 "$OUT/$name.txt"
done

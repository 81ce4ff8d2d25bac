#!/usr/bin/env bash
# One device call: ncu of the Hopper prefill kernel on B1 S8192 without a modifier and with each mod of
# the mods suite, for why soft-cap (+24%) and ALiBi (+16%) cost what they do: pipe utilisation (the
# SFU/XU pipe: ex2, tanh, I2F) and warp states of the consumer warpgroups. Logs to $OUT.
# MODS="plain" PROFILE_ARGS=--short profiles the B16 S2048 case instead (short items, the gap to fa3).
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for mod in ${MODS:-plain softcap alibi}; do
  arg=$([ "$mod" = plain ] || echo "$mod")
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --kernel-name batch_prefill_wgmma_kernel --launch-skip 3 \
    --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section SchedulerStats \
    --metrics smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active \
    python3 benchmarks/profile_prefill.py $arg ${PROFILE_ARGS:-} > "$OUT/ncu_prefill_$mod.full" 2>&1
  grep -vE "^==PROF==|^\s*$|^\s*-+\s*-+" "$OUT/ncu_prefill_$mod.full" | grep -vE "^    (OPT|INF)|^          " \
    | tail -n 110 > "$OUT/ncu_prefill_$mod.txt"
  rm -f "$OUT/ncu_prefill_$mod.full"; echo "== $mod"; grep -E "pipe_(xu|fma|alu|tensor)" "$OUT/ncu_prefill_$mod.txt"
done

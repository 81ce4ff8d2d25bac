#!/usr/bin/env bash
# Which timing method keeps a power-capped rotation fair (harness.time_interleaved's settle_s and gap_s, both
# off by default). Suite `prefill` on B1 S8192 and B1 S32768, FlashInfer in the rotation, three ways: as now; with
# a 0.1 s idle gap before each timed run (every variant starts from an idle GPU's clock, as a peer timed alone);
# with 0.3 s of the variant's own replays before it (its own sustained clock); then clocks_under_load.py's
# sustained 2 s windows on the same cases, for reference. Any GPU shows whether fa3's lead in rotation (13.7% on
# an H100, 18% on the H200 at S32768; 3.9% sustained) comes from the method; carry .anchors:
#   bash docs/prepared/call6-rotation-methods.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
# Predicted: the gap puts fa3 within ~4% of us at S32768 (the reference's standalone 638 against our ~620),
# settling near the sustained table (fa3 +3.9%). Not a record: compare within the call.
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/.anchors/flashinfer ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
export ATTNFORGE_BENCH_PREFILL_CASES="B1 S8192,B1 S32768"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader  # (8 files come back: the logs and JSON)
for m in "fa2 plain" "fa3 plain"; do  # FlashInfer's JIT modules, minutes each, at once
  MAX_JOBS=8 python3 benchmarks/bench_mods.py prebuild $m > /dev/null 2>&1 &
done
wait; echo "FlashInfer built at $(( $(date +%s) - start )) s"
for how in "plain" "gap ATTNFORGE_BENCH_GAP_S=0.1" "settle ATTNFORGE_BENCH_SETTLE_S=0.3"; do
  name=${how%% *}; knob=${how#* }; [ "$name" = plain ] && knob=""
  env $knob timeout $(( 560 - ($(date +%s) - start) )) python3 benchmarks/run.py --suites prefill \
    --out "$OUT/$name.json" 2>&1 | grep -v "^attnforge:" > "$OUT/$name.log"
  grep -E "^prefill .*(attnforge |flashinfer-fa3|cudnn)" "$OUT/$name.log"
  echo "$name done at $(( $(date +%s) - start )) s"
done
timeout $(( 590 - ($(date +%s) - start) )) python3 benchmarks/clocks_under_load.py --cases "B1 S8192,B1 S32768" \
  --seconds 2 --rounds 1 --out "$OUT/sustained.json" > "$OUT/sustained.log" 2>&1
tail -n 8 "$OUT/sustained.log"
echo "done at $(( $(date +%s) - start )) s"

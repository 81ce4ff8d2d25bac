#!/usr/bin/env bash
# fp8 items of 16 rows or fewer: the transposed default against the normal pipeline widened in registers (the default
# past 16 rows since the 113th session). The 114th session (H100) read the four 9-16-row cases 7.7-8.2% faster there
# (g4 q4, g8 q2, g16 q1 = plain decode at group 16, g4 q3); its run stopped at g7 q7, whose launch failed (48 KB of
# dynamic shared memory beside a static flag: fixed in the loader since, unrun on a GPU). This call runs:
#   1. the loader fix's GPU test and the verify fuzz that found it (test_random_verify[2], g8 q7 soft-cap);
#   2. suite verify_fp8_widen on g7 q7 and g9 q6 (49 and 54 rows, whose register-widened kernels spill 40-80 bytes
#      at 3 CTAs an SM; the shared-memory pass runs 2 without spills), plain decode g4 q1 and g8 q1 (4 and 8 rows:
#      the decode suite's fp8 case is g4), g2 q4 (8 rows), g4 q4 B16 (about one item an SM: the transposed
#      default's one-CTA whole-item kernel), g4 q4 again as the link to the 114th session's rows, and g32 q1 (two
#      16-head items a KV head: fp8 MQA-sized groups' items, transposed by default).
# Any GPU (~200 s with the builds). No carry. Then: if smem-widen leads on g7 q7 or g9 q6, bound the default to the
# shapes that do not spill; if the normal rows lead on every case of 16 rows or fewer, prepare spec_for_rows' and
# default_pipeline's fp8 change (perf-notes, Next steps 0).
#   bash docs/prepared/call10-fp8-small-rows.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/tests ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_decode_verify_gpu.py::test_fp8_items_taking_48_kb_of_dynamic_shared_memory_launch \
  tests/test_fuzz_gpu.py::test_random_verify > "$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/tests.log"
timeout 270 python3 benchmarks/bench_verify_fp8_widen.py --out "$OUT/verify_fp8_widen.json" \
  "g7 q7" "g9 q6" "g4 q1" "g8 q1" "g2 q4" "g4 q4 B16" "g4 q4" "g32 q1" > "$OUT/bench.log" 2>&1
echo "bench_verify_fp8_widen rc=$? at $(( $(date +%s) - start )) s"
grep -E " us |differs|x [0-9]+ CTAs|Error" "$OUT/bench.log"

#!/usr/bin/env bash
# The hundred-and-seventeenth session's decode kernels over K/V that are not paged (attnforge/dense_decode.py):
# attention() of one query a request (or a causal verify step) behind ATTNFORGE_ATTENTION_DECODE=1, and
# single_decode. This call runs:
#   1. their GPU tests (tests/test_dense_decode_gpu.py) with memcheck beside them, and the GPU input fuzz's two APIs
#      (attention-one-query, single-decode);
#   2. the decode suite on three equal-length cases, whose dense rows time attention() on the decode kernels
#      (attnforge-dense) against the default prefill path (attnforge-dense-prefill) in rotation, with their -static
#      twins on a sliced [B, Hkv, 2L, D] cache and -verify4 twins (4 causal queries a request) at B16 L8192;
#      cuDNN, FA2 and Flex beside them (FlashInfer where .anchors is carried). Predicted: the decode route
#      1.2-1.4x faster at B16 L8192.
# Any GPU for the ratio (~250 s with the builds); the H200 record's decode suite times the same rows. Then: where the
# tests pass and attnforge-dense leads on every case, turn ATTENTION_DECODE's default on (attnforge/jit/env.py),
# and say so in the README's feature table and docs/architecture.md.
#   bash docs/prepared/call11-dense-decode.sh      (on the GPU machine, repo root; logs and JSON under $OUT)
set -u
start=$(date +%s)
export PYTHONPATH=$PWD:$PWD/tests ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_dense_decode_gpu.py \
  tests/test_input_fuzz_gpu.py -k "test_dense_decode_gpu or attention-one-query or single-decode" \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/tests.log"
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace device \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dense_decode_gpu.py -k "not compiled" \
  > "$OUT/memcheck.log" 2>&1  # (inductor's own compile under the sanitizer would take the whole limit)
echo "memcheck rc=$? at $(( $(date +%s) - start )) s"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log"
ATTNFORGE_BENCH_DECODE_CASES="B16 L8192,B64 L4096,B1 L131072" timeout 240 python3 benchmarks/run.py \
  --suites decode --out "$OUT/decode.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(( $(date +%s) - start )) s"
python3 - "$OUT/decode.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(f"{r['case']:>12} {r['impl']:>32} {r['us']:9.1f} us {r.get('gbps') or 0:7.0f} GB/s")
EOF

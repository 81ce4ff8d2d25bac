#!/usr/bin/env bash
# cross-stream-order.patch on the GPU (one GPU, carry .anchors): plan() on one stream and run() on another ordered
# by events (StagedUpload.order_run). Its stream tests on main (expected to fail: the order is missing) and with
# the patch, then every GPU test with the patch. Logs under $OUT.
#   bash docs/prepared/call4-cross-stream.sh      (on the GPU machine, repo root)
set -u
export PYTHONPATH=$PWD ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
git apply --include='tests/*' docs/prepared/cross-stream-order.patch  # the tests alone first: main's behaviour
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_streams_gpu.py > "$OUT/streams_main.log" 2>&1
echo "== main"; tail -6 "$OUT/streams_main.log"
git checkout -q -- tests && rm -f tests/test_streams_gpu.py && git apply docs/prepared/cross-stream-order.patch
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_streams_gpu.py tests/jit/test_upload.py \
  > "$OUT/streams_patch.log" 2>&1
echo "== patch"; tail -15 "$OUT/streams_patch.log"
bash docs/prepared/call1-every-gpu-test.sh

#!/usr/bin/env bash
# The stream tests on the package before StagedUpload.order_run (1875866: all four should fail there) and on this
# checkout (all four pass), then, on an H200 only, suites `plan` (decode's `plan B256` row) and `host` with their
# peers. Stage the old package here first and carry it with FlashInfer:
#   bash tools/stage_trees.sh old=1875866        (then carry abtrees and .anchors; delete abtrees/ after)
#   bash docs/prepared/call4-streams-then-host.sh     (on the GPU machine, repo root; logs and JSON under $OUT)
# Then, on this machine: python3 benchmarks/report.py merge <files_at>/plan_host.json && python3 benchmarks/report.py
set -u
start=$(date +%s)
export ATTNFORGE_CACHE_DIR=/tmp/attnforge-cache MAX_JOBS=16
nvidia-smi --query-gpu=name --format=csv,noheader
for tree in abtrees/old .; do
  echo "== stream tests on $tree at $(( $(date +%s) - start )) s"
  # -P: the checkout's root stays off sys.path, so `import attnforge` finds the tree named here
  PYTHONPATH=$PWD/$tree python3 -P -c "import attnforge; print(attnforge.__file__)"
  PYTHONPATH=$PWD/$tree timeout 150 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/test_streams_gpu.py \
    2>&1 | grep -E "passed|failed|^FAILED" | head -n 12
done 2>&1 | tee "$OUT/streams.log"
echo "streams done at $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0  # (the record's rows are the H200's)
PYTHONPATH=$PWD:$PWD/.anchors/flashinfer timeout $(( 560 - ($(date +%s) - start) )) python3 benchmarks/run.py \
  --suites plan,host --out "$OUT/plan_host.json" 2>&1 | grep -v "^attnforge:" > "$OUT/bench.log"
tail -n 40 "$OUT/bench.log"
echo "done at $(( $(date +%s) - start )) s"

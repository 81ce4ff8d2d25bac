#!/usr/bin/env bash
# Runs a prepared device call on an H200 only. A call for kind nvidia-h200 may start an H100; a record's rows must
# be an H200's, so this checks the GPU's name first and otherwise runs $ELSE (a script that any GPU serves) or
# stops at once (ELSE unset: the probe costs only the machine's start):
#   IF_H200=docs/prepared/call5-prefill-mods-record.sh ELSE=docs/prepared/call6-rotation-methods.sh \
#     bash tools/on_h200.sh
# The scripts' own variables pass through the environment (TESTS=0 SUITES=prefill IF_H200=... bash tools/on_h200.sh).
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" == *H200* ]]; then exec bash "$IF_H200"; fi
[ -n "${ELSE:-}" ] && exec bash "$ELSE"
echo "not an H200 and no ELSE: nothing run"

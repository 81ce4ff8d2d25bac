#!/usr/bin/env bash
# A/B benchmark of source trees, in interleaved rounds (A B A B ...) so drift in clocks and
# temperature falls on every tree alike. One archive comes back: $OUT/ab.tgz (name.rN.json + logs);
# compare locally with `python tools/ab_compare.py ab.tgz`.
# Usage (GPU machine, repo root): SUITES=decode,cascade [ROUNDS=2] [DEADLINE=epoch-seconds]
#   [BENCH_ARGS=--no-peers] [SUITES_<name>=suites] bash tools/ab_bench.sh base=abtrees/base next=.
# SUITES_<name> gives one tree its own suites (e.g. main runs every suite, each branch only its own)
set -u
# WORK=dir keeps the raw files there (a caller that may be cut off can still pack what finished)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=${WORK:-$(mktemp -d)}; mkdir -p "$work"
export ATTNFORGE_CACHE_DIR=${ATTNFORGE_CACHE_DIR:-/tmp/attnforge-cache} PYTHONUNBUFFERED=1
anchors=$PWD/.anchors/flashinfer
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    name=${spec%%=*}; dir=$(cd "${spec#*=}" && pwd); var="SUITES_$name"; suites=${!var:-$SUITES}
    # a round that cannot finish before the call's limit would lose its log: stop cleanly instead
    if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "deadline: stopped before $name round $round"; break 2; fi
    (cd "$dir" && PYTHONPATH="$dir:$anchors" timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/run.py \
      --suites "$suites" --out "$work/$name.r$round.json" ${BENCH_ARGS:-}) > "$work/$name.r$round.log" 2>&1
    echo "$name round $round: exit $?"
  done
done
tar czf "$OUT/ab.tgz" -C "$work" .

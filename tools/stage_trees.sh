#!/usr/bin/env bash
# Stage source trees of git revisions for one device call (run here, before it): each named revision
# is exported into abtrees/<name> (untracked, so it travels with the working tree), ready for
# `tools/ab_bench.sh base=abtrees/base next=abtrees/next` or for pytest with PYTHONPATH=abtrees/<name>.
# Usage: bash tools/stage_trees.sh name=rev [name=rev ...]     (delete abtrees/ before committing)
set -eu
cd "$(git rev-parse --show-toplevel)"
for spec in "$@"; do
  name=${spec%%=*}; rev=${spec#*=}
  rm -rf "abtrees/$name" && mkdir -p "abtrees/$name"
  git archive "$rev" | tar -x -C "abtrees/$name"
  echo "abtrees/$name <- $(git rev-parse --short "$rev") ($rev)"
done

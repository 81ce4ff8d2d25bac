#!/usr/bin/env bash
# Stage source trees of git revisions for one device call (run here, before it): each named revision
# is exported into abtrees/<name> (untracked, so it travels with the working tree), ready for
# `tools/ab_bench.sh base=abtrees/base next=abtrees/next` or for pytest with PYTHONPATH=abtrees/<name>.
# Usage: bash tools/stage_trees.sh name=rev [name=rev ...]     (delete abtrees/ before committing)
# Each staged tree's tests are collected here first: a file that fails to collect (a decorator on the
# wrong function, an import) would otherwise cost a device call its tests (twenty-seventh session).
set -eu
cd "$(git rev-parse --show-toplevel)"
for spec in "$@"; do
  name=${spec%%=*}; rev=${spec#*=}
  rm -rf "abtrees/$name" && mkdir -p "abtrees/$name"
  git archive "$rev" | tar -x -C "abtrees/$name"
  echo "abtrees/$name <- $(git rev-parse --short "$rev") ($rev)"
  if ! (cd "abtrees/$name" && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=. python3 -m pytest --collect-only -q -p no:cacheprovider tests > /dev/null 2>&1); then
    echo "abtrees/$name: pytest cannot collect its tests:" >&2
    (cd "abtrees/$name" && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=. python3 -m pytest --collect-only -q -p no:cacheprovider tests 2>&1 | grep -E "ERROR|Error" | head -5) >&2
    exit 1
  fi
done

#!/usr/bin/env bash
# Stage a source tree as a renamed package, for A/Bs in one process (tighter than across processes):
#   bash tools/stage_package.sh NAME [REV] [PATCH...]
# exports REV (default HEAD) with PATCHes applied into .stage_NAME/ as package attnforge_NAME, its
# templates/ and csrc_include/ beside it (codegen finds them there), and ignores the folder locally
# (.git/info/exclude). Then: PYTHONPATH=.:.stage_NAME, `import attnforge, attnforge_NAME`, and carry
# .stage_NAME in the device call. Kernels build from each tree's own headers (the cache key is the source).
set -eu
if [ $# -lt 1 ] || ! [[ $1 =~ ^[a-z0-9_]+$ ]]; then
  echo "usage: bash tools/stage_package.sh NAME [REV] [PATCH...]  (NAME: lower-case letters, digits, _;" \
       "got '${1:-}')" >&2; exit 2
fi
name=$1; rev=${2:-HEAD}; shift $(( $# > 1 ? 2 : 1 ))
patches=(); for p in "$@"; do patches+=("$(realpath "$p")"); done  # (paths from the caller's folder)
cd "$(git rev-parse --show-toplevel)"
d=.stage_$name; rm -rf "$d"; mkdir -p "$d/x"
git archive "$rev" attnforge templates csrc_include | tar -x -C "$d/x"
for p in "${patches[@]}"; do patch -s -d "$d/x" -p1 < "$p"; done  # (git apply in a subfolder would skip the paths)
mv "$d/x/attnforge" "$d/attnforge_$name"; mv "$d/x/templates" "$d/x/csrc_include" "$d/"; rmdir "$d/x"
# every import of the package and its submodules, absolute or as `from attnforge import`
find "$d/attnforge_$name" -name "*.py" -exec sed -i -E \
  -e "s/\battnforge([.][a-z_]+| import|$)/attnforge_$name\1/g" {} +
grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
if ! PYTHONPATH="$d" PYTHONDONTWRITEBYTECODE=1 python3 -c "
import sys, attnforge_$name, attnforge_$name.mods
assert not [m for m in sys.modules if m.split('.')[0] == 'attnforge'], 'the copy imports the original package'
print('staged $d: attnforge_$name from', attnforge_$name.codegen.include_dir())"; then
  echo "stage_package: $d does not import cleanly" >&2; exit 1
fi

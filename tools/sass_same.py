"""Whether a change left the default decode kernels' machine code alone, without a GPU: build a set of default
decode kernels (head dims 64/128/256, bf16 and fp8 KV, both pipelines, GQA / MQA / 128-8 groups, verify steps of
2, 4 and 8 tokens, soft-cap with a window, ALiBi, float32 rows, every whole-item kernel of those specs) in each
of two source trees, disassemble them (nvdisasm) and compare the instruction streams, addresses dropped. A
template edit behind an `if constexpr` that the defaults never take should leave every one identical; a
refactor that moves code between functions may not (the 112th session's first try reordered two kernels).

    python tools/sass_same.py BASE_TREE [TREE]      (TREE defaults to this checkout; BASE_TREE e.g. a
                                                    `git worktree add /tmp/base <commit>`)

Prints each kernel that differs and how many instruction lines do; exits 1 if any differs.
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside each tree: prints "name<TAB>cubin path" for every kernel of the set, built for sm_90a.
BUILD = r"""
import dataclasses, sys
from attnforge import AttentionSpec
from attnforge.jit.builder import build_many
from attnforge.kernels.decode import DecodeKernel, spec_for_rows, whole_item_kernels
from attnforge.mods import alibi
from attnforge.mods.alibi import default_slopes
specs = []
for d in (64, 128, 256):
    for kv in ("bf16", "fp8_e4m3"):
        for hq, hkv in ((32, 8), (128, 8), (32, 1), (64, 8)):
            for pipeline in ("auto", "normal"):
                specs.append((AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=d,
                                            kv_dtype=kv, pipeline=pipeline), 1))
for q in (2, 4, 8):
    for kv in ("bf16", "fp8_e4m3"):
        specs.append((AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_dtype=kv), q))
specs.append((AttentionSpec(num_qo_heads=64, num_kv_heads=8, logits_soft_cap=30.0, window_left=128), 1))
specs.append((AttentionSpec(num_qo_heads=128, num_kv_heads=8, score_mod=alibi(default_slopes(128))), 1))
kernels = {}
for spec, q in specs:
    try:
        k = DecodeKernel(spec_for_rows(spec, q), max_q_len=q)
    except ValueError:
        continue
    for x in (k, dataclasses.replace(k, float_out=True), *whole_item_kernels(spec_for_rows(spec, q), q)):
        kernels[x.module().name] = x
paths = build_many([k.module() for k in kernels.values()], ("9.0a",))
for name, path in zip(kernels, paths):
    print(f"{name}\t{path}")
"""


def instructions(sass: str) -> list[str]:
    """The instruction lines of an nvdisasm listing, addresses and encodings dropped."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*(?:/\*\s*0x[0-9a-f]+\s*\*/)?\s*$", line)
        if m and m.group(1):
            out.append(m.group(1))
    return out


def build_tree(tree: Path, cache: Path) -> dict[str, Path]:
    env = {**os.environ, "PYTHONPATH": str(tree), "ATTNFORGE_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{tree}: the kernels did not build:\n{run.stderr[-3000:]}")
    return {name: Path(path) for name, path in (line.split("\t") for line in run.stdout.splitlines() if "\t" in line)}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    base = Path(argv[0]).resolve()
    tree = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from attnforge.jit import arch
    tool = arch.nvdisasm_path()
    if tool is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="sass_same-"))
    built = [build_tree(t, scratch / f"cache{i}") for i, t in enumerate((base, tree))]
    differ = 0
    for name in sorted(set(built[0]) | set(built[1])):
        if name not in built[0] or name not in built[1]:
            print(f"{name}: only in {'the tree' if name in built[1] else 'the base'}")
            differ += 1
            continue
        a, b = (instructions(subprocess.run([str(tool), "-c", str(side[name])], check=True, capture_output=True,
                                            text=True).stdout) for side in built)
        if a != b:
            changed = sum(1 for line in difflib.ndiff(a, b) if line[:1] in "+-")
            print(f"{name}: {changed} instruction lines differ ({len(a)} -> {len(b)} instructions)")
            differ += 1
    print(f"{len(set(built[0]) & set(built[1]))} kernels in both trees, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

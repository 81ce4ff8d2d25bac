"""Compare the machine code of one kernel across source trees, without a GPU: compile the module each
tree renders for an expression, disassemble it (nvdisasm: the test extra's wheel, or the toolkit's)
and print each tree's instruction count, registers, barriers, global loads and the opcodes whose counts
differ. Use it to vet a kernel change before spending device time on it.

    python tools/sass_mix.py EXPR KERNEL TREE [TREE ...]
    python tools/sass_mix.py "DecodeKernel(AttentionSpec(kv_dtype='fp8_e4m3')).module()" batch_decode_kernel . /tmp/base

EXPR is evaluated with AttentionSpec, DecodeKernel, whole_item_kernel, MLADecodeKernel, PrefillKernel
and QuestScoreKernel in scope, in each tree's own import of attnforge.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

RENDER = """
import sys
from attnforge import AttentionSpec
from attnforge.kernels.decode import DecodeKernel, whole_item_kernel
from attnforge.kernels.mla import MLADecodeKernel
from attnforge.kernels.prefill import PrefillKernel
from attnforge.kernels.quest import QuestScoreKernel
k = ({expr})
sys.stdout.write((k.module() if hasattr(k, 'module') else k).source)  # a kernel, or its JitModule
"""


def opcodes(sass: str, kernel: str) -> list[str]:
    """The kernel's instructions' opcodes (predicates dropped), in address order."""
    body = sass.split(f".text.{kernel}:", 1)[1].split("//--------------------- ", 1)[0]
    ops = []
    for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", body):
        ops.append(m.group(1))
    return ops


def summary(ops: list[str]) -> dict:
    return {"instructions": len(ops), "BAR.SYNC": sum(o.startswith("BAR.SYNC") for o in ops),
            "LDG": sum(o.startswith("LDG") for o in ops), "LDG.*.CONSTANT": sum(o.startswith("LDG") and
                                                                              "CONSTANT" in o for o in ops)}


def build(tree: Path, expr: str, kernel: str, nvcc: str, nvdisasm: str) -> tuple[list[str], str]:
    """The kernel's opcodes and register count as `tree` renders and compiles it."""
    src = subprocess.run([sys.executable, "-c", RENDER.format(expr=expr)], cwd=tree, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(tree)}).stdout
    cu = Path(tempfile.mkdtemp()) / "kernel.cu"
    cu.write_text(src)
    out = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
                          "-Xptxas=-v", f"-I{tree / 'csrc_include'}", str(cu), "-o", str(cu.with_suffix(".cubin"))],
                         check=True, capture_output=True, text=True).stderr
    regs = re.findall(rf"Compiling entry function '{kernel}'.*?Used (\d+) registers", out, re.S)
    sass = subprocess.run([nvdisasm, "-c", str(cu.with_suffix(".cubin"))], check=True, capture_output=True,
                          text=True).stdout
    return opcodes(sass, kernel), regs[0] if regs else "?"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    expr, kernel, trees = argv[0], argv[1], [Path(t).resolve() for t in argv[2:]]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from attnforge.jit import arch  # this checkout's toolkit search: nvcc, and nvdisasm (PATH, beside nvcc, wheel)
    tool = arch.nvdisasm_path()
    if tool is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
        return 2
    mixes = {}
    for tree in trees:
        ops, regs = build(tree, expr, kernel, str(arch.nvcc_path()), str(tool))
        mixes[tree] = Counter(ops)
        print(f"{tree}: registers {regs}, " + ", ".join(f"{k} {v}" for k, v in summary(ops).items()))
    base = mixes[trees[0]]
    for tree in trees[1:]:
        diff = {op: mixes[tree][op] - base[op] for op in set(base) | set(mixes[tree]) if mixes[tree][op] != base[op]}
        print(f"{tree} against {trees[0]}: " + (", ".join(f"{op} {d:+d}" for op, d in sorted(diff.items()))
                                                 or "the same opcode mix"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

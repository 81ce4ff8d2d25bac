"""What ptxas made of each PDL kernel's wait: in the SASS (nvdisasm -gi over a -lineinfo cubin), no
global load of a line that reads the predecessor's output may sit before the kernel's first ACQBULK
(griddepcontrol.wait). tests/jit/test_pdl.py checks the source; this checks the machine code, where
ptxas once issued decode's query loads (then ld.global.nc) ahead of the wait. Needs nvdisasm (the test
extra installs it); skipped where none is found."""
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from attnforge import AttentionSpec, codegen
from attnforge.jit import arch
from attnforge.jit.builder import BASE_FLAGS
from attnforge.kernels.decode import DecodeKernel, whole_item_kernel
from attnforge.kernels.mla import MLADecodeKernel
from attnforge.kernels.quest import QuestScoreKernel
from .test_pdl import READ_AFTER_WAIT, region_spans

NVDISASM = arch.nvdisasm_path()  # PATH, beside nvcc, or the test extra's wheel
pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

# A source line reads what a PDL kernel's predecessor writes when it lies in one of the regions
# test_pdl.READ_AFTER_WAIT names for that kernel (QStage, SlotQuery, load_q, the page-table loads, ...)
# or mentions one of these: the coherent-load helpers and the fields only predecessors write. A load
# attributed to such a line must come after the wait.
AFTER_WAIT_MARKERS = ("load_after_wait(", "page_id(", "load_floats(", "p.scores[", "p.q_pos", "p.q_neg",
                      "p.q_scale", "partial_lse[")


def _mla_spec(heads):
    return AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)


# name -> (the module's factory, the kernel): one case per PDL kernel and per way it reads its predecessor
CASES = {
    "decode-transposed": (lambda: DecodeKernel(AttentionSpec(pipeline="transposed")).module(), "batch_decode_kernel"),
    "decode-normal": (lambda: DecodeKernel(AttentionSpec(pipeline="normal")).module(), "batch_decode_kernel"),
    "decode-fp8": (lambda: DecodeKernel(AttentionSpec(kv_dtype="fp8_e4m3")).module(), "batch_decode_kernel"),
    "decode-whole-item": (lambda: whole_item_kernel(AttentionSpec()).module(), "batch_decode_kernel"),
    "decode-merge": (lambda: DecodeKernel(AttentionSpec()).module(), "batch_decode_merge_kernel"),
    "quest-score-int4": (lambda: QuestScoreKernel("bf16", "int4", 128, 8, 4).module(), "quest_score_kernel"),
    "quest-score-fp8": (lambda: QuestScoreKernel("bf16", "fp8", 128, 8, 4).module(), "quest_score_kernel"),
    "quest-select": (lambda: QuestScoreKernel("bf16", "int4", 128, 8, 4).module(), "quest_select_kernel"),
    "mla-merge": (lambda: MLADecodeKernel(_mla_spec(16), None, None, "mma", None).module(), "mla_merge_kernel"),
    "mla-merge-one-wave": (lambda: MLADecodeKernel(_mla_spec(16), None, None, "mma", None).module(),
                           "mla_merge_one_wave_kernel"),
    "mla-decode-mma": (lambda: MLADecodeKernel(_mla_spec(16), None, None, "mma", None).module(), "mla_decode_kernel"),
    "mla-decode-wgmma-roles": (lambda: MLADecodeKernel(_mla_spec(128), None, None, "wgmma", "roles").module(),
                               "mla_decode_kernel"),
    "mla-decode-wgmma-transposed": (lambda: MLADecodeKernel(AttentionSpec(
        family="mla_decode", num_qo_heads=8, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512, pipeline="transposed"),
        None, None, "wgmma", None).module(), "mla_decode_kernel"),
}


@lru_cache(maxsize=None)
def _sass(case: str, tmp: str) -> tuple[list, set]:
    """[(instruction, ((file, line), ...))] of the case's kernel in address order, each with its source
    line and the lines it was inlined at, and the kernel's marked lines."""
    make, kernel = CASES[case]
    module = make()
    src = Path(tmp) / f"{case}.cu"
    src.write_text(module.source)
    cubin = src.with_suffix(".cubin")
    subprocess.run([str(arch.nvcc_path()), *BASE_FLAGS, "-arch=sm_90a", "-cubin", f"-I{codegen.include_dir()}",
                    str(src), "-o", str(cubin)], check=True, capture_output=True)
    # -gi: each instruction's source line with the lines it was inlined at (an __ldg's own line is in
    # CUDA's headers; the caller's line is what names the buffer)
    text = subprocess.run([str(NVDISASM), "-gi", "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    body = text.split(f".text.{kernel}:", 1)[1].split("//--------------------- ", 1)[0]  # the kernel's section
    out, chain, fresh = [], (), True
    for line in body.splitlines():
        frames = re.findall(r'"([^"]+)", line (\d+)', line) if line.lstrip().startswith("//##") else []
        if frames:
            chain = (chain if not fresh else ()) + tuple((f, int(n)) for f, n in frames)
            fresh = False
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            out.append((m.group(1), chain))
            fresh = True
    return out, _region_lines(kernel, module.source, str(src))


@lru_cache(maxsize=None)
def _source_lines(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text().splitlines()) if Path(path).is_file() else ()


def _source_line(path: str, line: int) -> str:
    lines = _source_lines(path)
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _region_lines(kernel: str, module_source: str, module_path: str) -> set[tuple[str, int]]:
    """(file, line) of every line inside the regions READ_AFTER_WAIT names for the kernel, in the
    rendered module (regions of "decode", "mla", "quest", "quest-int4") or in a header."""
    lines = set()
    for where, opening in READ_AFTER_WAIT[kernel]:
        if opening is None or opening == f"{kernel}(":  # a whole kernel: its plan reads precede the wait,
            continue  # so only the markers' lines count there
        header = codegen.include_dir() / "attnforge" / where  # the copy nvcc compiled (-I), as nvdisasm names it
        path, src = (module_path, module_source) if "." not in where else (str(header), header.read_text())
        for a, b in region_spans(src, opening):
            first = src.count("\n", 0, a) + 1
            lines |= {(path, n) for n in range(first, first + src.count("\n", a, b) + 1)}
    return lines


def _loads_before_wait(sass, marked_lines=frozenset()):
    """The global loads ahead of the first ACQBULK whose source lines (the instruction's own and those
    it was inlined at) read a predecessor's output."""
    first = next(i for i, (ins, _) in enumerate(sass) if ins.split()[-1] == "ACQBULK")
    early = []
    for ins, chain in sass[:first]:
        if not re.search(r"\bLDG(STS)?\b|\bLDG(STS)?\.", ins):  # LDGSTS: cp.async
            continue
        for path, line in chain:
            text = _source_line(path, line)
            if (path, line) in marked_lines or any(mark in text for mark in AFTER_WAIT_MARKERS):
                early.append(f"{ins}  <- {Path(path).name}:{line}: {text.strip()}")
                break
    return early


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_read_of_the_predecessors_output_is_issued_before_the_wait(case, tmp_path_factory):
    sass, marked = _sass(case, str(tmp_path_factory.getbasetemp()))
    assert any(ins.split()[-1] == "ACQBULK" for ins, _ in sass), f"{case}: no griddepcontrol.wait (ACQBULK)"
    assert marked or case == "quest-select", f"{case}: no region of READ_AFTER_WAIT found"
    early = _loads_before_wait(sass, marked)
    assert not early, f"{case}: loads of the predecessor's output ahead of the wait:\n" + "\n".join(early)


def test_the_sass_check_catches_a_load_ahead_of_the_wait(tmp_path):
    # a marked load placed before ACQBULK (as ptxas placed decode's query loads once) must be reported
    marked = tmp_path / "k.cu"
    marked.write_text("x\n  v = load_after_wait(src);\n")
    at = ((str(marked), 2),)
    sass = [("LDG.E.128 R4, desc[UR8][R2.64]", at), ("ACQBULK", ()), ("LDG.E.128 R8, desc[UR8][R2.64]", at)]
    assert len(_loads_before_wait(sass)) == 1
    assert not _loads_before_wait(sass[1:])
    # so must a cp.async (LDGSTS: MLA's load_q), though no register receives it
    cp_async = [("LDGSTS.E.BYPASS.LTC128B.128 [R157], desc[UR12][R158.64], !P0", at), ("ACQBULK", ())]
    assert len(_loads_before_wait(cp_async)) == 1
    # a line inside a named region counts too, whatever its text (decode's query load was `__ldg(src)`),
    # and so does any line the load was inlined at
    plain = [("LDG.E.128.CONSTANT R4, desc[UR8][R2.64]", (("/nowhere.hpp", 7), (str(marked), 1))), ("ACQBULK", ())]
    assert not _loads_before_wait(plain) and len(_loads_before_wait(plain, {(str(marked), 1)})) == 1

"""tools/sass_mix.py: a kernel's opcodes from nvdisasm text, and the counts it compares; the toolkit
search it shares with the SASS tests (attnforge.jit.arch.nvdisasm_path)."""
from pathlib import Path

from attnforge.jit import arch
from helpers import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sass_mix.py"
SASS = """
//--------------------- .text.other_kernel --------------------------
.text.other_kernel:
        /*0000*/                   LDG.E R1, desc[UR4][R2.64] ;
//--------------------- .text.k --------------------------
.text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR8][R28.64] ;
        /*0020*/                   ACQBULK ;
        /*0030*/               @P1 LDG.E.128 R8, desc[UR8][R30.64] ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   EXIT ;
//--------------------- .nv.info --------------------------
"""


def test_opcodes_of_one_kernel_without_predicates():
    tool = load_tool("sass_mix")
    ops = tool.opcodes(SASS, "k")
    assert ops == ["LDC", "LDG.E.128.CONSTANT", "ACQBULK", "LDG.E.128", "BAR.SYNC.DEFER_BLOCKING", "EXIT"]
    assert tool.summary(ops) == {"instructions": 6, "BAR.SYNC": 1, "LDG": 2, "LDG.*.CONSTANT": 1}
    assert tool.opcodes(SASS, "other_kernel") == ["LDG.E"]


def test_nvdisasm_search_finds_a_tool_beside_nvcc_or_says_none(tmp_path, monkeypatch):
    monkeypatch.setattr(arch.shutil, "which", lambda name: None)
    (tmp_path / "nvcc").touch()
    monkeypatch.setattr(arch, "nvcc_path", lambda: tmp_path / "nvcc")
    monkeypatch.setattr(arch.importlib.util, "find_spec", lambda name: None)
    assert arch.nvdisasm_path() is None
    (tmp_path / "nvdisasm").touch()
    assert arch.nvdisasm_path() == tmp_path / "nvdisasm"


def test_render_script_takes_kernel_objects_and_modules():
    """The tool's EXPR may be a kernel (DecodeKernel(...), which has module()) or a JitModule itself: both
    render to the kernel's CUDA source (it once asked kernels for .source and failed on every one)."""
    import subprocess
    import sys
    tool, root = load_tool("sass_mix"), TOOL.parents[1]
    for expr in ("DecodeKernel(AttentionSpec())", "DecodeKernel(AttentionSpec()).module()"):
        out = subprocess.run([sys.executable, "-c", tool.RENDER.format(expr=expr)], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        assert 'extern "C"' in out and "batch_decode_kernel" in out

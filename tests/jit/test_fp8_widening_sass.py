"""fp8 decode widens the e4m3 K/V tile in registers, and the conversions are what its kernels issue most
of. An item of two n8 head tiles (a verify step of 9-16 rows, or a group of 16 on the transposed pipeline)
must widen each K and V fragment once and feed both tiles' MMAs from it: in the machine code, as many
e4m3 conversions as the one-tile kernel's (widening per tile doubled them and ran 10-12% slower on the
H200). Needs nvdisasm (the test extra installs it); skipped where none is found."""
import re
import subprocess

import pytest

from attnforge import AttentionSpec
from attnforge.jit import arch
from attnforge.jit.builder import build_many
from attnforge.kernels.decode import DecodeKernel

NVDISASM = arch.nvdisasm_path()
pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

E4M3_UNPACK = re.compile(r"\bF2FP\.[A-Z0-9]+\.E4M3\.UNPACK")


def _e4m3_conversions(kernel: DecodeKernel) -> int:
    """The decode kernel's e4m3 -> 16-bit conversion instructions in its sm_90a machine code."""
    (path,) = build_many([kernel.module()], ("9.0a",))
    text = subprocess.run([str(NVDISASM), "-c", str(path)], check=True, capture_output=True, text=True).stdout
    body = text.split(".text.batch_decode_kernel:", 1)[1].split("//--------------------- ", 1)[0]
    return len(E4M3_UNPACK.findall(body))


def _fp8_kernel(heads: tuple, q_len: int, head_dim: int = 128) -> DecodeKernel:
    spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim_qk=head_dim, kv_dtype="fp8_e4m3",
                         pipeline="transposed")
    return DecodeKernel(spec, max_q_len=q_len)


@pytest.mark.parametrize("heads,q_len,head_dim", [((32, 8), 4, 128), ((32, 8), 3, 128), ((32, 2), 1, 128),
                                                  ((32, 2), 1, 64)],
                         ids=["gqa8-q4", "gqa8-q3", "group16-q1", "group16-q1-d64"])
def test_two_head_tiles_widen_each_fragment_once(heads, q_len, head_dim):
    two_tiles = _fp8_kernel(heads, q_len, head_dim)
    one_tile = _fp8_kernel((32, 8), 2, head_dim)  # 8 rows: one n8 tile, the same tiling
    assert (two_tiles.tile_kv, two_tiles.num_stages, two_tiles.num_warps) == \
        (one_tile.tile_kv, one_tile.num_stages, one_tile.num_warps)
    one = _e4m3_conversions(one_tile)
    assert one > 0, "no e4m3 conversion found: the pattern no longer matches ptxas's spelling"
    assert _e4m3_conversions(two_tiles) == one

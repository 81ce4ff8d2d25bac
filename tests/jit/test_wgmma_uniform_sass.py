"""What ptxas made of the wgmma descriptors: a descriptor built from values ptxas cannot tell are
warp-uniform (a warpgroup index from threadIdx, a stage address from loaded tile counts) sits in vector
registers and reaches each wgmma through two R2UR moves; made warp-uniform (common.cuh: warp_uniform),
it stays in uniform registers. Checked on every wgmma batch, from its WARPGROUP.ARRIVE to the HGMMA that
commits it (gsb0), at most the broadcast's one move: the MLA transposed kernel with a producer warpgroup
had two before each of its 68 HGMMAs, the prefill kernel two before each of S's eight (thirty-fourth
session). Needs nvdisasm, as test_pdl_sass."""
import subprocess

import pytest

from attnforge import AttentionSpec
from attnforge.kernels.mla import MLADecodeKernel
from attnforge.kernels.prefill import PrefillKernel
from helpers import ptxas_log_of_async_wgmmas

from .test_pdl_sass import NVDISASM

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

MLA_TRANSPOSED = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                               head_dim_vo=512, pipeline="transposed")
CASES = {  # name -> (module factory, entry): the kernels whose batches read descriptors per wgmma
    "prefill-d128": (lambda: PrefillKernel(AttentionSpec(family="prefill", causal=True), "wgmma").module(),
                     "batch_prefill_wgmma_kernel"),
    "prefill-d256": (lambda: PrefillKernel(AttentionSpec(family="prefill", head_dim_qk=256, head_dim_vo=256),
                                           "wgmma").module(), "batch_prefill_wgmma_kernel"),
    "mla-transposed-producer": (lambda: MLADecodeKernel(MLA_TRANSPOSED, backend="wgmma", producer=True).module(),
                                "mla_decode_kernel"),
}


def batches(sass: str) -> list[list[str]]:
    """Each wgmma batch's instructions: from a WARPGROUP.ARRIVE to the first HGMMA after it that commits
    (gsb0)."""
    out, cur = [], None
    for line in sass.splitlines():
        ins = line.split("*/", 1)[1].strip() if "*/" in line else ""
        if "WARPGROUP.ARRIVE" in ins:
            cur = []
        if cur is not None and ins:
            cur.append(ins)
            if "HGMMA" in ins and "gsb0" in ins:
                out.append(cur)
                cur = None
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_wgmma_batches_take_descriptors_from_uniform_registers(case, tmp_path):
    make, entry = CASES[case]
    ptxas_log_of_async_wgmmas(make(), entry, tmp_path)
    sass = subprocess.run([str(NVDISASM), "-c", str(tmp_path / "k.cubin")], check=True, capture_output=True,
                          text=True).stdout
    found = batches(sass)
    assert len(found) >= 2 and all(any("HGMMA" in ins for ins in b) for b in found)
    # the broadcast itself may land once a batch (its shuffle's result moved to a uniform register);
    # before, every HGMMA of a batch waited on two
    moves = [[ins for ins in b if " R2UR " in f" {ins} "] for b in found]
    worst = max(moves, key=len)
    assert len(worst) <= 1, f"R2UR per wgmma batch: {[len(m) for m in moves]}, e.g. {worst[:3]}"

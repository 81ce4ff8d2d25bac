"""What ptxas made of the MLA merge's batched loads (merge_lse_states, softmax_state.cuh): a batch's
kMergeBatch LSE loads must all be issued before the first is used. Guarded loads once compiled to a
branch per state with the LSE's scaling inside it, so each load waited out its round trip before the
next was issued. Needs nvdisasm, as test_pdl_sass."""
import re

import pytest

from .test_pdl_sass import NVDISASM, _sass, _source_line

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

LOG2E = "1.4426950216293334961"  # the LSE's scaling to log2 units, the loads' first use


def test_a_batchs_lse_loads_are_issued_before_any_is_used(tmp_path_factory):
    sass, _ = _sass("mla-merge", str(tmp_path_factory.getbasetemp()))
    first_use = next(i for i, (ins, _) in enumerate(sass) if ins.startswith("FMUL") and LOG2E in ins)
    lse_loads = [ins for ins, chain in sass[:first_use] if re.match(r"LDG\.E\b", ins)
                 and any("lse_of(" in _source_line(path, line) or "partial_lse[" in _source_line(path, line)
                         for path, line in chain)]
    assert len(lse_loads) >= 8, f"only {len(lse_loads)} LSE loads in flight before the first is used: {lse_loads}"

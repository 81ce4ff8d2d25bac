"""What ptxas made of the MLA merges' batched loads (merge_lse_states, softmax_state.cuh): every batch's
kMergeBatch (or kMergeBatch + 2) LSE loads must all be issued before the first is used, and in the one-wave merge
its value loads too. Guarded loads once compiled to a branch per state with the LSE's scaling inside it, so each
load waited out its round trip before the next was issued; later ptxas put one LSE's scaling among the LSE loads,
and every load after it waited for that one. Needs nvdisasm, as test_pdl_sass."""
import re

import pytest

from .test_pdl_sass import NVDISASM, _sass, _source_line

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

LOG2E = "1.4426950216293334961"  # the LSE's scaling to log2 units, the loads' first use


def loads_before_each_batchs_first_use(sass) -> list[tuple[int, int]]:
    """(LSE loads, value loads) issued since the previous batch's first use, at each batch's first use: an LSE
    scaling with LSE loads issued since the last scaling (a scaling after value loads alone continues its batch)."""
    batches, lse, values = [], 0, 0
    for ins, chain in sass:
        if re.match(r"LDG\.E\.128\b", ins) and any("v_of(" in _source_line(p, n) for p, n in chain):
            values += 1
        elif re.match(r"LDG\.E\b", ins) and any("lse_of(" in _source_line(p, n) for p, n in chain):
            lse += 1
        elif ins.startswith("FMUL") and LOG2E in ins and lse:
            batches.append((lse, values))
            lse = values = 0
    return batches


@pytest.mark.parametrize("case,values_too", [("mla-merge", False), ("mla-merge-one-wave", True)])
def test_a_batchs_loads_are_issued_before_any_is_used(case, values_too, tmp_path_factory):
    sass, _ = _sass(case, str(tmp_path_factory.getbasetemp()))
    batches = loads_before_each_batchs_first_use(sass)
    assert sorted(lse for lse, _ in batches) == [8, 10], f"{case}: the LSE loads before each batch's first use: {batches}"
    if values_too:
        assert all(values == lse for lse, values in batches), f"{case}: value loads left for after the LSEs: {batches}"

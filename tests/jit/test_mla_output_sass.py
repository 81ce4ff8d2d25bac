"""What ptxas made of the wgmma MLA kernels' output staging (write_output, mla_decode.cu.jinja): the row
factors must not be loaded once per staged element. Scaled while staged, each factor was loaded again
after every staging store (a store that might alias it), a serial LDS -> FMUL -> STS chain of ~30 cycles
an element, 128-160 elements a thread, in every item's write (thirtieth session). Needs nvdisasm, as
test_pdl_sass."""
import re

import pytest

from .test_pdl_sass import NVDISASM, _sass, _source_line

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


@pytest.mark.parametrize("case", ["mla-decode-wgmma-roles", "mla-decode-wgmma-transposed"])
def test_row_factors_are_loaded_per_stored_chunk_not_per_staged_element(case, tmp_path_factory):
    sass, _ = _sass(case, str(tmp_path_factory.getbasetemp()))
    factor_loads = [ins for ins, chain in sass if re.match(r"LDS(\.32)?\s", ins)
                    and any("row_f[" in _source_line(path, line) for path, line in chain)]
    staging_stores = [ins for ins, chain in sass if re.match(r"STS(\.(U16|32|64))?\s", ins)
                      and any("staged_out_row" in _source_line(path, line) for path, line in chain)]
    # a thread stages 32-160 elements (the roles split's warpgroup 1: 160; the transposed kernel at h8: 32)
    assert len(staging_stores) >= 32, staging_stores[:4]
    # one factor a 16-byte row chunk, the row loop unrolled four times (plus finish_rows' own reads)
    assert len(factor_loads) <= 16, f"{len(factor_loads)} row-factor loads, e.g. {factor_loads[:4]}"

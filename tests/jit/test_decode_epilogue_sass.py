"""What nvcc and ptxas made of decode's epilogue (batch_decode.cu.jinja: publish, finish_item, the merged rows):
vector stores and vector reads where the data allow them. Built from scalars through float4*, the partial
state's store became four 4-byte stores (already in the PTX) and 16-bit rows left as four 2-byte stores; the
cross-warp scratch, at 2 + d floats a row, was read as 8-byte loads with 4-way bank conflicts (seventieth
session: -0.6..-2.9% once fixed). Needs nvdisasm, as test_pdl_sass."""
import re

import pytest

from .test_pdl_sass import NVDISASM, _sass, _source_line

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


def _from(sass, pattern: str, marker: str) -> list[str]:
    """Instructions matching `pattern` whose source line (or a line they were inlined at) holds `marker`."""
    return [ins for ins, chain in sass if re.search(pattern, ins)
            and any(marker in _source_line(path, line) for path, line in chain)]


@pytest.mark.parametrize("case", ["decode-normal", "decode-transposed"])
def test_rows_and_partial_states_leave_as_vector_stores(case, tmp_path_factory):
    sass, _ = _sass(case, str(tmp_path_factory.getbasetemp()))
    # (each also keeps a store an element for an address not so aligned: decode's out may be any view)
    assert _from(sass, r"\bSTG\.E\.128\b", "store_floats(p.partial_o"), "the partial state: no 16-byte store"
    assert _from(sass, r"\bSTG\.E\.64\b", "store_floats(out"), "the bf16 rows: no 8-byte store"


@pytest.mark.parametrize("case", ["decode-normal", "decode-transposed"])
def test_the_cross_warp_merge_reads_16_byte_vectors(case, tmp_path_factory):
    sass, _ = _sass(case, str(tmp_path_factory.getbasetemp()))
    reads = _from(sass, r"\bLDS(\.\w+)?\b", "scratch_row(scratch, w, h) + 4 + d0")
    assert reads and all(re.search(r"\bLDS\.128\b", ins) for ins in reads), reads[:4]
    if case == "decode-normal":  # its publish stores pairs of a row: 8 bytes each
        pairs = _from(sass, r"\bSTS(\.\w+)?\b", "make_float2(st.o[j]")
        assert pairs and all(re.search(r"\bSTS\.64\b", ins) for ins in pairs), pairs[:4]

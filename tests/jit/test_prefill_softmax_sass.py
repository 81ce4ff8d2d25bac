"""The per-score instruction budget of the Hopper prefill kernel's softmax, in its machine code. A consumer
thread holds 64 scores of a 128-token tile (d128: 64 rows x 128 columns over 128 threads), and the mods suite
measured that each instruction added per score costs ~11% of B1 S8192 (ALiBi's one FFMA; docs/perf-notes.md),
so a change that quietly adds one is a regression these counts catch without a GPU:
- plain causal: one exponential a score, in the one exponent loop every tile path shares (plus the two row
  rescales), and no integer-to-float conversion;
- ALiBi: interior tiles step the bias along each row in float (one FFMA a score); only the generic edge
  path converts positions per score (I2F). Converted per score on every tile (the sixth session's
  kernel), the kernel held 128 conversions a loop body;
- soft-cap: one tanh a score on each of the two paths that apply it (core tiles and edge tiles), each tanh
  issued among other work, never in a burst: two changes that left ptxas issuing a tile's 64 tanh back to back
  (the row max taken on raw scores, thirty-fourth session; a fixed row reference, ninety-fourth) cost +12%.
Needs nvdisasm, as test_pdl_sass."""
import re
import subprocess
from collections import Counter

import pytest

from attnforge import AttentionSpec, mods
from attnforge.kernels.prefill import PrefillKernel
from attnforge.mods.alibi import default_slopes
from helpers import ptxas_log_of_async_wgmmas

from .test_pdl_sass import NVDISASM

pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

SCORES = 64  # a consumer thread's scores of one tile at d128
MODS = {"plain": None, "alibi": lambda: mods.alibi(default_slopes(32)), "softcap": lambda: mods.softcap(50.0)}


def opcodes(mod, tmp_path) -> list[str]:
    """The kernel's opcodes in program order (predicates dropped)."""
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True,
                         score_mod=None if mod is None else mod())
    log = ptxas_log_of_async_wgmmas(PrefillKernel(spec, "wgmma").module(), "batch_prefill_wgmma_kernel",
                                    tmp_path)
    assert re.search(r"\b0 bytes spill stores", log), log
    sass = subprocess.run([str(NVDISASM), "-c", str(tmp_path / "k.cubin")], check=True, capture_output=True,
                          text=True).stdout
    lines = [x.split("*/", 1)[1].strip() for x in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", x)]
    return [re.sub(r"^@!?U?P[T0-9]+\s+", "", x).split(" ")[0] for x in lines]


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    return {name: opcodes(mod, tmp_path_factory.mktemp(name)) for name, mod in MODS.items()}


@pytest.fixture(scope="module")
def counts(sequences):
    return {name: Counter(ops) for name, ops in sequences.items()}


def test_plain_prefill_takes_one_exponential_a_score_and_no_conversion(counts):
    plain = counts["plain"]
    assert SCORES <= plain["MUFU.EX2"] <= SCORES + 4, plain["MUFU.EX2"]  # (+2: the rows' rescale factors)
    assert plain["I2FP.F32.S32"] == 0
    assert plain["HGMMA.64x128x16.F32.BF16"] >= 16  # (the kernel parsed: S and P.V of a tile)


def test_alibi_converts_positions_on_edge_tiles_only(counts):
    alibi, plain = counts["alibi"], counts["plain"]
    assert alibi["I2FP.F32.S32"] <= SCORES + 4, alibi["I2FP.F32.S32"]
    # one FFMA a score on interior tiles (the stepped bias) and one on the generic edge path, no more
    assert alibi["FFMA"] - plain["FFMA"] <= 2 * SCORES + 8, (alibi["FFMA"], plain["FFMA"])
    assert alibi["MUFU.EX2"] == plain["MUFU.EX2"]


def test_softcap_takes_one_tanh_a_score_on_each_path_that_applies_it(counts):
    assert counts["softcap"]["MUFU.TANH"] == 2 * SCORES, counts["softcap"]["MUFU.TANH"]


def longest_run(ops: list[str], opcode: str) -> int:
    run = best = 0
    for op in ops:
        run = run + 1 if op == opcode else 0
        best = max(best, run)
    return best


def test_softcap_issues_each_tanh_among_other_work(sequences):
    assert longest_run(["FMUL", "MUFU.TANH", "MUFU.TANH", "FMNMX", "MUFU.TANH"], "MUFU.TANH") == 2
    # (5 in the default kernel at d128: the core tile interleaves its tanh with the row max's FMNMX)
    assert longest_run(sequences["softcap"], "MUFU.TANH") <= 8, longest_run(sequences["softcap"], "MUFU.TANH")

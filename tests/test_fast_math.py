"""ex2_poly (csrc_include/attnforge/common.cuh), the softmax's exponential on the FMA pipe, run on the
host by nvcc against float64 2^x: its error bound, and exact zeros for masked (-inf) logits."""
import math
import shutil

import pytest

from helpers import run_host_program

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")

PROGRAM = r"""
#include <cmath>
#include <cstdio>
#include "attnforge/common.cuh"
int main() {
  for (int i = 0; i <= 270000; ++i) {  // -130 .. 5 in steps of 1/2000: every rounding of x
    const float x = -130.f + i * 0.0005f;
    std::printf("%.9g %.9g\n", x, attnforge::ex2_poly(x));
  }
  std::printf("%.9g %.9g\n", -INFINITY, attnforge::ex2_poly(-INFINITY));
}
"""


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    out = run_host_program(PROGRAM, tmp_path_factory.mktemp("ex2")).split()
    return [(float(out[i]), float(out[i + 1])) for i in range(0, len(out), 2)]


def test_relative_error_below_half_an_fp16_ulp(samples):
    worst = max(abs(y / 2.0 ** x - 1) for x, y in samples if x > -126)
    assert worst < 1.1e-4 < 2.0 ** -12  # P is rounded to bf16 / fp16 right after


def test_masked_and_underflowing_logits_give_exact_zeros(samples):
    assert samples[-1] == (-math.inf, 0.0)
    assert all(y == 0.0 for x, y in samples if x <= -127)
    assert all(0 <= y < 2.0 ** -125 for x, y in samples if -127 < x <= -126)  # tiny, never negative or NaN


def test_monotone_where_softmax_weights_live(samples):
    ys = [y for x, y in samples if x >= -100]
    assert all(b >= a for a, b in zip(ys, ys[1:]))


E4M3_PROGRAM = r"""
#include <cstdio>
#include "attnforge/common.cuh"
int main() {
  for (unsigned code = 0; code < 256; code += 4) {  // four codes a word, every code once
    const uint32_t x = code | (code + 1) << 8 | (code + 2) << 16 | (code + 3) << 24;
    uint32_t lo, hi;
    attnforge::e4m3x4_to_f16x4_div256(x, lo, hi);
    std::printf("%u %u %u %u\n", lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16);
  }
}
"""


def test_e4m3_widened_by_integer_ops_is_exact_over_all_codes(tmp_path):
    """The wgmma prefill producer's integer widening (fp8_int_widen): every e4m3 code as fp16 / 256, exact
    against torch's own e4m3 decoding (the NaN codes read +-480 / 256, finite; zeros keep their sign)."""
    import numpy as np
    import torch
    out = [int(t) for t in run_host_program(E4M3_PROGRAM, tmp_path).split()]
    got = torch.tensor(np.array(out, dtype=np.uint16).view(np.float16).astype(np.float64))
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double() / 256
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.equal(got[nan], torch.tensor([480.0, -480.0], dtype=torch.float64) / 256)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))  # -0 stays -0

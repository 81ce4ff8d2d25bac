"""Division by a run-time constant as a multiply and a shift (csrc_include/attnforge/common.cuh's fast_div).

For a divisor d, the host computes (mul, shift) once; the kernel then finds n // d for any 0 <= n < 2^31 as
(umulhi(n, mul) + n) >> shift, three instructions instead of a ~20-instruction division. With
shift = ceil(log2 d) and mul = floor(2^32 (2^shift - d) / d) + 1 (which fits 32 bits), the quotient is exact
for every n < 2^32 (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994);
n < 2^31 keeps umulhi(n, mul) + n inside 32 bits.
"""
from __future__ import annotations

MAX = 2 ** 31  # divisors and dividends below this


def divisor(d: int) -> tuple[int, int]:
    """(mul, shift) for fast_div by d, 1 <= d < 2^31."""
    if isinstance(d, bool) or not (isinstance(d, int) and 1 <= d < MAX):
        raise ValueError(f"intdiv.divisor: expected an int in [1, 2^31), got {d!r}; a kernel divides 32-bit "
                         f"indices by it, so pass a positive count below 2^31 (a page size, units a row)")
    shift = (d - 1).bit_length()  # ceil(log2 d)
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def fast_div(n: int, mul: int, shift: int) -> int:
    """The kernel's arithmetic, in Python integers (32-bit multiply-high, 32-bit sum): for tests."""
    return (((n * mul) >> 32) + n) % (1 << 32) >> shift

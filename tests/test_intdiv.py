"""attnforge.intdiv: the (mul, shift) pairs the kernels divide by (common.cuh's fast_div), checked in the
kernel's own 32-bit arithmetic against Python's floor division."""
import random

import pytest

from attnforge import intdiv

EDGE_DIVISORS = list(range(1, 1025)) + [(1 << k) + o for k in range(11, 31) for o in (-1, 0, 1)] + [2 ** 31 - 1]


def dividends(d: int, rng: random.Random) -> list:
    near = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, 2 ** 31 - 1, 2 ** 31 - 2, (2 ** 31 - 1) // d * d,
            (2 ** 31 - 1) // d * d - 1]
    return [n for n in near if 0 <= n < 2 ** 31] + [rng.randrange(2 ** 31) for _ in range(64)]


@pytest.mark.parametrize("chunk", range(4))
def test_fast_div_is_floor_division_below_2_31(chunk):
    rng = random.Random(chunk)
    divisors = EDGE_DIVISORS[chunk::4] + [rng.randrange(1, 2 ** 31) for _ in range(500)]
    for d in divisors:
        mul, shift = intdiv.divisor(d)
        assert 0 < mul < 2 ** 32 and 0 <= shift <= 31, (d, mul, shift)
        for n in dividends(d, rng):
            assert intdiv.fast_div(n, mul, shift) == n // d, (n, d)


def test_powers_of_two_are_plain_shifts():
    for k in range(31):
        assert intdiv.divisor(1 << k) == (1, k)


@pytest.mark.parametrize("bad", [0, -3, 2 ** 31, 1.5, True])
def test_divisors_outside_the_range_are_refused(bad):
    with pytest.raises(ValueError, match=r"\[1, 2\^31\)"):
        intdiv.divisor(bad)

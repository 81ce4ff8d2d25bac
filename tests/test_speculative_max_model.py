"""A float32 model of the prefill kernel's speculative row max (PrefillKernel(speculative_max=True)), against
float64 softmax. Per tile after the first, the weights 2^(x - m) are taken against the row's reference as it
stands, and kept only when every thread's partial row sum (32 of the row's 128 columns) is <= 2^8, which
proves every weight is (NaN and inf fail the test, as in the kernel); else the tile is recomputed against its
own max, the reference moved to it (rescale_to, not lazily). The model checks the argument the kernel rests
on: an accepted tile never holds a weight above 2^8 (the lazy rescale's bound, so P's 16-bit rounding is what
it always was), and rising scores, scores past 2^128 against the reference and rows that start at -inf all
come out as the exact softmax."""
import numpy as np
import pytest

LOG2E = np.float32(1.4426950408889634)
SLACK, LIMIT = np.float32(8.0), np.float32(256.0)


def speculative_row(scores: np.ndarray, values: np.ndarray, tile: int = 128) -> tuple[np.ndarray, int, float]:
    """The kernel's path for one row over its tiles: (output, slow tiles, largest accepted weight)."""
    m, d, o = np.float32(-np.inf), np.float32(0), np.zeros(values.shape[1], np.float32)
    slow, largest = 0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(0, len(scores), tile):
            x, v = (scores[t:t + tile] * LOG2E).astype(np.float32), values[t:t + tile]
            if t > 0:
                p = np.exp2(x - m).astype(np.float32)
                parts = [p[c::4].sum(dtype=np.float32) for c in range(4)]  # a quad's four threads split a row
                if all(part <= LIMIT for part in parts):  # (NaN and inf compare False)
                    largest = max(largest, float(p.max()))
                    d, o = d + p.sum(dtype=np.float32), o + p @ v
                    continue
                slow += 1
            bm = np.float32(x.max())
            new_m = max(m, bm) if t > 0 else (bm if bm > m + SLACK else m)  # tile 0: the lazy rescale from -inf
            scale = np.float32(1) if new_m == -np.inf else np.exp2(m - new_m, dtype=np.float32)
            m, d, o = new_m, d * scale, o * scale
            p = np.exp2(x - (m if m > -np.inf else 0)).astype(np.float32)  # (the kernel's neg_max: nothing seen yet)
            d, o = d + p.sum(dtype=np.float32), o + p @ v
    return o / d, slow, largest


def exact(scores, values):
    w = np.exp(scores.astype(np.float64) - scores.max())  # (-inf scores weigh 0)
    return (w @ values.astype(np.float64)) / w.sum()


@pytest.mark.parametrize("pattern", ["random", "rising", "jump", "late_peak", "flat_low", "masked_first"])
def test_speculative_row_is_the_softmax(pattern):
    rng = np.random.default_rng(7)
    n = 3000
    scores = rng.standard_normal(n).astype(np.float32) * 2
    if pattern == "rising":  # +5.5 nats a tile with little noise: every tile passes the reference
        scores = scores * np.float32(0.1) + np.arange(n, dtype=np.float32) * np.float32(5.5 / 128)
    elif pattern == "jump":  # keys 150, then 300 nats above the rest: weights past 2^128 (inf) against the reference
        scores[700] += 150
        scores[2100] += 300
    elif pattern == "late_peak":  # a modest rise once: one slow tile, then the fast path again
        scores[1500:] += 7
    elif pattern == "flat_low":  # every score far below zero: the reference follows them down from tile 0
        scores -= 500
    elif pattern == "masked_first":  # a row that sees nothing in tile 0: m = -inf into tile 1 (inf weights)
        scores[:128] = -np.inf
    values = rng.standard_normal((n, 16)).astype(np.float32)
    out, slow, largest = speculative_row(scores, values)
    np.testing.assert_allclose(out, exact(scores, values), rtol=2e-4, atol=2e-5)
    assert largest <= 256.0  # an accepted tile never held a weight past the lazy rescale's bound
    tiles = -(-n // 128) - 1
    expected_slow = {"random": (0, 2), "rising": (tiles - 1, tiles), "jump": (2, 2), "late_peak": (1, 1),
                     "flat_low": (0, 2), "masked_first": (1, 1)}[pattern]
    assert expected_slow[0] <= slow <= expected_slow[1], slow

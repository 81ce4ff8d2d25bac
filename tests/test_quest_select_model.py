"""A Python model of templates/quest_score.cu.jinja's quest_select_kernel (radix select of the top
pages, then an ordered compaction) against torch.topk + sort, the reference selection, on random
scores including repeated values, negatives and more or fewer pages than the budget."""
import struct

import numpy as np
import pytest
import torch


def order_key(f: float) -> int:
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    return (~u & 0xFFFFFFFF) if u & 0x80000000 else (u | 0x80000000)


def kernel_model(scores: np.ndarray, k_budget: int) -> list[int]:
    """The positions the kernel keeps, in list order (one request)."""
    n = len(scores)
    k = min(k_budget, n)
    keys = [0xFFFFFFFF if j == n - 1 else order_key(float(scores[j])) for j in range(n)]
    prefix, mask, take_eq, select = 0, 0, k, n > k
    if select:
        for shift in (24, 16, 8, 0):
            hist = [0] * 256
            for key in keys:
                if key & mask == prefix:
                    hist[(key >> shift) & 255] += 1
            above, b = 0, 255
            while b > 0 and above + hist[b] < take_eq:
                above += hist[b]
                b -= 1
            prefix |= b << shift
            take_eq -= above
            mask |= 255 << shift
    kept, eq_seen = [], 0
    for j, key in enumerate(keys):  # the rounds of 256 only batch this walk
        eq = select and key == prefix
        if not select or key > prefix or (eq and eq_seen < take_eq):
            kept.append(j)
        eq_seen += eq
    return kept


def reference(scores: np.ndarray, k_budget: int) -> list[int]:
    s = torch.tensor(scores, dtype=torch.float32)
    s[-1] = float("inf")
    return sorted(torch.topk(s, min(k_budget, len(s))).indices.tolist())


@pytest.mark.parametrize("seed", range(30))
def test_kernel_selection_matches_topk(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    scores = rng.standard_normal(n).astype(np.float32) * float(rng.choice([1e-3, 1.0, 1e4]))
    k = int(rng.integers(1, 700))
    got = kernel_model(scores, k)
    assert len(got) == min(k, n) and got == sorted(got) and got[-1] == n - 1
    assert got == reference(scores, k)


def test_ties_take_the_first_in_list_order():
    scores = np.array([1, 5, 5, 5, 2, 5, 0], dtype=np.float32)  # four 5s for two places (the last page is forced)
    assert kernel_model(scores, 3) == [1, 2, 6]  # any two 5s make a valid top 3: the kernel takes the first

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


BYTE_DIGITS = ((24, 8), (16, 8), (8, 8), (0, 8))  # select_large: 4 passes of 8 bits
REGISTER_PATH_DIGITS = ((21, 11), (10, 11), (0, 10))  # the register path: 3 passes of 11, 11, 10 bits


def radix_select(scores: np.ndarray, k: int, find_bin, digits=BYTE_DIGITS) -> tuple[list[int], int, int, bool]:
    """Keys (the last page's the largest), and the k-th largest key T with the number of keys equal to
    T in the top k, by MSB-first passes over `digits` (shift, bits); find_bin(hist, take_eq) -> (bin,
    keys above it)."""
    n = len(scores)
    keys = [0xFFFFFFFF if j == n - 1 else order_key(float(scores[j])) for j in range(n)]
    prefix, mask, take_eq, select = 0, 0, k, n > k
    if select:
        for shift, bits in digits:
            hist = [0] * (1 << bits)
            for key in keys:
                if key & mask == prefix:
                    hist[(key >> shift) & ((1 << bits) - 1)] += 1
            b, above = find_bin(hist, take_eq)
            prefix |= b << shift
            take_eq -= above
            mask |= ((1 << bits) - 1) << shift
    return keys, prefix, take_eq, select


def serial_bin(hist: list[int], take_eq: int) -> tuple[int, int]:
    """One thread walks the bins from the top (select_large)."""
    above, b = 0, len(hist) - 1
    while b > 0 and above + hist[b] < take_eq:
        above += hist[b]
        b -= 1
    return b, above


def kernel_model(scores: np.ndarray, k_budget: int) -> list[int]:
    """The positions the kernel keeps, in list order (one request)."""
    n = len(scores)
    k = min(k_budget, n)
    keys, prefix, take_eq, select = radix_select(scores, k, serial_bin)
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


def fast_kernel_model(scores: np.ndarray, k_budget: int, threads: int = 16, run: int = 8) -> list[int]:
    """quest_select_kernel's register path (n <= threads * run): thread t holds keys [t*run, t*run+run);
    each pass (digits of 11, 11, 10 bits) finds its bin by a suffix scan of the histogram, thread t
    taking the pair of bins hi = top - 2t and hi - 1; the write-out is an exclusive scan of equal
    keys, then of kept pages, over the threads in order."""
    n = len(scores)
    assert n <= threads * run
    k = min(k_budget, n)

    def scan_bin(hist, take_eq):
        top, cta = len(hist) - 1, 1024  # the kernel's 1024 threads scan 2048 bins
        his = [top - 2 * t for t in range(cta)]
        h_hi = [hist[hi] if hi >= 1 else 0 for hi in his]
        h_lo = [hist[hi - 1] if hi >= 1 else 0 for hi in his]
        pair = [a + b for a, b in zip(h_hi, h_lo)]
        above = np.concatenate([[0], np.cumsum(pair)[:-1]])
        hits = [t for t in range(cta) if above[t] < take_eq <= above[t] + pair[t]]
        assert len(hits) == 1  # exactly one thread writes the new prefix
        t = hits[0]
        if above[t] + h_hi[t] >= take_eq:
            return his[t], int(above[t])
        return his[t] - 1, int(above[t] + h_hi[t])
    keys, prefix, take_eq, select = radix_select(scores, k, scan_bin, REGISTER_PATH_DIGITS)
    runs = [range(t * run, min(n, t * run + run)) for t in range(threads)]
    eq_counts = [sum(select and keys[j] == prefix for j in r) for r in runs]
    gt_counts = [sum((not select) or keys[j] > prefix for j in r) for r in runs]
    eq_before = np.concatenate([[0], np.cumsum(eq_counts)[:-1]])
    mine = [max(0, min(e, take_eq - int(b))) for e, b in zip(eq_counts, eq_before)]
    pos = np.concatenate([[0], np.cumsum([g + m for g, m in zip(gt_counts, mine)])[:-1]])
    out = [None] * k
    for t, r in enumerate(runs):
        p, seen = int(pos[t]), int(eq_before[t])
        for j in r:
            eq = select and keys[j] == prefix
            if (not select) or keys[j] > prefix or (eq and seen < take_eq):
                out[p] = j
                p += 1
            seen += eq
    assert None not in out  # every slot of the selection is written exactly once
    return out


@pytest.mark.parametrize("seed", range(40))
def test_register_path_matches_topk(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 129))
    scores = rng.standard_normal(n).astype(np.float32) * float(rng.choice([1e-3, 1.0, 1e4]))
    if seed % 4 == 0:
        scores = np.round(scores)  # many exact ties
    k = int(rng.integers(1, 140))
    got = fast_kernel_model(scores, k)
    assert got == kernel_model(scores, k)  # the same pages as the ballot path, ties included
    ref = reference(scores, k)
    if seed % 4:  # no exact ties: torch.topk's choice is the only one
        assert got == ref
    else:  # ties (and +0 / -0): topk may take other equal keys, so compare the values kept
        forced = scores.copy()
        forced[-1] = np.inf
        assert sorted(forced[got].tolist()) == sorted(forced[ref].tolist())


def test_register_path_ties_take_the_first_in_list_order():
    scores = np.array([1, 5, 5, 5, 2, 5, 0], dtype=np.float32)
    assert fast_kernel_model(scores, 3, threads=4, run=2) == [1, 2, 6]

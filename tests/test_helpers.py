"""The GPU tests' shared helpers, checked on the CPU: the CUDA-graph replay protocol
(helpers.replays_after_replans, with a recording stand-in for torch's graph API: the GPU tests of every
wrapper rely on its order), the NaN poison of the cache slots no request holds, and the accuracy rule's
allowance for a lagging row max."""
import contextlib
import math

import numpy as np
import pytest
import torch

from helpers import (largest_holders, log_test_memory, poison_unused_slots, python_tensors, replays_after_replans,
                     weight_rounding_allowance)


def test_replay_protocol_order(monkeypatch):
    log = []

    class FakeGraph:
        def replay(self):
            log.append("replay")

    @contextlib.contextmanager
    def capture(graph):
        log.append("capture-begin")
        yield
        log.append("capture-end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    plans = iter(range(10))

    def replan():
        n = next(plans)
        log.append(f"plan{n}")
        return n

    got = list(replays_after_replans(lambda: log.append("run"), replan, lambda: log.append("refresh"), 2))
    assert got == [(0, 1), (1, 2)]  # each round checks what its own plan returned
    assert log == ["plan0", "run", "capture-begin", "run", "capture-end",
                   "plan1", "refresh", "replay", "sync", "plan2", "refresh", "replay", "sync"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_poison_reaches_exactly_the_slots_no_request_holds(dtype, layout):
    page, heads, d = 4, 2, 8
    indptr, indices, last = np.array([0, 2, 3]), np.array([3, 1, 0]), np.array([1, 4])  # page 2 unlisted
    shape = (4, 2, page, heads, d) if layout == "NHD" else (4, 2, heads, page, d)
    cache = torch.ones(shape).to(dtype)
    poison_unused_slots(cache, indptr, indices, last, page, layout)
    k = cache[:, 0].float() if layout == "NHD" else cache[:, 0].float().transpose(1, 2)  # [P, page, Hkv, D]
    nan = k.isnan().all(dim=(2, 3))
    assert not (k.isnan().any(dim=(2, 3)) & ~nan).any()  # a slot is poisoned whole or not at all
    expected = torch.zeros(4, page, dtype=torch.bool)
    expected[1, 1:] = True  # request 0's last page (1) holds one token
    expected[2] = True  # no request lists page 2
    assert torch.equal(nan, expected)
    assert torch.equal(cache[:, 1].float().isnan(), cache[:, 0].float().isnan())  # V as K


@pytest.mark.parametrize("code", ["C7511", "C7514", "C7515", "C7517", "C7518"])
def test_async_wgmma_check_fails_on_each_serialising_info_line(monkeypatch, tmp_path, code):
    """helpers.ptxas_log_of_async_wgmmas, on ptxas logs given to it: each of the five info lines that say
    wgmmas were serialised or waited on fails the check (only C7517 is also produced by a real build in
    the suite: test_ptxas_keeps_early_scores_asynchronous; C7518 came once, from a kernel since rewritten;
    C7511 from a measured design, not merged: the forty-third section of docs/perf-notes.md), and a clean
    log returns the entry's part."""
    import subprocess
    import types

    import helpers
    entry = "Compiling entry function 'k'"
    clean = f"ptxas info    : {entry} for 'sm_90a'\nptxas info    : Used 90 registers, 0 bytes spill stores\n"
    logs = iter([clean, clean + f"ptxas info    : ({code}) Potential Performance Loss: wgmma serialized\n"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=next(logs), stderr=""))
    module = types.SimpleNamespace(name="probe", source="// a stand-in: nvcc is not run")
    assert "0 bytes spill stores" in helpers.ptxas_log_of_async_wgmmas(module, "k", tmp_path)
    with pytest.raises(AssertionError, match=f"probe: ptxas {code}"):
        helpers.ptxas_log_of_async_wgmmas(module, "k", tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_rounding_allowance_bounds_weights_rounded_against_a_lagging_max(dtype):
    """Peaked rows, their reference max lagging the true one by 0-8 (log2), P = 2^(s - ref) rounded to
    16 bits and normalised by the unrounded sum (as the roles kernel does): the output's error stays
    within the allowance, and a lagging max does show more error than an eager one on these rows."""
    g = torch.Generator().manual_seed(0)
    worst_lazy, worst_eager = 0.0, 0.0
    for _ in range(300):
        s = torch.randn(257, generator=g, dtype=torch.float64) * 3
        s[int(torch.randint(257, (1,), generator=g))] += 12  # one dominant key
        v = torch.randn(257, 64, generator=g, dtype=torch.float64)
        exact = torch.softmax(s * math.log(2), 0) @ v
        for lag, kind in ((float(torch.rand(1, generator=g)) * 8, "lazy"), (0.0, "eager")):
            p = torch.exp2(s - (s.max() - lag))
            out = (p.to(dtype).double() @ v) / p.sum()
            err = (out - exact).abs().max().item()
            assert err <= weight_rounding_allowance(dtype, v.abs().max().item())
            if kind == "lazy":
                worst_lazy = max(worst_lazy, err)
            else:
                worst_eager = max(worst_eager, err)
    assert worst_lazy > 1.5 * worst_eager  # the dominant weight, exact only under an eager max


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_rounding_allowance_bounds_partial_rows_rounded_before_their_merge(dtype):
    """Keys split into 2-8 chunks, each chunk's normalised output rounded to 16 bits (a cascade's levels, a split
    prefill's 16-bit partials), merged by their exact LSE weights: the merged row stays within the allowance
    (the weights sum to one; these rows reach ~38% of it), and rounding the partials does show more error than
    merging them in float64."""
    g = torch.Generator().manual_seed(1)
    worst_rounded, worst_exact = 0.0, 0.0
    for _ in range(200):
        n = int(torch.randint(64, 1024, (1,), generator=g))
        s = torch.randn(n, generator=g, dtype=torch.float64) * 2
        v = torch.randn(n, 64, generator=g, dtype=torch.float64) * 2
        exact = torch.softmax(s, 0) @ v
        cuts = torch.linspace(0, n, int(torch.randint(3, 10, (1,), generator=g))).long().tolist()
        parts = [(torch.softmax(s[a:b], 0) @ v[a:b], torch.logsumexp(s[a:b], 0)) for a, b in zip(cuts, cuts[1:])]
        weights = torch.softmax(torch.stack([lse for _, lse in parts]), 0)
        for rounded in (True, False):
            merged = sum(w * (o.to(dtype).double() if rounded else o) for w, (o, _) in zip(weights, parts))
            err = (merged - exact).abs().max().item()
            assert err <= weight_rounding_allowance(dtype, v.abs().max().item())
            if rounded:
                worst_rounded = max(worst_rounded, err)
            else:
                worst_exact = max(worst_exact, err)
    assert worst_rounded > 100 * worst_exact


def test_memory_log_names_what_holds_the_largest_tensor():
    """The memory log's diagnosis (conftest, ATTNFORGE_TEST_MEMLOG): the tensors Python holds, and for the largest
    the types that refer to it and to those; nothing under the size bound, and this test's own lists not counted."""
    class Table:  # a stand-in for a module-level cache that outlives a test
        pass
    table = Table()
    table.entries = {"kv": torch.empty(9 << 20, dtype=torch.float64)}  # 72 MiB
    mine = python_tensors(lambda t: t.untyped_storage().nbytes() >= 8 << 20)
    assert sum(t is table.entries["kv"] for _, t in mine) == 1
    said = largest_holders(mine)
    assert said.startswith("; largest 72 MiB [9437184], 1 references, held by dict <- T"), said
    assert largest_holders(mine, min_bytes=1 << 30) == "" and largest_holders([]) == ""


def test_memory_log_names_a_frame_kept_after_its_function():
    """A frame kept off the stack (here by a stored exception's traceback) holding a tensor is named by its
    function, and the running stack's frames (this test's) are not named as holders."""
    def fails(t):
        raise ValueError(t.numel())
    stored = {}
    try:
        fails(torch.empty(9 << 20, dtype=torch.float64))
    except ValueError as e:
        stored["error"] = e  # (its traceback keeps fails' frame, and the frame its argument)
    mine = python_tensors(lambda t: t.untyped_storage().nbytes() == 72 << 20)
    said = largest_holders(mine)
    assert said.startswith("; largest 72 MiB [9437184], 1 references, held by frame fails@test_helpers.py:"), said
    assert "traceback" in said and "test_memory_log_names_a_frame" not in said


def test_memory_log_writes_a_line_a_test_and_gives_the_cache_back(monkeypatch, tmp_path):
    """The line conftest's fixture appends after each GPU test (torch's CUDA counters stubbed: no GPU here)."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 << 20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 5 << 20)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    path = tmp_path / "memory.log"
    log_test_memory(str(path), "tests/a.py::test_one")
    log_test_memory(str(path), "tests/a.py::test_two")
    lines = path.read_text().splitlines()
    cuda = len(python_tensors(lambda t: t.is_cuda))  # (none on a machine without a GPU)
    assert lines == [f"3 MiB live, 5 MiB reserved, {cuda} CUDA tensors Python holds (0 MiB): tests/a.py::test_{n}"
                     for n in ("one", "two")] and emptied == [True, True]


@pytest.mark.parametrize("rescale_slack", [0, 8])
def test_mla_reference_check_passes_the_rounded_reference_and_fails_a_wrong_row(rescale_slack):
    """test_mla_gpu.check_against_reference (run_case's and the repeat test's check) on CPU tensors: the
    float64 reference rounded to bf16 passes, with and without the lagging-max allowance; it returns the
    reference output and LSE, one row a query head; one wrong output row fails it. (Its extraction from
    run_case broke run_case on the GPU twice: eighty-sixth session.)"""
    from types import SimpleNamespace
    from test_mla_gpu import check_against_reference, mla_reference
    g = torch.Generator().manual_seed(7)
    heads, q_len, lengths = 16, 2, [5, 0, 70]
    per_req = [torch.randn(n, 576, generator=g).bfloat16().float() for n in lengths]
    q_nope = torch.randn(len(lengths) * q_len, heads, 512, generator=g).bfloat16()
    q_pe = torch.randn(len(lengths) * q_len, heads, 64, generator=g).bfloat16()
    w = SimpleNamespace(kernel=SimpleNamespace(rescale_slack=rescale_slack))
    scale = 0.1
    ref, _ = mla_reference(q_nope, q_pe, per_req, q_len, scale)
    out = ref.bfloat16()
    got, lse = check_against_reference(w, out, q_nope, q_pe, per_req, q_len, scale, 1.0, {}, "cpu")
    assert torch.equal(got, ref) and lse.shape == (len(lengths) * q_len, heads)
    assert torch.isinf(lse[q_len:2 * q_len]).all() and torch.isfinite(lse[:q_len]).all()  # the empty request
    wrong = out.clone()
    wrong[-1, 3] += 0.25  # one head's row of the last query, off by far more than bf16's rounding
    with pytest.raises(AssertionError, match="max err"):
        check_against_reference(w, wrong, q_nope, q_pe, per_req, q_len, scale, 1.0, {}, "cpu")

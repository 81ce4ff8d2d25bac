"""The GPU tests' shared helpers, checked on the CPU: the CUDA-graph replay protocol
(helpers.replays_after_replans, with a recording stand-in for torch's graph API: the GPU tests of every
wrapper rely on its order) and the NaN poison of the cache slots no request holds."""
import contextlib

import numpy as np
import pytest
import torch

from helpers import poison_unused_slots, replays_after_replans


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

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

"""The shared CUDA-graph replay protocol (helpers.replays_after_replans), checked on the CPU with a
recording stand-in for torch's graph API: the GPU tests of every wrapper rely on its order."""
import contextlib

import torch

from helpers import replays_after_replans


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

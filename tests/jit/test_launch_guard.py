"""loader.on_device: the device guard around every wrapper's launch is skipped only where torch's current device
already is the wrapper's (torch's own guard would change nothing then); any other device gets the guard."""
import torch

from attnforge.jit import loader


def _fake_cuda(monkeypatch, current: int) -> list:
    guarded = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", lambda d: guarded.append(d) or ("guard", d))
    return guarded


def test_no_guard_on_the_current_device(monkeypatch):
    guarded = _fake_cuda(monkeypatch, current=1)
    with loader.on_device(torch.device("cuda", 1)):
        pass
    assert guarded == []


def test_another_device_is_guarded(monkeypatch):
    guarded = _fake_cuda(monkeypatch, current=0)
    assert loader.on_device(torch.device("cuda", 1)) == ("guard", torch.device("cuda", 1))
    assert guarded == [torch.device("cuda", 1)]


def test_a_device_without_an_index_is_guarded(monkeypatch):
    guarded = _fake_cuda(monkeypatch, current=0)
    loader.on_device(torch.device("cuda"))
    assert guarded == [torch.device("cuda")]

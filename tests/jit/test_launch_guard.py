"""loader.on_device: the device guard around every wrapper's launch (and plan upload) is skipped only where torch's
current device already is the wrapper's (torch's own guard would change nothing then); any other device gets it."""
import torch

from attnforge.jit import loader


def _fake_cuda(monkeypatch, current: int) -> list:
    guarded = []
    monkeypatch.setattr(loader._thread, "has_context", True, raising=False)  # (this thread's context: made once)
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


def test_plan_uploads_enqueue_on_their_own_device(monkeypatch):
    """A plan's staged copy and its event go on the wrapper's device (its stream, in its context) whatever
    device is current; on the current device no guard is entered."""
    import contextlib
    from attnforge.jit.upload import StagedUpload
    events = []

    class Recorded(StagedUpload):  # the CUDA calls recorded, in host memory
        def _alloc(self, n):
            return torch.zeros(n, dtype=torch.int32), [torch.zeros(n, dtype=torch.int32) for _ in range(2)]

        def _stream(self):
            events.append("stream")
            return 0

        def _copy(self, dst, src, nbytes, stream):
            events.append(f"copy {nbytes}")

        def _record(self, event, stream):
            events.append("record")
            return 1

    @contextlib.contextmanager
    def guard(d):
        events.append(("enter", d))
        yield
        events.append(("exit", d))
    monkeypatch.setattr(loader._thread, "has_context", True, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", guard)
    Recorded(8, torch.device("cuda", 1)).upload(4)
    one = torch.device("cuda", 1)
    assert events == [("enter", one), "stream", "copy 16", "record", ("exit", one)]
    events.clear()
    Recorded(8, torch.device("cuda", 0)).upload(4)
    assert events == ["stream", "copy 16", "record"]


def test_each_threads_first_call_makes_a_context_current_once(monkeypatch):
    """The driver's current context is per thread and a new thread has none: on the current device, on_device makes
    one current at a thread's first call (ensure_context) and not again; each new thread does the same."""
    import threading
    made = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(loader, "ensure_context", lambda device: made.append((threading.get_ident(), device)))

    def calls():
        for _ in range(3):
            with loader.on_device(torch.device("cuda", 0)):
                pass
    for _ in range(2):
        t = threading.Thread(target=calls)
        t.start()
        t.join()
    assert len(made) == 2 and made[0][1] == torch.device("cuda", 0)

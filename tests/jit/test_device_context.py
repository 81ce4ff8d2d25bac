"""Which context a library's function handles belong to (CPU, a fake driver with a context stack per thread).

A CUfunction is bound to the context current when cuKernelGetFunction runs. A library for cuda:1 looked up while
cuda:0's context is current gives handles that fail on cuda:1's streams, so loader.device_context pushes the
device's primary context around the lookup and pops it after. tests/test_multi_gpu.py runs the same on two GPUs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnforge.jit import loader


class FakeDriver:
    """The driver calls device_context and LoadedLibrary make; contexts are ("ctx", device), functions
    ("fn", name, the context current at the lookup)."""
    CUresult = SimpleNamespace(CUDA_SUCCESS=0)

    def __init__(self, current=None):
        self.stack = [current] if current is not None else []
        self.retained, self.set_current = [], []

    def _current(self):
        return self.stack[-1] if self.stack else None

    def cuInit(self, flags):
        return (0,)

    def cuCtxGetCurrent(self):
        ctx = self._current()
        return 0, (None if ctx is None else Handle(ctx))

    def cuCtxGetDevice(self):
        return 0, self._current()[1]

    def cuDeviceGet(self, index):
        return 0, index

    def cuDevicePrimaryCtxRetain(self, dev):
        self.retained.append(dev)
        return 0, ("ctx", dev)

    def cuCtxPushCurrent(self, ctx):
        self.stack.append(ctx)
        return (0,)

    def cuCtxPopCurrent(self):
        return 0, self.stack.pop()

    def cuCtxSetCurrent(self, ctx):
        self.set_current.append(ctx)
        self.stack[-1:] = [ctx]
        return (0,)

    def cuLibraryLoadData(self, *args):
        return 0, "library"

    def cuLibraryGetKernel(self, library, name):
        return 0, name.decode()

    def cuKernelGetFunction(self, kernel):
        assert self._current() is not None, "a function looked up with no context current"
        return 0, ("fn", kernel, self._current())

    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic",
                                           CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static")

    def cuFuncGetAttribute(self, attr, function):  # (the shared-memory limit read at load, in the function's context)
        assert function[2] == self._current(), "a function's attribute read outside its context"
        return 0, {"max_dynamic": 48 * 1024, "static": 4}[attr]


class Handle:
    """A context handle as cuda-python gives it: int() is its address (non-zero)."""

    def __init__(self, ctx):
        self.ctx = ctx

    def __int__(self):
        return 1 + self.ctx[1]


@pytest.fixture
def fake(monkeypatch):
    def install(current):
        drv = FakeDriver(current)
        monkeypatch.setattr(loader, "driver", lambda: drv)
        monkeypatch.setattr(loader, "_retained", {})
        return drv
    return install


@pytest.mark.parametrize("current", [("ctx", 0), None])
def test_a_library_for_the_second_gpu_binds_its_functions_to_that_gpus_context(fake, tmp_path, current):
    """With cuda:0's context current, or none: the functions are cuda:1's and the context stack is as it was."""
    drv = fake(current)
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\0")
    lib = loader.LoadedLibrary(cubin, ("attention_kernel", "merge_kernel"), torch.device("cuda", 1))
    assert {lib[n].function for n in ("attention_kernel", "merge_kernel")} == {
        ("fn", "attention_kernel", ("ctx", 1)), ("fn", "merge_kernel", ("ctx", 1))}
    assert drv.stack == ([current] if current else []), "device_context must pop what it pushed"
    assert lib["attention_kernel"].device == torch.device("cuda", 1)
    assert lib["attention_kernel"]._smem_limit == 48 * 1024 - 4  # (the static bytes off the driver's 48 KB)


def test_the_devices_own_context_is_used_as_it_is(fake):
    """Where the device's context is already current nothing is pushed (the common, one-GPU case)."""
    drv = fake(("ctx", 1))
    with loader.device_context(torch.device("cuda", 1)):
        assert drv.stack == [("ctx", 1)]
    assert drv.retained == []


def test_the_primary_context_is_retained_once_and_popped_on_errors(fake):
    drv = fake(("ctx", 0))
    for _ in range(3):
        with loader.device_context(torch.device("cuda", 1)):
            assert drv.stack == [("ctx", 0), ("ctx", 1)]
    assert drv.retained == [1]
    with pytest.raises(RuntimeError, match="inside"):
        with loader.device_context(torch.device("cuda", 1)):
            raise RuntimeError("inside")
    assert drv.stack == [("ctx", 0)]


@pytest.mark.parametrize("torch_device", [0, 1])
def test_ensure_context_leaves_torchs_current_device_alone(fake, monkeypatch, torch_device):
    """No context yet: for torch's current device the primary context is set current (what torch would bind); for
    another device, torch's own switch makes that device's context (its switch back is lazy), and nothing is set
    behind torch's back, which would move the device torch reports as current."""
    drv = fake(None)
    switched = []

    class TorchSwitch:  # torch.cuda.device(1): cudaSetDevice makes the context current; the lazy switch back leaves it
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            switched.append(self.index)
            drv.stack[-1:] = [("ctx", self.index)]

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch_device)
    monkeypatch.setattr(torch.cuda, "device", TorchSwitch)
    loader.ensure_context(torch.device("cuda", 1))
    assert drv.stack == [("ctx", 1)]
    if torch_device == 1:
        assert drv.set_current == [("ctx", 1)] and switched == []
    else:
        assert drv.set_current == [] and switched == [1]

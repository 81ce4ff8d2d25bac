"""LoadedKernel raises a kernel's dynamic shared memory attribute past the driver's default limit, which is 48 KB
less the kernel's static __shared__ variables: a launch of exactly 48 KB beside a 4-byte static flag failed with
CUDA_ERROR_INVALID_VALUE (fp8 verify items of 49-60 rows on the normal pipeline, hundred-and-fourteenth session).
Here the driver is a recorder, in host memory."""
import ctypes
from types import SimpleNamespace

import pytest

from attnforge.jit import loader

SUCCESS = 0


class FakeDriver:
    """The driver calls LoadedKernel and dynamic_smem_limit make, recorded."""
    CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS)
    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic",
                                           CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static",
                                           CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT="carveout")

    def __init__(self, max_dynamic, static):
        self.values, self.calls = {"max_dynamic": max_dynamic, "static": static}, []

    def cuFuncGetAttribute(self, attr, function):
        self.calls.append(("get", attr, function))
        return SUCCESS, self.values[attr]

    def cuFuncSetAttribute(self, function, attr, value):
        self.calls.append(("set", attr, value))
        return (SUCCESS,)

    def CUstream(self, handle):
        return handle

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        self.calls.append(("launch", smem))
        return (SUCCESS,)


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver(max_dynamic=48 * 1024 - 16, static=16)
    monkeypatch.setattr(loader, "driver", lambda: drv)
    monkeypatch.setattr(loader, "current_stream_handle", lambda: 7)
    return drv


class Params(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int)]


def test_the_limit_is_the_drivers_value_for_the_function(fake):
    assert loader.dynamic_smem_limit("fn") == 48 * 1024 - 16
    assert fake.calls == [("get", "max_dynamic", "fn"), ("get", "static", "fn")]


@pytest.mark.parametrize("max_dynamic,static,limit", [(48 * 1024, 4, 48 * 1024 - 4), (48 * 1024, 0, 48 * 1024),
                                                      (100_000, 4, 48 * 1024 - 4), (30_000, 4, 30_000)])
def test_static_memory_comes_off_the_48_kb_whatever_the_driver_reports(monkeypatch, max_dynamic, static, limit):
    """(Where a driver reported a flat 48 KB, or a raised limit, the static bytes still count.)"""
    monkeypatch.setattr(loader, "driver", lambda: FakeDriver(max_dynamic, static))
    assert loader.dynamic_smem_limit("fn") == limit


@pytest.mark.parametrize("smem,raised", [(48 * 1024 - 16, False), (48 * 1024, True), (100_000, True), (0, False)])
def test_a_launch_past_the_limit_raises_the_attribute_first(fake, smem, raised):
    k = loader.LoadedKernel("lib.cubin", "kern", "fn", None, loader.dynamic_smem_limit("fn"))
    fake.calls.clear()
    k.launch((2,), (128,), Params(1), smem=smem)
    expected = [("set", "max_dynamic", smem), ("set", "carveout", 100)] if raised else []
    assert fake.calls == expected + [("launch", smem)]
    fake.calls.clear()
    k.launch((2,), (128,), Params(1), smem=smem)  # raised once: the next launch goes straight to the driver
    assert fake.calls == [("launch", smem)]

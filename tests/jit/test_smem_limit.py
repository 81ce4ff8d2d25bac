"""LoadedKernel raises a kernel's dynamic shared memory attribute past the driver's default limit, which is 48 KB
less the kernel's static __shared__ variables: a launch of exactly 48 KB beside a 4-byte static flag failed with
CUDA_ERROR_INVALID_VALUE (fp8 verify items of 49-56 rows on the normal pipeline, hundred-and-fourteenth session).
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
                                           CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT="carveout")

    def __init__(self, default_limit):
        self.default_limit, self.calls = default_limit, []

    def cuFuncGetAttribute(self, attr, function):
        self.calls.append(("get", attr, function))
        return SUCCESS, self.default_limit

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
    drv = FakeDriver(default_limit=48 * 1024 - 16)  # (16 static bytes)
    monkeypatch.setattr(loader, "driver", lambda: drv)
    monkeypatch.setattr(loader, "current_stream_handle", lambda: 7)
    return drv


class Params(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int)]


def test_the_limit_is_the_drivers_value_for_the_function(fake):
    assert loader.dynamic_smem_limit("fn") == 48 * 1024 - 16
    assert fake.calls == [("get", "max_dynamic", "fn")]


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

"""Programmatic dependent launch (attnforge/jit/loader.py, wait_for_prior_grid in common.cuh): a kernel
launched with PDL may run while the previous kernel in the stream finishes, so it must wait for that
grid before it reads anything. CPU: the launch configuration, the refusal of kernels that do not wait,
and, for every kernel that may be launched so, a wait as the first statement of its body; before sm_90
a pdl=True launch is an ordinary one."""
import ctypes
import re

import pytest
import torch

from attnforge import AttentionSpec
from attnforge.jit import loader
from attnforge.kernels.decode import DecodeKernel
from attnforge.kernels.mla import MLADecodeKernel
from attnforge.kernels.quest import QuestScoreKernel


def test_launch_config_allows_programmatic_serialization():
    config = loader.pdl_launch_config((3, 2, 1), (128, 1, 1), 4096, 0)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (3, 2, 128, 4096)
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == loader.driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


def test_pdl_launch_of_a_kernel_that_does_not_wait_is_refused():
    k = loader.LoadedKernel("lib", "batch_prefill_kernel", function=None)
    with pytest.raises(ValueError, match="waits for the prior grid"):
        k.launch((1,), (32,), params=None, pdl=True)  # refused before any driver call


def _sources():
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    return [DecodeKernel(AttentionSpec()).module().source, MLADecodeKernel(mla).module().source,
            QuestScoreKernel("bf16", "fp8", 128, 8, 4).module().source]


@pytest.mark.parametrize("kernel", sorted(loader.PDL_KERNELS))
def test_every_pdl_kernel_waits_before_anything_else(kernel):
    bodies = [m for src in _sources() for m in re.finditer(rf'extern "C" __global__[^{{]*\b{kernel}\(', src)]
    assert len(bodies) == 1, f"{kernel}: defined {len(bodies)} times in the rendered modules"
    src = bodies[0].string
    first = src[src.index("{", bodies[0].end()) + 1:].lstrip().split(";")[0]
    assert first == "wait_for_prior_grid()", f"{kernel} starts with {first!r}"


class _RecordingDriver:
    """The real cuda-python driver module, but launches are recorded instead of made (no GPU here)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cuLaunchKernel(self, *args):
        self.calls.append("cuLaunchKernel")
        return (self.real.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, *args):
        self.calls.append("cuLaunchKernelEx")
        return (self.real.CUresult.CUDA_SUCCESS,)


@pytest.mark.parametrize("major,expected", [(8, "cuLaunchKernel"), (9, "cuLaunchKernelEx"), (10, "cuLaunchKernelEx")])
def test_pdl_launch_is_an_ordinary_one_before_sm90(monkeypatch, major, expected):
    fake = _RecordingDriver(loader.driver())
    monkeypatch.setattr(loader, "driver", lambda: fake)
    monkeypatch.setattr(loader, "pdl_supported", lambda device_index=None: major >= 9)
    k = loader.LoadedKernel("lib", "quest_select_kernel", function=None)
    k.launch((4,), (128,), ctypes.c_int(0), stream=0, pdl=True)
    k.launch((4,), (128,), ctypes.c_int(0), stream=0)  # without pdl: always the ordinary call
    assert fake.calls == [expected, "cuLaunchKernel"]


def test_pdl_support_follows_the_compute_capability(monkeypatch):
    loader._capability_major.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (8, 0), 1: (9, 0)}[index])
    try:
        assert not loader.pdl_supported(0) and loader.pdl_supported(1)
    finally:
        loader._capability_major.cache_clear()

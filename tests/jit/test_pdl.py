"""Programmatic dependent launch (attnforge/jit/loader.py, wait_for_prior_grid in common.cuh): a kernel
launched with PDL may run while the previous kernel in the stream finishes, so it must wait for that
grid before it reads anything. CPU: the launch configuration, the refusal of kernels that do not wait,
and, for every kernel that may be launched so, a wait as the first statement of its body."""
import re

import pytest

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

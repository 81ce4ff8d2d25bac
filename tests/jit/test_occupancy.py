"""The planners size persistent grids for kernel.ctas_per_sm CTAs an SM (a rule in each kernel class); once a
cubin is loaded, registry.check_occupancy asks the driver how many the SM holds and warns where it is fewer."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from attnforge import AttentionSpec
from attnforge.jit import registry
from attnforge.jit.registry import OccupancyWarning, check_occupancy


class FakeLoaded:
    def __init__(self, held):
        self.held, self.asked = held, []

    def max_active_ctas(self, threads, smem):
        self.asked.append((threads, smem))
        return self.held


def kernel(ctas_per_sm=2, threads=256, smem_bytes=100_000):
    return SimpleNamespace(ctas_per_sm=ctas_per_sm, threads=threads, smem_bytes=smem_bytes)


def test_fewer_ctas_than_planned_warns_with_the_fix():
    loaded = FakeLoaded(held=1)
    with pytest.warns(OccupancyWarning, match=r"sizes grids for 2 CTAs per SM, but this GPU holds 1 .*ctas_per_sm=1"):
        check_occupancy(kernel(), "decode_x", loaded)
    assert loaded.asked == [(256, 100_000)]  # the launch's block and dynamic shared memory


def test_the_warning_is_exported():
    import attnforge
    assert attnforge.OccupancyWarning is OccupancyWarning and issubclass(OccupancyWarning, UserWarning)


def test_a_kernel_no_sm_can_hold_says_its_launches_fail():
    with pytest.warns(OccupancyWarning, match="cannot hold one of its CTAs .* launches will fail"):
        check_occupancy(kernel(), "prefill_x", FakeLoaded(held=0))


@pytest.mark.parametrize("held", [2, 3])
def test_as_many_or_more_is_silent(held):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_occupancy(kernel(), "decode_x", FakeLoaded(held))


def test_modules_without_a_planned_occupancy_are_not_asked():
    loaded = FakeLoaded(held=0)
    for key in (AttentionSpec(), SimpleNamespace(ctas_per_sm=2), SimpleNamespace(threads=1, smem_bytes=0), "merge"):
        check_occupancy(key, "m", loaded)
    assert loaded.asked == []


def _default_kernels():
    """The kernels the wrappers pick by default across the families' main shapes."""
    from attnforge.kernels.decode import DecodeKernel, whole_item_kernel, whole_item_kernels
    from attnforge.kernels.mla import MLADecodeKernel, default_backend as mla_backend
    from attnforge.kernels.prefill import PrefillKernel, default_backend
    decode = [AttentionSpec(), AttentionSpec(pipeline="normal"), AttentionSpec(head_dim_qk=256),
              AttentionSpec(head_dim_qk=64), AttentionSpec(kv_dtype="fp8_e4m3"),
              AttentionSpec(num_qo_heads=32, num_kv_heads=1), AttentionSpec(num_qo_heads=32, num_kv_heads=4)]
    ks = [DecodeKernel(s) for s in decode] + [k for s in decode for k in whole_item_kernels(s)]  # (4-CTA ones too)
    ks.append(whole_item_kernel(AttentionSpec(pipeline="normal"), max_q_len=4))  # the verify step's, 4 CTAs an SM
    for heads, pipeline in ((8, "transposed"), (16, "transposed"), (16, "normal"), (64, "normal"), (128, "normal")):
        s = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576,
                          head_dim_vo=512, pipeline=pipeline)
        ks.append(MLADecodeKernel(s, backend=mla_backend(s)))
    for d, dv, kv in ((64, 64, "bf16"), (128, 128, "bf16"), (256, 256, "bf16"), (192, 128, "bf16"),
                      (128, 128, "fp8_e4m3")):
        s = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, head_dim_qk=d, head_dim_vo=dv,
                          kv_dtype=kv, causal=True)
        ks.append(PrefillKernel(s, default_backend(s)))
    ks.append(PrefillKernel(AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True), "mma"))
    # shapes the rules once got wrong: an m16 tile of 7 rows (ptxas alone took 216 registers, 2 CTAs) and
    # dynamic shared memory that fills the SM exactly at 4 CTAs (the static last_chunk_flag left room for 3)
    ks += [DecodeKernel(AttentionSpec(num_qo_heads=56, num_kv_heads=8, pipeline="normal", kv_dtype=kv))
           for kv in ("bf16", "fp8_e4m3")]
    ks.append(DecodeKernel(AttentionSpec(head_dim_qk=256, kv_dtype="fp8_e4m3", pipeline="transposed"),
                           tile_kv=32, stages=3, num_warps=2))
    return ks


@pytest.mark.gpu
def test_default_kernels_hold_the_ctas_their_planners_assume():
    """On this GPU every default kernel's CTAs per SM (the driver's count over the loaded cubin) is at least its
    class's ctas_per_sm, and loading it warns of nothing."""
    device, problems = torch.device("cuda", torch.cuda.current_device()), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", OccupancyWarning)
        for k in _default_kernels():
            module = k.module()
            lib = registry.get_library(k, k.module, device)
            held = lib[module.kernel_names[0]].max_active_ctas(k.threads, k.smem_bytes)
            if held < k.ctas_per_sm:
                problems.append(f"{module.name}: holds {held}, planned {k.ctas_per_sm}")
    assert not problems, problems


class Planned:  # (a kernel class is hashable: it keys the registry)
    ctas_per_sm, threads, smem_bytes = 3, 128, 69632


def test_get_library_checks_the_main_kernel_once_at_load(monkeypatch):
    """registry.get_library asks about the module's first kernel (the attention kernel; merge kernels follow it)
    when it loads the library, and a cached library is not asked again."""
    loaded = FakeLoaded(held=1)

    class FakeLibrary:
        def __init__(self, path, kernel_names, device):
            self.names = kernel_names

        def __getitem__(self, name):
            assert name == self.names[0]
            return loaded
    monkeypatch.setattr(registry, "LoadedLibrary", FakeLibrary)
    monkeypatch.setattr(registry._build, "build", lambda module: "unused.cubin")
    monkeypatch.setattr(registry, "_libraries", {})
    module = SimpleNamespace(name="decode_x", kernel_names=("batch_decode_kernel", "batch_decode_merge_kernel"))
    key = Planned()
    with pytest.warns(OccupancyWarning, match="decode_x"):
        registry.get_library(key, lambda: module, torch.device("cuda", 0))
    registry.get_library(key, lambda: module, torch.device("cuda", 0))
    assert len(loaded.asked) == 1

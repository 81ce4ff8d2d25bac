"""load_kernels() on a machine without a GPU (the registry stubbed): it asks for every kernel a wrapper's plans
may launch, so that no later plan's run builds or loads one. Each test plans batches that pick each kernel and
checks that what run() asks the registry for (or the plan picked) is among what load_kernels() asked for."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchMLADecode, BatchPrefill
from attnforge.decode import BatchDecode
from attnforge.jit import registry
from attnforge.merge import MergeSpec
from helpers import csr_table as table, stub_host_prefill


@pytest.fixture
def asked(monkeypatch):
    """The keys the registry is asked for, in order (its libraries: no GPU here)."""
    keys = []

    def get_library(key, make_module, device):
        keys.append(key)
        return None

    monkeypatch.setattr(registry, "get_library", get_library)
    return keys


def on_a_gpu(w):
    """A host-only wrapper named as on cuda:0 (torch.device needs no GPU), so load_kernels asks the registry."""
    w.device = torch.device("cuda", 0)
    return w


def test_decode_loads_the_kernel_of_every_plan(asked):
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=256)
    names = on_a_gpu(w).load_kernels()
    loaded = set(asked)
    assert len(names) == len(loaded) == 3  # the default kernel and two whole-item kernels (GQA 32/8, d128)
    rng = np.random.default_rng(0)
    batches = [[8192] * 16, [1024] * 64, [1000], [512] * 256]  # a whole-item kernel each, then the default
    batches += [list(rng.integers(0, 9000, size=rng.integers(1, 257))) for _ in range(30)]
    picked = set()
    for lengths in batches:
        w.plan(*table(lengths), page_size=16)
        picked.add(w.planned_kernel[0])
    assert picked == loaded  # every kernel loaded was picked by some plan, and no plan picked another


def test_decode_under_cuda_graphs_loads_the_whole_item_kernels_only_where_plans_may_pick_them(asked):
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    w.use_cuda_graph = True  # (whole_items=None: a graph keeps the default kernel)
    assert w.launchable_kernels() == (w.kernel,)
    w.whole_items = True
    assert w.launchable_kernels() == (w.kernel, *(launch.kernel for launch in w._wholes))


def test_mla_loads_the_default_and_the_transposed_kernel(asked):
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                         page_size=64)
    w = BatchMLADecode.host_only(spec)
    w.max_q_len = 2  # (host_only plans one token a request; two take the default 64-row kernel)
    on_a_gpu(w).load_kernels()
    picked = set()
    for lengths, q_len in (([131072], 1), ([8192] * 16, 1), ([4096] * 8, 2)):
        w.plan(*table(lengths, 64), page_size=64, q_len=q_len)
        picked.add(w.kernel)
    assert len(picked) == 2 and picked == set(asked)


def test_prefill_loads_both_kv_kinds_and_the_merge(monkeypatch):
    rec = stub_host_prefill(monkeypatch, lambda t, box: bytes(128))
    keys = []
    monkeypatch.setattr(registry, "get_library", lambda key, make, device: keys.append(key) or rec)
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, kv_dtype="fp8_e4m3",
                                   causal=True), device="cpu")
    names = on_a_gpu(w).load_kernels()
    w.device = torch.device("cpu")  # (its runs below, on host tensors)
    loaded = set(keys)
    # the paged kernel, the ragged TMA twin, their float32-partials twins (plans that split KV) and the merge
    assert MergeSpec(torch.float32, torch.bfloat16) in loaded and len(names) == len(loaded) == 5
    keys.clear()
    q = torch.randn(80, 8, 128).bfloat16()
    k, v = (torch.randn(2000, 2, 128).to(torch.float8_e4m3fn) for _ in range(2))
    for kv_len in (100, 2000):  # one slot, then split KV merged by LSE
        w.plan(np.array([0, 80]), np.array([0, kv_len]))
        w.run(q, (k[:kv_len], v[:kv_len]))
    paged = torch.randn(8, 2, 16, 2, 128).to(torch.float8_e4m3fn)
    w.plan(np.array([0, 80]), *table([100]), page_size=16)
    w.run(q, paged)
    assert set(keys) <= loaded and len(set(keys)) == 4  # each run's kernel (ragged, split, paged) and the merge
    # were loaded ahead


@pytest.mark.parametrize("graph", [False, True])
def test_cascade_loads_float_row_kernels_for_its_levels_and_suffix_and_their_merges(asked, graph):
    """CascadeDecode.load_kernels: the suffix's decode kernels and the levels' prefill kernels, each writing
    float32 rows, and the merges of float32 rows (a split level's, into float32; the cascade's, into the output
    type). Under CUDA graphs a level never splits: no float32 -> float32 merge."""
    from attnforge.cascade import CascadeDecode
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    c = on_a_gpu(CascadeDecode.host_only(spec, use_cuda_graph=graph))
    names = c.load_kernels()
    assert len(names) == len(set(asked)) == len(c.launchable_kernels())
    decode = [k for k in asked if type(k).__name__ == "DecodeKernel"]
    prefill = [k for k in asked if type(k).__name__ == "PrefillKernel"]
    assert decode and all(k.float_out for k in decode) and len(decode) == (1 if graph else 3)
    assert prefill and all(k.partial_out and k.exact_max for k in prefill)  # (the levels' default)
    merges = {k for k in asked if isinstance(k, MergeSpec)}
    assert merges == {MergeSpec(torch.float32, torch.bfloat16)} | (
        set() if graph else {MergeSpec(torch.float32, torch.float32)})


def test_prefill_without_split_kv_loads_no_merge(asked):
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2), device="cpu", split_kv=False)
    assert not any(isinstance(k, MergeSpec) for k in w.launchable_kernels())
    assert len(on_a_gpu(w).load_kernels()) == len(asked) == len(w.launchable_kernels())


def test_a_kernel_missing_from_a_no_jit_cache_is_refused_at_load_kernels(tmp_path, monkeypatch):
    """Serving hosts copy the cache and set ATTNFORGE_DISABLE_JIT=1 (docs/serving.md): load_kernels() then names a
    missing kernel at start-up, before any library is loaded."""
    from attnforge.jit import MissingModuleError
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNFORGE_DISABLE_JIT", "1")

    def no_load(*args, **kwargs):
        raise AssertionError("a library was loaded")

    monkeypatch.setattr(registry, "LoadedLibrary", no_load)
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    with pytest.raises(MissingModuleError, match="python -m attnforge build"):
        on_a_gpu(w).load_kernels()


def test_a_host_only_wrapper_has_nothing_to_load(asked):
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    with pytest.raises(ValueError, match=r"expected a wrapper on a CUDA device, got one on cpu\. Construct it"):
        w.load_kernels()
    assert not asked

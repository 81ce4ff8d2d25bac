"""load_kernels() on the GPU: after it, plans that pick each of the wrapper's kernels run correctly and load no
library (the registry's loader is replaced by one that fails)."""
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, BatchPrefill, reference
from attnforge.jit import registry
from helpers import assert_attention_close, decode_expected, make_paged_case, poison

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_more_loads(monkeypatch):
    def refuse(path, *args, **kwargs):
        raise AssertionError(f"a run loaded {path} after load_kernels()")
    return lambda: monkeypatch.setattr(registry, "LoadedLibrary", refuse)


def test_decode_runs_every_kernel_it_loaded_without_loading_again(no_more_loads):
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    w = BatchDecode(spec)
    assert len(w.load_kernels()) == len(w.launchable_kernels()) == 3
    no_more_loads()
    picked = set()
    for lengths in ([300] * 16, [100] * 64, [7, 1000, 0, 65]):  # the two whole-item kernels, then the default
        q, cache, table, per_req = make_paged_case(spec, lengths, 16, seed=len(lengths))
        w.plan(*table, page_size=16)
        picked.add(w.planned_kernel[0])
        out = w.run(q, cache, out=poison(q.shape, q.dtype))
        ref, _, low = decode_expected(spec, q, per_req)
        assert_attention_close(out.cpu(), ref, low, f"decode of {len(lengths)} requests after load_kernels")
    assert picked == set(w.launchable_kernels())


def test_prefill_split_kv_after_load_kernels_loads_nothing(no_more_loads):
    spec = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, causal=True)
    w = BatchPrefill(spec)
    w.load_kernels()
    no_more_loads()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 128, generator=g).bfloat16().cuda() for n, h in ((40, 8), (3000, 2), (3000, 2)))
    w.plan([0, 40], [0, 3000])
    assert w._plan["num_slots"] > 1  # (the merge's module is among those loaded)
    out = w.run(q, (k, v), out=poison(q.shape, q.dtype))
    ref, _ = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    low, _ = reference.attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal=True, dtype=torch.float32)
    assert_attention_close(out.cpu(), ref, low.bfloat16(), "split prefill after load_kernels")


def test_cascade_after_load_kernels_loads_nothing(no_more_loads):
    """CascadeDecode.load_kernels: a plan whose shared level splits (float32 partials merged into float32 rows)
    and whose suffix runs the float32-rows decode kernel, merged into bf16, then loads no library."""
    from attnforge.cascade import CascadeDecode
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    c = CascadeDecode(spec)
    names = c.load_kernels()
    assert sum("_outf32_" in n for n in names) >= 2 and "merge_states_float_outbf16" in names
    no_more_loads()
    lengths = [3000, 5, 70, 1, 16]  # the shared prefix (whole pages), then each request's own tokens
    q, cache, (indptr, indices, last), per = make_paged_case(spec, lengths, 16, seed=9)
    q = q[1:]
    c.plan(levels=[([0, 4], indptr[:2], indices[:indptr[1]], last[:1])], suffix=(indptr[1:] - indptr[1],
           indices[indptr[1]:], last[1:]), page_size=16)
    assert c.levels[0]._plan["num_slots"] > 1  # (the float32 -> float32 merge is among those loaded)
    out = c.run(q, cache, out=poison(q.shape, q.dtype))
    whole = [(torch.cat([per[0][0], k]), torch.cat([per[0][1], v])) for k, v in per[1:]]
    ref, _, low = decode_expected(spec, q, whole)
    assert_attention_close(out.cpu(), ref, low, "cascade after load_kernels")

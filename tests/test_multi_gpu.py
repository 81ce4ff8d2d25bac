"""Two GPUs: each kernel family on the second GPU while torch's current device is the first, both GPUs in turn
with the same specs, a CUDA graph on the second, and a fresh process whose first attnforge call targets the second.

Engines run a model on several GPUs of one host. Some pass device="cuda:N" and never call torch.cuda.set_device,
so a kernel's handles must belong to its own device's context, and torch's current device must stay as it was.
Skipped where fewer than two GPUs are present (the gpu marker's skip covers machines with none).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill, reference
from attnforge.mla import DEEPSEEK_SM_SCALE
from helpers import (assert_attention_close, assert_lse_close, decode_expected, decode_in_a_fresh_process,
                     make_paged_case, poison)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

SECOND = torch.device("cuda", 1)
LENGTHS = [0, 1, 17, 300, 1000, 4100]


@pytest.fixture(autouse=True)
def _first_gpu_current():
    """Each test starts and must end with torch's current device 0 (the engine's default), whatever it launched."""
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "attnforge changed torch's current device"


def decode_on(device, spec=None, lengths=LENGTHS, page_size=16, seed=0, **wrapper_kw):
    """BatchDecode on `device` against the float64 reference; returns the wrapper."""
    spec = spec or AttentionSpec()
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, lengths, page_size, seed)
    q, cache = q.to(device), cache.to(device)
    w = BatchDecode(spec, device=device, **wrapper_kw)
    w.plan(indptr, indices, last, page_size=page_size)
    out, lse = w.run(q, cache, out=poison((len(lengths), spec.num_qo_heads, spec.head_dim_vo), q.dtype, device),
                     return_lse=True)
    assert out.device == w.device and lse.device == w.device  # (w.device: "cuda" resolved to an index)
    torch.cuda.synchronize(device)
    check_decode(spec, q, out, lse, per_req)
    return w


def check_decode(spec, q, out, lse, per_req):
    ref, ref_lse, low = decode_expected(spec, q, per_req)
    assert_attention_close(out.cpu(), ref, low, f"{spec.name} on {out.device}")
    assert_lse_close(lse, ref_lse, spec.name)


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_decode_on_the_second_gpu_while_the_first_is_current(pipeline):
    decode_on(SECOND, AttentionSpec(pipeline=pipeline))


def test_both_gpus_in_turn_with_the_same_spec():
    """The registry keeps a library per device: the same spec's kernels on both GPUs, alternately, with one
    wrapper per device and a fresh one for each round."""
    spec = AttentionSpec(num_qo_heads=16, num_kv_heads=4)
    for seed, device in enumerate(["cuda:1", "cuda:0", "cuda:1", "cuda:0"]):
        decode_on(torch.device(device), spec, seed=seed)


def test_device_cuda_follows_the_current_device():
    """device="cuda" (no index) binds a wrapper to torch's current device when it is built."""
    with torch.cuda.device(1):
        w = decode_on(torch.device("cuda"), seed=3)
    assert w.device == SECOND


def test_tensors_on_the_other_gpu_are_refused_before_a_launch():
    spec = AttentionSpec()
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, [5, 40], 16)  # on cuda:0
    w = BatchDecode(spec, device=SECOND)
    w.plan(indptr, indices, last, page_size=16)
    with pytest.raises(ValueError, match="cuda:1"):
        w.run(q, cache.to(SECOND))
    with pytest.raises(ValueError, match="cuda:1"):
        w.run(q.to(SECOND), cache)


def test_cuda_graph_on_the_second_gpu_replays_after_replans():
    spec = AttentionSpec()
    rng = np.random.default_rng(0)
    pages, page_size, batch = 600, 16, 6
    cache = torch.randn(pages, 2, page_size, spec.num_kv_heads, 128, device=SECOND).bfloat16()
    q = torch.randn(batch, spec.num_qo_heads, 128, device=SECOND).bfloat16()
    w = BatchDecode(spec, device=SECOND, use_cuda_graph=True, max_batch_size=batch, max_num_pages=pages)

    def replan():
        lengths = rng.integers(0, 1500, size=batch)
        n = -(-lengths // page_size)
        indptr = np.concatenate([[0], np.cumsum(n)])
        indices = rng.permutation(pages)[:indptr[-1]]
        last = np.where(n > 0, lengths - (n - 1) * page_size, 0)
        w.plan(indptr, indices, last, page_size=page_size)
        return reference.gather_paged(cache[:, 0].float().cpu(), cache[:, 1].float().cpu(), "NHD", indptr, indices,
                                      last, page_size)

    replan()
    out = poison((batch, spec.num_qo_heads, 128), torch.bfloat16, SECOND)
    lse = torch.empty(batch, spec.num_qo_heads, device=SECOND)
    with torch.cuda.device(1):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            w.run(q, cache, out=out, lse=lse)  # warm-up outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            w.run(q, cache, out=out, lse=lse)
    for _ in range(4):
        per_req = replan()
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize(SECOND)
        check_decode(spec, q, out, lse, per_req)


@pytest.mark.parametrize("backend", [None, "mma"])
def test_prefill_on_the_second_gpu(backend):
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=4, causal=True)
    qo, kv = [1, 130, 700], [1, 300, 2000]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(n), h, 128, generator=g).bfloat16().to(SECOND)
               for n, h in ((qo, 16), (kv, 4), (kv, 4)))
    qo_indptr, kv_indptr = np.cumsum([0] + qo), np.cumsum([0] + kv)
    w = BatchPrefill(spec, device=SECOND, **({"backend": backend} if backend else {}))
    w.plan(qo_indptr, kv_indptr)
    out, lse = w.run(q, (k, v), out=poison(q.shape, q.dtype, SECOND), return_lse=True)
    torch.cuda.synchronize(SECOND)
    for b in range(len(qo)):
        rows, keys = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        qs, ks, vs = q[rows].cpu(), k[keys].cpu(), v[keys].cpu()
        ref, ref_lse = reference.attention(qs, ks, vs, causal=True)
        low, _ = reference.attention(qs.float(), ks.float(), vs.float(), causal=True, dtype=torch.float32)
        assert_attention_close(out[rows].cpu(), ref, low.to(q.dtype), f"prefill request {b}")
        assert_lse_close(lse[rows], ref_lse, "prefill")


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_on_the_second_gpu(heads):
    lengths, page_size = [0, 70, 1000, 3000], 64
    g = torch.Generator().manual_seed(heads)
    n = [-(-L // page_size) for L in lengths]
    indptr = np.cumsum([0] + n)
    indices = torch.randperm(indptr[-1] + 2, generator=g).numpy()[:indptr[-1]]
    last = np.array([L - (p - 1) * page_size if p else 0 for L, p in zip(lengths, n)])
    kv = torch.randn(indptr[-1] + 2, page_size, 576, generator=g).bfloat16()
    q_nope = torch.randn(len(lengths), heads, 512, generator=g).bfloat16()
    q_pe = torch.randn(len(lengths), heads, 64, generator=g).bfloat16()
    w = BatchMLADecode(num_qo_heads=heads, device=SECOND)
    w.plan(indptr, indices, last, page_size=page_size)
    caches = (kv[..., :512].contiguous().to(SECOND), kv[..., 512:].contiguous().to(SECOND))
    out, lse = w.run(q_nope.to(SECOND), q_pe.to(SECOND), *caches, return_lse=True)
    torch.cuda.synchronize(SECOND)
    for b, L in enumerate(lengths):
        rows = kv[torch.as_tensor(indices[indptr[b]:indptr[b + 1]], dtype=torch.long)].reshape(-1, 576)[:L].double()
        args = (q_nope[b:b + 1].double(), q_pe[b:b + 1].double(), rows[:, :512], rows[:, 512:])
        ref, ref_lse = reference.mla_attention(*args, sm_scale=DEEPSEEK_SM_SCALE)
        low, _ = reference.mla_attention(*(a.float() for a in args), sm_scale=DEEPSEEK_SM_SCALE, dtype=torch.float32)
        slack = 2.0 ** -8 * rows[:, :512].abs().max().item() if L and w.kernel.rescale_slack > 0 else 0.0
        assert_attention_close(out[b:b + 1].cpu(), ref, low.bfloat16(), f"MLA h{heads} request {b}", slack)
        assert_lse_close(lse[b:b + 1], ref_lse, f"MLA h{heads}")


def test_merge_append_and_attention_on_the_second_gpu():
    va, vb = (torch.randn(9, 4, 128, device=SECOND).bfloat16() for _ in range(2))
    sa, sb = (torch.randn(9, 4, device=SECOND) for _ in range(2))
    out, lse = attnforge.merge_state(va, sa, vb, sb)
    ref, ref_lse = reference.merge_states(torch.stack([va, vb], 1).cpu(), torch.stack([sa, sb], 1).cpu())
    assert out.device == SECOND and torch.allclose(out.double().cpu(), ref, atol=1e-2)
    assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-4)

    cache = torch.zeros(8, 2, 16, 4, 128, device=SECOND).bfloat16()
    k, v = (torch.randn(5, 4, 128, device=SECOND).bfloat16() for _ in range(2))
    batch, pos = torch.tensor([0, 0, 1, 1, 1], device=SECOND), torch.tensor([0, 17, 3, 4, 30], device=SECOND)
    indices, indptr = torch.tensor([5, 2, 7, 0], device=SECOND), torch.tensor([0, 2, 4], device=SECOND)
    want = cache.clone()
    reference.append_paged_kv(k, v, batch, pos, want, indices, indptr)
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr)
    assert torch.equal(cache, want)

    q, kk, vv = (torch.randn(2, 8, 200, 64, device=SECOND).half() for _ in range(3))
    got = attnforge.attention(q, kk, vv)
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), kk.double(), vv.double())
    low = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), vv.float())
    assert_attention_close(got, expect, low.half(), "attention() on cuda:1")


def test_virtual_cache_on_the_second_gpu():
    """VirtualKVCache maps its physical chunks on its own device (the location in cuMemCreate and cuMemSetAccess),
    and a decode there reads them."""
    from attnforge.kvcache import VirtualKVCache
    lengths = [1, 3000, 0]
    c = VirtualKVCache(num_layers=1, max_batch=3, max_len=4096, num_kv_heads=8, head_dim=128, device=SECOND)
    k, v = c.tensors(0)
    assert k.device == SECOND
    for slot, n in enumerate(lengths):
        c.grow(slot, n)
        k[slot, :n] = torch.randn(n, 8, 128, device=SECOND).bfloat16()
        v[slot, :n] = torch.randn(n, 8, 128, device=SECOND).bfloat16()
    q = torch.randn(3, 32, 128, device=SECOND).bfloat16()
    w = BatchDecode(AttentionSpec(), device=SECOND)
    w.plan(*c.decode_plan(range(3), lengths), page_size=c.max_len)
    out = w.run(q, (k, v))
    for b, n in enumerate(lengths[:2]):
        ref, _ = reference.attention(q[b:b + 1].cpu(), k[b, :n].cpu(), v[b, :n].cpu())
        assert (out[b].cpu().double() - ref[0]).abs().max().item() < 2e-2
    assert torch.all(out[2] == 0)
    c.close()


def test_a_fresh_process_whose_first_call_targets_the_second_gpu():
    """No CUDA context exists when the wrapper is built: building, planning and running on cuda:1 must leave torch's
    current device at 0 and give the reference's answer."""
    current, err = decode_in_a_fresh_process("cuda:1")
    assert current == 0 and err < 2e-2

"""Worker threads: engines plan a step (and some run it) off the main thread. The CUDA driver keeps a current
context per thread, and a new thread has none until something makes one current, so every driver call attnforge
makes (a plan's copy and event, a launch, a library load) must work in a thread whose first CUDA work it is."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill, reference
from helpers import assert_attention_close, decode_expected, decode_in_a_fresh_process, make_paged_case, poison

pytestmark = pytest.mark.gpu


def in_new_thread(fn):
    """fn() in a fresh thread; its result, or its exception raised here."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join(600)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["value"]


def decode_case(seed=0, spec=None):
    spec = spec or AttentionSpec(num_qo_heads=16, num_kv_heads=4)
    q, cache, table, per_req = make_paged_case(spec, [0, 1, 33, 900, 2500], 16, seed)
    ref, _, low = decode_expected(spec, q, per_req)
    return spec, q, cache, table, ref, low


def test_plan_in_a_worker_thread_and_run_in_the_main_one():
    spec, q, cache, (indptr, indices, last), ref, low = decode_case(0)
    w = BatchDecode(spec)
    in_new_thread(lambda: w.plan(indptr, indices, last, page_size=16))
    torch.cuda.synchronize()
    out = w.run(q, cache, out=poison(q.shape, q.dtype))
    assert_attention_close(out.cpu(), ref, low, "planned in a thread")


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_build_plan_and_run_in_a_worker_thread(use_cuda_graph):
    """Everything in the new thread, the wrapper's construction (its library's load) included; twice, so the second
    thread finds the library loaded by the first."""
    spec, q, cache, (indptr, indices, last), ref, low = decode_case(1, AttentionSpec(num_qo_heads=8, num_kv_heads=8))

    def step():
        w = BatchDecode(spec, use_cuda_graph=use_cuda_graph, max_batch_size=8, max_num_pages=1024)
        w.plan(indptr, indices, last, page_size=16)
        out = w.run(q, cache, out=poison(q.shape, q.dtype))
        torch.cuda.synchronize()
        return out.cpu()
    for _ in range(2):
        assert_attention_close(in_new_thread(step), ref, low, "a wrapper of a worker thread")


def test_prefill_and_mla_in_a_worker_thread():
    spec = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, causal=True)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 128, generator=g).bfloat16().cuda() for n, h in ((300, 8), (700, 2), (700, 2)))

    def prefill():
        w = BatchPrefill(spec)
        w.plan(np.array([0, 300]), np.array([0, 700]))
        out = w.run(q, (k, v), out=poison(q.shape, q.dtype))
        torch.cuda.synchronize()
        return out.cpu()
    out = in_new_thread(prefill)
    ref, _ = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    low, _ = reference.attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal=True, dtype=torch.float32)
    assert_attention_close(out, ref, low.bfloat16(), "prefill in a thread")

    kv = torch.randn(20, 64, 576, generator=g).bfloat16()
    q_nope, q_pe = torch.randn(2, 16, 512, generator=g).bfloat16(), torch.randn(2, 16, 64, generator=g).bfloat16()

    def mla():
        w = BatchMLADecode(num_qo_heads=16)
        w.plan(np.array([0, 3, 10]), np.arange(10), np.array([64, 5]), page_size=64)
        out = w.run(q_nope.cuda(), q_pe.cuda(), kv[..., :512].contiguous().cuda(), kv[..., 512:].contiguous().cuda())
        torch.cuda.synchronize()
        return out.cpu()
    out = in_new_thread(mla)
    for b, (pages, n) in enumerate(((range(0, 3), 3 * 64), (range(3, 10), 6 * 64 + 5))):
        rows = kv[list(pages)].reshape(-1, 576)[:n].double()
        ref, _ = reference.mla_attention(q_nope[b:b + 1].double(), q_pe[b:b + 1].double(), rows[:, :512],
                                         rows[:, 512:], sm_scale=1 / math.sqrt(192))
        assert (out[b:b + 1].double() - ref).abs().max().item() < 3e-2, f"MLA request {b} in a thread"


def test_virtual_cache_grown_in_a_worker_thread():
    """VirtualKVCache maps physical chunks where a slot grows: an engine may grow slots from its scheduler thread."""
    from attnforge.kvcache import VirtualKVCache
    c = VirtualKVCache(num_layers=1, max_batch=2, max_len=4096, num_kv_heads=8, head_dim=128)
    in_new_thread(lambda: [c.grow(slot, n) for slot, n in ((0, 3000), (1, 5))])
    k, v = c.tensors(0)
    for slot, n in ((0, 3000), (1, 5)):
        k[slot, :n] = torch.randn(n, 8, 128, device="cuda").bfloat16()
        v[slot, :n] = torch.randn(n, 8, 128, device="cuda").bfloat16()
    q = torch.randn(2, 32, 128, device="cuda").bfloat16()
    w = BatchDecode(AttentionSpec())
    w.plan(*c.decode_plan(range(2), [3000, 5]), page_size=c.max_len)
    out = w.run(q, (k, v))
    for b, n in enumerate((3000, 5)):
        ref, _ = reference.attention(q[b:b + 1].cpu(), k[b, :n].cpu(), v[b, :n].cpu())
        assert (out[b].cpu().double() - ref[0]).abs().max().item() < 2e-2
    in_new_thread(lambda: c.free(0))  # unmapped from another thread too
    c.close()


def test_a_fresh_process_whose_first_cuda_work_is_a_wrapper():
    """No context exists when the library loads: it is loaded in the device's primary context, pushed and popped
    (loader.device_context), and the launches after find it valid."""
    current, err = decode_in_a_fresh_process("cuda:0")
    assert current == 0 and err < 2e-2

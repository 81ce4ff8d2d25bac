"""attnforge under torch.compile on the GPU (inductor, fullgraph): each compiled call launches the eager
call's kernel through its custom op, so outputs match the eager ones bit for bit; a compiled run follows
each new plan without a new graph; CUDA graphs of the compiled step (mode="reduce-overhead") replay
correctly after replans."""
import math

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
from helpers import make_paged_case, poison, random_page_table

pytestmark = pytest.mark.gpu
ALIBI_SLOPES = None


def inductor(fn, **kw):  # (a fresh dynamo state: each test's graphs are its own)
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, **kw)


def assert_same(got, want):
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), (g.double() - w.double()).abs().max().item()


def alibi(score, b, h, q_idx, kv_idx):
    return score + ALIBI_SLOPES[h] * (kv_idx - q_idx)


@pytest.mark.parametrize("hq,hkv,lq,lk,mod", [(8, 8, 77, 77, None), (16, 4, 129, 1000, alibi), (8, 2, 5, 4000, None)])
def test_compiled_attention_equals_eager(hq, hkv, lq, lk, mod):
    global ALIBI_SLOPES
    ALIBI_SLOPES = torch.rand(hq, device="cuda")
    q = torch.randn(2, hq, lq, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, hkv, lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def fn(q, k, v):  # an op before the call, as in a model: one graph with attnforge's op inside
        return attnforge.attention(q * 0.5, k, v, score_mod=mod, enable_gqa=hq != hkv, return_lse=True)

    got = inductor(fn)(q, k, v)
    assert_same(got, fn(q, k, v))
    if mod is None:  # and it is attention: SDPA's answer in float32
        ref = torch.nn.functional.scaled_dot_product_attention((q * 0.5).float(), k.float(), v.float(),
                                                               enable_gqa=hq != hkv)
        assert (got[0].float() - ref).abs().max().item() < 2e-2


def counted_inductor(fn, **kw):
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    return torch.compile(fn, backend=counter, fullgraph=True, **kw), counter


def test_a_compiled_decode_follows_each_plan_without_a_new_graph():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    pages = 2048
    cache = torch.randn(pages, 2, 16, 8, 128, device="cuda").bfloat16()
    q = torch.randn(4, 32, 128, device="cuda").bfloat16()
    rng = np.random.default_rng(1)
    w = BatchDecode(spec)
    step, counter = counted_inductor(lambda q, c: w.run(q, c, return_lse=True))
    for i in range(4):  # new tables for the same batch: the compiled step reads each plan's device buffers
        _, indptr, indices, last = random_page_table(rng, 4, 16, pages, 5000, (20000, 30000) if i % 2 else None)
        w.plan(indptr, indices, last, page_size=16)
        assert_same(step(q, cache), w.run(q, cache, return_lse=True))
    assert counter.frame_count == 1


def test_compiled_decode_fills_given_buffers_and_takes_a_kv_pair():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, kv_layout="HND")
    q, cache, table, _ = make_paged_case(spec, [100, 2000, 33], 16)
    w = BatchDecode(spec)
    w.plan(*table, page_size=16)
    out, lse = poison(tuple(q.shape), q.dtype), poison(tuple(q.shape[:2]), torch.float32)
    got = inductor(lambda q, k, v, o, l_: w.run(q, (k, v), out=o, lse=l_, return_lse=True))(
        q, cache[:, 0], cache[:, 1], out, lse)
    want = w.run(q, cache, return_lse=True)
    assert_same((out, lse), want)
    assert got[0].data_ptr() == out.data_ptr() and got[1].data_ptr() == lse.data_ptr()


def test_reduce_overhead_graphs_replay_after_replans():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    batch, pages = 8, 4096
    rng = np.random.default_rng(2)
    cache = torch.randn(pages, 2, 16, 8, 128, device="cuda").bfloat16()
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=batch, max_num_pages=pages)
    step = inductor(lambda q, c: w.run(q, c) * 1.0, mode="reduce-overhead")
    for i in range(6):
        _, indptr, indices, last = random_page_table(rng, batch, 16, pages, 3000, (10000, 30000) if i % 2 else None)
        w.plan(indptr, indices, last, page_size=16)
        q.copy_(torch.randn_like(q.float()).bfloat16())
        got = step(q, cache).clone()
        assert_same(got, w.run(q, cache))


def test_compiled_prefill_equals_eager():
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=4, causal=True)
    qo, kv = [0, 100, 357, 1000], [0, 300, 357, 2000]
    q = torch.randn(qo[-1], 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(kv[-1], 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = BatchPrefill(spec)
    w.plan(qo, kv)
    got = inductor(lambda q, k, v: w.run(q, (k, v), return_lse=True))(q, k, v)
    assert_same(got, w.run(q, (k, v), return_lse=True))


@pytest.mark.parametrize("one_cache", [True, False])
def test_compiled_mla_equals_eager(one_cache):
    spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    lengths, page = [1000, 64, 7], 64
    pages_per = [-(-n // page) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    indices = np.random.default_rng(3).permutation(indptr[-1]).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lengths, pages_per)], dtype=np.int32)
    kv = torch.randn(indptr[-1], page, 576, device="cuda").bfloat16()
    caches = (kv,) if one_cache else (kv[..., :512].contiguous(), kv[..., 512:].contiguous())
    q_nope = torch.randn(3, 16, 512, device="cuda").bfloat16()
    q_pe = torch.randn(3, 16, 64, device="cuda").bfloat16()
    w = BatchMLADecode(spec)
    w.plan(indptr, indices, last, page_size=page)
    got = inductor(lambda a, b, *c: w.run(a, b, *c, return_lse=True))(q_nope, q_pe, *caches)
    assert_same(got, w.run(q_nope, q_pe, *caches, return_lse=True))


def test_compiled_merges_and_append_equal_eager():
    v = torch.randn(50, 3, 8, 128, device="cuda", dtype=torch.float16)
    s = torch.randn(50, 3, 8, device="cuda")
    s[0] = -math.inf
    assert_same(inductor(lambda v, s: attnforge.merge_states(v, s))(v, s), attnforge.merge_states(v, s))
    args = (v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert_same(inductor(lambda *a: attnforge.merge_state(*a, out_dtype=torch.float32))(*args),
                attnforge.merge_state(*args, out_dtype=torch.float32))
    cache, want = (torch.zeros(6, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v_new = (torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    idx = dict(batch_indices=torch.tensor([0, 0, 1, 1, 1], device="cuda"),
               positions=torch.tensor([15, 16, 0, 1, 31], device="cuda"),
               kv_indices=torch.tensor([4, 2, 0, 5], device="cuda", dtype=torch.int32),
               kv_indptr=torch.tensor([0, 2, 4], device="cuda", dtype=torch.int32))
    inductor(lambda k, v, c: attnforge.append_paged_kv_cache(k, v, kv_cache=c, **idx))(k, v_new, cache)
    attnforge.append_paged_kv_cache(k, v_new, kv_cache=want, **idx)
    assert torch.equal(cache, want) and cache.abs().sum() > 0


def test_attention_under_reduce_overhead_stays_right_as_shapes_alternate():
    """attention() plans at every call into one wrapper per spec: its op is kept out of inductor's CUDA graphs
    (a captured plan would replay host buffers a later call has rewritten)."""
    step = inductor(lambda q, k, v: attnforge.attention(q, k, v) * 1.0, mode="reduce-overhead")
    shapes = [(1, 8, 300, 128), (2, 8, 77, 128)] * 3
    for i, shape in enumerate(shapes):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        assert_same(step(q, k, v).clone(), attnforge.attention(q, k, v)), f"call {i}"


def test_compiled_quest_and_cascade_equal_eager():
    import test_quest_gpu as tq
    import test_quest_heads_gpu as th
    from attnforge.cascade import CascadeDecode
    from attnforge.sparse import QuestDecode, QuestHeadDecode
    cache, indptr, indices, last, index = tq.build([3000, 17, 900])
    q = torch.randn(3, 32, 128, device="cuda").bfloat16()
    quest = QuestDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=tq.HKV), index, budget_tokens=512, page_size=16)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    assert_same(inductor(lambda q, c: quest.run(q, c, return_lse=True))(q, cache), quest.run(q, cache, return_lse=True))
    _, kv, indptr, indices, last, index = th.build([2000, 0, 700], "pair", seed=1)
    q = torch.randn(3, th.HQ, th.D, device="cuda").bfloat16()
    heads = QuestHeadDecode(th.SPEC, index, budget_tokens=256, page_size=th.PAGE)
    heads.plan(indptr.cpu(), indices.cpu(), last)
    assert_same(inductor(lambda q, k, v: heads.run(q, (k, v)))(q, *kv), heads.run(q, kv))
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    pool = torch.randn(40, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    c = CascadeDecode(spec)
    c.plan(levels=[([0, 3], [0, 20], np.arange(20), [16])], suffix=([0, 5, 9, 20], np.arange(20, 40), [3, 16, 1]),
           page_size=16)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    assert_same(inductor(lambda q, c_: c.run(q, c_, return_lse=True))(q, pool), c.run(q, pool, return_lse=True))


def test_a_dynamic_batch_compiles_once_and_follows_each_plan():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
    cache = torch.randn(1024, 2, 16, 8, 128, device="cuda").bfloat16()
    rng = np.random.default_rng(4)
    w = BatchDecode(spec)
    step, counter = counted_inductor(lambda q, c: w.run(q, c), dynamic=True)
    for batch in (3, 5, 9, 5):
        _, indptr, indices, last = random_page_table(rng, batch, 16, cache.shape[0], 1500)
        w.plan(indptr, indices, last, page_size=16)
        q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
        assert_same(step(q, cache), w.run(q, cache))
    assert counter.frame_count == 1

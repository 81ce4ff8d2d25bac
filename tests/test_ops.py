"""attnforge.ops on the CPU: torch.compile(fullgraph=True) traces each public GPU call into one custom op,
with fake CUDA tensors (no GPU, nothing launched); the op's fake outputs have the eager call's shapes."""
import gc

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnforge
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, ops


class Recorder:
    """A torch.compile backend that keeps the traced graph and runs nothing (inputs are fake)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_nodes(self, name: str) -> list:
        return [n for g in self.graphs for n in g.graph.nodes
                if n.op == "call_function" and str(n.target).startswith(f"attnforge.{name}")]


@pytest.fixture
def fake():
    """Fake CUDA tensors (this CPU build of torch makes them but runs no view op on them: no slicing)."""
    with FakeTensorMode() as mode:
        yield mode


@pytest.fixture
def fake_mode():
    return FakeTensorMode()  # entered by the test, after what must be real (plans) is built


def compiled(fn, rec: Recorder):
    torch._dynamo.reset()
    return torch.compile(fn, backend=rec, fullgraph=True)


def cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def test_every_op_is_registered_with_its_schema():
    schemas = {name: str(getattr(torch.ops.attnforge, name).default._schema)
               for name in ("run", "attention", "merge_state", "merge_states")}
    assert "run(str wrapper, Tensor[] args, bool return_lse) -> (Tensor, Tensor)" in schemas["run"]
    assert "str mod, float? scale, bool enable_gqa, bool return_lse" in schemas["attention"]
    assert "ScalarType? out_dtype" in schemas["merge_state"] and "ScalarType? out_dtype" in schemas["merge_states"]
    if hasattr(torch.Tag, "cudagraph_unsafe"):  # attention plans at each call: kept out of inductor's graphs
        assert torch.Tag.cudagraph_unsafe in torch.ops.attnforge.attention.default.tags
        assert torch.Tag.cudagraph_unsafe not in torch.ops.attnforge.run.default.tags


@pytest.mark.parametrize("hq,hkv,return_lse", [(8, 8, False), (8, 2, True)])
def test_attention_is_one_node_of_one_graph(fake, hq, hkv, return_lse):
    rec = Recorder()
    q, k, v = cuda(2, hq, 100, 64), cuda(2, hkv, 300, 64), cuda(2, hkv, 300, 64)
    got = compiled(lambda q, k, v: attnforge.attention(q, k, v, enable_gqa=hq != hkv, return_lse=return_lse,
                                                       scale=0.1), rec)(q, k, v)
    out, lse = got if return_lse else (got, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "cuda"
    if return_lse:
        assert lse.shape == (2, hq, 100) and lse.dtype == torch.float32
    (node,) = rec.op_nodes("attention")
    assert node.args[3:] == ("", 0.1, hq != hkv, return_lse, False)  # no modifier: handle ""


def test_is_causal_reaches_the_op_and_lengths_that_differ_fail_while_the_graph_is_made(fake):
    rec = Recorder()
    q, k = cuda(2, 8, 100, 64), cuda(2, 2, 100, 64)
    out = compiled(lambda q, k: attnforge.attention(q, k, k, enable_gqa=True, is_causal=True), rec)(q, k)
    (node,) = rec.op_nodes("attention")
    assert out.shape == q.shape and node.args[3:] == ("", None, True, False, True)
    with pytest.raises(Exception, match=r"is_causal=True\): expected as many queries as keys, got Lq=100 and Lk=300"):
        k3 = cuda(2, 2, 300, 64)
        compiled(lambda q, k: attnforge.attention(q, k, k, enable_gqa=True, is_causal=True), Recorder())(q, k3)


def test_attention_with_bad_shapes_fails_while_the_graph_is_made(fake):
    q, k = cuda(2, 8, 10, 64), cuda(2, 2, 10, 64)
    with pytest.raises(Exception, match=r"num heads: expected q heads == k heads \(2\), got 8. Pass enable_gqa=True"):
        compiled(lambda q, k: attnforge.attention(q, k, k), Recorder())(q, k)


def test_a_tracked_query_fails_while_the_graph_is_made(fake):
    """The custom ops have no backward: a compiled call with a tracked input fails as the eager one does, at the
    trace, rather than at a later backward (or not at all where nothing reaches it)."""
    q, k = cuda(2, 8, 10, 64).requires_grad_(), cuda(2, 8, 10, 64)
    with pytest.raises(Exception, match=r"attention: q: expected a tensor autograd does not track"):
        compiled(lambda q, k: attnforge.attention(q, k, k), Recorder())(q, k)
    rec = Recorder()
    with torch.no_grad():
        compiled(lambda q, k: attnforge.attention(q, k, k), rec)(q, k)
    assert len(rec.op_nodes("attention")) == 1


SLOPES = torch.rand(8)  # a tensor outside the compiled function (a CPU one: nothing launches here)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def test_a_score_mod_is_built_when_the_graph_is_and_named_by_its_handle(fake):
    rec = Recorder()
    q = cuda(1, 8, 64, 128)
    fn = compiled(lambda q, k, v: attnforge.attention(q, k, v, score_mod=alibi), rec)
    assert fn(q, q, q).shape == q.shape
    (node,) = rec.op_nodes("attention")
    mod = ops.lookup(node.args[3])
    assert isinstance(mod, attnforge.mods.variant.ScoreMod) and mod.tensors[0] is SLOPES
    # the same function again: the same modifier object, the same handle, no second build
    compiled(lambda q, k, v: attnforge.attention(q, k, v, score_mod=alibi), rec)(q, q, q)
    assert rec.op_nodes("attention")[1].args[3] == node.args[3]


def test_a_score_mod_capturing_a_tensor_of_the_graph_is_refused(fake):
    inside = torch.rand(8)  # created under the fake mode: what a graph input is while dynamo traces

    def mod(score, b, h, q_idx, kv_idx):
        return score + inside[h]

    q = cuda(1, 8, 64, 128)
    with pytest.raises(Exception, match="captured tensor #0: under torch.compile a modifier may capture only"):
        compiled(lambda q: attnforge.attention(q, q, q, score_mod=mod), Recorder())(q)


def decode_wrapper(**spec_kw) -> BatchDecode:
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8, **spec_kw), max_batch_size=8)
    w.plan(np.array([0, 3, 5], np.int32), np.arange(5, dtype=np.int32), np.array([16, 1], np.int32), page_size=16)
    return w


@pytest.mark.parametrize("pair", [False, True])
def test_a_decode_run_is_the_run_op_on_its_wrapper(fake_mode, pair):
    w, rec = decode_wrapper(), Recorder()
    with fake_mode:
        q = cuda(2, 32, 128)
        kv = (cuda(5, 16, 8, 128), cuda(5, 16, 8, 128)) if pair else cuda(5, 2, 16, 8, 128)
        out, lse = compiled(lambda q, kv: w.run(q, kv, return_lse=True), rec)(q, kv)
    assert out.shape == (2, 32, 128) and out.dtype == torch.bfloat16 and lse.shape == (2, 32)
    (node,) = rec.op_nodes("run")
    assert node.args[0] == ops.handle(w) and len(node.args[1]) == (3 if pair else 2)
    assert ops.lookup(node.args[0]) is w


def test_a_float_out_run_traces_float32_rows(fake_mode):
    """A wrapper built with float_out=True returns float32 rows, compiled as eagerly (the op's fake output)."""
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=8, float_out=True)
    w.plan(np.array([0, 3, 5], np.int32), np.arange(5, dtype=np.int32), np.array([16, 1], np.int32), page_size=16)
    rec = Recorder()
    with fake_mode:
        out = compiled(lambda q, c: w.run(q, c), rec)(cuda(2, 32, 128), cuda(5, 2, 16, 8, 128))
    assert out.shape == (2, 32, 128) and out.dtype == torch.float32 and len(rec.op_nodes("run")) == 1
    p = attnforge.BatchPrefill(AttentionSpec(family="prefill"), float_out=True, device="cpu")
    assert p._op_out_shape([torch.empty(7, 32, 128)]) == ((7, 32, 128), torch.float32)


def test_a_dynamic_batch_is_one_graph_with_symbolic_output_rows(fake_mode):
    w, rec = decode_wrapper(), Recorder()
    step = torch.compile(lambda q, c: w.run(q, c), backend=rec, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    with fake_mode:
        cache = cuda(7, 2, 16, 8, 128)
        for batch in (3, 5):  # (batch sizes that equal no cache dimension: no duck-sized guard)
            assert step(cuda(batch, 32, 128), cache).shape == (batch, 32, 128)
    assert len(rec.graphs) == 1 and len(rec.op_nodes("run")) == 1


def test_a_compiled_run_before_plan_fails_while_the_graph_is_made(fake_mode):
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=8)
    with fake_mode, pytest.raises(Exception, match=r"BatchDecode.run: call plan\(...\) first, outside the compiled function"):
        compiled(lambda q, c: w.run(q, c), Recorder())(cuda(2, 32, 128), cuda(5, 2, 16, 8, 128))


@pytest.mark.parametrize("one_cache", [True, False])
def test_an_mla_run_gives_512_wide_rows(fake_mode, one_cache):
    w = BatchMLADecode.host_only(AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                                     head_dim_vo=512), max_batch_size=4)
    w.plan(np.array([0, 2, 3], np.int32), np.arange(3, dtype=np.int32), np.array([64, 5], np.int32), page_size=64)
    rec = Recorder()
    with fake_mode:
        q_nope, q_pe = cuda(2, 16, 512), cuda(2, 16, 64)
        caches = (cuda(3, 64, 576),) if one_cache else (cuda(3, 64, 512), cuda(3, 64, 64))
        out = compiled(lambda a, b, *c: w.run(a, b, *c), rec)(q_nope, q_pe, *caches)
    assert out.shape == (2, 16, 512) and out.dtype == torch.bfloat16
    (node,) = rec.op_nodes("run")
    assert len(node.args[1]) == 2 + len(caches)


@pytest.mark.parametrize("num_levels", [1, 2])
def test_a_cascade_traces_float32_level_rows_merged_into_its_dtype(fake_mode, monkeypatch, num_levels):
    """CascadeDecode.run compiled: each level's prefill and the suffix's decode are run ops of float32 rows
    (float_out), merged by one merge op into the spec's dtype (merge_state for one level, merge_states for more)."""
    from attnforge.cascade import CascadeDecode
    monkeypatch.setattr(attnforge.BatchPrefill, "_sms", lambda self: 132)  # (the levels plan on the host)
    c = CascadeDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    level = (np.array([0, 2], np.int32), np.array([0, 2], np.int32), np.array([5, 6], np.int32),
             np.array([16], np.int32))
    c.plan(levels=[level] * num_levels, suffix=(np.array([0, 1, 3], np.int32), np.arange(3, dtype=np.int32),
                                                np.array([7, 16], np.int32)), page_size=16)
    rec = Recorder()
    with fake_mode:
        out, lse = compiled(lambda q, kv: c.run(q, kv, return_lse=True), rec)(cuda(2, 32, 128),
                                                                               cuda(7, 2, 16, 8, 128))
    assert out.shape == (2, 32, 128) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    runs = rec.op_nodes("run")
    assert len(runs) == num_levels + 1 and [ops.lookup(n.args[0]) for n in runs] == c.levels + [c.suffix]
    assert all(n.meta["example_value"][0].dtype == torch.float32 for n in runs)  # (the ops' fake rows)
    (merge,) = rec.op_nodes("merge_state")  # (op_nodes matches names by prefix: merge_state and merge_states)
    assert str(merge.target) == f"attnforge.{'merge_state' if num_levels == 1 else 'merge_states'}.default"
    assert merge.meta["example_value"][0].dtype == torch.bfloat16


def test_merges_trace_to_their_ops_with_the_eager_shapes(fake):
    rec = Recorder()
    v, s = cuda(10, 3, 4, 64), cuda(10, 3, 4, dtype=torch.float32)
    out, lse = compiled(lambda v, s: attnforge.merge_states(v, s, out_dtype=torch.float32), rec)(v, s)
    assert out.shape == (10, 4, 64) and out.dtype == torch.float32 and lse.shape == (10, 4)
    a, sa = cuda(10, 4, 64, dtype=torch.float16), cuda(10, 4, dtype=torch.float32)
    out, lse = compiled(lambda *t: attnforge.merge_state(*t), rec)(a, sa, a, sa)
    assert out.shape == (10, 4, 64) and out.dtype == torch.float16 and lse.shape == (10, 4)
    assert len(rec.op_nodes("merge_states")) == 1 and len(rec.op_nodes("merge_state.")) == 1


def test_a_handle_outlives_nothing():
    w = BatchDecode.host_only(AttentionSpec(num_qo_heads=32, num_kv_heads=8), max_batch_size=2)
    h = ops.handle(w)
    assert ops.handle(w) == h and ops.lookup(h) is w
    del w
    gc.collect()
    assert h.startswith("BatchDecode#")
    with pytest.raises(RuntimeError, match=f"handle {h}: the wrapper or score modifier it names was freed"):
        ops.lookup(h)


def test_a_global_tensor_rebound_gives_a_new_modifier():
    from attnforge.dense import compiled_mod
    scope = {"BIAS": torch.rand(8)}
    exec("def mod(score, b, h, q_idx, kv_idx):\n    return score + BIAS[h]", scope)
    first = compiled_mod(scope["mod"], None)
    assert compiled_mod(scope["mod"], None) is first and first.tensors[0] is scope["BIAS"]
    scope["BIAS"] = torch.rand(8)  # the old build would read the old tensor: a new one is built
    second = compiled_mod(scope["mod"], None)
    assert second is not first and second.tensors[0] is scope["BIAS"]


def test_the_run_op_rebuilds_each_run_signature_from_its_flat_arguments():
    """What the op's real side calls: run(*split(flat)) with the arguments the traced call flattened."""
    from attnforge.paged import cache_list
    q, cache, k, v, kpe = (torch.zeros(1) for _ in range(5))
    same = lambda got, want: len(got) == len(want) and all(g is w for g, w in zip(got, want))  # noqa: E731
    got_q, got_kv = ops._q_and_kv([q, *cache_list(cache)])  # decode, prefill and Quest: run(q, kv)
    assert got_q is q and got_kv is cache
    got_q, got_kv = ops._q_and_kv([q, *cache_list((k, v))])
    assert got_q is q and isinstance(got_kv, tuple) and same(got_kv, (k, v))
    assert same(BatchMLADecode._op_run_args([q, k, cache]), (q, k, cache, None))  # MLA: q_nope, q_pe, ckv[, kpe]
    assert same(BatchMLADecode._op_run_args([q, k, cache, kpe]), (q, k, cache, kpe))


def documents_block_mask(flex):
    """A Flex BlockMask over 64 tokens in documents of 20, built before compiling, as a model builds it."""
    docs = torch.arange(64) // 20

    def same_doc(b, h, q, kv):
        return docs[q] == docs[kv]
    return flex.create_block_mask(same_doc, None, None, 64, 64, device="cpu")


def test_a_flex_block_mask_compiles_to_its_mask_mod(fake_mode):
    """attention(..., block_mask=create_block_mask(...)) inside torch.compile: one op whose modifier is the
    BlockMask's mask_mod."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = documents_block_mask(flex)
    with fake_mode:
        rec = Recorder()
        q = cuda(1, 8, 64, 128)
        fn = compiled(lambda q, k, v: attnforge.attention(q, k, v, block_mask=block_mask), rec)
        assert fn(q, q, q).shape == q.shape
    (node,) = rec.op_nodes("attention")
    assert ops.lookup(node.args[3]).mask_root == ("eq", ("load", 0, ("input", "q_idx")),
                                                    ("load", 0, ("input", "kv_idx")))
    noop = flex.create_block_mask(flex.noop_mask, None, None, 64, 64, device="cpu")
    with fake_mode:  # a mask that is always True: no modifier (the plain kernel)
        compiled(lambda q, k, v: attnforge.attention(q, k, v, block_mask=noop), rec)(q, q, q)
    assert rec.op_nodes("attention")[-1].args[3] == ""


def test_eager_modifiers_are_kept_in_a_bounded_table_and_graph_ones_for_good(monkeypatch):
    """attention() called with a modifier defined anew each call (a closure over a fresh tensor) must not keep
    every build and its tensors; a modifier a compiled graph names by handle (mod_handle) must outlive them."""
    import weakref
    from attnforge import dense
    monkeypatch.setattr(dense, "_MODS", {})
    monkeypatch.setattr(dense, "_GRAPH_MODS", {})
    bias = torch.rand(8)
    pinned = lambda score, b, h, q_idx, kv_idx: score + bias[h]  # noqa: E731
    graph_mod = dense.compiled_mod(pinned, None, for_graph=True)

    def per_call(t):  # what a model that defines its modifier in forward() passes each call
        return lambda score, b, h, q_idx, kv_idx: score + t[h]

    first_bias = None
    for _ in range(3 * dense.MAX_MODS):
        fresh = torch.rand(8)
        first_bias = first_bias or weakref.ref(fresh)
        dense.compiled_mod(per_call(fresh), None)
        assert len(dense._MODS) <= dense.MAX_MODS
        del fresh
    gc.collect()
    assert first_bias() is None, "an evicted eager modifier still holds its captured tensor"
    assert dense.compiled_mod(pinned, None) is graph_mod, "the graph's modifier was rebuilt or dropped"
    assert ops.lookup(ops.handle(graph_mod)) is graph_mod


def test_flexs_positional_call_and_return_aux_compile_to_one_op(fake_mode):
    """flex_attention's call spelled for attnforge (a BlockMask fifth, kernel_options, return_aux) traces to one
    attention op that returns the LSE, handed back in Flex's AuxOutput."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = documents_block_mask(flex)
    with fake_mode:
        rec = Recorder()
        q = cuda(1, 8, 64, 128)
        fn = compiled(lambda q, k, v: attnforge.attention(q, k, v, None, block_mask, 0.1, False, False,
                                                          {"BLOCK_M": 64}, return_aux=flex.AuxRequest(lse=True)), rec)
        out, aux = fn(q, q, q)
        assert out.shape == q.shape and aux.lse.shape == (1, 8, 64) and aux.max_scores is None
    (node,) = rec.op_nodes("attention")
    assert node.args[4:6] == (0.1, False) and node.args[6] is True  # (scale, enable_gqa; return_lse asked of the op)
    assert ops.lookup(node.args[3]).mask_root is not None

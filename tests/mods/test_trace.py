"""Tracing rules: what compiles, what is refused (with the construct and the line), cache keys."""
import math

import pytest
import torch
import torch.nn.functional as F

import attnforge.mods as m
from attnforge import AttentionSpec
from attnforge.kernels import module_for_attention
from attnforge.mods import ModTraceError, compile_mod, graph, raw_mod


def test_if_on_traced_value_names_construct_and_line():
    def bad(score, b, h, q_idx, kv_idx):
        if kv_idx > q_idx:  # the offending line
            return score
        return score * 2
    with pytest.raises(ModTraceError) as e:
        compile_mod(score_mod=bad)
    msg = str(e.value)
    assert "truth value" in msg and "if kv_idx > q_idx" in msg and "test_trace.py" in msg


@pytest.mark.parametrize("body, construct", [
    (lambda s, b, h, q, kv: sum(x for x in kv), "iteration"),
    (lambda s, b, h, q, kv: s + int(kv), "int()"),
    (lambda s, b, h, q, kv: s + float(q), "float()"),
    (lambda s, b, h, q, kv: s + len(range(kv)), "Python index"),
    (lambda s, b, h, q, kv: torch.erf(s), "torch function torch.erf is not supported"),  # (as the user wrote it)
    (lambda s, b, h, q, kv: F.softplus(s), "torch function torch.nn.functional.softplus is not supported"),
    (lambda s, b, h, q, kv: 30 * math.tanh(s / 30), "a math.* function, which calls it) on a traced value is "
                                                    "data-dependent .* Call the torch function"),
    (lambda s, b, h, q, kv: s + int(kv) // 2, "int() on a traced value .* Cast with .to(torch.int32)"),
    (lambda s, b, h, q, kv: s + torch.zeros(4, 4)[kv], "rank 2 must be indexed with 2"),
    (lambda s, b, h, q, kv: s + torch.zeros(4)[0:kv], "slices"),
    (lambda s, b, h, q, kv: s + "x", "type str"),
    # what torch itself refuses (the reference evaluates the graph in torch)
    (lambda s, b, h, q, kv: s + ((kv > q) - (h > 1)), "refuses `-` on a boolean"),
    (lambda s, b, h, q, kv: s + ((kv > q) - 1), "refuses `-` on a boolean"),
    (lambda s, b, h, q, kv: s * -(kv > q), "refuses `-` on a boolean"),
    (lambda s, b, h, q, kv: s + abs(kv > q), "refuses `abs` on booleans"),
    (lambda s, b, h, q, kv: s + ((kv > q) // (h > 1)), "refuses `//` on booleans"),
    (lambda s, b, h, q, kv: s + (s & 1), "`&` is bitwise on integers and logical on booleans"),
    (lambda s, b, h, q, kv: s + (~s > 0), "`~` is bitwise"),
    (lambda s, b, h, q, kv: s + (s >> 1), "`>>` is bitwise"),
    (lambda s, b, h, q, kv: s + h ** -1, "integer power needs a constant exponent >= 0"),
    (lambda s, b, h, q, kv: s + 2 ** kv, "integer power needs a constant exponent >= 0"),
])
def test_unsupported_constructs(body, construct):
    with pytest.raises(ModTraceError, match=construct.replace("(", r"\(").replace(")", r"\)")) as e:
        compile_mod(score_mod=body)
    assert "test_trace.py" in str(e.value)  # the user's line


def test_integer_and_boolean_operations_mean_what_torch_means():
    """& | ^ ~ << >> are bitwise on integers, logical on booleans; True + True is True; logical_* read
    nonzero-ness; an integer power stays an integer; a 0-d integer tensor is a runtime scalar that stays an
    integer (exact below 2^24). Values from the graph against eager torch, types from the graph."""
    from attnforge.mods import graph
    lut, scale = torch.tensor([4, 5, 6]), torch.tensor(0.5)
    cases = {
        "bitwise": lambda s, b, h, q, kv: s + (((kv & 6) | (h << 3)) ^ (~q >> 1)),
        "bool sum": lambda s, b, h, q, kv: s + ((kv > q) + (h > 1)) * 10,
        "logical": lambda s, b, h, q, kv: s + torch.logical_xor(kv - q, h) + torch.logical_not(kv & 1),
        "int power": lambda s, b, h, q, kv: s + (kv - q) ** 3 // 7,
        "0-d int": lambda s, b, h, q, kv: s + (kv // lut[1]) + scale * s,
    }
    kv, q = torch.arange(-20, 20), torch.full((40,), 3)
    h, score = torch.arange(40) % 4, torch.linspace(-2, 2, 40)
    for name, fn in cases.items():
        mod = compile_mod(score_mod=fn)
        assert torch.equal(mod.torch_score(score, torch.zeros(40, dtype=torch.long), h, q, kv),
                           fn(score, 0, h, q, kv)), name
    power = compile_mod(score_mod=cases["int power"]).score_root
    assert graph.node_type(power[2][1], {}) == "i"  # (kv - q) ** 3 // 7: integer floor division
    zero_d = compile_mod(score_mod=cases["0-d int"])  # kv // lut[1]: an integer runtime scalar
    assert zero_d.score_root[1][2] == ("floordiv", ("input", "kv_idx"), ("scalar", 0, "i"))
    assert zero_d.scalars == [5.0, 0.5] and graph.node_type(zero_d.score_root[1][2], {}) == "i"
    with pytest.raises(ModTraceError, match="below 2\\^24"):
        compile_mod(score_mod=lambda s, b, h, q, kv: s + kv // torch.tensor(2 ** 24))


def test_wrong_arity_and_mask_type():
    with pytest.raises(ModTraceError, match="score_mod\\(score, b, h, q_idx, kv_idx\\)"):
        compile_mod(score_mod=lambda s, b, h, q: s)
    with pytest.raises(ModTraceError, match="mask_mod\\(b, h, q_idx, kv_idx\\)"):
        compile_mod(mask_mod=lambda s, b, h, q, kv: q > kv)
    with pytest.raises(ModTraceError, match="boolean"):
        compile_mod(mask_mod=lambda b, h, q, kv: q - kv)
    with pytest.raises(ValueError, match="pass a score_mod"):
        compile_mod()


def test_cache_key_follows_the_expression_not_the_object():
    a = compile_mod(score_mod=lambda s, b, h, q, kv: s + (kv - q) * 0.5)
    b = compile_mod(score_mod=lambda s, b, h, q, kv: s + (kv - q) * 0.5)
    c = compile_mod(score_mod=lambda s, b, h, q, kv: s + (kv - q) * 0.25)  # a compiled-in constant
    assert a.cache_key == b.cache_key and a == b and hash(a) == hash(b)
    assert c.cache_key != a.cache_key
    assert AttentionSpec(score_mod=a) == AttentionSpec(score_mod=b)
    assert AttentionSpec(score_mod=a).content_hash != AttentionSpec(score_mod=c).content_hash


def test_runtime_values_do_not_rebuild():
    # 0-d tensors and captured tensors' values are kernel parameters: same source, same build
    x, y = m.softcap(torch.tensor(30.0)), m.softcap(torch.tensor(50.0))
    assert x.cache_key == y.cache_key and x.scalars == [30.0] and y.scalars == [50.0]
    s1, s2 = m.alibi(torch.rand(8)), m.alibi(torch.rand(8))
    assert module_for_attention(AttentionSpec(score_mod=s1)).source == module_for_attention(
        AttentionSpec(score_mod=s2)).source
    assert m.alibi(torch.rand(8)).cache_key != m.relative_position_bias(torch.rand(8, 3), 1).cache_key


def test_torch_eval_matches_library_references():
    import importlib
    alibi_mod, doc_mod, win_mod = (importlib.import_module(f"attnforge.mods.{n}")
                                   for n in ("alibi", "document_mask", "sliding_window"))
    q, kv, h = torch.arange(10, 20), torch.arange(0, 20), torch.arange(4)
    slopes = alibi_mod.default_slopes(4)
    score = torch.randn(4, 10, 20)
    traced = m.alibi(slopes).torch_score(score, torch.tensor(0), h[:, None, None], q[None, :, None], kv[None, None])
    assert torch.allclose(traced, alibi_mod.reference(score, h, q, kv, slopes))
    keep = m.sliding_window(3).torch_mask(torch.tensor(0), torch.tensor(0), q[:, None], kv[None])
    assert torch.equal(keep, win_mod.reference(q, kv, 3))
    ids = torch.randint(0, 3, (1, 20))
    keep = m.document_mask(ids).torch_mask(torch.tensor(0), torch.tensor(0), q[:, None], kv[None])
    assert torch.equal(keep, doc_mod.reference(ids[0], q, kv))


def test_raw_cpp_escape_hatch_compiles():
    mod = raw_mod("""  static constexpr bool kHasLogitsTransform = true;
  template <class P> AF_DEVICE float logits_transform(const P& p, float s, const attnforge::LogitsIndex& i) const {
    return s * p.mod_s0 + static_cast<const float*>(p.mod_t0)[i.qo_head];
  }""", tensors=[torch.zeros(32)], scalars=[0.5])
    src = module_for_attention(AttentionSpec(score_mod=mod)).source
    assert "p.mod_s0" in src and "float mod_s0;" in src


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensors=[torch.zeros(3, dtype=torch.float64)]), r"raw_mod\(tensors\[0\]\): expected a torch.Tensor of dtype "
                                                          r"float32.*bool, got dtype torch.float64\. Convert it"),
    (dict(tensors=[torch.zeros(2), [1, 2]]), r"tensors\[1\].*got list"),
    (dict(tensors=[torch.zeros(2)] * 9), r"at most 8 tensors and 8 scalars, got 9 and 0\. Pack"),
    (dict(scalars=["0.5"]), r"raw_mod\(scalars\[0\]\): expected a number.*got '0.5'\. Pass a Python"),
    (dict(scalars=[1.0, torch.zeros(3)]), r"scalars\[1\].*got tensor"),
    (dict(scalars=[None]), r"scalars\[0\].*got None")])
def test_raw_mod_refuses_what_its_parameters_cannot_carry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        raw_mod("return score;", **kwargs)


def test_raw_mod_takes_each_captured_dtype_and_one_element_scalars():
    kinds = {}
    for dtype in graph.DTYPE_NAMES:
        mod = raw_mod("return score;", tensors=iter([torch.zeros(2, dtype=dtype)]), scalars=[2, torch.tensor(0.5)])
        assert mod.scalars == [2.0, 0.5] and mod.tensors[0].dtype == dtype  # (a generator is taken too)
        kinds[dtype] = mod.slots[0].kind
    assert kinds[torch.bool] == "b" and kinds[torch.int8] == "i" and kinds[torch.bfloat16] == "f"


def test_library_is_one_factory_per_file():
    import importlib
    for name in m.LIBRARY:
        file = "relative_bias" if name == "relative_position_bias" else name
        module = importlib.import_module(f"attnforge.mods.{file}")
        assert getattr(module, name).__doc__ and hasattr(module, "reference"), name


def test_hot_path_math_avoids_ieee_division_and_sqrt():
    """Per-score C++ must not carry IEEE division or sqrt (a slow-path call per score on the device):
    a constant divisor is a multiply by its float32 reciprocal, a runtime one af_div (__fdividef);
    sigmoid and sqrt take the approximate device forms. Float // and % stay exact (see the g++ test)."""
    import re
    scale = torch.tensor(0.5)
    mod = compile_mod(score_mod=lambda score, b, h, q_idx, kv_idx:
                      score / 50.0 + score / scale + torch.sqrt(abs(score)) + torch.sigmoid(score))
    body = mod.cpp_decl
    body = body[body.index("_score(float"):]
    body = body[:body.index("\n}\n")]
    assert "0.019999999552965164f" in body  # 1 / 50 rounded to float32, multiplied
    assert "af_div(float(score), float(v" in body and "af_sqrt(" in body and "af_sigmoid(" in body
    assert not re.search(r"[^/]/ ?float\(", body) and "sqrtf" not in body
    from attnforge.mods.variant import CPP_PRELUDE
    device = CPP_PRELUDE[CPP_PRELUDE.index("#ifdef __CUDA_ARCH__"):]
    assert "AF_PICK(__fdividef, af_div_exact)" in device and "AF_PICK(af_sqrt_approx, sqrtf)" in device
    assert "af_sigmoid(float x) { return af_div(" in device


def test_a_modifier_may_return_a_captured_0d_tensor():
    """A function that returns a 0-d tensor without touching its arguments (a switch) traces to its runtime
    scalar; it used to fail after the trace, looking for a tracer that was gone."""
    on = torch.tensor(True)
    mod = compile_mod(mask_mod=lambda b, h, q_idx, kv_idx: on)
    assert mod.mask_root == ("scalar", 0, "b")
    on.fill_(False)
    mod.refresh_scalars()
    assert not mod.torch_mask(torch.tensor(0), torch.tensor(0), torch.tensor(3), torch.tensor(1))


def test_flex_attention_helpers_and_tensor_methods_trace():
    """What FlexAttention users write besides operators: its and_masks / or_masks / noop_mask (which call
    b.new_ones((), dtype=...)), tensor methods (.abs(), .clamp(min=), .where(), .to(score.dtype), .long()),
    torch.div's rounding modes, fmod, rounding, sign, square, *_like constants. Values from the graph against
    eager torch."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def causal(b, h, q, kv):
        return q >= kv

    def near(b, h, q, kv):
        return (q - kv).abs() <= 5
    masks = {"and_masks": flex.and_masks(causal, near), "or_masks": flex.or_masks(causal, near),
             "noop_mask": flex.noop_mask, "new_zeros": lambda b, h, q, kv: b.new_zeros((), dtype=torch.bool) | near(
                 b, h, q, kv), "bool method": lambda b, h, q, kv: (kv - q).bool().logical_not()}
    scores = {
        "methods": lambda s, b, h, q, kv: s.where(q >= kv, -float("inf")) + (kv - q).clamp(min=-8).to(s.dtype)
        + (kv > q).to(kv.device).type_as(s),
        "divisions": lambda s, b, h, q, kv: s + torch.div(kv - q, 3, rounding_mode="trunc") + torch.div(
            kv, 4, rounding_mode="floor") + torch.fmod(kv - q, 5) + torch.fmod(s, 0.7) + torch.floor_divide(kv, 3),
        "rounding": lambda s, b, h, q, kv: torch.floor(s) + torch.ceil(s * 0.3) + (s * 2).round() + torch.trunc(-s)
        + torch.sign(kv - q) + torch.sign(s) + torch.square(kv - q) * 0.01 + (kv // 2).long() * 0.5,
        "like": lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.full_like(s, -1e4)) + torch.zeros_like(s)
        + torch.ones_like(kv),
        "more math": lambda s, b, h, q, kv: torch.log1p(s.abs()) + torch.expm1(s.clamp(max=2.0)) + torch.rsqrt(
            s.abs() + 1) + s.tanh() + s.sigmoid() + s.neg().exp().clamp(max=10.0),
    }
    kv, q = torch.arange(-20, 20), torch.full((40,), 3)
    h, score, b = torch.arange(40) % 4, torch.linspace(-2, 2, 40), torch.zeros(40, dtype=torch.long)
    for name, fn in masks.items():
        got = compile_mod(mask_mod=fn).torch_mask(b, h, q, kv)
        assert torch.equal(got.expand(40), torch.as_tensor(fn(b, h, q, kv)).expand(40)), name
    for name, fn in scores.items():
        got = compile_mod(score_mod=fn).torch_score(score, b, h, q, kv)
        assert torch.allclose(got, fn(score, b, h, q, kv).float(), rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("body, construct", [
    (lambda s, b, h, q, kv: s.cumsum(0), "tensor method or attribute .cumsum"),
    (lambda s, b, h, q, kv: s.to(torch.bfloat16), "a cast to torch.bfloat16"),
    (lambda s, b, h, q, kv: s + b.new_ones(3), "only size () is supported"),
    (lambda s, b, h, q, kv: s + s.size(0), "size(0) of a traced value: it is 0-d"),
])
def test_unsupported_methods_name_themselves_and_the_line(body, construct):
    with pytest.raises(ModTraceError, match=construct.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as e:
        compile_mod(score_mod=body)
    assert "test_trace.py" in str(e.value)


def test_numpy_scalars_are_constants_on_either_side():
    import numpy as np
    for c, want in ((np.float32(0.5), ("const", 0.5, "f")), (np.int64(3), ("const", 3, "i")),
                    (np.bool_(True), ("const", True, "b"))):
        assert compile_mod(score_mod=lambda s, b, h, q, kv: s * c).score_root == ("mul", ("input", "score"), want)
        assert compile_mod(score_mod=lambda s, b, h, q, kv: c * s).score_root[1] == want


def test_hasattr_on_a_traced_value_answers_instead_of_failing():
    """Library code probes objects with hasattr() / getattr(x, name, default): an attribute a traced value lacks
    is an AttributeError (and a ModTraceError naming the line when used)."""
    mod = compile_mod(score_mod=lambda s, b, h, q, kv: s + (1.0 if hasattr(s, "cumsum") else 0.0)
                      + getattr(kv, "no_such_field", 2))
    assert mod.score_root == ("add", ("add", ("input", "score"), ("const", 0.0, "f")), ("const", 2, "i"))


def test_int64_tables_outside_32_bits_are_refused_when_traced():
    """The device reads int64 tables as 32-bit integers (docs/mods.md): ids past 2^31 would wrap and two
    documents could share an id. A table that fits traces."""
    ids = torch.tensor([0, 5, 2 ** 33])
    with pytest.raises(ModTraceError, match=r"values in \[0, 8589934592\], outside 32 bits.*test_trace.py"):
        compile_mod(mask_mod=lambda b, h, q, kv: ids[q] == ids[kv])
    fits = torch.tensor([0, 5, 2 ** 31 - 1, -2 ** 31])
    assert compile_mod(mask_mod=lambda b, h, q, kv: fits[q] == fits[kv]).tensors[0] is fits


def test_bool_and_narrow_integer_tables_trace_with_torch_types():
    """A captured bool tensor's elements are booleans, so `keep[b, kv_idx]` is a mask_mod's whole result (as in
    FlexAttention); int8 / uint8 / int16 elements are integers. Each dtype is its own build (the kernels read
    elements of that width); other dtypes are refused naming the supported ones and the line."""
    keep = torch.rand(2, 50) < 0.5
    mod = compile_mod(mask_mod=lambda b, h, q, kv: keep[b, kv])
    b, kv = torch.tensor([[0], [1]]), torch.arange(50)
    assert torch.equal(mod.torch_mask(b, torch.tensor(0), torch.tensor(0), kv), keep)
    assert "(a.load_i(0, {b, kv_idx}) != 0)" in mod.host_functions()
    keys = {compile_mod(score_mod=lambda s, b, h, q, kv: s + t[kv % 3]).cache_key
            for t in (torch.tensor([1, 0, 1], dtype=d) for d in (torch.int8, torch.uint8, torch.int16, torch.int32))}
    assert len(keys) == 4
    u8 = torch.tensor([250, 3], dtype=torch.uint8)
    got = compile_mod(score_mod=lambda s, b, h, q, kv: s + u8[kv]).torch_score(torch.zeros(2), 0, 0, 0, torch.arange(2))
    assert torch.equal(got, torch.tensor([250.0, 3.0]))
    for bad in (torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.complex64)):
        with pytest.raises(ModTraceError, match=r"int64/int32/int16/int8/uint8 or bool tensor.*test_trace.py"):
            compile_mod(score_mod=lambda s, b, h, q, kv: s + bad[kv])


def test_integer_constants_outside_32_bits_are_refused_when_traced():
    """A constant the device's 32-bit integers would wrap (10**12 became -727379968: every key masked, while the
    torch reference kept them all) is refused naming its line; the 32-bit bounds and float constants trace."""
    with pytest.raises(ModTraceError, match=r"integer constant 1000000000000 is outside 32 bits.*1e\+12.*"
                                            r"test_trace.py"):
        compile_mod(mask_mod=lambda b, h, q, kv: q - kv <= 10 ** 12)
    with pytest.raises(ModTraceError, match=r"integer constant -2147483649 is outside 32 bits"):
        compile_mod(score_mod=lambda s, b, h, q, kv: s + torch.where(q > kv, 0, -2 ** 31 - 1))
    with pytest.raises(ModTraceError, match=r"integer constant 4294967296 is outside 32 bits"):
        compile_mod(mask_mod=lambda b, h, q, kv: torch.full_like(q, 2 ** 32) > kv)
    assert compile_mod(mask_mod=lambda b, h, q, kv: q - kv <= 2 ** 31 - 1).mask_root[2] == ("const", 2 ** 31 - 1, "i")
    assert compile_mod(mask_mod=lambda b, h, q, kv: q - kv >= -2 ** 31).mask_root[2] == ("const", -2 ** 31, "i")
    assert compile_mod(mask_mod=lambda b, h, q, kv: q - kv <= 1e12).mask_root[2] == ("const", 1e12, "f")


def test_only_a_modifier_with_nothing_to_apply_is_identity():
    """attention() and the compiled op run the plain kernel for an identity modifier (Flex's noop_mask: a mask
    that is the constant True); a sink or raw C++ alone has work to do and is kept."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    assert compile_mod(mask_mod=flex.noop_mask).is_identity
    assert not compile_mod(mask_mod=lambda b, h, q, kv: q >= kv).is_identity
    assert not compile_mod(score_mod=lambda s, b, h, q, kv: s * 2).is_identity
    assert not compile_mod(mask_mod=flex.noop_mask, sink=torch.zeros(4)).is_identity
    assert not raw_mod("return score;").is_identity


def test_sink_logits_are_one_per_query_head_on_the_kernels_device():
    """The kernels read sink[qo_head] by address: a sink of fewer heads would be read past its end, one on the host
    through a pointer the GPU cannot follow. The spec refuses the first, the launch parameters the second (as they
    refuse a captured tensor on another device)."""
    sink = m.attention_sink(torch.zeros(4))
    with pytest.raises(ValueError, match=r"one sink logit per query head \(8\), got 'attention sink logits of 4"):
        AttentionSpec(num_qo_heads=8, num_kv_heads=2, score_mod=sink)
    assert AttentionSpec(num_qo_heads=4, num_kv_heads=2, score_mod=sink).score_mod is sink
    with pytest.raises(ValueError, match="attention sink logits: expected a tensor on meta, got cpu"):
        sink.param_values(torch.device("meta"))
    assert sink.param_values(torch.device("cpu"))["mod_sink"] == sink.sink.data_ptr()


@pytest.mark.parametrize("kind,fn", [("score", 3), ("mask", 7.0), ("mask", "q >= k")])
def test_compile_mod_refuses_what_is_not_a_function(kind, fn):
    with pytest.raises(TypeError, match=rf"a {kind}_mod must be a Python function, got"):
        compile_mod(**{f"{kind}_mod": fn})


@pytest.mark.parametrize("sink,got", [(0.5, "float 0.5"), (torch.zeros(2, 16), r"shape \[2, 16\]"),
                                      (torch.ones(32, dtype=torch.bool), "torch.bool"),
                                      ([0.0] * 32, "list")])
def test_a_sink_must_be_one_real_logit_per_query_head(sink, got):
    want = r"compile_mod\(sink=...\): expected a real tensor \[num_qo_heads\] \(one logit per query head\), got "
    with pytest.raises(TypeError, match=want + f".*{got}"):
        compile_mod(score_mod=lambda s, b, h, q, k: s, sink=sink)
    taken = compile_mod(sink=torch.arange(32, dtype=torch.int32))  # (an integer tensor is taken, as float32)
    assert taken.sink.dtype == torch.float32 and taken.sink.tolist() == list(range(32))

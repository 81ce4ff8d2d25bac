"""Differential tests on random modifiers (CPU): the same Python function run eagerly on torch tensors
(what FlexAttention computes), traced and evaluated from its graph (attnforge's reference), and traced,
emitted as C++ and built with g++ (the kernels' code; a second build with FMA fusion on models nvcc) must
agree; where a modifier takes the affine or the scaled-core fast form, that form must reproduce it too; and
the reference must agree with FlexAttention itself. tests/mods/random_exprs.py says which values are compared
exactly and which to a tolerance."""
import shutil

import pytest
import torch

from attnforge.mods import compile_mod, graph

from .host_program import DEVICE_LIKE, default_call, host_has_fma, run_calls
from .random_exprs import HEADS, INT_LIMIT, MASK_PARAMS, POSITIONS, ROWS, SCORE_PARAMS, Generator, captured, draw, \
    make_function

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
N = 256


def inputs(seed: int) -> dict:
    """N random rows; in a quarter of them kv_idx equals q_idx (a mask's diagonal, where ties are)."""
    g = torch.Generator().manual_seed(seed)
    x = {"score": torch.randn(N, generator=g) * 3, "b": torch.randint(0, ROWS, (N,), generator=g),
         "h": torch.randint(0, HEADS, (N,), generator=g), "q_idx": torch.randint(0, POSITIONS, (N,), generator=g),
         "kv_idx": torch.randint(0, POSITIONS, (N,), generator=g)}
    x["kv_idx"][: N // 4] = x["q_idx"][: N // 4]
    return x


def magnitude(root, env, mod) -> torch.Tensor:
    """Per input, the largest |value| of any float node of the graph: the scale of an ulp-level difference
    carried to the result (a cancellation leaves the ulps of its operands)."""
    seen, out = set(), torch.zeros(N)

    def walk(node):
        nonlocal out
        if not isinstance(node, tuple) or node in seen or node[0] in ("const", "input"):
            return
        seen.add(node)
        if graph.node_type(node, mod.slots) == "f":
            out = torch.maximum(out, graph.evaluate(node, env, mod.tensors, mod.scalars).float().abs().expand(N))
        for a in node[1:]:
            walk(a)
    walk(root)
    return torch.maximum(out, env["score"].abs()) if "score" in env else out


def same_value(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Equal floats, or both NaN. (-0 equals 0: min / max may return either zero, and a score's sign of
    zero never shows: exp(-0) = exp(0).)"""
    return (x == y) | (x.isnan() & y.isnan())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mask", [False, True], ids=["score_mod", "mask_mod"])
def test_eager_traced_and_gxx_agree_on_random_modifiers(seed, mask, tmp_path):
    x = inputs(100 + seed)
    env = {k: v for k, v in x.items() if not mask or k != "score"}
    cases = draw(seed, 40, mask)
    mods = [compile_mod(**{"mask_mod" if mask else "score_mod": fn}) for fn, _ in cases]
    rows = list(zip(*(x[k].tolist() for k in ("score", "b", "h", "q_idx", "kv_idx"))))
    calls = [(mod, default_call(mod)) for mod in mods]
    gxx = run_calls(calls, rows, tmp_path)
    # the device's FMA fusion, modelled: continuous values may move by ulps, discontinuous ones must not
    fused = run_calls(calls, rows, tmp_path, DEVICE_LIKE) if host_has_fma() else gxx
    for (fn, exact), mod, got, got_fused in zip(cases, mods, gxx, fused):
        eager = fn(**env)
        eager = (eager if isinstance(eager, torch.Tensor) else torch.tensor(eager)).float().expand(N)
        traced = (mod.torch_mask(**env) if mask else mod.torch_score(**env)).float().expand(N)
        tol = 1e-5 * (1 + magnitude(mod.mask_root if mask else mod.score_root, env, mod))
        if exact:
            differ = lambda a, b: ~same_value(a, b)  # noqa: E731
        else:  # (torch's x ** 2.0 squares where the graph's pow calls powf: an ulp)
            differ = lambda a, b: ~((a - b).abs() <= tol) & ~same_value(a, b)  # noqa: E731
        # the graph computes what the function computes
        bad = differ(traced, eager)
        assert not bad.any(), (f"traced graph != eager torch at {int(bad.sum())} of {N} inputs, e.g. "
                               f"{traced[bad][:3].tolist()} against {eager[bad][:3].tolist()}\n{fn.source}")
        bad = differ(got, traced)
        assert not bad.any(), (f"g++ != torch at {int(bad.sum())} of {N} inputs, e.g. {got[bad][:3].tolist()} "
                               f"against {traced[bad][:3].tolist()}\n{fn.source}")
        bad = ~((got_fused - traced).abs() <= tol) & ~same_value(got_fused, traced)
        assert not bad.any(), (f"g++ with FMA fusion != torch at {int(bad.sum())} of {N} inputs, e.g. "
                               f"{got_fused[bad][:3].tolist()} against {traced[bad][:3].tolist()}\n{fn.source}")


def affine_function(gen: Generator, ns: dict):
    """score + A + B * kv_idx written in a random arrangement (A, B free of score and kv_idx), or a near miss
    (kv_idx squared, a scaled score, kv_idx under floor division or a comparison) that is not affine."""
    r = gen.rng

    def free(kinds="ffii", limit=INT_LIMIT):  # (a boolean only as a factor: torch refuses `-` on one)
        e = gen.gen(r.choice(kinds), r.randint(0, 2), exact=True)
        while "kv_idx" in e.src or "score" in e.src or (e.kind != "f" and e.bound > limit):
            e = gen.gen(r.choice(kinds), r.randint(0, 2), exact=True)
        return e.src

    # an integer factor of kv (|kv| < 2 x POSITIONS) bounded so that the product stays inside 32 bits, where the
    # device's arithmetic is torch's (docs/mods.md): seed 1363 drew (q_idx << 3) ** 3 * kv_idx, past 2^31
    factor = INT_LIMIT // (2 * POSITIONS)
    kv = r.choice(["kv_idx", "(kv_idx - q_idx)", "(q_idx - kv_idx)", "(kv_idx).to(torch.float32)", "(-kv_idx)"])
    terms = [f"{kv} * {free('ffiib', factor)}", free(), f"({free('ffiib', factor)}) * {kv}", "score"]
    if r.random() < 0.25:
        terms.append(r.choice(["kv_idx * kv_idx", "score * 2.0", "(kv_idx // 3)", "(kv_idx > q_idx).to(torch.int32)"]))
    r.shuffle(terms)
    src = terms[0]
    for t in terms[1:]:
        src = f"({src} {r.choice('++-')} {t})" if t != "score" else f"({src} + score)"
    return make_function(src, SCORE_PARAMS, ns)


@pytest.mark.parametrize("seed", range(3))
def test_affine_fast_form_reproduces_random_modifiers(seed, tmp_path):
    """Where kv_slope_root is found, the kernel's form: the modifier at score 0 and a reference column kv0,
    stepped by the slope, plus the score (attnforge/mods/affine.py), with the slope from g++."""
    x, gen, ns = inputs(200 + seed), Generator(300 + seed), captured(seed)
    mods = [compile_mod(score_mod=affine_function(gen, ns)) for _ in range(40)]
    affine = [m for m in mods if m.kv_slope_root is not None]
    assert len(affine) >= 20, "the draw should be mostly affine"
    kv0 = (x["kv_idx"] // 16) * 16
    rows = list(zip(x["score"].tolist(), x["b"].tolist(), x["h"].tolist(), x["q_idx"].tolist(), kv0.tolist()))
    calls = [(m, f"{m.cpp_struct_name}_kv_slope(in[i].b, in[i].h, in[i].q, a)") for m in affine]
    calls += [(m, f"{m.cpp_struct_name}_score(0.f, in[i].b, in[i].h, in[i].q, in[i].kv, a)") for m in affine]
    values = run_calls(calls, rows, tmp_path)
    env = {k: x[k] for k in ("b", "h", "q_idx", "kv_idx")}
    for k, m in enumerate(affine):
        slope, at_kv0 = values[k], values[len(affine) + k]
        want_slope = graph.evaluate(m.kv_slope_root, env, m.tensors, m.scalars).float().expand(N)
        assert torch.allclose(slope, want_slope, rtol=1e-6, atol=1e-6), m.score_root
        step = slope * (x["kv_idx"] - kv0)
        stepped = x["score"] + at_kv0 + step
        want = m.torch_score(**x)
        # (the form evaluates the modifier at kv0 and adds a step: the ulps of those values count, as in the kernel)
        at_kv0_env = {**env, "kv_idx": kv0, "score": torch.zeros(N)}
        scale = magnitude(m.score_root, {**env, "score": x["score"]}, m) + magnitude(m.score_root, at_kv0_env, m)
        tol = 1e-5 * (1 + scale + step.abs())
        assert ((stepped - want).abs() <= tol).all(), m.score_root


@pytest.mark.parametrize("seed", range(2))
def test_scaled_core_fast_form_reproduces_random_modifiers(seed):
    """out * F(in * score) with the constants the kernel folds (attnforge/mods/scaled.py), for random
    arrangements of soft-cap-like modifiers and near misses (a negative out, a score offset)."""
    x, rng, ns = inputs(400 + seed), Generator(500 + seed).rng, captured(seed)
    found = 0
    for _ in range(60):
        fn = rng.choice(["tanh", "sigmoid", "exp", "sin"])
        inner = rng.choice(["score / {c}", "score * {c}", "{c} * score", "(score).to(torch.float32) / {c}",
                            "score + {c}"]).format(c=rng.choice([30.0, -7.0, 0.25, 3]))
        outer = rng.choice(["{c} * torch.{f}({i})", "torch.{f}({i}) * {c}", "torch.{f}({i})", "-{c} * torch.{f}({i})"])
        src = outer.format(c=rng.choice([50.0, 2, 0.5]), f=fn, i=inner)
        mod = compile_mod(score_mod=make_function(src, SCORE_PARAMS, ns))
        if mod.scaled_core is None:
            assert src.startswith("-") or "score +" in src, f"{src}: a scaled core not recognised"
            continue
        found += 1
        scale_in, scale_out, core = mod.scaled_core
        folded = scale_out * graph.FLOAT_FUNCS[core][0](x["score"] * scale_in)
        want = mod.torch_score(**x)
        assert torch.allclose(folded, want, rtol=1e-5, atol=1e-5 * scale_out), src
    assert found >= 20, found  # (~36 of 60 expected)


@pytest.mark.parametrize("seed", range(2))
def test_reference_agrees_with_flex_attention_on_random_modifiers(seed):
    """attnforge's reference (the traced graph, in torch) against FlexAttention running the same Python
    function (eagerly, on the CPU, with its own index tensors): q and k hold small integers, so every score is
    exact whatever the matmul order, and the exact draws give both sides the same logits. Masks go to Flex as
    a block mask; fully masked rows are zeros with LSE -inf on both sides."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    from attnforge import reference
    g = torch.Generator().manual_seed(600 + seed)
    hkv = 2
    q = torch.randint(-2, 3, (ROWS, HEADS, POSITIONS, 8), generator=g).float()
    k = torch.randint(-2, 3, (ROWS, hkv, POSITIONS, 8), generator=g).float()
    v = torch.randn(ROWS, hkv, POSITIONS, 8, generator=g)
    scores = [fn for fn, exact in draw(700 + seed, 16, mask=False) if exact]
    masks = [fn for fn, _ in draw(800 + seed, 8, mask=True)]
    for fn in scores + masks:
        is_mask = fn in masks
        mod = compile_mod(**{"mask_mod" if is_mask else "score_mod": fn})
        with warnings.catch_warnings():  # (Flex warns that it runs eagerly, unfused)
            warnings.simplefilter("ignore")
            kw = ({"block_mask": flex.create_block_mask(fn, ROWS, HEADS, POSITIONS, POSITIONS, device="cpu")}
                  if is_mask else {"score_mod": fn})
            want, want_lse = flex.flex_attention(q, k, v, scale=1.0, enable_gqa=True, return_lse=True, **kw)
        ref_kw = {"mask_mod": mod.torch_mask} if is_mask else {"score_mod": mod.torch_score}
        for b in range(ROWS):
            out, lse = reference.attention(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
                                           sm_scale=1.0, batch_index=b, **ref_kw)
            lse_want = want_lse[b].transpose(0, 1).double()
            assert torch.allclose(out.float(), want[b].transpose(0, 1), atol=1e-4, rtol=1e-4), fn.source
            both_empty = lse.isinf() & lse_want.isinf()
            assert (both_empty | ((lse - lse_want).abs() <= 1e-5 * (1 + lse.abs()))).all(), fn.source


@pytest.mark.parametrize("seed,heads", [(11, 32), (21, 16), (21, 128)])
def test_the_gpu_draws_keep_their_logits_within_the_limit(seed, heads):
    """gpu_mods' draws meet the float64 reference on the GPU, where a float32 logit keeps 24 bits: at 1e5 an ulp
    is 7.8e-3, past the tolerance. Seed 11 once drew `score + (max(..., kv_idx * ...) >> 3) - ...` (logits ~1e6:
    an integer root added to the score without the float limit). Over the tests' bounds (batch 8, `heads`, 4096
    positions), a draw's value stays within float_limit 64 plus the score's 16."""
    g = torch.Generator().manual_seed(seed)
    n = 4096
    env = {"score": torch.randn(n, generator=g) * 3, "b": torch.randint(0, 8, (n,), generator=g),
           "h": torch.randint(0, heads, (n,), generator=g), "q_idx": torch.randint(0, 4096, (n,), generator=g),
           "kv_idx": torch.randint(0, 4096, (n,), generator=g)}
    for fn, _ in draw(seed, 8, False, steps_see_score=False, bounds=(8, heads, 4096), float_limit=64.0):
        value = fn(**env).double()
        assert torch.isfinite(value).all() and value.abs().max().item() <= 64.0 + 16.0, fn.source

"""Which score modifiers are out * F(in * score) (attnforge/mods/scaled.py): the Hopper prefill then
folds in into sm_scale and out into the exponent's log2 e (CPU)."""
import numpy as np
import pytest
import torch

import attnforge.mods as m
from attnforge.mods import compile_mod

from .host_program import run_on_host


def mod(fn):
    return compile_mod(score_mod=fn)


def test_softcap_is_a_scaled_tanh():
    assert m.softcap(50.0).scaled_core == (float(np.float32(1 / 50.0)), 50.0, "tanh")
    assert m.softcap(torch.tensor(50.0)).scaled_core is None, "a runtime cap: its sign is unknown at build time"


@pytest.mark.parametrize("fn,form", [
    (lambda s, b, h, q, kv: 30.0 * torch.tanh(s * 0.1), (float(np.float32(0.1)), 30.0, "tanh")),
    (lambda s, b, h, q, kv: torch.tanh(s / 4.0) * 2.5, (0.25, 2.5, "tanh")),
    (lambda s, b, h, q, kv: torch.sigmoid(s), (1.0, 1.0, "sigmoid")),
    (lambda s, b, h, q, kv: 3.0 * torch.tanh(-2.0 * s), (-2.0, 3.0, "tanh")),  # in may be negative
])
def test_scaled_forms(fn, form):
    assert mod(fn).scaled_core == form


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: -3.0 * torch.tanh(s * 0.1),  # out < 0: the row max would be the core's min
    lambda s, b, h, q, kv: 0.0 * torch.tanh(s),
    lambda s, b, h, q, kv: torch.tanh(s) + 1.0,
    lambda s, b, h, q, kv: torch.tanh(s * h),  # in depends on the head
    lambda s, b, h, q, kv: 2.0 * torch.tanh(s * 0.5 + kv),
    lambda s, b, h, q, kv: s * 0.5,  # no core function
])
def test_non_scaled_forms(fn):
    assert mod(fn).scaled_core is None


def test_scaled_mods_get_the_hooks_in_their_variant():
    decl = m.softcap(30.0).cpp_decl
    assert "static constexpr bool kScaledCore = true;" in decl and "core_out_scale(const P&) const { return 30.0f; }" in decl
    assert "kScaledCore" not in m.alibi(torch.ones(4)).cpp_decl


@pytest.mark.parametrize("fn", [lambda s, b, h, q, kv: 50.0 * torch.tanh(s / 50.0),
                                lambda s, b, h, q, kv: 2.5 * torch.tanh(s * 0.7),
                                lambda s, b, h, q, kv: torch.sigmoid(s * -1.5)])
def test_gxx_scaled_core_reproduces_the_modifier(fn, tmp_path):
    """out * core(in * s), with core compiled by g++ from the emitted C++, equals the torch modifier."""
    mm = mod(fn)
    scale_in, scale_out, _ = mm.scaled_core
    g = torch.Generator().manual_seed(6)
    score = torch.randn(256, generator=g) * 40
    inputs = [(float(s), 0, 0, 0, 0) for s in score]
    got = run_on_host(mm, inputs, tmp_path, call=f"{scale_out!r}f * {mm.cpp_struct_name}_core(in[i].s * {scale_in!r}f)")
    zeros = torch.zeros(256, dtype=torch.int64)
    want = mm.torch_score(score, zeros, zeros, zeros, zeros)
    assert torch.allclose(got, want.float(), rtol=1e-5, atol=1e-5)


def test_softcap_written_with_exp_equals_the_tanh_form(tmp_path):
    """The softcap docstring's tighter form, cap * (1 - 2 / (exp(2 s / cap) + 1)), traces (not a scaled
    core: no fold) and, compiled by g++ from the emitted C++, equals cap * tanh(s / cap) on scores
    across the curve, its flat ends and past exp's overflow (exp -> inf gives exactly cap)."""
    cap = 50.0
    mm = mod(lambda s, b, h, q, kv: cap * (1 - 2 / (torch.exp(2 * s / cap) + 1)))
    assert mm.scaled_core is None
    score = torch.cat([torch.tensor([-1e4, -300.0, -60.0, 0.0, 60.0, 300.0, 1e4]), torch.randn(64) * 40])
    got = run_on_host(mm, [(float(s), 0, 0, 0, 0) for s in score], tmp_path)
    assert torch.allclose(got.double(), cap * torch.tanh(score.double() / cap), rtol=1e-5, atol=1e-4)

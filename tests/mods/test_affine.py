"""Which score modifiers are score + A + B * kv_idx (attnforge/mods/affine.py): the Hopper prefill
then evaluates the modifier once per row and tile and steps by B (CPU)."""
import pytest
import torch

import attnforge.mods as m
from attnforge.mods import compile_mod
from attnforge.mods.alibi import default_slopes


def mod(fn):
    return compile_mod(score_mod=fn)


def test_alibi_slope_is_its_slopes_table():
    assert m.alibi(default_slopes(8)).kv_slope_root == ("load", 0, ("input", "h"))


@pytest.mark.parametrize("fn,slope", [
    (lambda s, b, h, q, kv: s + h, ("const", 0, "i")),  # a bias free of kv: slope 0
    (lambda s, b, h, q, kv: s - kv, ("neg", ("const", 1, "i"))),
    (lambda s, b, h, q, kv: (kv - q) * 0.5 + s, ("const", 0.5, "f")),
    (lambda s, b, h, q, kv: s + (kv * 3 - q).to(torch.float32), ("const", 3, "i")),
])
def test_affine_forms(fn, slope):
    assert mod(fn).kv_slope_root == slope


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s * 2 + kv,  # the score scaled
    lambda s, b, h, q, kv: kv - s,  # the score negated
    lambda s, b, h, q, kv: s + kv * kv,  # quadratic
    lambda s, b, h, q, kv: s + (kv - q) // 3,  # floor division
    lambda s, b, h, q, kv: s + abs(kv - q),  # not linear
    lambda s, b, h, q, kv: torch.tanh(s) + kv,  # soft-cap-like
    lambda s, b, h, q, kv: s + torch.where(kv > q, 1.0, 0.0),
])
def test_non_affine_forms(fn):
    assert mod(fn).kv_slope_root is None


def test_library_mods_that_are_not_affine():
    assert m.softcap(30.0).kv_slope_root is None
    assert m.relative_position_bias(torch.randn(4, 9), 4).kv_slope_root is None  # a table lookup by distance
    assert m.causal().kv_slope_root is None  # a mask only


def test_affine_mods_get_the_hook_in_their_variant():
    decl = m.alibi(default_slopes(4)).cpp_decl
    assert "static constexpr bool kAffineKV = true;" in decl and "_kv_slope(i.batch, i.qo_head, i.qo_pos()" in decl
    assert "kAffineKV" not in m.softcap(30.0).cpp_decl


@pytest.mark.parametrize("fn,runtime", [
    (lambda s, b, h, q, kv: s + (kv - q) * 0.5, False),  # a constant slope
    (lambda s, b, h, q, kv: s - 0.75 * (kv - q), False),
    (lambda s, b, h, q, kv: s + torch.tensor(0.5) * (kv - q), True),  # a runtime scalar
])
def test_a_slope_reads_runtime_values_or_is_constant(fn, runtime):
    # graph.reads_runtime_values: what keeps decode off its whole-item kernel (kernels.decode.whole_item_tiling)
    from attnforge.mods import graph
    assert graph.reads_runtime_values(mod(fn).kv_slope_root) is runtime
    assert graph.reads_runtime_values(m.alibi(default_slopes(8)).kv_slope_root)  # a tensor table
    assert not graph.reads_runtime_values(None)

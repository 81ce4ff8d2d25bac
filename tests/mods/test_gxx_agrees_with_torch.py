"""The C++ emitted for each modifier, compiled for the host with g++, agrees with the torch
evaluation of the same graph on random inputs (CPU)."""
import shutil
import subprocess

import pytest
import torch

import attnforge.mods as m
from attnforge.mods import compile_mod
from attnforge.mods.alibi import default_slopes
from attnforge.mods.variant import CPP_PRELUDE

from mod_library import every_operation

from .host_program import DEVICE_LIKE, default_call, host_has_fma, run_calls, run_device_accessor, run_on_host

N = 400
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


def user_mods():
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(4, 33, generator=g)
    lut = torch.randint(-5, 5, (17,), generator=g)
    scale = torch.tensor(0.75)

    def arith(score, b, h, q_idx, kv_idx):
        return score * 0.5 + (kv_idx - q_idx) * 0.01 - h * 2 + b

    def where_minmax(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx > q_idx, max(score, -1.0), min(score * 2, torch.abs(score)))

    def intops(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) // 3 + (kv_idx - 7 * q_idx) % 5 + abs(q_idx - kv_idx) // 2

    def transcendental(score, b, h, q_idx, kv_idx):
        return torch.sigmoid(score) + torch.log(torch.exp(score * 0.1) + 1.0) + torch.tanh(score) * scale

    def table_negative_index(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx - q_idx] + lut[kv_idx % 17 - 8]

    def clamp_and_cast(score, b, h, q_idx, kv_idx):
        return torch.clamp(score, -2.0, 2.0) + (kv_idx >= q_idx).to(torch.float32)

    def divisions(score, b, h, q_idx, kv_idx):  # constant divisors become reciprocal multiplies
        return score / 3 + score / 0.7 + score / (abs(kv_idx - q_idx) + 0.5) + (h + 1) / scale

    def fast_forms(score, b, h, q_idx, kv_idx):  # af_sqrt, af_sigmoid and float floordiv / mod
        return torch.sqrt(abs(score) + 1.0) + torch.sigmoid(score * 3.0) + score // 0.7 + score % 1.5

    def minus_inf(score, b, h, q_idx, kv_idx):  # FlexAttention's way to mask in a score_mod; NaN has no literal
        return torch.where(kv_idx > q_idx + 3, float("-inf"), score) + torch.where(h == 9, float("nan"), 0.0)

    def mask_combo(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 4 != 0) | ~(kv_idx > q_idx) & (h < 2)

    narrow = (torch.randint(-128, 128, (7,), generator=g, dtype=torch.int8),
              torch.randint(0, 256, (5,), generator=g, dtype=torch.uint8),
              torch.randint(-2 ** 15, 2 ** 15, (4, 3), generator=g, dtype=torch.int16))
    keep = torch.rand(4, 60, generator=g) < 0.6  # (bool elements are booleans, as in torch)

    def narrow_tables(score, b, h, q_idx, kv_idx):
        return score + narrow[0][kv_idx % 7] + narrow[1][q_idx - kv_idx] * 0.5 + narrow[2][h, b - kv_idx] * 0.01

    def bool_table(score, b, h, q_idx, kv_idx):
        return torch.where(keep[h, kv_idx], score, score * 2 + keep[h, q_idx])

    def bool_table_mask(b, h, q_idx, kv_idx):
        return keep[h, kv_idx] & (q_idx >= kv_idx) | ~keep[h, -q_idx]

    return [compile_mod(score_mod=f) for f in (arith, where_minmax, intops, transcendental, table_negative_index,
                                              clamp_and_cast, divisions, fast_forms, minus_inf, narrow_tables,
                                              bool_table)] + \
        [compile_mod(mask_mod=mask_combo), compile_mod(mask_mod=bool_table_mask), every_operation("cpu")]


def library_mods():
    g = torch.Generator().manual_seed(1)
    return [m.causal(), m.sliding_window(5), m.softcap(3.0), m.softcap(torch.tensor(2.5)),
            m.alibi(default_slopes(4)), m.relative_position_bias(torch.randn(4, 9, generator=g), 4),
            m.document_mask(torch.randint(0, 3, (2, 64), generator=g, dtype=torch.int32)),
            m.document_mask(torch.randint(0, 3, (2, 64), generator=g), causal=False),
            m.prefix_lm(torch.tensor([5, 17]))]


def random_calls(mod, seed):
    """N random (score, b, h, q, kv) rows and the torch evaluation of mod's graph on them (a mask as 0 / 1)."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(N, generator=g) * 3
    b, h = torch.randint(0, 2, (N,), generator=g), torch.randint(0, 4, (N,), generator=g)
    q, kv = torch.randint(0, 60, (N,), generator=g), torch.randint(0, 60, (N,), generator=g)
    want = mod.torch_score(score, b, h, q, kv) if mod.score_root is not None else mod.torch_mask(b, h, q, kv)
    return list(zip(score.tolist(), b.tolist(), h.tolist(), q.tolist(), kv.tolist())), want.float()


@pytest.mark.parametrize("mod", user_mods() + library_mods(), ids=lambda x: x.name)
def test_gxx_matches_torch(mod, tmp_path):
    inputs, want = random_calls(mod, 2)
    got = run_on_host(mod, inputs, tmp_path)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def _host_readable(mods):  # (the kernels' f16 / bf16 element reads need cuda_fp16.h: device only)
    return [x for x in mods if all(slot.dtype not in ("f16", "bf16") for slot in x.slots.values())]


@pytest.mark.parametrize("mod", _host_readable(user_mods() + library_mods()), ids=lambda x: x.name)
def test_the_kernels_accessor_reads_each_element_type_as_torch_does(mod, tmp_path):
    """The accessor the kernels use (ScoreMod.cpp_decl: each captured tensor read through a pointer of its element's
    C type, at offsets from the sizes in the params struct), built with g++ over the tensors' bytes, gives what torch
    gives: int8 and int16 signs, uint8 past 127, bool bytes, int64 read as 32 bits, negative indices wrapped."""
    assert any(x.slots and {s.dtype for s in x.slots.values()} >= {"i8", "u8", "i16", "b8"}
               for x in _host_readable(user_mods() + library_mods()))  # (the narrow types are in this test)
    inputs, want = random_calls(mod, 6)
    got = run_device_accessor(mod, inputs, tmp_path)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_float_floor_division_and_modulo_match_torch_bitwise(tmp_path):
    """Float // and % are discontinuous: one ulp of quotient moves floor by one. The prelude's af_floordiv and
    af_mod must give torch's float32 results exactly (sign of zero included) where floor(a / b) does not:
    multiples of b computed in float32, one ulp either side, mixed signs, and division by zero."""
    g = torch.Generator().manual_seed(5)
    b = (torch.rand(300, generator=g) * 3 + 0.05) * torch.where(torch.rand(300, generator=g) < 0.5, -1.0, 1.0)
    k = torch.randint(-40, 40, (300,), generator=g).float()
    multiple = b * k
    ulp_up, ulp_down = torch.nextafter(multiple, multiple + 1), torch.nextafter(multiple, multiple - 1)
    edges = torch.tensor([2.1, -2.1, 0.0, -0.0])
    a = torch.cat([multiple, ulp_up, ulp_down, torch.randn(300, generator=g) * 50, edges])
    b = torch.cat([b, b, b, b, torch.tensor([0.7, 0.7, -3.0, 2.0])])
    a, b = torch.cat([a, torch.tensor([1.0, -1.0, 0.0])]), torch.cat([b, torch.zeros(3)])
    pairs = ",\n".join(f"{{{x!r}f, {y!r}f}}" for x, y in zip(a.tolist(), b.tolist()))
    src = (f"#include <cstdio>\n{CPP_PRELUDE}\nstatic const float in[][2] = {{\n{pairs}\n}};\nint main() {{\n"
           "  for (auto& p : in) std::printf(\"%.9g %.9g\\n\", (double)af_floordiv(p[0], p[1]), "
           "(double)af_mod(p[0], p[1]));\n}\n")
    (tmp_path / "fd.cpp").write_text(src)
    subprocess.run(["g++", "-std=c++17", "-O2", "-o", str(tmp_path / "fd"), str(tmp_path / "fd.cpp")], check=True,
                   capture_output=True)
    out = subprocess.run([str(tmp_path / "fd")], capture_output=True, text=True, check=True).stdout.split()
    got = torch.tensor([float(x) for x in out]).view(-1, 2)
    want = torch.stack([torch.div(a, b, rounding_mode="floor"), torch.remainder(a, b)], dim=1)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), (a[~same.all(1)][:5], b[~same.all(1)][:5], got[~same.all(1)][:5], want[~same.all(1)][:5])
    naive = torch.floor(a / b)  # the form the prelude no longer uses: this input set must tell them apart
    assert not torch.equal(naive[b != 0], want[b != 0, 0])


def _affine_mods():
    g = torch.Generator().manual_seed(4)
    slopes = torch.rand(4, generator=g)

    def distance_scaled(score, b, h, q_idx, kv_idx):  # a slope from h and b, an intercept from q
        return score + 0.5 * (kv_idx - q_idx) * h - (kv_idx * 2 - b)
    def negated(score, b, h, q_idx, kv_idx):  # a slope of -(-1.25): once emitted as `--1.25f`, which no compiler takes
        return score + -(kv_idx * -1.25)
    return [m.alibi(default_slopes(4)), compile_mod(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (q - kv) * 0.25),
            compile_mod(score_mod=distance_scaled), compile_mod(score_mod=negated)]


@pytest.mark.parametrize("mod", _affine_mods(), ids=lambda x: x.name)
def test_gxx_affine_slope_matches_torch(mod, tmp_path):
    """The kv slope B of an affine score modifier (attnforge/mods/affine.py), compiled with g++, equals
    the torch evaluation of its graph, and score + bias(kv0) + B (kv - kv0) reproduces the modifier."""
    from attnforge.mods import graph
    g = torch.Generator().manual_seed(3)
    b, h = torch.randint(0, 2, (N,), generator=g), torch.randint(0, 4, (N,), generator=g)
    q, kv = torch.randint(0, 600, (N,), generator=g), torch.randint(0, 600, (N,), generator=g)
    assert mod.kv_slope_root is not None
    inputs = list(zip([0.0] * N, b.tolist(), h.tolist(), q.tolist(), kv.tolist()))
    got = run_on_host(mod, inputs, tmp_path, call=f"{mod.cpp_struct_name}_kv_slope(in[i].b, in[i].h, in[i].q, a)")
    env = {"b": b, "h": h, "q_idx": q, "kv_idx": kv}
    slope = graph.evaluate(mod.kv_slope_root, env, mod.tensors, mod.scalars).float().expand(N)
    assert torch.allclose(got, slope, rtol=1e-6, atol=1e-6)
    # the kernel's form: the bias at a reference column kv0, stepped by the slope
    score = torch.randn(N, generator=g)
    kv0 = (kv // 128) * 128 + 2 * (kv % 4)
    stepped = score + mod.torch_score(torch.zeros(N), b, h, q, kv0) + slope * (kv - kv0)
    assert torch.allclose(stepped, mod.torch_score(score, b, h, q, kv), rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not host_has_fma(), reason="the host CPU has no FMA to model the device's fusion with")
def test_scaled_position_masks_keep_their_diagonal_under_fma_fusion(tmp_path):
    """nvcc fuses a * b + c into one FMA, which skips a rounding: `kv * 0.1 - q * 0.1 <= 0` then fails on
    88 of 199 diagonal keys that torch (the reference and the block mask) keeps. Arithmetic under a comparison,
    floor or integer cast is emitted unfused (af_*_rn); g++ with FMA fusion on models the device."""
    mods = [compile_mod(mask_mod=lambda b, h, q, kv: kv * 0.1 - q * 0.1 <= 0),
            compile_mod(mask_mod=lambda b, h, q, kv: kv * 0.3 + 0.7 >= q * 0.3 + 0.7),
            compile_mod(score_mod=lambda s, b, h, q, kv: s + (kv * 0.1 - q * 0.1 + 2.0) // 1.0)]
    rows = [(0.5, 0, 0, i, i) for i in range(1, 200)]
    got = run_calls([(mod, default_call(mod)) for mod in mods], rows, tmp_path, DEVICE_LIKE)
    assert (got[:2] == 1.0).all() and (got[2] == 2.5).all()
    assert "af_sub_rn(float(v0), float(v1))" in mods[0].cpp_decl and "af_mul_rn(" in mods[2].cpp_decl
    plain = compile_mod(score_mod=lambda s, b, h, q, kv: s * 0.5 + kv * 0.1)  # no discontinuity: FMA welcome
    assert "_rn(" not in plain.cpp_decl.replace(CPP_PRELUDE, "")

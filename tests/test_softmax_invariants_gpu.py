"""Two properties of the softmax that every kernel family must keep, each checked where the tests' usual rule
(2x torch's error against float64) would blur a one-ulp bug:
- shift invariance: with every score shifted far below zero (a score_mod adding SHIFT) the output moves by no
  more than P's rounding can, and the LSE by SHIFT exactly. A running max that started at 0 would weigh each
  token 2^(SHIFT log2 e) = 0 and return zeros: nvcc 13.0 zeroed the second head tile's states of the
  transposed decode kernel that way (forty-fifth session);
- a row that sees one key weighs it exactly 1: its output is that key's V row, bit for bit (decode's
  single-token requests: tests/test_decode_gpu.py; prefill's first causal rows and MLA's here)."""
import pytest
import torch

import attnforge.mods as m
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
from helpers import make_paged_case, poison
from test_mla_gpu import make_case as make_mla_case, mla_spec
from test_prefill_gpu import ragged_case

pytestmark = pytest.mark.gpu
SHIFT = -1000.0
SHIFTED = m.compile_mod(score_mod=lambda s, b, h, q_idx, kv_idx: s + SHIFT)


def assert_shift_invariant(plain, shifted):
    """(out, lse) pairs of one kernel without and with the shift: same softmax, LSE moved by SHIFT."""
    (out0, lse0), (out1, lse1) = plain, shifted
    assert torch.isfinite(out1).all(), "non-finite output under the shift"
    # Two runs of equal standing, not one exact value: the shifted fp32 scores keep ~1e-4 of their precision
    # (ulp 1.2e-4 at 1443 in log2 units), so P's bf16 rounding may fall the other way for any weight: up to
    # 2^-9 w|v| each, ~2^-9 max|v| sqrt(sum w^2) / sum w in all on a flat row (~2e-3 on 17 tokens at |v| 4;
    # eight kernels passed 1e-3 + 2^-7 |out| by up to 3e-4 in call 5), and peaked rows scale with |out|.
    # A max that started at 0 returns zeros and an LSE of -inf.
    diff, bound = (out1.float() - out0.float()).abs(), 8e-3 + 2.0 ** -6 * out0.float().abs()
    assert (diff <= bound).all(), (f"output changed by up to {diff.max().item():.3e} (bound 8e-3 + 2^-6 |out|) "
                                   f"under a shift of every score by {SHIFT}")
    seen = torch.isfinite(lse0)
    assert torch.equal(torch.isfinite(lse1), seen), "the -inf pattern of the LSE changed"
    moved = (lse1[seen].double() - lse0[seen].double() - SHIFT).abs().max().item()
    assert moved < 1e-2, f"LSE moved by SHIFT {SHIFT} +- {moved:.3e}"


@pytest.mark.parametrize("heads,pipeline,extra", [
    ((32, 8), "transposed", {}), ((128, 8), "transposed", {}), ((96, 8), "transposed", {}),
    ((32, 8), "transposed", {"kv_dtype": "fp8_e4m3"}), ((32, 2), "transposed", {"head_dim_qk": 256}),
    ((32, 2), "normal", {}), ((32, 8), "normal", {}), ((32, 1), "normal", {"kv_dtype": "fp8_e4m3"})])
def test_decode(heads, pipeline, extra):
    lengths = [1, 0, 17, 1000, 1, 3000]
    runs = []
    for mod in (None, SHIFTED):
        spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], pipeline=pipeline, score_mod=mod, **extra)
        q, cache, (indptr, indices, last), _ = make_paged_case(spec, lengths, 16, seed=3)
        w = BatchDecode(spec)
        w.plan(indptr, indices, last, page_size=16)
        runs.append(w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True))
    assert_shift_invariant(*runs)


@pytest.mark.parametrize("causal,backend", [(True, None), (False, None), (True, "mma")])
def test_prefill(causal, backend):
    q, k, v, qo, kv = ragged_case(AttentionSpec(family="prefill"), [1, 129, 170], [1, 699, 300], seed=4)
    runs = []
    for mod in (None, SHIFTED):
        p = BatchPrefill(AttentionSpec(family="prefill", causal=causal, score_mod=mod), backend=backend)
        p.plan(qo, kv)
        runs.append(p.run(q, (k, v), out=poison(q.shape, q.dtype), return_lse=True))
    assert_shift_invariant(*runs)


@pytest.mark.parametrize("backend", [None, "mma"])
def test_prefill_rows_of_one_key_are_its_value_row(backend):
    """Causal with as many queries as keys: each request's first query sees its first key alone."""
    lengths = [1, 130, 300, 769]
    q, k, v, bounds, _ = ragged_case(AttentionSpec(family="prefill"), lengths, lengths, seed=6)
    p = BatchPrefill(AttentionSpec(family="prefill", causal=True), backend=backend)
    p.plan(bounds, bounds)
    out = p.run(q, (k, v), out=poison(q.shape, q.dtype)).cpu()
    for first in bounds[:-1]:
        value_rows = v[first].repeat_interleave(4, dim=0).cpu()  # [32 q heads, 128]: q head h reads KV head h // 4
        wrong = (out[first] != value_rows).any(dim=1).nonzero().flatten().tolist()
        assert not wrong, f"query row {first}: heads {wrong} are not its one key's V row"


MLA_KERNELS = [(16, "normal", None), (128, "normal", None), (8, "transposed", None), (16, "transposed", None),
               (16, "normal", "mma"), (16, "transposed", "mma")]


@pytest.mark.parametrize("heads,pipeline,backend", MLA_KERNELS)
def test_mla_single_token_rows_are_its_latent_row(heads, pipeline, backend):
    lengths, page = [1, 65, 1, 2000, 1], 64
    spec = mla_spec(heads, pipeline)
    q_nope, q_pe, (ckv, kpe), (indptr, indices, last), _ = make_mla_case(spec, lengths, page, seed=7)
    w = BatchMLADecode(spec, backend=backend)
    w.plan(indptr, indices, last, page_size=page)
    out = w.run(q_nope, q_pe, ckv, kpe, out=poison(q_nope.shape, q_nope.dtype)).cpu()
    for b in (b for b, n in enumerate(lengths) if n == 1):
        latent = ckv[int(indices[indptr[b]]), 0].cpu()  # [512]: V is the latent row
        wrong = (out[b] != latent).any(dim=1).nonzero().flatten().tolist()
        assert not wrong, f"request {b}: heads {wrong} are not its one token's latent row"


@pytest.mark.parametrize("heads,pipeline,backend", MLA_KERNELS)
def test_mla(heads, pipeline, backend):
    q_nope, q_pe, (ckv, kpe), (indptr, indices, last), _ = make_mla_case(mla_spec(heads), [1, 65, 0, 2000], 64,
                                                                          seed=5)
    runs = []
    for mod in (None, SHIFTED):
        w = BatchMLADecode(mla_spec(heads, pipeline, score_mod=mod), backend=backend)
        w.plan(indptr, indices, last, page_size=64)
        runs.append(w.run(q_nope, q_pe, ckv, kpe, out=poison(q_nope.shape, q_nope.dtype), return_lse=True))
    assert_shift_invariant(*runs)

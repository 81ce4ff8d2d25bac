"""Every kernel family's running max starts at -inf, never at 0: with every score shifted far below zero
(a score_mod adding SHIFT) the output must not change and the LSE must move by exactly SHIFT. A max that
started at 0 would weigh each token 2^(SHIFT log2 e) = 0 and return zeros: nvcc 13.0 zeroed the second
head tile's states of the transposed decode kernel that way (forty-fifth session)."""
import numpy as np
import pytest
import torch

import attnforge.mods as m
from attnforge import AttentionSpec, BatchDecode, BatchMLADecode, BatchPrefill
from helpers import make_paged_case, poison

pytestmark = pytest.mark.gpu
SHIFT = -1000.0
SHIFTED = m.compile_mod(score_mod=lambda s, b, h, q_idx, kv_idx: s + SHIFT)


def assert_shift_invariant(plain, shifted):
    """(out, lse) pairs of one kernel without and with the shift: same softmax, LSE moved by SHIFT."""
    (out0, lse0), (out1, lse1) = plain, shifted
    assert torch.isfinite(out1).all(), "non-finite output under the shift"
    err = (out1.float() - out0.float()).abs().max().item()
    assert err < 1e-2, f"output changed by {err:.3e} under a shift of every score by {SHIFT}"
    seen = torch.isfinite(lse0)
    assert torch.equal(torch.isfinite(lse1), seen), "the -inf pattern of the LSE changed"
    moved = (lse1[seen].double() - lse0[seen].double() - SHIFT).abs().max().item()
    assert moved < 1e-2, f"LSE moved by SHIFT {SHIFT} +- {moved:.3e}"


@pytest.mark.parametrize("heads,pipeline", [((32, 8), "transposed"), ((128, 8), "transposed"), ((96, 8), "transposed"),
                                            ((32, 2), "normal"), ((32, 8), "normal")])
def test_decode(heads, pipeline):
    lengths = [1, 0, 17, 1000, 1, 3000]
    runs = []
    for mod in (None, SHIFTED):
        spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], pipeline=pipeline, score_mod=mod)
        q, cache, (indptr, indices, last), _ = make_paged_case(spec, lengths, 16, seed=3)
        w = BatchDecode(spec)
        w.plan(indptr, indices, last, page_size=16)
        runs.append(w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True))
    assert_shift_invariant(*runs)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill(causal):
    g = torch.Generator().manual_seed(4)
    qo, kv = np.array([0, 1, 130, 300]), np.array([0, 1, 700, 1000])
    q = torch.randn(300, 32, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(1000, 8, 128, generator=g).bfloat16().cuda() for _ in range(2))
    runs = []
    for mod in (None, SHIFTED):
        p = BatchPrefill(AttentionSpec(family="prefill", causal=causal, score_mod=mod))
        p.plan(qo, kv)
        runs.append(p.run(q, (k, v), out=poison(q.shape, q.dtype), return_lse=True))
    assert_shift_invariant(*runs)


@pytest.mark.parametrize("heads,pipeline", [(16, "normal"), (128, "normal"), (8, "transposed"), (16, "transposed")])
def test_mla(heads, pipeline):
    g = torch.Generator().manual_seed(5)
    lengths, page = [1, 65, 0, 2000], 64
    pages = [-(-n // page) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = torch.randperm(int(indptr[-1]) + 2, generator=g).numpy()[: indptr[-1]].astype(np.int32)
    last = np.array([n - (p - 1) * page if p else 0 for n, p in zip(lengths, pages)], dtype=np.int32)
    ckv = torch.randn(int(indptr[-1]) + 2, page, 512, generator=g).bfloat16().cuda()
    kpe = torch.randn(int(indptr[-1]) + 2, page, 64, generator=g).bfloat16().cuda()
    q_nope = torch.randn(len(lengths), heads, 512, generator=g).bfloat16().cuda()
    q_pe = torch.randn(len(lengths), heads, 64, generator=g).bfloat16().cuda()
    runs = []
    for mod in (None, SHIFTED):
        spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                             pipeline=pipeline, score_mod=mod)
        w = BatchMLADecode(spec)
        w.plan(indptr, indices, last, page_size=page)
        runs.append(w.run(q_nope, q_pe, ckv, kpe, out=poison(q_nope.shape, q_nope.dtype), return_lse=True))
    assert_shift_invariant(*runs)

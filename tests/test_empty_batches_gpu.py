"""Batches in which every request has no keys: an empty page table (no indices at all), zero-row K / V, plans
with no work. Each family gives zeros and LSE -inf on every row, and writes every row (outputs are poisoned
first). Requests with no keys beside others are tested in each family's own file; these are the batches where
the whole KV is empty, which the fuzz drew only past its default seeds (decode 126, MLA 92 and 161, split dims
30, 129, 151 and 160 of ATTNFORGE_TEST_FUZZ_SEEDS=0:210; the split-dims draws found a test bug, not a kernel's)."""
import math

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchPrefill
from helpers import make_paged_case, poison
from test_decode_gpu import run_case as run_decode_case
from test_mla_gpu import mla_spec, run_case as run_mla_case
from test_prefill_split_dims_gpu import split_case

pytestmark = pytest.mark.gpu


def assert_zeros_and_no_lse(out, lse):
    assert torch.all(out == 0), "rows with no keys must be zeros"
    assert torch.all(lse == -math.inf), "rows with no keys must have LSE -inf"


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
@pytest.mark.parametrize("graph", [False, True])
def test_decode_every_request_empty(pipeline, graph):
    _, out = run_decode_case(AttentionSpec(pipeline=pipeline), [0, 0, 0], 16, use_cuda_graph=graph,
                             max_batch_size=3)
    assert torch.all(out == 0)


def test_decode_fp8_every_request_empty_page1():
    _, out = run_decode_case(AttentionSpec(kv_dtype="fp8_e4m3"), [0], 1, k_scale=0.5, v_scale=2.0)
    assert torch.all(out == 0)


@pytest.mark.parametrize("heads,pipeline", [(16, "transposed"), (16, "normal"), (128, "normal")])
def test_mla_every_request_empty(heads, pipeline):
    run_mla_case(mla_spec(heads, pipeline), [0, 0], 64, q_len=2)  # (checks zeros and -inf itself)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_every_request_empty(paged, causal):
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=causal)
    qo_lens, kv_lens = [3, 1, 0], [0, 0, 0]
    q = torch.randn(sum(qo_lens), 32, 128, device="cuda").bfloat16()
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    w = BatchPrefill(spec)
    if paged:
        twin = AttentionSpec(num_qo_heads=32, num_kv_heads=8)
        _, cache, (indptr, indices, last), _ = make_paged_case(twin, kv_lens, 16)
        assert len(indices) == 0
        w.plan(qo, indptr, indices, last, page_size=16)
        out, lse = w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True)
    else:
        k = v = torch.empty(0, 8, 128, device="cuda", dtype=torch.bfloat16)
        w.plan(qo, np.zeros(4, np.int64))
        out, lse = w.run(q, (k, v), out=poison(q.shape, q.dtype), return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (4, 32)
    assert_zeros_and_no_lse(out, lse)


def test_prefill_split_dims_every_request_empty():
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=2, head_dim_qk=192, head_dim_vo=128)
    q, k, v, qo, kv = split_case(spec, [2, 1], [0, 0])
    w = BatchPrefill(spec)
    w.plan(qo, kv)
    out, lse = w.run(q, (k, v), out=poison((3, 16, 128), q.dtype), return_lse=True)
    torch.cuda.synchronize()
    assert w.kernel.backend == "wgmma"
    assert_zeros_and_no_lse(out, lse)


def test_attention_with_no_keys_gives_zeros():
    """The one-shot API with Lk = 0: zeros and LSE -inf, like the wrappers (SDPA gives NaN there)."""
    q = torch.randn(1, 8, 5, 64, device="cuda").bfloat16()
    k = v = torch.empty(1, 8, 0, 64, device="cuda").bfloat16()
    out, lse = attnforge.attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert_zeros_and_no_lse(out, lse)

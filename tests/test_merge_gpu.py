import math

import pytest
import torch

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,s,h,d", [(1, 1, 1, 64), (7, 3, 5, 128), (13, 9, 3, 512), (33, 2, 32, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_states_matches_reference(n, s, h, d, dtype):
    torch.manual_seed(n * 100 + s)
    v = torch.randn(n, s, h, d, device="cuda").to(dtype)
    lse = torch.randn(n, s, h, device="cuda") * 4
    lse[0, :, 0] = -math.inf  # a row with no contribution on any side
    if s > 1:
        lse[-1, 0, -1] = -math.inf  # one side empty
    out = torch.full((n, h, d), math.nan, dtype=dtype, device="cuda")
    out, out_lse = attnforge.merge_states(v, lse, out=out)
    ref, ref_lse = reference.merge_states(v.cpu(), lse.cpu())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double().cpu(), ref, atol=tol, rtol=tol)
    assert torch.all(out[0, 0] == 0) and out_lse[0, 0].item() == -math.inf
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(out_lse.cpu()), fin)
    assert torch.allclose(out_lse.cpu()[fin].double(), ref_lse[fin], atol=1e-4)


def test_merge_state_pair_and_all_neg_inf():
    torch.manual_seed(1)
    n, h, d = 17, 3, 128
    va, vb = torch.randn(n, h, d, device="cuda").bfloat16(), torch.randn(n, h, d, device="cuda").bfloat16()
    sa, sb = torch.randn(n, h, device="cuda"), torch.randn(n, h, device="cuda")
    sa[2], sb[2] = -math.inf, -math.inf
    va[2] = math.nan  # garbage behind an empty state must not leak
    out, lse = attnforge.merge_state(va, sa, vb, sb)
    ref, ref_lse = reference.merge_states(torch.stack([va, vb], 1).cpu(), torch.stack([sa, sb], 1).cpu())
    assert torch.all(out[2] == 0) and torch.all(lse[2] == -math.inf)
    mask = torch.ones(n, dtype=torch.bool)
    mask[2] = False
    assert torch.allclose(out.double().cpu()[mask], ref[mask], atol=1e-2)


def test_merge_captured_in_cuda_graph():
    v = torch.randn(9, 4, 8, 128, device="cuda").half()
    s = torch.randn(9, 4, 8, device="cuda")
    out = torch.empty(9, 8, 128, device="cuda", dtype=torch.half)
    attnforge.merge_states(v, s, out=out)  # warm-up: build and load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attnforge.merge_states(v, s, out=out)
    for seed in range(3):
        torch.manual_seed(seed)
        v.copy_(torch.randn_like(v.float()).half())
        s.copy_(torch.randn_like(s))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference.merge_states(v.cpu(), s.cpu())
        assert torch.allclose(out.double().cpu(), ref, atol=1e-2)


def test_merge_bad_inputs():
    v = torch.randn(2, 2, 2, 128, device="cuda")
    with pytest.raises(ValueError, match="s.shape"):
        attnforge.merge_states(v, torch.zeros(2, 3, 2, device="cuda"))
    with pytest.raises(ValueError, match="s.dtype"):
        attnforge.merge_states(v, torch.zeros(2, 2, 2, device="cuda", dtype=torch.half))
    with pytest.raises(ValueError, match="CUDA tensor"):
        attnforge.merge_states(v.cpu(), torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="head_dim"):
        attnforge.merge_states(torch.randn(2, 2, 2, 6, device="cuda"), torch.zeros(2, 2, 2, device="cuda"))

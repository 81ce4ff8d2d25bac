"""Every library modifier through batch decode (both pipelines) against the reference, and user
modifiers against torch FlexAttention given the same Python function."""
import math

import pytest
import torch

import attnforge.mods as m
from attnforge import AttentionSpec, BatchDecode, reference
from attnforge.jit import registry
from helpers import assert_attention_close, assert_lse_close, make_paged_case, poison
from mod_library import HQ, library

from .random_exprs import gpu_mods

pytestmark = pytest.mark.gpu
HKV, D = 8, 128


def decode_with_mod(mod, pipeline, lengths=(1, 200, 2999, 1000), page_size=16, seed=0, **wrapper_kw):
    spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, score_mod=mod, pipeline=pipeline)
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, list(lengths), page_size, seed)
    w = BatchDecode(spec, **wrapper_kw)
    w.plan(indptr, indices, last, page_size=page_size)
    out, lse = w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True)
    torch.cuda.synchronize()
    refs, lows, lses = [], [], []
    for b, (k, v) in enumerate(per_req):
        kw = dict(score_mod=mod.torch_score if mod.score_root is not None else None,
                  mask_mod=mod.torch_mask if mod.mask_root is not None else None, sink=mod.sink, batch_index=b)
        o, l_ = reference.attention(q[b:b + 1], k, v, **kw)
        lo, _ = reference.attention(q[b:b + 1].float(), k.float(), v.float(), dtype=torch.float32, **kw)
        refs.append(o[0]), lses.append(l_[0]), lows.append(lo[0])
    return out, lse, torch.stack(refs), torch.stack(lses), torch.stack(lows).to(q.dtype)


@pytest.mark.parametrize("name", list(library("cpu")))
@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_library_mod_in_decode(name, pipeline):
    mod = library()[name]
    out, lse, ref, ref_lse, low = decode_with_mod(mod, pipeline)
    assert_attention_close(out, ref, low, f"{name}/{pipeline}")
    assert_lse_close(lse, ref_lse, name)


@pytest.mark.parametrize("heads,lengths,whole,kv_dtype,pipeline", [
    ((32, 8), [3000] * 15 + [2990], True, "bf16", "transposed"),  # ~1 item an SM
    ((32, 8), (1, 200, 2999, 1000), False, "bf16", "transposed"),
    ((32, 8), (1, 200, 2999, 1000), False, "fp8_e4m3", "transposed"),
    ((32, 4), (5000, 17, 700), False, "bf16", "transposed"),  # a full n8 head tile
    ((32, 2), (5000, 17, 700), False, "bf16", "transposed"),  # two head tiles
    ((32, 2), (5000, 17, 700), False, "bf16", "normal"),
    ((32, 1), (20000, 17, 700), False, "bf16", "normal")])  # MQA: two head splits, a split request
def test_affine_mods_with_steep_and_negative_slopes(heads, lengths, whole, kv_dtype, pipeline):
    """score + A + B kv: each head's bias at the query's position and its slope once per item, then
    B (pos - q_pos) per score. ALiBi with slopes from -1.5 to 4 (biases in the thousands), a mod with
    a per-head offset A as well, and one of a constant slope (the whole-item kernel's: slopes read at run
    time keep the default kernel there), on the default kernel (fp8 K/V widened in registers too), groups
    of 8 and 16 (two head tiles a warp on the transposed pipeline), both pipelines, MQA's head splits
    included, against the reference."""
    hq, hkv = heads
    slopes = torch.tensor([4.0, 0.72, 0.75, -0.3, 0.05, -1.5, 0.0, 0.7] * 4, device="cuda")
    offsets = torch.linspace(-3.0, 5.0, hq, device="cuda")
    mods = {"alibi": m.alibi(slopes),
            "offset": m.compile_mod(score_mod=lambda s, b, h, q, kv: s + offsets[h] + slopes[h] * 0.01 * (kv - q)),
            "constant slope": m.compile_mod(score_mod=lambda s, b, h, q, kv: s + offsets[h] - 0.75 * (kv - q))}
    for name, mod in mods.items():
        # slopes read at run time keep the default kernel (kernels.decode.whole_item_tiling says why)
        whole_here = whole and name == "constant slope"
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D, score_mod=mod, pipeline=pipeline,
                             kv_dtype=kv_dtype)
        assert "kAffineKV = true" in BatchDecode.host_only(spec).kernel.module().source, name
        q, cache, (indptr, indices, last), per_req = make_paged_case(spec, list(lengths), 16, seed=4)
        w = BatchDecode(spec)
        w.plan(indptr, indices, last, page_size=16)
        assert (w.planned_kernel[0] is w._whole) == whole_here, name
        out, lse = w.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True)
        for b, (k, v) in enumerate(per_req):
            kw = dict(score_mod=mod.torch_score, batch_index=b)
            ref, ref_lse = reference.attention(q[b:b + 1], k, v, **kw)
            low, _ = reference.attention(q[b:b + 1].float(), k.float(), v.float(), dtype=torch.float32, **kw)
            assert_attention_close(out[b:b + 1], ref, low.to(q.dtype), f"{name} request {b}")
            assert_lse_close(lse[b:b + 1], ref_lse, f"{name} request {b}")


@pytest.mark.parametrize("merge_launch", [None, True])
def test_split_rows_get_the_sink_after_the_merge(merge_launch):
    """In the CTA that finishes a split item, or in the merge's second launch (batch_decode_merge_kernel)."""
    mod = m.attention_sink(torch.full((HQ,), 2.0, device="cuda"))
    out, lse, ref, ref_lse, low = decode_with_mod(mod, "transposed", lengths=(70000, 3), merge_launch=merge_launch)
    assert_attention_close(out, ref, low, "sink split")
    assert_lse_close(lse, ref_lse, "sink split")


@pytest.mark.parametrize("merge_launch", [None, True])
def test_raw_output_transform_on_whole_and_split_rows(merge_launch):
    """The escape hatch's output hook (raw C++, a tensor and a scalar parameter) applied once to every
    output element: on whole rows, and on split rows merged in the kernel or by the second launch."""
    scale = torch.linspace(0.5, 2.0, HQ, device="cuda")
    mod = m.raw_mod("""  static constexpr bool kHasOutputTransform = true;
  template <class P> AF_DEVICE float output_transform(const P& p, float v, const attnforge::OutputIndex& i) const {
    return v * static_cast<const float*>(p.mod_t0)[i.qo_head] + p.mod_s0 * float(i.dim & 1);
  }""", tensors=[scale], scalars=[0.25], name="scaled_out")
    out, lse, ref, ref_lse, low = decode_with_mod(mod, "transposed", lengths=(70000, 3), merge_launch=merge_launch)
    odd = (torch.arange(D, device="cuda") & 1).double() * 0.25
    transform = lambda o: (o.double() * scale.double()[:, None] + odd).to(o.dtype)  # noqa: E731
    assert_attention_close(out, transform(ref), transform(low), "raw output transform")
    assert_lse_close(lse, ref_lse, "raw output transform")  # the hook leaves the lse alone


def test_runtime_scalar_changes_without_rebuild():
    a, b = m.softcap(torch.tensor(30.0)), m.softcap(torch.tensor(2.0))
    out_a = decode_with_mod(a, "transposed")
    n = len(registry._libraries)
    out_b, _, ref_b, _, low_b = decode_with_mod(b, "transposed")
    assert len(registry._libraries) == n  # the same compiled kernel served the new cap
    assert_attention_close(out_b, ref_b, low_b, "softcap 2.0")
    assert not torch.equal(out_a[0], out_b)


def test_user_mods_match_flex_attention():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    L, B = 777, 2
    slopes = torch.rand(HQ, device="cuda")
    ids = (torch.arange(L, device="cuda") // 100).repeat(B, 1)

    def biased(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * torch.minimum(kv_idx - q_idx, torch.tensor(0, device="cuda")) * 0.1

    def same_doc(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    mod = m.compile_mod(score_mod=biased, mask_mod=same_doc)
    spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, score_mod=mod)
    q, cache, (indptr, indices, last), per_req = make_paged_case(spec, [L] * B, 16, seed=5)
    w = BatchDecode(spec)
    w.plan(indptr, indices, last, page_size=16)
    out = w.run(q, cache)
    # FlexAttention sees the decode query at q_idx 0; ours at its position L-1 (end-aligned)
    off = L - 1
    k = torch.stack([kv[0] for kv in per_req]).transpose(1, 2).to(q.dtype)
    v = torch.stack([kv[1] for kv in per_req]).transpose(1, 2).to(q.dtype)
    bm = create_block_mask(lambda b, h, qi, kvi: same_doc(b, h, qi + off, kvi), B, None, 1, L, device="cuda")
    flex = flex_attention(q[:, :, None], k, v, score_mod=lambda s, b, h, qi, kvi: biased(s, b, h, qi + off, kvi),
                          block_mask=bm, enable_gqa=True)[:, :, 0]
    err = (out.float() - flex.float()).abs().max().item()
    assert err < 2e-2, err
    assert math.isfinite(err)


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_random_modifiers_in_decode(pipeline):
    """Eight random score_mods and four random mask_mods (every traced operation, FMA-sensitive ties included)
    through batch decode against the float64 reference."""
    for k, mod in enumerate(gpu_mods(11, 8, False) + gpu_mods(12, 4, True)):
        out, lse, ref, ref_lse, low = decode_with_mod(mod, pipeline)
        assert_attention_close(out, ref, low, f"random mod {k}/{pipeline}: {mod.score_root or mod.mask_root}")
        assert_lse_close(lse, ref_lse, f"random mod {k}")


def test_random_modifiers_in_prefill():
    """The same draws through the wgmma prefill (ragged, causal, GQA 32/8) against the float64 reference."""
    from test_prefill_gpu import check_against_reference, ragged_case

    from attnforge import BatchPrefill
    for k, mod in enumerate(gpu_mods(11, 8, False) + gpu_mods(12, 4, True)):
        spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, causal=True, score_mod=mod)
        q, kk, v, qo, kv = ragged_case(spec, [200, 1, 515, 64], [200, 700, 515, 2999], seed=k)
        w = BatchPrefill(spec)
        w.plan(qo, kv)
        out, lse = w.run(q, (kk, v), return_lse=True)
        per = [(kk[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]]) for b in range(4)]
        check_against_reference(spec, q, out, lse, per, qo)

"""Prefill with values narrower than keys (head_dim_vo < head_dim_qk), host side: the spec's pairs, the kernel's
shape and shared memory, the refusals, and what a run launches (no GPU: launches are recorded)."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchPrefill
from attnforge.jit import tma as tma_maps
from attnforge.kernels.prefill import SMEM_LIMIT, PrefillKernel, default_backend
from attnforge.spec import PREFILL_QK_VO_DIMS
from test_prefill_run_host import full_pack, recorder  # noqa: F401 (a fixture)

DEEPSEEK = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128,
                         causal=True)


@pytest.mark.parametrize("dims", PREFILL_QK_VO_DIMS)
def test_each_pair_is_a_prefill_spec_whose_kernel_fits(dims):
    spec = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=8, head_dim_qk=dims[0], head_dim_vo=dims[1])
    assert spec.name.startswith(f"prefill_mha_d{dims[0]}x{dims[1]}_")
    assert default_backend(spec, ("8.0",)) == "wgmma"  # (the only kernel that takes them)
    k = PrefillKernel(spec, "wgmma")
    assert k.smem_bytes <= SMEM_LIMIT and k.stages >= (2 if k.split_ring else 3) and k.tile_q == 128
    # Q [128][dqk] and every slot's K [tile][dqk] or V [tile][dvo], 16-bit, are inside the total
    assert k.smem_bytes >= 2 * (128 * dims[0] + k.tile_kv * (k.stages * dims[0] + k.v_slots * dims[1]))
    assert PrefillKernel(spec, "wgmma", producer=False).stages >= 3  # (a split ring is the producer's)
    names = [f.name for f in k.params.fields]
    assert "v_stride_token" in names and "v_stride_head" in names
    assert f"d{dims[0]}x{dims[1]}" in k.module().name
    assert k.module().context["head_dim_vo"] == dims[1]


def test_deepseek_shape_is_a_split_ring_of_128_token_tiles():
    """192/128: 128-token tiles in three shared stages need 48 + 3 x 80 KB (too much); a split ring of two K
    (48 KB) and two V slots (32 KB) fits, a third V slot would not. Without a producer: 64-token tiles."""
    k = PrefillKernel(DEEPSEEK, "wgmma")
    assert (k.tile_kv, k.stages, k.split_ring, k.v_slots) == (128, 2, True, 2)
    assert k.smem_bytes <= SMEM_LIMIT < k.smem_bytes + 128 * 128 * 2
    assert k.module().context["v_slots"] == 2
    assert (lambda p: (p.tile_kv, p.stages))(PrefillKernel(DEEPSEEK, "wgmma", producer=False)) == (64, 4)
    two = PrefillKernel(DEEPSEEK, "wgmma", kv_tile=64, num_stages=2)  # 64-token tiles: room for V's extra slot
    assert two.split_ring and two.v_slots == 3


@pytest.mark.parametrize("kwargs,field,words", [
    (dict(family="decode", head_dim_qk=192, head_dim_vo=128), "head_dim_qk", "prefill also takes"),
    (dict(family="prefill", head_dim_qk=192, head_dim_vo=192), "head_dim_qk", "(192, 128)"),
    (dict(family="prefill", head_dim_qk=128, head_dim_vo=96), "head_dim_vo", "a pair in"),
    (dict(family="decode", head_dim_qk=128, head_dim_vo=64), "head_dim_vo", "family='prefill'"),
])
def test_other_pairs_are_refused_with_the_supported_ones(kwargs, field, words):
    with pytest.raises(ValueError, match=f"AttentionSpec.{field}") as e:
        AttentionSpec(**kwargs)
    assert words in str(e.value)


def test_mma_and_fp8_are_refused_before_any_build():
    with pytest.raises(ValueError, match="backend='wgmma'"):
        PrefillKernel(DEEPSEEK, "mma")
    fp8 = AttentionSpec(family="prefill", head_dim_qk=192, head_dim_vo=128, kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="16-bit K/V only"):
        PrefillKernel(fp8, "wgmma")


def test_paged_plans_are_refused_with_the_ragged_form():
    w = BatchPrefill(DEEPSEEK, device="cpu")
    with pytest.raises(ValueError, match="ragged K/V only"):
        w.plan([0, 4], [0, 1], kv_indices=[0], kv_last_page_len=[4], page_size=16)


def test_run_launches_v_strides_and_v_map_and_returns_vo_rows(recorder, monkeypatch):
    """V sliced out of a fused projection: the params carry its own strides and a map of V (not K's)."""
    w = BatchPrefill(DEEPSEEK, device="cpu", split_kv=False)  # (one launch, straight into out)
    w.plan(np.array([0, 70]), np.array([0, 300]))
    q = torch.randn(70, 16, 192).bfloat16()
    k = torch.randn(300, 16, 192).bfloat16()
    v = torch.randn(300, 16, 320).bfloat16()[..., 192:]
    out, lse = w.run(q, (k, v), return_lse=True)
    assert out.shape == (70, 16, 128) and lse.shape == (70, 16)
    strides = dict(stride_page=0, stride_token=16 * 192, stride_head=192, v_stride_token=16 * 320, v_stride_head=320,
                   q_stride_n=16 * 192, q_stride_h=192, out_stride_n=16 * 128, out_stride_h=128, out_stride_slot=0,
                   lse_stride_n=16, lse_stride_h=1, lse_stride_slot=0)
    assert bytes(recorder.last(w)) == bytes(full_pack(w, q, k, v, out, lse, strides))
    monkeypatch.setattr(tma_maps, "encode", lambda t, b: (t.data_ptr(), b))  # the whole box: extents, strides
    values = w._plan["kernel"].tma_values(k, v, w._plan["page_size"], True)
    tile = w.kernel.tile_kv
    assert values["k_tmap"] == (k.data_ptr(), tma_maps.ragged_kv_box(192, 16, 300, 16 * 192, 192, 2, tile, False)[0])
    assert values["v_tmap"] == (v.data_ptr(), tma_maps.ragged_kv_box(128, 16, 300, 16 * 320, 320, 2, tile, False)[0])


@pytest.mark.parametrize("bad,words", [
    (lambda k, v: (k, torch.randn(300, 16, 192).bfloat16()), "v.shape"),
    (lambda k, v: (k, v[:299]), "equal token counts"),
    (lambda k, v: (k[..., :128], v), "k.shape"),
])
def test_run_refuses_k_and_v_of_the_wrong_widths(recorder, bad, words):
    w = BatchPrefill(DEEPSEEK, device="cpu")
    w.plan(np.array([0, 70]), np.array([0, 300]))
    k, v = torch.randn(300, 16, 192).bfloat16(), torch.randn(300, 16, 128).bfloat16()
    with pytest.raises(ValueError, match=words):
        w.run(torch.randn(70, 16, 192).bfloat16(), bad(k, v))
    out_wrong = torch.empty(70, 16, 192).bfloat16()
    with pytest.raises(ValueError, match="out"):
        w.run(torch.randn(70, 16, 192).bfloat16(), (k, v), out=out_wrong)
    assert not recorder.launches


def test_attention_refuses_a_v_width_without_a_kernel(recorder):
    import attnforge
    q, k = torch.randn(1, 8, 16, 192).bfloat16(), torch.randn(1, 8, 16, 192).bfloat16()
    with pytest.raises(ValueError, match=r"k/v shape.*\(192, 128\)"):
        attnforge.attention(q, k, torch.randn(1, 8, 16, 64).bfloat16())
    with pytest.raises(ValueError, match="k/v shape"):
        attnforge.attention(q, k, torch.randn(1, 8, 15, 128).bfloat16())  # (lengths must agree)
    assert not recorder.launches


def test_compiled_attention_output_takes_v_width():
    """Under torch.compile the op's fake output is V's width (the graph's later ops see [B, H, Lq, Dv])."""
    from attnforge.ops import _attention_fake
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(1, 8, 16, 192, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 8, 40, 192, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(1, 8, 40, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = _attention_fake(q, k, v, "", None, False, True)
    assert tuple(out.shape) == (1, 8, 16, 128) and tuple(lse.shape) == (1, 8, 16)


def test_the_deepseek_prefill_preset_builds_what_batch_prefill_launches():
    """`python -m attnforge build --preset deepseek-prefill`: 192/128 in bf16 and fp16, the module a ragged plan
    launches (the only kind these specs plan), and its float32-partials twin and the merge (plans that split KV)."""
    from attnforge import presets
    specs = presets.PRESETS["deepseek-prefill"]()
    assert {(s.head_dim_qk, s.head_dim_vo, s.q_dtype) for s in specs} == {(192, 128, "bf16"), (192, 128, "fp16")}
    for spec in specs:
        w = BatchPrefill(spec, device="cpu")
        ragged = [w._kernels[True, split].module().name for split in (False, True)]
        merge = f"merge_states_float_out{'bf16' if spec.q_dtype == 'bf16' else 'fp16'}"
        assert [m.name for m in presets.modules_for(spec)] == ragged + [merge]
        assert all("wgmma" in name for name in ragged) and "outf32" in ragged[1]


def test_k_goes_a_tile_ahead_of_v_on_split_dims_alone():
    """K(t+1) is copied before V(t) (and freed as S(t) retires) on split dims' split ring, which loads ragged K/V
    only; other split rings copy paged rows K resolved for V, so they keep K beside V, and the option says so."""
    import dataclasses
    spec = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128)
    ahead, beside = PrefillKernel(spec, "wgmma"), PrefillKernel(spec, "wgmma", k_ahead=False)
    assert ahead.k_ahead and ahead.module().context["k_ahead"] and not beside.module().context["k_ahead"]
    assert beside.module().name == ahead.module().name.replace("_s2", "_kb_s2")
    assert "if (t > 0) load_v(t - 1);" in ahead.module().source and "load_v" not in beside.module().source
    assert BatchPrefill(spec, device="cuda:0", k_ahead=False).kernel.k_ahead is False
    d256 = dataclasses.replace(spec, num_kv_heads=2, head_dim_qk=256, head_dim_vo=256)
    assert PrefillKernel(d256, "wgmma").split_ring and not PrefillKernel(d256, "wgmma").k_ahead
    for other, kw in ((d256, {}), (spec, {"kv_tile": 64, "num_stages": 4}),
                      (dataclasses.replace(spec, head_dim_qk=128, head_dim_vo=128), {"num_stages": 2})):
        assert not PrefillKernel(other, "wgmma", **kw).k_ahead
        with pytest.raises(ValueError, match="k_ahead: K one tile ahead of V needs a split ring"):
            PrefillKernel(other, "wgmma", k_ahead=True, **kw)
    with pytest.raises(ValueError, match="k_ahead=1"):  # (a bool, not a number that compares equal to one)
        PrefillKernel(spec, "wgmma", k_ahead=1)

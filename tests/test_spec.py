import pytest
import torch

from attnforge import AttentionSpec


def test_defaults_and_name():
    s = AttentionSpec(logits_soft_cap=50.0, num_qo_heads=32, num_kv_heads=8)
    assert s.name == "decode_gqa4_d128_bf16_kvbf16_nhd_softcap"
    assert s.head_dim_vo == 128 and s.kv_dtype == "bf16" and s.out_dtype == "bf16"
    assert AttentionSpec(num_qo_heads=8, num_kv_heads=8).head_layout == "mha"
    assert AttentionSpec(num_qo_heads=16, num_kv_heads=1).head_layout == "mqa16"


def test_torch_dtypes_normalize():
    s = AttentionSpec(q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)
    assert (s.q_dtype, s.kv_dtype, s.out_dtype) == ("fp16", "fp8_e4m3", "fp16")


def test_hash_is_stable_and_content_based():
    a, b = AttentionSpec(), AttentionSpec()
    assert a.content_hash == b.content_hash and a == b and hash(a) == hash(b)
    assert AttentionSpec(causal=True).content_hash != a.content_hash
    # a fixed value: the hash must not depend on the process (no id(), no Python hash())
    assert len(a.content_hash) == 64


def test_mla_spec():
    s = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    assert s.name.startswith("mla_decode_mla16_d576x512")
    assert s.pipeline == "normal"  # measured faster at every head count with the mma.sync kernels


def test_unset_shape_fields_take_the_familys_shape():
    # MLA has one valid KV shape, so its spec needs only the heads; the GQA families keep 8 KV heads of 128
    mla = AttentionSpec(family="mla_decode", num_qo_heads=16)
    assert (mla.num_kv_heads, mla.head_dim_qk, mla.head_dim_vo) == (1, 576, 512)
    assert mla == AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                head_dim_vo=512)
    assert AttentionSpec(family="mla_decode", num_qo_heads=16, head_dim_qk=576).head_dim_vo == 512
    for family in ("decode", "prefill"):
        gqa = AttentionSpec(family=family)
        assert (gqa.num_kv_heads, gqa.head_dim_qk, gqa.head_dim_vo) == (8, 128, 128)
        assert gqa.content_hash == AttentionSpec(family=family, num_kv_heads=8, head_dim_qk=128).content_hash
    assert AttentionSpec(family="prefill", head_dim_qk=192, head_dim_vo=128).head_dim_vo == 128
    assert AttentionSpec.from_dict(mla.to_dict()) == mla


@pytest.mark.parametrize("kwargs, field, hint", [
    (dict(family="encode"), "family", "one of"),
    (dict(num_qo_heads=0), "num_qo_heads", "positive int"),
    (dict(num_qo_heads=30, num_kv_heads=8), "num_qo_heads", "multiple of num_kv_heads=8"),
    (dict(num_qo_heads=128, num_kv_heads=1), "num_qo_heads", "at most 64"),
    (dict(head_dim_qk=96), "head_dim_qk", "one of (64, 128, 256)"),
    (dict(head_dim_vo=64), "head_dim_vo", "equal to head_dim_qk"),
    (dict(q_dtype="fp8_e4m3"), "q_dtype", "fp8 is supported for KV only"),
    (dict(q_dtype="float32"), "q_dtype", "one of"),
    (dict(out_dtype="fp8_e4m3"), "out_dtype", "bf16"),
    (dict(q_dtype="bf16", kv_dtype="fp16"), "kv_dtype", "same as q_dtype"),
    (dict(kv_layout="NCHW"), "kv_layout", "one of"),
    (dict(page_size=0), "page_size", ">= 1"),
    (dict(pipeline="fast"), "pipeline", "one of"),
    (dict(family="prefill", pipeline="transposed"), "pipeline", "'normal' for prefill"),
    (dict(causal=1), "causal", "a bool"),
    (dict(window_left=-2), "window_left", "-1 (off)"),
    (dict(window_left=10 ** 12), "window_left", "an int below 2^31"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap", "finite float"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap", "finite float"),
    (dict(logits_soft_cap=1e39), "logits_soft_cap", "finite float"),  # (inf as float32: inf * tanh(0) is NaN)
    (dict(score_mod=lambda s: s), "score_mod", "compile_mod(score_mod=fn)"),  # (a function: says to trace it)
    (dict(score_mod="alibi"), "score_mod", "attnforge.mods factories"),
    (dict(family="mla_decode", num_qo_heads=16, num_kv_heads=2, head_dim_qk=576, head_dim_vo=512),
     "num_kv_heads", "1 for MLA"),
    (dict(family="mla_decode", num_qo_heads=12, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512),
     "num_qo_heads", "mla_decode"),
    (dict(family="mla_decode", num_qo_heads=16, head_dim_qk=128), "head_dim_qk/head_dim_vo", "576"),
    (dict(family="mla_decode", num_qo_heads=16, head_dim_vo=576), "head_dim_qk/head_dim_vo", "576"),
    (dict(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
          kv_layout="HND"), "kv_layout", "'NHD' for MLA"),
    (dict(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
          window_left=128), "window_left", "-1 for mla_decode"),
])
def test_every_invalid_field_is_named(kwargs, field, hint):
    with pytest.raises(ValueError) as e:
        AttentionSpec(**kwargs)
    msg = str(e.value)
    assert f"AttentionSpec.{field}" in msg and hint in msg and "got" in msg


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        AttentionSpec.from_dict({"family": "decode", "heads": 3})
    assert AttentionSpec.from_dict(AttentionSpec(causal=True).to_dict()) == AttentionSpec(causal=True)


def test_auto_pipeline_resolves_to_measured_winner():
    from attnforge.spec import default_pipeline
    assert AttentionSpec().pipeline == "transposed" == default_pipeline("decode", 4)
    assert AttentionSpec(num_qo_heads=64, num_kv_heads=1).pipeline == "normal"
    assert AttentionSpec(num_qo_heads=64, num_kv_heads=8).pipeline == "transposed"  # group 8: one n8 tile
    assert AttentionSpec(num_qo_heads=64, num_kv_heads=4).pipeline == "normal"  # group 16: one m16 tile
    # fp8 KV widens in registers on the transposed pipeline: up to its two n8 head tiles at d64 and d256; at d128
    # the normal pipeline widens in registers too, and its one m16 tile takes groups past 8
    fp8 = dict(num_qo_heads=64, num_kv_heads=4, kv_dtype="fp8_e4m3")
    assert AttentionSpec(**fp8).pipeline == "normal" == default_pipeline("decode", 16, "fp8_e4m3")
    assert AttentionSpec(num_qo_heads=36, num_kv_heads=4, kv_dtype="fp8_e4m3").pipeline == "normal"  # 9
    assert AttentionSpec(num_qo_heads=32, num_kv_heads=4, kv_dtype="fp8_e4m3").pipeline == "transposed"  # 8
    assert AttentionSpec(num_qo_heads=68, num_kv_heads=4, kv_dtype="fp8_e4m3").pipeline == "normal"  # 17
    assert AttentionSpec(**fp8, head_dim_qk=64, head_dim_vo=64).pipeline == "transposed"
    assert AttentionSpec(**fp8, head_dim_qk=256, head_dim_vo=256).pipeline == "transposed"
    for hq, d, pipeline in ((32, 128, "normal"), (64, 128, "normal"), (24, 128, "normal"), (8, 128, "transposed"),
                            (32, 256, "normal"), (32, 64, "transposed")):  # MQA-sized: items of 16 at d64
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=1, head_dim_qk=d, head_dim_vo=d, kv_dtype="fp8_e4m3")
        assert spec.pipeline == pipeline, (hq, d)
    assert "normal" not in AttentionSpec(**fp8).name
    assert "transposed" in AttentionSpec(**fp8, pipeline="transposed").name
    assert AttentionSpec(family="prefill").pipeline == "normal"
    # the name mentions the pipeline only when it is not the default for the shape
    assert "normal" in AttentionSpec(pipeline="normal").name
    assert AttentionSpec(pipeline="normal").content_hash != AttentionSpec().content_hash

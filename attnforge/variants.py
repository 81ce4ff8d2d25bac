"""AttentionSpec -> the C++ `Variant` a kernel instantiates (attnforge/variant.cuh contract).

Built-ins: identity and soft-cap, layered with the causal and sliding-window masks.
Extra runtime scalars every family passes (see COMMON_VARIANT_FIELDS) keep values such as the
soft-cap out of the compiled code, so changing them never triggers a rebuild.
"""
from __future__ import annotations

from functools import lru_cache

from .codegen import ParamField, ParamsLayout
from .spec import AttentionSpec

COMMON_VARIANT_FIELDS = (
    ParamField("sm_scale", "float", "f32"),
    ParamField("logits_soft_cap", "float", "f32"),
    ParamField("inv_logits_soft_cap", "float", "f32"),
    ParamField("window_left", "int32_t", "i32"),
)


def variant_decl(spec: AttentionSpec) -> str:
    base = "attnforge::SoftCapVariant" if spec.logits_soft_cap > 0 else "attnforge::IdentityVariant"
    if spec.score_mod is not None:
        base = spec.score_mod.cpp_struct_name
        prelude = spec.score_mod.cpp_decl + "\n"
    else:
        prelude = ""
    causal = "true" if spec.causal and spec.family != "decode" else "false"  # decode: trivially causal
    # prefill's causal mask runs per element; whole tiles past the diagonal are skipped by the kernel
    window = "true" if spec.window_left >= 0 else "false"
    return f"{prelude}using Variant = attnforge::WithPositionMask<{base}, {causal}, {window}>;"


def variant_values(spec: AttentionSpec, sm_scale: float) -> dict:
    cap = spec.logits_soft_cap
    return {"sm_scale": sm_scale, "logits_soft_cap": cap, "inv_logits_soft_cap": (1.0 / cap) if cap > 0 else 0.0,
            "window_left": spec.window_left}


@lru_cache(maxsize=128)
def _layout(struct_name: str, fields: tuple) -> ParamsLayout:
    return ParamsLayout(struct_name, fields)


def params_for(struct_name: str, base_fields: tuple, spec: AttentionSpec) -> ParamsLayout:
    """A kernel family's parameter struct: its base fields plus the score modifier's, if any."""
    extra = tuple(spec.score_mod.param_fields()) if spec.score_mod is not None else ()
    return _layout(struct_name, (*base_fields, *extra))

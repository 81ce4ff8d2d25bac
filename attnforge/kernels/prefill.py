"""The batch-prefill kernel family: template variables, parameter struct and launch shape."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .. import variants
from ..codegen import ParamField, ParamsLayout
from ..jit import JitModule
from ..spec import AttentionSpec
from .fields import IO_FIELDS, PAGED_KV_FIELDS, ptrs, scalars

_CPP = {"bf16": "bf16", "fp16": "fp16"}
TILE_Q, TILE_KV = 64, 64

BASE_FIELDS = (
    *IO_FIELDS, *PAGED_KV_FIELDS,
    *ptrs("qo_indptr", "q_offset", "kv_offset", "work", "kv_tile_indptr", "kv_tiles", "num_work"),
    *scalars("i64", "int64_t", "q_stride_n", "q_stride_h", "out_stride_n", "out_stride_h", "lse_stride_n",
             "lse_stride_h"),
    ParamField("ragged", "int32_t", "i32"),
    *variants.COMMON_VARIANT_FIELDS,
)


@dataclass(frozen=True)
class PrefillKernel:
    spec: AttentionSpec
    num_stages: int = 2

    def __post_init__(self):
        if self.spec.family != "prefill":
            raise ValueError(f"PrefillKernel: expected a spec with family='prefill', got {self.spec.family!r}")

    @property
    def threads(self) -> int:
        return 32 * (TILE_Q // 16)

    @cached_property
    def smem_bytes(self) -> int:
        d = self.spec.head_dim_qk
        return TILE_Q * d * 2 + self.num_stages * 2 * TILE_KV * d * 2

    @property
    def params(self) -> ParamsLayout:
        return variants.params_for("PrefillParams", BASE_FIELDS, self.spec)

    def module(self) -> JitModule:
        s = self.spec
        ctx = {"q_dtype": _CPP[s.q_dtype], "kv_dtype": _CPP[s.kv_dtype], "out_dtype": _CPP[s.out_dtype],
               "head_dim": s.head_dim_qk, "group_size": s.group_size, "causal": s.causal,
               "tile_q": TILE_Q, "tile_kv": TILE_KV, "num_stages": self.num_stages, "smem_bytes": self.smem_bytes,
               "variant_decl": variants.variant_decl(s), "params_struct": self.params.cpp()}
        name = "_".join(["prefill", f"g{s.group_size}", f"d{s.head_dim_qk}", s.q_dtype, f"out{s.out_dtype}",
                         *(["causal"] if s.causal else []), *(["softcap"] if s.logits_soft_cap > 0 else []),
                         *(["win"] if s.window_left >= 0 else []),
                         *([f"mod{s.score_mod.cache_key[:8]}"] if s.score_mod is not None else []),
                         f"s{self.num_stages}"])
        return JitModule(name, "batch_prefill.cu.jinja", ctx, ("batch_prefill_kernel",))

"""The Quest page-scoring kernel: template variables and parameter struct."""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen import ParamField, ParamsLayout
from ..jit import JitModule
from .fields import ptrs, scalars

_CPP = {"bf16": "bf16", "fp16": "fp16", "fp32": "float", "fp8": "fp8e4m3", "int4": "uint8_t"}
VALUES_PER_VECTOR = {"fp32": 4, "bf16": 8, "fp8": 16, "int4": 32}  # summary values in 16 bytes
FIELDS = (*ptrs("q", "kmin", "kmax", cpp="const void*"), *ptrs("kv_indptr", "kv_indices", "meta"),
          ParamField("scores", "float*", "ptr"),
          # [B, Hkv, D] each: the sums of a KV head's positive / negative query values (quest_qsplit_kernel)
          ParamField("q_pos", "float*", "ptr"), ParamField("q_neg", "float*", "ptr"),
          # int4 summaries: q_pos / q_neg hold int8 sums [B, Hkv, D], q_scale their scales [B * Hkv, 2]
          ParamField("q_scale", "float*", "ptr"),
          *scalars("i64", "int64_t", "q_stride_b", "q_stride_h"),
          # fp8 / int4 summaries hold key / scale: [scale_rows, D] scales (1 otherwise), folded into the query sums
          ParamField("channel_scale", "const float*", "ptr"), ParamField("scale_rows", "int32_t", "i32"))
LAYOUT = ParamsLayout("QuestParams", FIELDS)
SELECT_FIELDS = (ParamField("scores", "const float*", "ptr"),
                 *ptrs("kv_indptr", "kv_indices", "meta", "sel_indptr"), ParamField("out_indices", "int32_t*", "ptr"),
                 ParamField("budget_pages", "int32_t", "i32"))
SELECT_LAYOUT = ParamsLayout("QuestSelectParams", SELECT_FIELDS)
# quest_expand_heads_kernel: the request-level table (kv_indptr [batch + 1], kv_indices) in, the table per
# (request, KV head) out (row_indptr [batch * num_heads + 1], head_ids)
EXPAND_FIELDS = (*ptrs("kv_indptr", "kv_indices"), *ptrs("row_indptr", "head_ids", cpp="int32_t*"),
                 *scalars("i32", "int32_t", "batch", "num_heads"))
EXPAND_LAYOUT = ParamsLayout("QuestExpandParams", EXPAND_FIELDS)
EXPAND_THREADS = 256  # quest_expand_heads_kernel's CTA, one per request (grid-stride past EXPAND_MAX_CTAS)
EXPAND_MAX_CTAS = 1024
SELECT_THREADS = 1024  # quest_select_kernel's CTA, one per request: up to 8 keys per thread in registers
SCORE_THREADS = 256  # quest_score_kernel's CTA: up to 256 threads share one page's summary


@dataclass(frozen=True)
class QuestScoreKernel:
    q_dtype: str  # "bf16" / "fp16"
    meta_dtype: str  # "fp32" / "bf16" / "fp8" (e4m3 with a scale) / "int4" (codes with a scale, two a byte)
    head_dim: int
    num_kv_heads: int
    group_size: int

    def __post_init__(self):
        if self.head_dim % 32:
            raise ValueError(f"QuestScoreKernel.head_dim: expected a multiple of 32, got {self.head_dim}")

    @property
    def score_ctas_per_sm(self) -> int:
        """quest_score_kernel's CTAs per SM (a register bound: each thread holds two steps of ~8 summary
        vectors and its P / N), with 32-64 KB of summaries in flight per SM."""
        return 2

    params = LAYOUT
    select_params = SELECT_LAYOUT
    expand_params = EXPAND_LAYOUT

    def module(self) -> JitModule:
        ctx = {"q_dtype": _CPP[self.q_dtype], "meta_dtype": _CPP[self.meta_dtype], "head_dim": self.head_dim,
               "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
               "values_per_vector": VALUES_PER_VECTOR[self.meta_dtype], "int4_codes": self.meta_dtype == "int4",
               "score_ctas_per_sm": self.score_ctas_per_sm, "score_threads": SCORE_THREADS,
               "select_threads": SELECT_THREADS, "params_struct": LAYOUT.cpp(),
               "select_params_struct": SELECT_LAYOUT.cpp(), "expand_params_struct": EXPAND_LAYOUT.cpp(),
               "trace": False}
        name = f"quest_score_{self.q_dtype}_{self.meta_dtype}_d{self.head_dim}_h{self.num_kv_heads}g{self.group_size}"
        kernels = ("quest_qsplit_kernel", "quest_score_kernel", "quest_select_kernel", "quest_expand_heads_kernel")
        return JitModule(name, "quest_score.cu.jinja", ctx, kernels)

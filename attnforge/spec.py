"""AttentionSpec: one attention variant, validated when it is constructed.

Every invalid combination raises ``ValueError`` naming the field, the value received,
what is allowed and how to fix it, before anything is rendered or compiled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

FAMILIES = ("decode", "prefill", "mla_decode")
DTYPES_16 = ("bf16", "fp16")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
LAYOUTS = ("NHD", "HND")
PIPELINES = ("normal", "transposed")


# The largest group for which 'auto' picks the transposed decode pipeline with 16-bit KV: one n8 tile of heads.
# Groups 9-16 need two tiles there (200 registers at d128, spills at d256) where the normal pipeline's one m16
# tile fits; the transposed kernel still takes them when asked (kernels.decode.MAX_TRANSPOSED_GROUP).
AUTO_TRANSPOSED_MAX_GROUP = 8
# With fp8 KV the transposed kernel widens each K/V fragment in registers, once for both head tiles, where the
# normal one widens the tile through shared memory (up to 16 rows an item; past them in registers too, the
# 113th session): there 'auto' picks transposed for groups up to 16 and, at
# d64, for multiples of 16 (items of 16 heads, as the normal pipeline's head splits). Seventy-fifth session,
# benchmarks/bench_decode_fp8_groups.py: 32/2 B64 L8192 75.2 against 116.7 us, d256 32/2 B64 L4096 75.1 against
# 155.0, MQA 32/1 B64 L8192 73.9 against 115.1; d64 since the seventy-sixth, whose kernel widens in registers
# there too (4 CTAs an SM): 32/2 B64 L8192 51.8 against 65.2, 96/8 B32 L4096 52.8 against 67.7, MQA 51.0 / 64.3
AUTO_TRANSPOSED_MAX_GROUP_FP8 = 16
# ... except at d128, where the normal pipeline widens fp8 in registers too (DecodeKernel.normal_widen_in_registers)
# and its one m16 tile at 4 CTAs an SM beat the transposed kernel's two n8 tiles at 3 for items of 9-16 rows
# (114th and 115th sessions, H100, suite verify_fp8_widen: 16 heads x 1 token B64 L4096 -8.0%, GQA 256/8's 16-head
# items B32 L4096 -35.6%, 4 x 4 tokens -7.7%, 8 x 2 -8.2%, 4 x 3 -7.7%); items of up to 8 rows tied or lost there
# (4 x 1 and 8 x 1 ties, 2 x 4 +2.4%), so they stay transposed. Groups of 16 keep the transposed kernel's
# whole-item plans (kernels.decode.whole_item_tiling: at about one item an SM it led, 4 x 4 tokens B16 L16384 182.1
# against 189.3 us)
AUTO_TRANSPOSED_MAX_ROWS_FP8_D128 = 8


def auto_transposed_max_rows(kv_dtype: str, head_dim: int) -> int:
    """The most query rows (heads x tokens) of a work item for which 'auto' keeps the transposed decode pipeline:
    one token's group (default_pipeline) or a verify step's item (kernels.decode.spec_for_rows)."""
    if kv_dtype == "fp8_e4m3":
        return AUTO_TRANSPOSED_MAX_ROWS_FP8_D128 if head_dim == 128 else AUTO_TRANSPOSED_MAX_GROUP_FP8
    return AUTO_TRANSPOSED_MAX_GROUP


# MLA heads up to which the transposed pipeline (on sm_90a: its wgmma kernel) is the default: at 8 heads
# it beat mma.sync's normal pipeline on every batch shape (H200, fourteenth session: -2.4% B16 L65536,
# -1.6% B64 L8192, level at B128 L4096, -3.8% B1 L131072); at 16 heads it loses by 4-17%.
MLA_TRANSPOSED_MAX_HEADS = 8


def default_pipeline(family: str, group_size: int, kv_dtype: str = "bf16", head_dim: int = 128) -> str:
    """The measured winner (docs/perf-notes.md): decode puts KV tokens on the MMA's M side
    (transposed) for groups up to 8, where padding query heads to 16 rows wastes work (measured at
    group 4). Larger groups take the normal pipeline (one m16 tile wastes at most 7 rows, where
    the transposed kernel needs two n8 head tiles and more registers), except with fp8 KV
    (AUTO_TRANSPOSED_MAX_GROUP_FP8; at d128 AUTO_TRANSPOSED_MAX_ROWS_FP8_D128). MLA decode uses the normal pipeline
    from 16 heads (its wgmma kernel on sm_90a with 16-bit KV, else mma.sync, whose m16 tiles pad at most 8 heads
    to 16) and the transposed one at 8 heads with 16-bit KV, where its wgmma kernel wins (fp8 KV runs mma.sync
    only, whose transposed kernel loses there); docs/architecture.md has the table."""
    if family == "decode":
        if group_size <= auto_transposed_max_rows(kv_dtype, head_dim):
            return "transposed"
        # fp8 at d64: multiples of 16 as items of 16 heads on the transposed kernel's two n8 tiles
        sixteen_head_items = kv_dtype == "fp8_e4m3" and head_dim < 128 and group_size % 16 == 0
        return "transposed" if sixteen_head_items else "normal"
    if family == "mla_decode" and group_size <= MLA_TRANSPOSED_MAX_HEADS and kv_dtype != "fp8_e4m3":
        return "transposed"
    return "normal"


HEAD_DIMS = (64, 128, 256)
# prefill with narrower values than keys, (head_dim_qk, head_dim_vo): DeepSeek-V2/V3's prefill before
# absorption is 192 (128 nope + 64 rope) by 128; the Hopper prefill kernel takes these (sm_90a)
PREFILL_QK_VO_DIMS = ((192, 128), (128, 64), (256, 128))
MLA_HEAD_DIM_QK, MLA_HEAD_DIM_VO = 576, 512  # 512 latent (ckv) + 64 rope (kpe)
MLA_HEADS = (8, 16, 32, 64, 128)
MAX_GROUP_SIZE = 64
FLOAT32_MAX = 3.4028234663852886e38  # the kernels take scales and caps as float32: past it a finite value is inf

# Accept torch dtypes and common spellings without importing torch at module load.
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e4m3fn": "fp8_e4m3",
}


def _bad(field: str, got: Any, allowed: str, fix: str) -> ValueError:
    return ValueError(f"AttentionSpec.{field}: expected {allowed}, got {got!r}. {fix}")


def normalize_dtype(field: str, value: Any) -> str:
    key = str(value)
    if key not in _DTYPE_ALIASES:
        raise _bad(field, value, f"one of {sorted(set(_DTYPE_ALIASES.values()))} (or the torch dtype)",
                   "Pass e.g. 'bf16' or torch.bfloat16.")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class AttentionSpec:
    """One attention variant: what the kernel is specialised on.

    Runtime values (sm_scale, the soft-cap's value, lengths, page tables) are not
    part of the compiled kernel: changing them never triggers a rebuild.
    """

    family: str = "decode"
    num_qo_heads: int = 32
    # None: the family's shape (mla_decode: 1 KV head, 576/512; else 8 KV heads, 128): an MLA spec needs only its heads
    num_kv_heads: Optional[int] = None
    head_dim_qk: Optional[int] = None
    head_dim_vo: Optional[int] = None  # None: same as head_dim_qk (mla_decode: 512)
    q_dtype: Any = "bf16"
    kv_dtype: Any = None  # None: same as q_dtype
    out_dtype: Any = None  # None: same as q_dtype
    kv_layout: str = "NHD"
    page_size: Optional[int] = None  # None: any page size at run time
    pipeline: str = "auto"  # "auto": the measured winner for the shape (default_pipeline)
    causal: bool = False
    window_left: int = -1  # -1: no sliding window; else keys with qo_pos - kv_pos <= window_left
    logits_soft_cap: float = 0.0  # 0: off; else score = cap * tanh(score / cap)
    score_mod: Any = None  # filled by the score-modifier work: an object with a .cache_key str

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.family not in FAMILIES:
            raise _bad("family", self.family, f"one of {FAMILIES}", "Pick the kernel family to build.")
        mla = self.family == "mla_decode"
        if self.num_kv_heads is None:
            put("num_kv_heads", 1 if mla else 8)
        if self.head_dim_qk is None:
            put("head_dim_qk", MLA_HEAD_DIM_QK if mla else 128)
        if mla and self.head_dim_vo is None:
            put("head_dim_vo", MLA_HEAD_DIM_VO)
        for f in ("num_qo_heads", "num_kv_heads", "head_dim_qk"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _bad(f, v, "a positive int", f"Set {f} to the model's value.")
        put("head_dim_vo", self.head_dim_qk if self.head_dim_vo is None else self.head_dim_vo)
        put("q_dtype", normalize_dtype("q_dtype", self.q_dtype))
        put("kv_dtype", normalize_dtype("kv_dtype", self.q_dtype if self.kv_dtype is None else self.kv_dtype))
        put("out_dtype", normalize_dtype("out_dtype", self.q_dtype if self.out_dtype is None else self.out_dtype))
        self._check_heads()
        self._check_dtypes()
        self._check_layout_and_flags()

    # -- validation ----------------------------------------------------------------------------
    def _check_heads(self) -> None:
        hq, hkv = self.num_qo_heads, self.num_kv_heads
        if self.family == "mla_decode":
            if hkv != 1:
                raise _bad("num_kv_heads", hkv, "1 for MLA (one shared latent KV)", "Set num_kv_heads=1.")
            if hq not in MLA_HEADS:
                raise _bad("num_qo_heads", hq, f"one of {MLA_HEADS} for mla_decode",
                           "Pad the head count up to the next supported value.")
            if (self.head_dim_qk, self.head_dim_vo) != (MLA_HEAD_DIM_QK, MLA_HEAD_DIM_VO):
                raise _bad("head_dim_qk/head_dim_vo", (self.head_dim_qk, self.head_dim_vo),
                           f"({MLA_HEAD_DIM_QK}, {MLA_HEAD_DIM_VO}) for MLA (512 latent + 64 rope)",
                           "Use head_dim_qk=576, head_dim_vo=512.")
            return
        if hq % hkv:
            raise _bad("num_qo_heads", hq, f"a multiple of num_kv_heads={hkv}",
                       "GQA needs an integer group size; check both head counts.")
        if hq // hkv > MAX_GROUP_SIZE:
            raise _bad("num_qo_heads", hq, f"at most {MAX_GROUP_SIZE} query heads per KV head "
                       f"(num_kv_heads={hkv})", "Split the heads over several calls.")
        dims = (self.head_dim_qk, self.head_dim_vo)
        if self.family == "prefill" and dims in PREFILL_QK_VO_DIMS:
            return
        if self.head_dim_qk not in HEAD_DIMS:
            pairs = f" (prefill also takes (head_dim_qk, head_dim_vo) in {PREFILL_QK_VO_DIMS})"
            raise _bad("head_dim_qk", self.head_dim_qk, f"one of {HEAD_DIMS}{pairs}",
                       "Pad the head dimension to a supported size.")
        if self.head_dim_vo != self.head_dim_qk:
            allowed = f"equal to head_dim_qk={self.head_dim_qk}, or for prefill a pair in {PREFILL_QK_VO_DIMS}"
            raise _bad("head_dim_vo", self.head_dim_vo, allowed,
                       "Use family='mla_decode' for 576/512 heads, family='prefill' for DeepSeek's 192/128, "
                       "else drop head_dim_vo.")

    def _check_dtypes(self) -> None:
        if self.q_dtype not in DTYPES_16:
            raise _bad("q_dtype", self.q_dtype, f"one of {DTYPES_16}", "fp8 is supported for KV only.")
        if self.out_dtype not in DTYPES_16:
            raise _bad("out_dtype", self.out_dtype, f"one of {DTYPES_16}", "Write bf16 or fp16 outputs.")
        if self.kv_dtype in DTYPES_16 and self.kv_dtype != self.q_dtype:
            raise _bad("kv_dtype", self.kv_dtype, f"'{self.q_dtype}' (same as q_dtype) or 'fp8_e4m3'",
                       "Cast q or the cache so that both 16-bit dtypes agree.")

    def _check_layout_and_flags(self) -> None:
        if self.kv_layout not in LAYOUTS:
            raise _bad("kv_layout", self.kv_layout, f"one of {LAYOUTS}", "NHD is [page, token, head, dim].")
        if self.family == "mla_decode" and self.kv_layout != "NHD":
            raise _bad("kv_layout", self.kv_layout, "'NHD' for MLA (the latent cache has no head axis)",
                       "Leave kv_layout at its default.")
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise _bad("page_size", self.page_size, "None (any, at run time) or an int >= 1",
                       "Pass the cache's tokens per page.")
        if self.pipeline == "auto":
            object.__setattr__(self, "pipeline", default_pipeline(self.family, self._group_or_one(), self.kv_dtype,
                                                                  self.head_dim_qk))
        if self.pipeline not in PIPELINES:
            raise _bad("pipeline", self.pipeline, f"'auto' or one of {PIPELINES}",
                       "'normal' puts query heads on the MMA's M side; 'transposed' puts KV tokens there.")
        if self.pipeline == "transposed" and self.family == "prefill":
            raise _bad("pipeline", self.pipeline, "'normal' for prefill",
                       "The transposed (ETAP) pipeline is for decode, where queries are few.")
        if not isinstance(self.causal, bool):
            raise _bad("causal", self.causal, "a bool", "Pass causal=True or False.")
        if not isinstance(self.window_left, int) or isinstance(self.window_left, bool) or self.window_left < -1:
            raise _bad("window_left", self.window_left, "-1 (off) or an int >= 0",
                       "window_left=W keeps the W keys before the query and the query's own.")
        if self.window_left >= 2 ** 31:  # (the kernels take it as int32: 10**12 wrapped negative)
            raise _bad("window_left", self.window_left, "an int below 2^31 (the kernels' positions are 32-bit)",
                       "A window past any sequence is no window: pass -1.")
        if self.window_left >= 0 and self.family == "mla_decode":
            raise _bad("window_left", self.window_left, "-1 for mla_decode (no sliding window: DeepSeek's MLA "
                       "attends the whole cache)", "Use a mask_mod in score_mod if you need one.")
        cap = self.logits_soft_cap
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not (0 <= cap <= FLOAT32_MAX):
            # (the kernels take it as float32: a cap past float32's range arrived as inf, and inf * tanh(0) is NaN)
            raise _bad("logits_soft_cap", cap, "0 (off) or a finite float > 0", "Gemma-2 uses 50.0.")
        object.__setattr__(self, "logits_soft_cap", float(cap))
        if self.score_mod is not None and not isinstance(getattr(self.score_mod, "cache_key", None), str):
            fix = ("A Python function is traced first: score_mod=attnforge.mods.compile_mod(score_mod=fn) (or "
                   "mask_mod=fn, as for FlexAttention)." if callable(self.score_mod) else
                   "Build modifiers with the attnforge.mods factories (compile_mod, raw_mod, alibi, softcap, ...).")
            raise _bad("score_mod", self.score_mod, "None or a traced modifier with a str .cache_key", fix)
        sink = getattr(self.score_mod, "sink", None)  # (read by query head: one logit each, or reads run past it)
        if sink is not None and sink.numel() != self.num_qo_heads:
            raise _bad("score_mod", f"attention sink logits of {sink.numel()} heads",
                       f"one sink logit per query head ({self.num_qo_heads})", "Pass sink logits [num_qo_heads].")
        if self.score_mod is not None and self.logits_soft_cap > 0:
            raise _bad("logits_soft_cap", self.logits_soft_cap, "0 when a score_mod is given",
                       "Put the cap inside the modifier: attnforge.mods.softcap(cap), or compose it in your score_mod.")

    def _group_or_one(self) -> int:
        return self.num_qo_heads // self.num_kv_heads if self.family != "mla_decode" else self.num_qo_heads

    # -- derived -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def head_layout(self) -> str:
        if self.family == "mla_decode":
            return f"mla{self.num_qo_heads}"
        if self.num_kv_heads == self.num_qo_heads:
            return "mha"
        if self.num_kv_heads == 1:
            return f"mqa{self.num_qo_heads}"
        return f"gqa{self.group_size}"

    @property
    def name(self) -> str:
        """Readable identifier, e.g. ``decode_gqa4_d128_bf16_kvbf16_nhd_softcap``."""
        d = f"d{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_vo else \
            f"d{self.head_dim_qk}x{self.head_dim_vo}"
        kv = {"fp8_e4m3": "fp8"}.get(self.kv_dtype, self.kv_dtype)
        parts = [self.family, self.head_layout, d, self.q_dtype, f"kv{kv}", self.kv_layout.lower()]
        if self.out_dtype != self.q_dtype:
            parts.append(f"out{self.out_dtype}")
        if self.page_size is not None:
            parts.append(f"page{self.page_size}")
        if self.pipeline != default_pipeline(self.family, self._group_or_one(), self.kv_dtype, self.head_dim_qk):
            parts.append(self.pipeline)
        if self.causal:
            parts.append("causal")
        if self.window_left >= 0:
            parts.append(f"win{self.window_left}")
        if self.logits_soft_cap > 0:
            parts.append("softcap")
        if self.score_mod is not None:
            parts.append("mod")
        return "_".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["score_mod"] = None if self.score_mod is None else self.score_mod.cache_key
        return d

    @property
    def content_hash(self) -> str:
        """Stable across processes and machines (no Python hash(), no object ids)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionSpec":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"AttentionSpec: unknown field(s) {sorted(unknown)}; "
                             f"allowed: {[f.name for f in dataclasses.fields(cls)]}.")
        return cls(**d)

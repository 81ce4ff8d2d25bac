"""The batch-prefill kernel family: template variables, parameter struct and launch shape.

Two kernels share one parameter struct, one work list and the variant hooks:
  "wgmma": the Hopper kernel (sm_90a; batch_prefill_wgmma.cu.jinja), 128 query rows per CTA over
           two warpgroups (head_dim 256 without a producer: 64 rows, one warpgroup); 16-bit Q/KV, and
           fp8 K/V at head_dim 64 and 128: fp8 tiles land as stored in a staging ring of their own and
           the producer warpgroup widens them into the 16-bit ring (fp16 MMAs).
  "mma":   the portable mma.sync kernel (sm_80+; batch_prefill.cu.jinja), four warps of one or two m16 row
           tiles (64 or 128 rows per CTA, mma_m_tiles); the
           fallback where wgmma does not apply (other archs), and the fp8-KV kernel: fp8 tiles land as they
           are stored and are widened into one 16-bit tile in shared memory (KVTileLoader::widen) before
           the MMAs; k_scale folds into sm_scale, v_scale into the epilogue (a `v_scale` parameter).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from .. import variants
from ..codegen import ParamField, ParamsLayout
from ..jit import JitModule, arch, env
from ..jit import tma as tma_maps
from ..jit.cubin import REGISTERS_PER_SM
from ..mods import graph
from ..spec import AttentionSpec
from .fields import IO_FIELDS, PAGED_KV_FIELDS, ptrs, scalars

_CPP = {"bf16": "bf16", "fp16": "fp16", "fp8_e4m3": "fp8e4m3"}
# registers a thread of the mma.sync kernel by (head_dim, m_tiles), rounded up (tests/jit/test_build.py checks)
MMA_REGISTERS = {(64, 1): 136, (128, 1): 232, (256, 1): 256, (64, 2): 256, (128, 2): 256}


def mma_m_tiles(spec: AttentionSpec) -> int:
    """m16 row tiles a warp of the mma kernel, as measured on the H200 (forty-ninth session, B1 S8192 causal
    GQA 32/8 unless noted, two against one in rotation): d128 -7.3% (bf16), -7.6% (S4096 not causal), -33.6%
    (soft-cap 30), -14.9% (fp8 K/V, 16-token pages), -32.0% (fp8, S4096 not causal): two. But a sliding
    window +9.7%, ALiBi +16%, a document mask +3.4% and d64 +20%: one (ptxas then spills or, at d64, holds two
    CTAs an SM instead of three). d256 takes one: its accumulators alone fill the registers."""
    plain = spec.window_left < 0 and spec.score_mod is None
    return 2 if spec.head_dim_qk == 128 and plain else 1


BACKENDS = ("wgmma", "mma")
WGMMA_HEAD_DIMS = (64, 128, 256)
WGMMA_ARCH = "9.0a"
SMEM_PER_SM = 228 * 1024  # H100/H200
SMEM_LIMIT = 227 * 1024  # the H100/H200 per-block opt-in maximum
# backend -> (query rows per CTA, KV tokens per tile, default stages). wgmma at head_dim 256: 64-token
# tiles in a split ring of two K and three V slots, so Q of 128 rows fits beside them (224 KB) and two
# consumer warpgroups share the tensor cores; without a producer (no split ring) Q and tiles halve so
# three shared stages fit (one consumer warpgroup, 224 KB).
# wgmma at head_dim 64 with a producer: four stages, measured 661.2 vs 669.0 us (thirteenth session) and
# 669.3 vs 673.9 (twelfth) at B1 S8192 causal against three, timed in rotation
# (mma: query rows at one m16 tile a warp, times m_tiles)
# fp8 K/V on wgmma: 16-bit stages beside fp8 staging slots. head_dim 128 keeps 128-token tiles in a split
# ring of two K and two V slots (Q 32 KB + 4 x 32 + two 32 KB staging slots: 224 KB); head_dim 64 three
# shared stages (16 + 3 x 32 + 4 x 16 KB)
_SHAPES = {"wgmma": (128, 128, 3), "mma": (64, 64, 2), "wgmma256": (128, 64, 2), "wgmma256_plain": (64, 64, 3),
           "wgmma64": (128, 128, 4), "wgmma_fp8": (128, 128, 2), "wgmma64_fp8": (128, 128, 3)}
WGMMA_FP8_HEAD_DIMS = (64, 128)  # head_dim 256: no room for staging beside its tiles

BASE_FIELDS = (
    *IO_FIELDS, *PAGED_KV_FIELDS,
    *ptrs("qo_indptr", "q_offset", "kv_offset", "work", "kv_tile_indptr", "kv_tiles", "num_work"),
    *scalars("i64", "int64_t", "q_stride_n", "q_stride_h", "out_stride_n", "out_stride_h", "lse_stride_n",
             "lse_stride_h", "out_stride_slot", "lse_stride_slot"),
    ParamField("ragged", "int32_t", "i32"), ParamField("work_count", "int32_t", "i32"),
    *variants.COMMON_VARIANT_FIELDS,
)


# Paged or ragged K/V tiles by the copy engine (wgmma kernel with a producer): the maps of K and V and
# the box shape (attnforge/jit/tma.py); tma_box_rows 0 means the tensors do not qualify: cp.async.
# By default boxes are used from this many rows up: measured on the H200 (suite prefill_copies, B1
# S8192 causal, a tile's boxes spread over the four producer warps) TMA took 1030 / 940 / 958 / 942 /
# 947 us at pages of 8 / 16 / 32 / 64 / 128 tokens against 1100 / 1107 / 1155 / 1142 / 1148 us by
# cp.async, and 949 vs 1022 us on ragged K/V (a whole tile per box). (With one warp issuing every
# box, 16-token pages took 1458 us.) 8 rows is also the least a box may hold, so the default now
# equals tma=True; the knob stays for the next kernel whose boxes are not always a gain.
TMA_AUTO_MIN_ROWS = 8
FP8_FIELDS = (ParamField("v_scale", "float", "f32"),)  # fp8 KV: V's per-tensor scale, applied to each output row
# narrower values (split_dims): ragged V's own element strides (K's are stride_token / stride_head)
V_STRIDE_FIELDS = scalars("i64", "int64_t", "v_stride_token", "v_stride_head")
TMA_FIELDS = (ParamField("k_tmap", "TensorMap", "tmap"), ParamField("v_tmap", "TensorMap", "tmap"),
              ParamField("q_tmap", "TensorMap", "tmap"),
              *scalars("i32", "int32_t", "tma_box_rows", "tma_heads_inner", "tma_page_per_request", "tma_q_tokens"))


# The softmax's exponentials on the FMA pipe (wgmma kernel), one in N by (head_dim, whether a function of
# the score also runs on the SFU): where the SFU's share of a tile approaches the tensor cores'. Measured
# on the H200 (B1 S8192 causal, timed in rotation, twenty-second session): d64 N=8 -3.9% (N=4 +2.6%,
# N=2 +12.9%); d128 N=8 +4.0%, N=4 +11.9% (left at 0); d128 soft-cap N=4 -0.7% (N=8 +0.5%, N=2 +7.7%);
# d64 soft-cap N=4 -6.4% (N=8 -4.8%, N=2 -3.7%).
FMA_EXP_EVERY = {(64, False): 8, (64, True): 4, (128, True): 4}
FMA_EXP_CHOICES = (0, 1, 2, 4, 8)


def sfu_core_per_score(spec: AttentionSpec) -> bool:
    """Whether the spec's logits transform puts a transcendental function of the score (soft-cap's
    tanh, a sigmoid, ...) on the SFU beside the softmax's exponential: two SFU ops a score."""
    mod = spec.score_mod
    return spec.logits_soft_cap > 0 or (mod is not None and graph.applies_function_to_score(mod.score_root))


def split_dims(spec: AttentionSpec) -> bool:
    """Values narrower than keys (head_dim_vo < head_dim_qk, e.g. DeepSeek's 192/128): the wgmma kernel alone,
    16-bit ragged K/V (V's strides are its own)."""
    return spec.head_dim_vo != spec.head_dim_qk


def wgmma_applies(spec: AttentionSpec) -> Optional[str]:
    """None when the Hopper kernel can run this spec, else why not."""
    if split_dims(spec):
        if spec.kv_dtype == "fp8_e4m3":
            return (f"kv_dtype fp8_e4m3 with head_dim_qk {spec.head_dim_qk} != head_dim_vo {spec.head_dim_vo} "
                    "(narrower values: 16-bit K/V only)")
        return None
    if spec.head_dim_qk not in WGMMA_HEAD_DIMS:
        return f"head_dim {spec.head_dim_qk} (the wgmma kernel takes {WGMMA_HEAD_DIMS})"
    if spec.kv_dtype == "fp8_e4m3" and spec.head_dim_qk not in WGMMA_FP8_HEAD_DIMS:
        return (f"kv_dtype fp8_e4m3 at head_dim {spec.head_dim_qk} (fp8 K/V on wgmma: head_dim "
                f"{WGMMA_FP8_HEAD_DIMS}; no room to stage fp8 tiles beside d256's)")
    if spec.kv_dtype not in (spec.q_dtype, "fp8_e4m3"):
        return f"kv_dtype {spec.kv_dtype} differs from q_dtype {spec.q_dtype}"
    return None


def default_backend(spec: AttentionSpec, archs: Optional[tuple] = None) -> str:
    """ATTNFORGE_PREFILL_BACKEND if set, else wgmma where it applies and sm_90a is being built."""
    forced = env.PREFILL_BACKEND.value
    if forced != "auto":
        return forced
    if split_dims(spec):  # (the only kernel that takes them)
        return "wgmma"
    archs = arch.arch_list() if archs is None else archs
    hopper = any(a.startswith(WGMMA_ARCH) for a in archs)  # "9.0a" or "9.0a+PTX"
    return "wgmma" if wgmma_applies(spec) is None and hopper else "mma"


@dataclass(frozen=True)
class PrefillKernel:
    spec: AttentionSpec
    backend: str = "mma"
    num_stages: Optional[int] = None
    kv_tile: Optional[int] = None  # wgmma: 64 or 128 KV tokens per tile (default 128)
    producer: Optional[bool] = None  # wgmma: a producer warpgroup owns the copies (mbarrier ring,
    # setmaxnreg); None: on for wgmma (measured 1.3x at B1 S8192, docs/perf-notes.md), off for mma
    pingpong: bool = False  # with a producer: the consumer warpgroups take turns at the tensor cores
    persistent: Optional[bool] = None  # with a producer: one CTA per SM loops over work items, the ring
    # running on across them (the next item's Q and tiles load under the last one's tail). None: on with
    # a producer and no ping-pong (measured on the H200 with balanced launch orders: B16 S2048 1158 vs
    # 1308 us, ragged 16 random 4588 vs 4830, B1 S8192 894 vs 900, B1 S32768 14989 vs 14893)
    tma: Optional[bool] = None  # with a producer: whole tiles copied by TMA boxes. None: where a box
    # holds TMA_AUTO_MIN_ROWS+ rows (ragged K/V, pages of 8+ tokens); True: wherever the tensors
    # qualify (also pages of 8+ tokens that tile the KV tile); False: cp.async only (no maps built in)
    fma_exp_every: Optional[int] = None  # wgmma: every Nth exponential on the FMA pipe (ex2_poly), 0 for
    # none. None: FMA_EXP_EVERY's measured choice by head_dim and whether a function of the score
    # (soft-cap's tanh) shares the SFU with the exponentials; 0 where it has none
    m_tiles: Optional[int] = None  # mma: m16 row tiles a warp (its four warps hold 64 x m_tiles rows; at two
    # every K / V fragment loaded feeds two MMAs). None: mma_m_tiles(spec), as measured
    fp8_stages: Optional[int] = None  # wgmma with fp8 K/V: staging slots of one fp8 tile each (None: as many
    # as fit, up to 4)
    fp8_int_widen: bool = False  # wgmma with fp8 K/V: widen by integer ops (fp16 / 256), not by cvt
    k_ahead: Optional[bool] = None  # a split ring of narrower V: the producer copies K(t+1) before V(t), so K(t+1)
    # waits only for S(t-1) (its slot's last reader), not behind V(t)'s slot. None: on at split dims (ragged K/V:
    # no paged row offsets that K's copy resolves and V's reuses)
    exact_max: bool = False  # wgmma: a row's reference max follows every new maximum (O rescaled whenever one
    # moves), as the mma kernel's always does. False: it lags up to 2^8 (log2 units), so O is rescaled on few tiles
    # (the lag measured 1.2-3% faster on the H200), but a peaked row's dominant weight is then 2^f rounded to
    # P's 16 bits, not exactly 1
    partial_out: bool = False  # the rows are a split plan's partial states, float32, merged by LSE after (16-bit
    # partials are rounded twice: up to 2.8x torch's error on GPU fuzz seed 917; decode's partials are float32 too)

    def __post_init__(self):
        if self.m_tiles is None:
            object.__setattr__(self, "m_tiles", mma_m_tiles(self.spec) if self.backend == "mma" else 1)
        if self.fma_exp_every is None:
            key = (self.spec.head_dim_qk, sfu_core_per_score(self.spec))
            object.__setattr__(self, "fma_exp_every", FMA_EXP_EVERY.get(key, 0) if self.backend == "wgmma" else 0)
        if self.producer is None:
            object.__setattr__(self, "producer", self.backend == "wgmma")
        if self.fp8_stages is None:
            object.__setattr__(self, "fp8_stages", self._fitting_fp8_stages() if self.wgmma_fp8 else 0)
        if self.persistent is None:
            object.__setattr__(self, "persistent", bool(self.producer and not self.pingpong))
        if self.k_ahead is None:
            object.__setattr__(self, "k_ahead", self._k_ahead_fits())
        if self.spec.family != "prefill":
            raise ValueError(f"PrefillKernel: expected a spec with family='prefill', got {self.spec.family!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"PrefillKernel.backend: expected one of {BACKENDS}, got {self.backend!r}; "
                             "or pass backend=None to BatchPrefill to pick the best one here")
        if self.backend == "mma" and split_dims(self.spec):
            raise ValueError(f"PrefillKernel: the mma backend takes head_dim_vo == head_dim_qk, got "
                             f"{self.spec.head_dim_qk}/{self.spec.head_dim_vo}; use backend='wgmma' (sm_90a), "
                             "the kernel for narrower values")
        if self.backend == "wgmma" and (why := wgmma_applies(self.spec)) is not None:
            raise ValueError(f"PrefillKernel: the wgmma backend does not take {why}; use backend='mma' "
                             "(or ATTNFORGE_PREFILL_BACKEND=auto)")
        if self.kv_tile is not None and (self.backend != "wgmma" or self.kv_tile not in (64, 128)):
            raise ValueError(f"PrefillKernel.kv_tile: the wgmma backend takes 64 or 128 (mma: fixed 64), "
                             f"got {self.kv_tile} with backend {self.backend!r}")
        if self.producer and self.backend != "wgmma":
            raise ValueError(f"PrefillKernel.producer: only the wgmma backend has a producer warpgroup, got backend "
                             f"{self.backend!r}; pass producer=None (or False), or backend='wgmma'")
        if self.persistent and not self.producer:
            raise ValueError(f"PrefillKernel.persistent: needs the producer warpgroup, got producer={self.producer}; "
                             f"pass producer=True (the wgmma default)")
        if self.tma not in (None, True, False):
            raise ValueError(f"PrefillKernel.tma: expected None (by measurement), True or False, got {self.tma!r}; "
                             "pass one of those")
        if self.wgmma_fp8 and (not self.producer or self.pingpong):
            raise ValueError("PrefillKernel: fp8 K/V on the wgmma backend is widened by the producer warpgroup from "
                             f"its staging ring, got producer={self.producer}, pingpong={self.pingpong}; pass the "
                             "defaults (None), or backend='mma'")
        if type(self.fp8_stages) is not int or (self.fp8_stages < 2 if self.wgmma_fp8 else self.fp8_stages != 0):
            raise ValueError(f"PrefillKernel.fp8_stages: 2 or more with fp8 K/V on the wgmma backend, else 0 (None "
                             f"picks), got {self.fp8_stages!r}")
        if type(self.fp8_int_widen) is not bool or (self.fp8_int_widen and not self.wgmma_fp8):
            raise ValueError(f"PrefillKernel.fp8_int_widen: True only with fp8 K/V on the wgmma backend, got "
                             f"{self.fp8_int_widen!r} with kv_dtype {self.spec.kv_dtype}, backend {self.backend!r}")
        if type(self.k_ahead) is not bool or (self.k_ahead and not self._k_ahead_fits()):
            s = self.spec
            raise ValueError(f"PrefillKernel.k_ahead: K one tile ahead of V needs a split ring (a producer at two "
                             f"stages) of head_dim_vo < head_dim_qk and 16-bit K/V, got k_ahead={self.k_ahead!r} with "
                             f"head dims {s.head_dim_qk}/{s.head_dim_vo}, kv_dtype {s.kv_dtype}, {self.stages} stages; "
                             "pass None for the default")
        if self.tma is True and not self.producer:
            raise ValueError("PrefillKernel.tma: the copy engine is driven by the producer warpgroup, got producer="
                             f"{self.producer}; pass producer=True (the wgmma default) or tma=False")
        if self.pingpong and not self.producer:
            raise ValueError("PrefillKernel.pingpong: needs the producer warpgroup (the consumers then share no CTA "
                             "barrier), got producer=False; pass producer=True (the wgmma default) or pingpong=False")
        if (type(self.fma_exp_every) is not int or self.fma_exp_every not in FMA_EXP_CHOICES
                or (self.fma_exp_every and self.backend != "wgmma")):
            raise ValueError(f"PrefillKernel.fma_exp_every: expected one of {FMA_EXP_CHOICES} (every Nth "
                             f"exponential on the FMA pipe; only the wgmma backend has it, mma takes 0), got "
                             f"{self.fma_exp_every!r} with backend {self.backend!r}; pass None for the default")
        if type(self.exact_max) is not bool:
            raise ValueError(f"PrefillKernel.exact_max: expected True or False, got {self.exact_max!r}; pass True "
                             "for a row max that follows every new maximum, or False (the default) for the lag")
        if (self.m_tiles not in (1, 2) or (self.m_tiles != 1 and self.backend != "mma")
                or (self.m_tiles == 2 and (self.spec.head_dim_qk, 2) not in MMA_REGISTERS)):
            raise ValueError(f"PrefillKernel.m_tiles: the mma backend takes 1 or 2 m16 row tiles a warp (2 at "
                             f"head_dim 64 and 128: d256's accumulators fill the registers at one; wgmma: 1), got "
                             f"{self.m_tiles!r} with backend {self.backend!r} at head_dim {self.spec.head_dim_qk}; "
                             "pass None for the default")
        least = 3 if self.backend == "wgmma" and not self.producer else 2  # a producer's split ring: 2
        if type(self.stages) is not int or self.stages < least:
            raise ValueError(f"PrefillKernel.num_stages: {self.backend} "
                             f"{'with' if self.producer else 'without'} a producer needs an int of at least "
                             f"{least}, got {self.stages!r}; pass more, or None for the default")
        if self.smem_bytes > SMEM_LIMIT:
            staging = self.fp8_stages * 2 * self.tile_kv * self.spec.head_dim_qk
            detail = f" ({self.fp8_stages} fp8 staging slots: {staging} B)" if self.wgmma_fp8 else ""
            raise ValueError(f"PrefillKernel: {self.smem_bytes} B of shared memory exceeds {SMEM_LIMIT} B at "
                             f"{self.stages} stages of {self.tile_kv}-token tiles{detail}; use fewer stages"
                             + (", fewer fp8_stages or kv_tile=64" if self.wgmma_fp8 else "")
                             + ", or None for the defaults")

    def _k_ahead_fits(self) -> bool:
        """Whether the producer may copy K(t+1) before V(t): a split ring on ragged K/V (split dims), 16-bit."""
        return self.backend == "wgmma" and split_dims(self.spec) and self.split_ring and not self.fp8_kv

    def _fitting_fp8_stages(self) -> int:
        """The most fp8 staging slots (2 to 4: copies run up to three tiles ahead of the widening) that fit
        beside the rest (2 where none fit: the size check then says so)."""
        return next((n for n in (4, 3) if self._smem_bytes(n) <= SMEM_LIMIT), 2)

    @property
    def rescale_slack(self) -> float:
        """How far (log2 units) a tile's row max may pass the row's reference max before the reference moves:
        8 on the wgmma kernel unless exact_max, else 0 (the mma kernel's is exact; its template has no slack)."""
        return 8.0 if self.backend == "wgmma" and not self.exact_max else 0.0

    @property
    def wgmma_fp8(self) -> bool:
        """fp8 K/V on the wgmma kernel (staged as stored, widened by the producer)."""
        return self.backend == "wgmma" and self.fp8_kv

    # the sizes below are cached: the fields are final once __post_init__ has run, and plan() and run() read them
    @cached_property
    def _shape(self) -> tuple[int, int, int]:
        if split_dims(self.spec):
            return self._split_dims_shape()
        if self.wgmma_fp8:
            return _SHAPES["wgmma64_fp8" if self.spec.head_dim_qk == 64 else "wgmma_fp8"]
        if self.backend == "wgmma" and self.spec.head_dim_qk == 256:
            return _SHAPES["wgmma256" if self.producer else "wgmma256_plain"]
        if self.backend == "wgmma" and self.spec.head_dim_qk == 64 and self.producer:
            return _SHAPES["wgmma64"]
        return _SHAPES[self.backend]

    def _split_dims_shape(self) -> tuple[int, int, int]:
        """Narrower values: 128-token tiles in three shared stages where they fit (128/64); else (with a producer)
        in a split ring of two K and two V slots (192/128: Q 48 KB + 2 x 48 + 2 x 32 KB); else 64-token tiles
        in four or three shared stages (256/128: three). At 192/128 the split ring measured 600-653 TFLOP/s
        against 507-546 for 64-token tiles in four stages (H200, suite prefill_split_dims, in rotation)."""
        for tile, stages in ((128, 3), (128, 2), (64, 4), (64, 3)):
            split = stages == 2
            if split and not self.producer:
                continue
            if self._ring_bytes(128, tile, stages, split, 0, stages) <= SMEM_LIMIT:
                return 128, tile, stages
        raise AssertionError(f"no prefill tile fits head dims {self.spec.head_dim_qk}/{self.spec.head_dim_vo}")

    @cached_property
    def v_slots(self) -> int:
        """A split ring's V slots: one more than K's (V(t) is held until P.V(t) retired) where it fits; as many
        as K's with fp8 (widened within an iteration) or where the extra tile would not fit (192/128 at
        128-token tiles: Q 48 KB + 2 x 48 + 2 x 32 KB)."""
        if not self.split_ring or self.fp8_kv:
            return self.stages
        extra = self._ring_bytes(self.tile_q, self.tile_kv, self.stages, True, 0, self.stages + 1)
        return self.stages + (0 if extra > SMEM_LIMIT else 1)

    @property
    def split_ring(self) -> bool:
        """K and V in rings of their own (the wgmma producer at two stages): `stages` K slots and one
        more V slot (V(t) is held until P.V(t) retired, an iteration longer than K(t)), so five
        matrices keep the leads three shared stages (six) give."""
        return self.backend == "wgmma" and bool(self.producer) and self.stages == 2

    @cached_property
    def tile_q(self) -> int:
        return self._shape[0] * (self.m_tiles if self.backend == "mma" else 1)

    @cached_property
    def tile_kv(self) -> int:
        return self.kv_tile or self._shape[1]

    @cached_property
    def stages(self) -> int:
        return self.num_stages if self.num_stages is not None else self._shape[2]

    @cached_property
    def threads(self) -> int:
        if self.backend == "wgmma":
            return 2 * self.tile_q + (128 if self.producer else 0)
        return 32 * (self.tile_q // (16 * self.m_tiles))

    @cached_property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM (the split planner's and the persistent grid's unit): as shared memory
        and registers allow. One for the wgmma kernel, built with __launch_bounds__(threads, 1): ptxas
        may give one CTA the whole register file, and setmaxnreg hands out exactly that pool (d64 with
        64-token KV tiles fits two CTAs by shared memory: the persistent grid had twice the CTAs that
        can be resident)."""
        if self.backend == "wgmma":
            return 1
        by_smem = max(1, SMEM_PER_SM // (self.smem_bytes + 1024))  # the driver reserves 1 KB per CTA
        # mma.sync: registers as ptxas gave them (m_tiles 1: 129 / 231 / 255 a thread at d64 / 128 / 256;
        # 2: 236-255), rounded up
        by_registers = REGISTERS_PER_SM // (self.threads * MMA_REGISTERS[self.spec.head_dim_qk, self.m_tiles])
        return max(1, min(by_smem, by_registers))

    @property
    def kernel_name(self) -> str:
        return "batch_prefill_wgmma_kernel" if self.backend == "wgmma" else "batch_prefill_kernel"

    @cached_property
    def smem_bytes(self) -> int:
        return self._smem_bytes(self.fp8_stages)

    def _smem_bytes(self, fp8_stages: int) -> int:
        d = self.spec.head_dim_qk
        if self.backend != "wgmma":  # Q, the ring of K and V tiles as stored, and fp8's widened K and V
            wide = 2 * self.tile_kv * d * 2 if self.fp8_kv else 0
            return self.tile_q * d * 2 + self.stages * 2 * self.tile_kv * d * self.kv_bytes + wide
        return self._ring_bytes(self.tile_q, self.tile_kv, self.stages, self.split_ring, fp8_stages, self.v_slots)

    def _ring_bytes(self, tile_q: int, tile_kv: int, stages: int, split_ring: bool, fp8_stages: int,
                    v_slots: Optional[int] = None) -> int:
        """The wgmma kernel's shared memory: Q, the ring of K [tile_kv][head_dim_qk] and V [tile_kv][head_dim_vo]
        tiles, fp8 staging; sw128 tiles need 1024-byte alignment, plus 128 scratch bytes (a scheduling anchor)
        and, with a producer, two mbarriers per stage and an int64 offset per KV row (paged loads)."""
        dk, dv = self.spec.head_dim_qk, self.spec.head_dim_vo
        v_mats = v_slots or stages  # (v_slots: a split ring's)
        bars = 16 * (stages + v_mats if split_ring else stages)  # full and empty mbarriers (per matrix when split)
        ws = bars + 8 * tile_kv + (8 if self.persistent else 0) + 8 * fp8_stages  # + q_empty, fp8's staged
        extra = 1024 + 128 + (ws if self.producer else 0)
        staging = fp8_stages * 2 * tile_kv * dk  # fp8 {K, V} tiles as stored
        return tile_q * dk * 2 + tile_kv * 2 * (stages * dk + v_mats * dv) + staging + extra

    @property
    def fp8_kv(self) -> bool:
        return self.spec.kv_dtype == "fp8_e4m3"

    @property
    def kv_bytes(self) -> int:
        return 1 if self.fp8_kv else 2

    @cached_property  # (a run reads it; hashing its ~30 fields for params_for's cache cost ~10 us)
    def params(self) -> ParamsLayout:
        base = (*TMA_FIELDS, *BASE_FIELDS) if self.has_tma else BASE_FIELDS
        base = (*base, *V_STRIDE_FIELDS) if split_dims(self.spec) else base
        return variants.params_for("PrefillParams", (*base, *FP8_FIELDS) if self.fp8_kv else base, self.spec)

    @property
    def has_tma(self) -> bool:
        """Whether the kernel is built with the TMA tile path (its params then carry the maps). fp8 K/V on
        wgmma (boxes of whole rows into the staging ring): only with tma=True, which for_kv picks for ragged
        plans where that measured faster (docs/perf-notes.md, fifty-first and fifty-second sessions)."""
        if self.wgmma_fp8:
            return self.tma is True
        return self.tma is not False and bool(self.producer)

    def for_kv(self, ragged: bool) -> "PrefillKernel":
        """The kernel a plan of this KV kind runs. fp8 K/V at head_dim 128 with tma=None: ragged K/V on a
        TMA-built twin (5.7-5.9% faster), pages on this cp.async-only kernel (a TMA build runs 16-token pages
        3.5-4% slower, by either path). At head_dim 64 TMA lost on pages (+5.7%) and ragged K/V (+1.0%).
        Every other kernel serves both kinds."""
        if ragged and self.wgmma_fp8 and self.tma is None and self.spec.head_dim_qk == 128:
            return dataclasses.replace(self, tma=True)
        return self

    def for_partials(self) -> "PrefillKernel":
        """The twin a plan that splits KV runs: the same tiles, its rows written as float32 partial states."""
        return dataclasses.replace(self, partial_out=True)

    def tma_values(self, k, v, page_size: int, ragged: bool, q=None) -> dict:
        """The TMA fields of the params for these K/V: maps and box rows, or box rows 0 (cp.async).
        Ragged K/V is [tokens, Hkv, D]; the SDPA layout [B, Hkv, Lk, D] (attention()) is described as
        an HND cache of one Lk-token page per request. Queries [tokens, Hq, D] (q given) get a map too
        when the group divides the Q tile: the next item's Q then loads as one box per 64-column
        block from one thread, not 16 cp.async per producer thread, which competed with the
        consumers' shuffles on the last tile (per-item trace: that tile took ~4300 cycles against
        ~2900 for the others)."""
        return {**self.kv_tma_values(k, v, page_size, ragged), **self.q_tma_values(q)}

    def q_tma_values(self, q) -> dict:
        """tma_values' query fields (none for a kernel without maps)."""
        return self._q_tma_values(q) if self.has_tma else {}

    def kv_tma_values(self, k, v, page_size: int, ragged: bool) -> dict:
        """tma_values' K/V fields (none for a kernel without maps)."""
        return self._kv_tma_values(k, v, page_size, ragged) if self.has_tma else {}

    def _q_tma_values(self, q) -> dict:
        s = self.spec
        box = None
        # (fp8 K/V: Q by cp.async, so the producer knows when it landed and can stage it for the fp16 MMAs)
        if q is not None and q.dim() == 3 and q.data_ptr() % 16 == 0 and not self.fp8_kv:
            box, _ = tma_maps.q_box(s.head_dim_qk, s.num_qo_heads, s.group_size, self.tile_q, q.shape[0], q.stride(0),
                                    q.stride(1), q.element_size())
        if box is None:
            return {"q_tmap": None, "tma_q_tokens": 0}
        return {"q_tmap": tma_maps.encode(q, box), "tma_q_tokens": box.rows}

    def _kv_tma_values(self, k, v, page_size: int, ragged: bool) -> dict:
        s, per_request = self.spec, ragged and k.dim() == 4
        box = self._kv_box(k, s.head_dim_qk, page_size, ragged)
        if split_dims(s):  # V's box from its own width and strides: the same rows, or no maps
            v_box = self._kv_box(v, s.head_dim_vo, page_size, ragged)
            same = None not in (box, v_box) and (v_box.rows, v_box.heads_inner) == (box.rows, box.heads_inner)
            box = box if same else None
        else:
            v_box = box
        small = box is not None and self.tma is None and box.rows < TMA_AUTO_MIN_ROWS
        if box is None or small or k.data_ptr() % 16 or v.data_ptr() % 16:
            return {"k_tmap": None, "v_tmap": None, "tma_box_rows": 0, "tma_heads_inner": 0, "tma_page_per_request": 0}
        return {"k_tmap": tma_maps.encode(k, box), "v_tmap": tma_maps.encode(v, v_box), "tma_box_rows": box.rows,
                "tma_heads_inner": int(box.heads_inner), "tma_page_per_request": int(per_request)}

    def _kv_box(self, t, head_dim: int, page_size: int, ragged: bool):
        """The TMA box of K or V (`t`, `head_dim` wide) as this plan holds it, or None: ragged [tokens, Hkv, D],
        the SDPA layout [B, Hkv, Lk, D] (a cache of one Lk-token page per request), or the paged cache."""
        s, plain = self.spec, self.fp8_kv  # fp8: unswizzled rows into staging
        if ragged and t.dim() == 3:
            return tma_maps.ragged_kv_box(head_dim, s.num_kv_heads, t.shape[0], t.stride(0), t.stride(1),
                                          t.element_size(), self.tile_kv, plain)[0]
        if ragged and t.dim() == 4:
            return tma_maps.paged_kv_box(head_dim, s.num_kv_heads, t.shape[2], t.shape[0], t.stride(0), t.stride(2),
                                         t.stride(1), t.element_size(), self.tile_kv, plain)[0]
        tok, head = (1, 2) if s.kv_layout == "NHD" else (2, 1)
        return tma_maps.paged_kv_box(head_dim, s.num_kv_heads, page_size, t.shape[0], t.stride(0), t.stride(tok),
                                     t.stride(head), t.element_size(), self.tile_kv, plain)[0]

    def module(self) -> JitModule:
        s = self.spec
        ctx = {"q_dtype": _CPP[s.q_dtype], "kv_dtype": _CPP[s.kv_dtype],
               "out_dtype": "float" if self.partial_out else _CPP[s.out_dtype],
               "head_dim": s.head_dim_qk, "head_dim_vo": s.head_dim_vo, "group_size": s.group_size,
               "causal": s.causal,
               "tile_q": self.tile_q, "tile_kv": self.tile_kv, "num_stages": self.stages, "m_tiles": self.m_tiles,
               "smem_bytes": self.smem_bytes, "variant_decl": variants.variant_decl(s),
               "producer_warpgroup": self.producer, "pingpong": self.pingpong, "persistent": self.persistent,
               "split_ring": self.split_ring, "tma": self.has_tma, "fma_exp_every": self.fma_exp_every,
               "fp8_stages": self.fp8_stages, "fp8_int_widen": self.fp8_int_widen, "v_slots": self.v_slots,
               "k_ahead": self.k_ahead, "rescale_slack": self.rescale_slack, "params_struct": self.params.cpp(),
               "trace": False}
        dims = f"d{s.head_dim_qk}" + (f"x{s.head_dim_vo}" if split_dims(s) else "")
        name = "_".join(["prefill", *(["wgmma"] if self.backend == "wgmma" else []), f"g{s.group_size}",
                         dims, s.q_dtype, *(["kvfp8"] if self.fp8_kv else []),
                         f"out{'f32' if self.partial_out else s.out_dtype}",
                         *(["causal"] if s.causal else []), *(["softcap"] if s.logits_soft_cap > 0 else []),
                         *(["win"] if s.window_left >= 0 else []),
                         *([f"mod{s.score_mod.cache_key[:8]}"] if s.score_mod is not None else []),
                         *([f"t{self.tile_kv}"] if self.tile_kv != self._shape[1] else []),
                         *([f"m{self.m_tiles}"] if self.m_tiles != 1 else []),
                         *(["ws"] if self.producer else []), *(["pp"] if self.pingpong else []),
                         *(["pers"] if self.persistent else []), *(["tma"] if self.has_tma else []),
                         *([f"fx{self.fma_exp_every}"] if self.fma_exp_every else []),
                         *([f"f{self.fp8_stages}"] if self.wgmma_fp8 else []),
                         *(["iw"] if self.fp8_int_widen else []),
                         *(["xm"] if self.exact_max and self.backend == "wgmma" else []),
                         *(["kb"] if split_dims(s) and self.split_ring and not self.k_ahead else []),
                         f"s{self.stages}"])
        if self.backend == "wgmma":  # sm_90a only, whatever else the arch list asks for
            return JitModule(name, "batch_prefill_wgmma.cu.jinja", ctx, (self.kernel_name,), archs=(WGMMA_ARCH,))
        return JitModule(name, "batch_prefill.cu.jinja", ctx, (self.kernel_name,))

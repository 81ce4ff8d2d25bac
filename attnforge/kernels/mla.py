"""The MLA-decode kernel family: template variables, parameter struct and launch shape."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional
from functools import cached_property

import torch

from .. import scheduler, variants
from ..codegen import ParamField, ParamsLayout
from ..jit import JitModule, arch
from ..jit import tma as tma_maps
from ..spec import MLA_HEAD_DIM_QK, AttentionSpec
from .decode import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from .fields import ptrs, scalars

_CPP = {"bf16": "bf16", "fp16": "fp16", "fp8_e4m3": "fp8e4m3"}
THREADS = 256
MAX_ROWS = 64  # query rows (draft token x head) per CTA
BACKENDS = ("mma", "wgmma")
SCHEDULES = ("symmetric", "roles")
WGMMA_MAX_TRANSPOSED_ROWS = 32
WGMMA_ARCH = "9.0a"

BASE_FIELDS = (
    *ptrs("q_nope", "q_pe", "ckv_cache", "kpe_cache", cpp="const void*"), ParamField("out", "void*", "ptr"),
    ParamField("lse", "float*", "ptr"), ParamField("partial_o", "void*", "ptr"),  # float, or fp16 (partial_16bit)
    ParamField("partial_lse", "float*", "ptr"), ParamField("partial_scale", "float*", "ptr"),  # (partial_16bit)
    *ptrs("kv_indptr", "kv_indices", "kv_len", "kv_begin", "stream_prefix"),
    ParamField("meta", "const attnforge::StreamMeta*", "ptr"),
    *scalars("i64", "int64_t", "q_nope_stride_t", "q_nope_stride_h", "q_pe_stride_t", "q_pe_stride_h",
             "out_stride_t", "out_stride_h", "ckv_stride_page", "ckv_stride_token", "kpe_stride_page",
             "kpe_stride_token"),
    *scalars("i32", "int32_t", "page_size", "q_len", "num_row_blocks", "side_blocks"),
    ParamField("v_scale", "float", "f32"),
    *variants.COMMON_VARIANT_FIELDS,
)


# The copy engine's fields (MLADecodeKernel.tma): a map each of the latent and rope parts of the cache,
# and the rows of one box (0: the cache does not qualify, every tile by cp.async; attnforge/jit/tma.py).
TMA_FIELDS = (ParamField("ckv_tmap", "TensorMap", "tmap"), ParamField("kpe_tmap", "TensorMap", "tmap"),
              *scalars("i32", "int32_t", "tma_rows"))
# Whether the roles kernel's refills go by the copy engine by default. Measured slower alone (H200,
# thirtieth session, in one process beside cp.async, B16 L65536): +1.4..+2.4% at h16-h128 with the maps'
# L2 promotion at 256 bytes, +1.7% at h128 with 128 (ROLES_TMA_L2_PROMOTION, below). The trace shows
# S faster with no cp.async landing in shared memory (h128: 1733 -> 1503 cycles a tile) but both
# warpgroups waiting longer for the tiles (warpgroup 0: 140 -> 395), so the period grew (3120 -> 3210).
# With roles_w0_dims=128 it won only h64 / h16 B16 L65536 (-2.6%, -1.3%) and lost every batched and B1
# case (+0.2..+5%), so cp.async stays the default and both are kernel fields for ablations.
ROLES_TMA = False
# The wgmma transposed kernel with a second warpgroup that issues its copies (MLADecodeKernel.producer).
# Measured on the H200 (thirty-second session, three rounds in rotation against one warpgroup): h8 B16
# L65536 -4.4%, B64 L8192 -2.8%, B1 L131072 -2.1%; h16 -6..-9% (B1 -3.2%); h32 B16 -2.3%; h64 +0.2%.
TRANSPOSED_PRODUCER = True
# With the producer: S^T(t + 1) issued behind P.V(t), before it completes, where tile t + 1 has landed by
# then, so the tensor cores run the two back to back and S^T's issue hides under P.V; where it has not,
# tile t's stage is released first (MLADecodeKernel.early_scores; the refills' hand-over goes by mbarriers).
# Measured on the H200 (thirty-fifth session, three rounds each): h16 B1 L131072 -2.9% (the default there),
# h16 B16 L65536 -4.0%, B64 -3.3%, B128 -4.4%, h32 B16 -8.5%; h8 B16 L65536 a tie (+0.2%, in one process).
# Issued early whatever the next tile's landing, h8 lost 2.7%: tile t's release then waited for it.
TRANSPOSED_EARLY_SCORES = True
# The transposed wgmma kernel's copier issues the rope's 8 chunks of 4 rows a copy instruction (all 32 lanes)
# instead of one row's 8 lanes (MLADecodeKernel.kpe_batched; the same bytes in the same places, so the same
# outputs bit for bit). ncu at h16 B16 L65536 had its copies loading L1/TEX at 52% against decode's 21%.
# Measured on the H200 (thirty-seventh session, three rounds in one process): h16 B16 L65536 -1.5%, B128
# L4096 -1.1%, B64 L8192 -0.9%, B1 L131072 and h8 B16 L65536 ties. The roles kernel (its prologue's tiles
# only) keeps the row copies: not measured.
TRANSPOSED_KPE_BATCHED = True
# With early_scores, the copier's tiles by column block (MLADecodeKernel.copies_by_block), as the roles
# kernel copies since the twenty-ninth session (h32 -4.5%, h64 -5.4% there): per 4 rows, 9 copies and one
# pointer shuffle (two 32-bit halves) for the latent and one for the rope, against 8 copies, 8 offset
# shuffles and the rope's copy by rows (296 fewer static instructions at h16). Thirty-eighth session, three
# rounds in one process: h16 B16 L65536 -0.8% (287.5 -> 285.2 us), B64 L8192 / B128 L4096 / B1 L131072
# -0.5%, h8 B16 L65536 -0.2%; outputs bit for bit the row copies'. kpe_batched is moot under it.
TRANSPOSED_COPIES_BY_BLOCK = True
# Split items' partial outputs in 16 bits (MLADecodeKernel.partial_16bit, the wgmma kernels): half the bytes
# the chunks write and the merge reads (h128 B1 L131072 wrote 17 MB of fp32 partial states at ~3 TB/s, a
# 9.8K-cycle write an item: thirty-first session's trace). Measured on the H200 (thirty-ninth session):
# - in the output type, as FlashInfer keeps them (three rounds in one process against fp32, every round the
#   same sign): h64 B1 L131072 -5.1..-5.9%, h128 B1 -3.1..-3.5%, h32 B1 -2.6..-3.3%, h16 B1 -1.4..-2.1%,
#   batches -0.4..-1.0%; but bf16's second rounding broke the accuracy rule (max error at most twice torch's
#   low-precision error plus 2e-3) on an h128 case (1.02e-2 against 9.8e-3) and raised the RMSE 20%;
# - so as fp16 over a power-of-two scale per row (templates/mla_decode.cu.jinja, scale_partial_rows; 11
#   significant bits at any range): every MLA GPU test passed with it on the wgmma kernels but one, the fp16
#   roles kernel's RMSE against the mma.sync kernel's (3.26e-5 against 2.38e-5, over its 1.25x bound: in fp16
#   the partial's rounding is as coarse as the output's). One round: h16 B1 L131072 -2.7%, h16 B16 L65536 a
#   tie, but h64 / h128 B1 L131072 +3.2 / +2.7%: their merge took ~10 us against ~6 (no-merge rows), at 78
#   registers one 512-thread block an SM. With the merge bounded to two (64 registers; fortieth session,
#   three rounds in one process): h64 B1 L131072 -1.1..-1.5%, h128 B1 -0.1..-0.6%, h16 B1 -0.7..+0.5%, h16
#   B16 L65536 -0.1..-0.2%, but h32 B1 +0.8..+1.9% and h128 B16 L65536 +0.1..+1.7%. bf16 RMSE (h16 B4 L4096)
#   1.708e-4 against fp32's 1.703e-4 (bf16 partials: +20%).
# Off: fp32 partials keep the outputs within the rule at every dtype and lose nowhere; True is the opt-in
# trade (at most -1.5% measured).
PARTIALS_16BIT = False
# Each CTA's first item (the stream's walk) and the copier's first tiles' page-table rows read before the PDL
# wait (MLADecodeKernel.reads_before_wait): a trace of h16 B1 L131072 (fortieth session) put ~900 cycles of
# the stream's walk after the wait and two more round trips (kv_indptr, the page ids) before the first copy.
# Measured on the H200 (fortieth session, four rounds in one process against it off): h16 B1 L131072 -0.9..-1.1%
# in three rounds (+0.6% in one), h16 batches -0.2..-0.7% (B64 L8192 a tie), h8 -0.1..-1.0%, h64 B16 L65536
# -0.7..-0.9%, h32 / h64 B1 -0.1..-1.1%; h128, launched without PDL, tied except h128 B64 L8192 (+4.6 and +5.5%
# in two noisy rounds, ties in two). The default for the kernels launched with PDL (pdl_by_default).
READS_BEFORE_WAIT = True
# With tma, the maps' L2 promotion (attnforge.jit.tma.L2_PROMOTION_SIZES): the prefill maps' 256 bytes cost
# h128 2% against none or 128 (501.5 against 491.5 / 491.9 us at B16 L65536, in one process; h64 the same
# within 0.3%; thirtieth session). 256 makes each 128-byte box row's request fetch its neighbour block
# too; the traced tile period was the same with none (3211 against 3210 cycles), so where the 2% goes is open.
ROLES_TMA_L2_PROMOTION = 128


# the module's kernels: the decode, and its two merges (the one-wave merge where its grid fits one block an SM)
MLA_MERGE_KERNELS = ("mla_merge_kernel", "mla_merge_one_wave_kernel")
MLA_KERNELS = ("mla_decode_kernel", *MLA_MERGE_KERNELS)


def rows_per_cta(num_heads: int, pipeline: str, backend: str = "mma") -> int:
    """Query rows one CTA owns: all heads of a draft token up to 64; the normal pipeline's m16
    tiles need at least 16 rows, the transposed pipeline's n8 tiles only 8; wgmma's m64 tiles
    always 64 for the normal pipeline (rows past the heads are zero padding), and at most 32 for the
    transposed one (its O^T accumulators hold 512 x rows per warpgroup)."""
    if backend == "wgmma":
        return MAX_ROWS if pipeline == "normal" else min(WGMMA_MAX_TRANSPOSED_ROWS, max(num_heads, 8))
    return min(MAX_ROWS, max(num_heads, 16 if pipeline == "normal" else 8))


def wgmma_applies(spec: AttentionSpec) -> Optional[str]:
    """None when the wgmma MLA kernel can run this spec, else why not."""
    if spec.kv_dtype == "fp8_e4m3":
        return "fp8 KV (wgmma reads 16-bit tiles as they land)"
    return None


# From this many heads the wgmma normal pipeline ("roles" schedule) beats mma.sync (H200,
# docs/perf-notes.md: h32 +12% GB/s, h64 +49%, h128 +30-64% TFLOP/s; h16 -1..-10% since warpgroup 1
# refills by column block, twenty-ninth session); at 8 heads the transposed pipeline wins.
WGMMA_MIN_HEADS = 16
# The roles kernel moves a row's reference max only when a tile's max passes it by more than this (log2
# units): most tiles skip rescaling O (h128 -2..-3%, ninth session), but the dominant weight of a peaked
# row is 2^f, not exactly 1, and rounds in 16 bits (docs/architecture.md, "Lazy rescaling").
ROLES_RESCALE_SLACK = 8.0
# From this many heads the "roles" kernel is bound by its tensor work (the heads' row blocks share each
# tile through L2), and warpgroup 0, which also runs S and the softmax, takes 192 of P.V's 512 dims:
# h128 -5.5..-6.8% (H200, twenty-eighth session); at h32 (bandwidth-bound) the narrow split cost +3%.
ROLES_NARROW_W0_MIN_HEADS = 128
# With that split, warpgroup 0 takes the first k-steps of S's 36 from Q in registers (templates/mla/
# normal_wgmma.cu.jinja, kQRegSteps): 2 KB a step less through the shared-memory port that bounds S
# (4 steps: h128 -2.0..-2.5%). 12 compile without spills with every modifier (16 spill with ALiBi and
# a document mask), now that warpgroup 0's path no longer carries warpgroup 1's accumulators.
ROLES_Q_REG_STEPS = 12
# With that split, warpgroup 0's P.V may take P from registers (the A fragment S's accumulators already
# form), issued before P is stored for warpgroup 1. Measured slower: with warpgroup 1's copies by column
# block, P from shared memory is 2.0-2.7% faster at h128 (twenty-ninth session), so it stays a knob.
ROLES_PV_FROM_REGISTERS = False
# With that split the kernel launches plainly by default, not with PDL: in three records (twenty-eighth
# and twenty-ninth sessions, in rotation in one process) the plain launch took 0.4-1.6% less time at
# h128 on every case, where PDL saved 0.1-1.5% at h8-h64. Why is open. Not the side-by-side row blocks
# (two CTAs on the same tokens) starting apart: traced after a merge (trace_mla.py --chained, thirtieth
# session) the pairs started at most 224 ns apart under PDL (32 ns plain) and the tile loops took the
# same cycles (799.6K against 799.9K a CTA); only the cycles per ns differed (1.69 against 1.73 GHz),
# within the spread of the clock between runs.
ROLES_NARROW_PDL = False


def default_backend(spec: AttentionSpec, archs: Optional[tuple] = None) -> str:
    """The measured winner: wgmma when sm_90a is being built and the spec has 16-bit KV, for the
    normal pipeline from WGMMA_MIN_HEADS heads and for the transposed pipeline at every head count
    (its wgmma kernel beat the mma.sync one in every case of the latest record, by 15-25%); mma.sync
    otherwise."""
    archs = arch.arch_list() if archs is None else archs
    hopper = any(a.startswith(WGMMA_ARCH) for a in archs)
    wins = spec.pipeline == "transposed" or spec.num_qo_heads >= WGMMA_MIN_HEADS
    return "wgmma" if hopper and wins and wgmma_applies(spec) is None else "mma"


def default_tiling(rows: int) -> tuple[int, int]:
    """(tile_kv, stages), measured on the H200 (docs/perf-notes.md): up to 16 rows, 32-token tiles
    let two CTAs share an SM (+15-18% on batched cases); from 32 rows, 64-token tiles (fewer
    barriers per token) win by 20-25%."""
    return (32, 2) if rows <= 16 else (64, 2)


@dataclass(frozen=True)
class MLADecodeKernel:
    spec: AttentionSpec
    num_stages: Optional[int] = None
    tile_kv: Optional[int] = None
    backend: str = "mma"  # "wgmma": sm_90a warpgroup MMA (both pipelines, 16-bit KV)
    # wgmma normal pipeline: "symmetric" (the warpgroups split S by tokens) or "roles" (warpgroup 0:
    # S and softmax, warpgroup 1: the copies; templates/mla_decode.cu.jinja); None: "roles" there (it
    # won every case measured, +1-18%), "symmetric" (the only one) elsewhere
    schedule: Optional[str] = None
    # "roles": the output dims of warpgroup 0's P.V (the rest are warpgroup 1's); None: 192 from
    # ROLES_NARROW_W0_MIN_HEADS heads, else 256 (templates/mla/normal_wgmma.cu.jinja says why); 128: an ablation
    # (+0.9..+3.2% against the default at h16-h128, thirtieth session)
    roles_w0_dims: Optional[int] = None
    # "roles" with a narrow split (192 or 128): S's k16 steps (of 36) taking Q from registers, and whether warpgroup
    # 0's P.V takes P from registers; None: ROLES_Q_REG_STEPS / ROLES_PV_FROM_REGISTERS
    roles_q_steps: Optional[int] = None
    roles_pv_rs: Optional[bool] = None
    # "roles": warpgroup 1 refills by TMA boxes where the cache's pages allow (the even split's whole
    # tiles, the narrow splits' second part; templates/mla/normal_wgmma.cu.jinja, tile_by_tma); None: ROLES_TMA
    tma: Optional[bool] = None
    # with tma: the L2 fetch around each box row's request, in bytes (attnforge.jit.tma.L2_PROMOTION_SIZES);
    # None: ROLES_TMA_L2_PROMOTION. A host-side map setting: the kernel's source is the same.
    tma_l2_promotion: Optional[int] = None
    # wgmma transposed pipeline: a second warpgroup issues every copy (named barriers hand the stages over),
    # so the computing warpgroup's chain is S^T, the softmax and P.V alone; None: TRANSPOSED_PRODUCER there
    producer: Optional[bool] = None
    # with the producer: S^T(t + 1) issued behind P.V(t) where tile t + 1 has landed; None: TRANSPOSED_EARLY_SCORES
    early_scores: Optional[bool] = None
    # wgmma kernels' issue_tile: the rope's 8 chunks of 4 rows a copy instruction (all 32 lanes), not one row's
    # 8 lanes an instruction; None: TRANSPOSED_KPE_BATCHED for the transposed wgmma kernel, else False
    kpe_batched: Optional[bool] = None
    # with early_scores: the copier's tiles by column block (4 rows x 128 bytes a copy, one pointer shuffle a
    # group of 4 rows, as the roles kernel copies), not by row (two copies and an offset shuffle a row);
    # None: TRANSPOSED_COPIES_BY_BLOCK
    copies_by_block: Optional[bool] = None
    # the wgmma kernels: split items' partial outputs stored as fp16 over a power-of-two scale per row (half
    # the bytes the chunks write and the merge reads) instead of fp32; None: PARTIALS_16BIT there
    partial_16bit: Optional[bool] = None
    # each CTA's first item (and with a producer warpgroup its first tiles' page-table rows) read before the PDL
    # wait, from plan()'s copies, so their round trips run under it; None: READS_BEFORE_WAIT where the kernel
    # launches with PDL by default
    reads_before_wait: Optional[bool] = None

    def __post_init__(self):
        if self.spec.family != "mla_decode":
            raise ValueError(f"MLADecodeKernel: expected a spec with family='mla_decode', got {self.spec.family!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"MLADecodeKernel.backend: expected one of {BACKENDS}, got {self.backend!r}; or leave "
                             f"BatchMLADecode(backend=None) to get the measured winner")
        if self.backend == "wgmma":
            if (why := wgmma_applies(self.spec)) is not None:
                raise ValueError(f"MLADecodeKernel: the wgmma backend does not take {why}; use backend='mma'")
            if (self.tile_kv or 64) != 64 or (self.num_stages or 2) != 2:
                raise ValueError(f"MLADecodeKernel: the wgmma backend runs 64-token tiles in 2 stages (Q and two "
                                 f"576-wide tiles fill shared memory), got tile_kv={self.tile_kv}, "
                                 f"num_stages={self.num_stages}")
        if self.schedule not in (None,) + SCHEDULES:
            raise ValueError(f"MLADecodeKernel.schedule: expected None or one of {SCHEDULES}, got {self.schedule!r}; "
                             f"None picks 'roles' for the wgmma normal pipeline (the measured winner)")
        if self.schedule == "roles" and (self.backend, self.spec.pipeline) != ("wgmma", "normal"):
            raise ValueError(f"MLADecodeKernel.schedule='roles' is the wgmma normal pipeline's, got backend="
                             f"{self.backend!r}, pipeline={self.spec.pipeline!r}; pass backend='wgmma' and "
                             f"pipeline='normal', or leave schedule=None")
        if self.roles_w0_dims not in (None, 128, 192, 256):
            raise ValueError(f"MLADecodeKernel.roles_w0_dims: expected None, 128, 192 or 256, got "
                             f"{self.roles_w0_dims!r}; "
                             f"leave it None for the measured split (the output dims warpgroup 0's P.V takes)")
        if self.roles_w0_dims is not None and self.resolved_schedule != "roles":
            raise ValueError(f"MLADecodeKernel.roles_w0_dims applies to the 'roles' schedule only, got schedule="
                             f"{self.resolved_schedule!r}; leave roles_w0_dims=None")
        q_steps = self.roles_q_steps
        if q_steps is not None and (type(q_steps) is not int or not 0 <= q_steps <= 36):  # (bool is not an int here)
            raise ValueError(f"MLADecodeKernel.roles_q_steps: expected None or an int in 0..36 (S's k16 steps), got "
                             f"{q_steps!r}; leave it None for the measured default")
        # the switches that default to a measured choice: None or a bool
        for name, default in (("roles_pv_rs", "ROLES_PV_FROM_REGISTERS"), ("tma", "ROLES_TMA: cp.async refills"),
                              ("producer", "TRANSPOSED_PRODUCER"), ("early_scores", "TRANSPOSED_EARLY_SCORES")):
            value = getattr(self, name)
            if value is not None and type(value) is not bool:
                raise ValueError(f"MLADecodeKernel.{name}: expected None, True or False, got {value!r}; leave it None "
                                 f"for the measured default ({default})")
        promotion_ok = self.tma and self.tma_l2_promotion in tma_maps.L2_PROMOTION_SIZES
        if self.tma_l2_promotion is not None and not promotion_ok:
            raise ValueError(f"MLADecodeKernel.tma_l2_promotion: expected None, or one of "
                             f"{tma_maps.L2_PROMOTION_SIZES} with tma=True, got {self.tma_l2_promotion!r} with "
                             f"tma={self.tma!r}; pass tma=True with one of those sizes, or leave tma_l2_promotion "
                             f"None (ROLES_TMA_L2_PROMOTION)")
        if self.tma and self.resolved_schedule != "roles":
            raise ValueError(f"MLADecodeKernel.tma: the copy engine refills the 'roles' schedule's stages (wgmma, "
                             f"normal pipeline), got schedule={self.resolved_schedule!r}; pass backend='wgmma' and "
                             f"pipeline='normal', or tma=False")
        if self.producer and not self._transposed_wgmma:
            raise ValueError(f"MLADecodeKernel.producer: the wgmma transposed kernel's, got backend={self.backend!r}, "
                             f"pipeline={self.spec.pipeline!r}; pass backend='wgmma' and pipeline='transposed', or "
                             f"producer=None")
        if self.early_scores and not self.uses_producer:
            raise ValueError("MLADecodeKernel.early_scores: the wgmma transposed kernel with its producer warpgroup "
                             f"issues S^T early, got backend={self.backend!r}, pipeline={self.spec.pipeline!r}, "
                             f"producer={self.producer!r}; pass backend='wgmma', pipeline='transposed' and "
                             f"producer=None (or True), or early_scores=None")
        self._check_flag("kpe_batched", self.backend == "wgmma", "a wgmma kernel")
        self._check_flag("copies_by_block", self.uses_early_scores, "the early-scores transposed wgmma kernel")
        if self.kpe_batched and self.uses_copies_by_block:  # issue_tile, which kpe_batched shapes, is not called
            raise ValueError("MLADecodeKernel.kpe_batched=True shapes the row copies, but this kernel copies by column "
                             "block (copies_by_block, the early-scores transposed kernel's default); pass "
                             "copies_by_block=False with it, or leave kpe_batched None")
        self._check_flag("partial_16bit", self.backend == "wgmma",
                         "a wgmma kernel (rows scaled over its staged output)")
        self._check_flag("reads_before_wait", True, "any kernel")
        if self.tile_kv not in (None, 32, 64):
            raise ValueError(f"MLADecodeKernel.tile_kv: expected 32 or 64, got {self.tile_kv}")
        if self.num_stages is not None and (type(self.num_stages) is not int or not 2 <= self.num_stages <= 6):
            raise ValueError(f"MLADecodeKernel.num_stages: expected an int in 2..6, got {self.num_stages!r}")
        if self.smem_bytes + SMEM_RESERVED_PER_CTA > SMEM_PER_SM:
            raise ValueError(f"MLADecodeKernel: {self.smem_bytes} B of shared memory per CTA exceeds the SM's "
                             f"{SMEM_PER_SM - SMEM_RESERVED_PER_CTA} B; use fewer stages")

    @property
    def resolved_schedule(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "roles" if (self.backend, self.spec.pipeline) == ("wgmma", "normal") else "symmetric"

    @property
    def resolved_roles_w0_dims(self) -> int:
        if self.roles_w0_dims is not None:
            return self.roles_w0_dims
        return 192 if self.spec.num_qo_heads >= ROLES_NARROW_W0_MIN_HEADS else 256

    @property
    def roles_q_reg_steps(self) -> int:
        """S's k-steps taken from Q in registers (the "roles" kernel with the 192-dim split)."""
        if self.resolved_roles_w0_dims == 256:
            return 0
        return ROLES_Q_REG_STEPS if self.roles_q_steps is None else self.roles_q_steps

    @property
    def roles_pv_from_registers(self) -> bool:
        """Whether warpgroup 0's P.V takes P from registers (the "roles" kernel with the 192-dim split)."""
        if self.resolved_roles_w0_dims == 256:
            return False
        return ROLES_PV_FROM_REGISTERS if self.roles_pv_rs is None else self.roles_pv_rs

    @property
    def uses_tma(self) -> bool:
        """Whether warpgroup 1 refills by TMA boxes (the "roles" kernel: the even split's whole tiles, the
        narrow splits' second part)."""
        return self.resolved_schedule == "roles" and (ROLES_TMA if self.tma is None else self.tma)

    def tma_values(self, ckv: torch.Tensor, kpe: torch.Tensor, page_size: int) -> dict:
        """The params' TMA fields for a latent cache ckv [P, page, 512] and rope cache kpe [P, page, 64]
        (views of one [P, page, 576] cache, or two tensors): maps and the box's rows, or rows 0 where
        the pages do not tile the 64-token tile (then every tile goes by cp.async)."""
        if not self.uses_tma:
            return {}
        # one "head" per page (its stride the page's): the map's coordinates are (dim, token in page, 0, page)
        boxes = [tma_maps.paged_kv_box(t.shape[2], 1, page_size, t.shape[0], t.stride(0), t.stride(1), t.stride(0),
                                       t.element_size(), self.tiling[0])[0] for t in (ckv, kpe)]
        if any(b is None for b in boxes) or any(t.data_ptr() % 16 for t in (ckv, kpe)):
            return {"ckv_tmap": None, "kpe_tmap": None, "tma_rows": 0}
        assert boxes[0].rows & (boxes[0].rows - 1) == 0, boxes  # the kernel tests box boundaries by mask
        promotion = ROLES_TMA_L2_PROMOTION if self.tma_l2_promotion is None else self.tma_l2_promotion
        boxes = [dataclasses.replace(b, l2_promotion=promotion) for b in boxes]
        return {"ckv_tmap": tma_maps.encode(ckv, boxes[0]), "kpe_tmap": tma_maps.encode(kpe, boxes[1]),
                "tma_rows": boxes[0].rows}

    @property
    def pdl_by_default(self) -> bool:
        """Whether BatchMLADecode(pdl=None) launches this kernel with programmatic dependent launch."""
        narrow_roles = self.resolved_schedule == "roles" and self.resolved_roles_w0_dims < 256
        return ROLES_NARROW_PDL if narrow_roles else True

    @property
    def threads(self) -> int:  # the wgmma transposed kernel: one computing warpgroup (and its producer)
        if not self._transposed_wgmma:
            return THREADS
        return 256 if self.uses_producer else 128

    @property
    def _transposed_wgmma(self) -> bool:
        return self.backend == "wgmma" and self.spec.pipeline == "transposed"

    @property
    def uses_producer(self) -> bool:
        """Whether a second warpgroup issues the wgmma transposed kernel's copies."""
        return self._transposed_wgmma and (TRANSPOSED_PRODUCER if self.producer is None else self.producer)

    @property
    def uses_early_scores(self) -> bool:
        """Whether the wgmma transposed kernel's producer path issues S^T(t + 1) behind P.V(t) (early_scores)."""
        return self.uses_producer and (TRANSPOSED_EARLY_SCORES if self.early_scores is None else self.early_scores)

    def _check_flag(self, name: str, applies: bool, where: str) -> None:
        """An optional bool field (None: the measured default) that only `where` can turn on."""
        value = getattr(self, name)
        if (value is not None and type(value) is not bool) or (value and not applies):
            raise ValueError(f"MLADecodeKernel.{name}: expected None, False, or True on {where}, got {value!r} with "
                             f"backend={self.backend!r}, pipeline={self.spec.pipeline!r}; leave it None for the "
                             f"measured default")

    @property
    def uses_copies_by_block(self) -> bool:
        """Whether the early-scores transposed kernel's copier copies by column block (copies_by_block)."""
        if not self.uses_early_scores:
            return False
        return TRANSPOSED_COPIES_BY_BLOCK if self.copies_by_block is None else self.copies_by_block

    @property
    def uses_partial_16bit(self) -> bool:
        """Whether split items' partial outputs are stored as scaled fp16 (partial_16bit; wgmma kernels only)."""
        if self.partial_16bit is not None:
            return self.partial_16bit
        return PARTIALS_16BIT and self.backend == "wgmma"

    @property
    def rescale_slack(self) -> float:
        """How far (log2) a row's max may pass its reference before O is rescaled: ROLES_RESCALE_SLACK
        for the roles kernel, 0 (an eager max) for the others."""
        return ROLES_RESCALE_SLACK if self.resolved_schedule == "roles" else 0.0

    @property
    def uses_reads_before_wait(self) -> bool:
        """Whether each CTA reads its first item (and its copier's first rows) before the PDL wait."""
        if self.reads_before_wait is not None:
            return self.reads_before_wait
        return READS_BEFORE_WAIT and self.pdl_by_default  # (nothing to hide the reads under without PDL)

    @property
    def uses_kpe_batched(self) -> bool:
        """Whether issue_tile copies the rope chunks of 4 rows an instruction (kpe_batched); never where the
        copier copies by column block (issue_tile is not called there)."""
        if self.kpe_batched is not None:
            return self.kpe_batched
        return TRANSPOSED_KPE_BATCHED and self._transposed_wgmma and not self.uses_copies_by_block

    @property
    def rows(self) -> int:
        return rows_per_cta(self.spec.num_qo_heads, self.spec.pipeline, self.backend)

    @property
    def tiling(self) -> tuple[int, int]:
        if self.backend == "wgmma":  # m64 tiles of tokens (transposed) or rows; Q + two stages fill the SM
            return 64, 2
        tile, stages = default_tiling(self.rows)
        if self.tile_kv is not None and self.tile_kv != tile:  # an override: the shallow pipeline fits
            tile, stages = self.tile_kv, 2
        return tile, (self.num_stages or stages)

    @property
    def kv_bytes(self) -> int:
        return 1 if self.spec.kv_dtype == "fp8_e4m3" else 2

    def row_blocks(self, q_len: int) -> int:
        return -(-q_len * self.spec.num_qo_heads // self.rows)

    def side_blocks(self, row_blocks: int) -> int:
        """Row blocks of one request run side by side on the same tokens (their copies share L2):
        all of them for wgmma (H200, h128: +5-15% normal, +0-6% transposed), none for mma.sync
        (normal unchanged, transposed -22%: docs/perf-notes.md)."""
        return row_blocks if self.backend == "wgmma" else 1

    @cached_property
    def smem_bytes(self) -> int:
        (tile, stages), d, rows = self.tiling, MLA_HEAD_DIM_QK, self.rows
        if self.spec.pipeline == "transposed":
            red, k_split = tile // 16, 1
        else:  # S tiles (m16 x token slice); spare warps split their k-steps (templates/mla_decode.cu.jinja)
            red = min(8 // (rows // 16), tile // 16)
            k_split = 8 // (rows // 16 * red)
        wide = tile * d * 2 if self.kv_bytes == 1 else 0
        align = 1024 if self.backend == "wgmma" else 0  # sw128 tiles start 1024-byte aligned
        return rows * d * 2 + stages * tile * d * self.kv_bytes + wide + rows * tile * 2 + (2 * red + 3) * rows * 4 + \
            (k_split - 1) * rows * (tile + 8) * 4 + align  # split-K partials, rows padded by 8 floats

    @cached_property  # (a run reads it; hashing its ~30 fields for params_for's cache cost ~10 us)
    def params(self) -> ParamsLayout:
        return variants.params_for("MLAParams", (*TMA_FIELDS, *BASE_FIELDS) if self.uses_tma else BASE_FIELDS,
                                   self.spec)

    @property
    def ctas_per_sm(self) -> int:  # 256 threads: two CTAs leave 128 registers per thread
        return min(2, max(1, SMEM_PER_SM // (self.smem_bytes + SMEM_RESERVED_PER_CTA)))

    def module(self) -> JitModule:
        s = self.spec
        tile, stages = self.tiling
        ctx = {"q_dtype": _CPP[s.q_dtype], "kv_dtype": _CPP[s.kv_dtype], "out_dtype": _CPP[s.out_dtype],
               "num_heads": s.num_qo_heads, "rows": self.rows, "pipeline": s.pipeline, "backend": self.backend,
               "schedule": self.resolved_schedule, "roles_w0_dims": self.resolved_roles_w0_dims,
               "roles_q_reg_steps": self.roles_q_reg_steps, "roles_pv_from_registers": self.roles_pv_from_registers,
               "tma": self.uses_tma, "producer": self.uses_producer, "early_scores": self.uses_early_scores,
               "kpe_batched": self.uses_kpe_batched,
               "copies_by_block": self.uses_copies_by_block, "partial_16bit": self.uses_partial_16bit,
               "reads_before_wait": self.uses_reads_before_wait, "rescale_slack": self.rescale_slack, "tile_kv": tile,
               "num_stages": stages, "min_ctas_per_sm": self.ctas_per_sm, "smem_bytes": self.smem_bytes,
               "variant_decl": variants.variant_decl(s), "chunk_fixed_cost": scheduler.CHUNK_FIXED_COST,
               "params_struct": self.params.cpp(), "trace": False}
        name = "_".join(["mla", f"h{s.num_qo_heads}", s.q_dtype, f"kv{_CPP[s.kv_dtype]}", f"out{s.out_dtype}",
                         s.pipeline, *(["wgmma"] if self.backend == "wgmma" else []),
                         *([f"roles{self.resolved_roles_w0_dims}"] if self.resolved_schedule == "roles" else []),
                         *(["tma"] if self.uses_tma else []),
                         *(["pw"] if self.uses_producer else []), *(["es"] if self.uses_early_scores else []),
                         *(["softcap"] if s.logits_soft_cap > 0 else []),
                         *(["mod"] if s.score_mod is not None else []),
                         *(["kb"] if self.uses_kpe_batched else []),
                         *(["cbb"] if self.uses_copies_by_block else []),
                         *(["p16"] if self.uses_partial_16bit else []),
                         *(["rbw"] if self.uses_reads_before_wait else []),
                         f"r{self.rows}t{tile}s{stages}"])
        archs = (WGMMA_ARCH,) if self.backend == "wgmma" else ()  # sm_90a only, whatever the arch list says
        return JitModule(name, "mla_decode.cu.jinja", ctx, MLA_KERNELS, archs=archs)

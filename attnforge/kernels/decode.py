"""The batch-decode kernel family: template variables, parameter struct and launch shape."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional
from functools import cached_property

from .. import scheduler, variants
from ..codegen import ParamField, ParamsLayout
from ..jit import JitModule
from ..jit.cubin import REGISTERS_PER_SM
from ..mods import graph
from ..spec import AttentionSpec, auto_transposed_max_rows
from .fields import IO_FIELDS, PAGED_KV_FIELDS, ptrs, scalars

_CPP = {"bf16": "bf16", "fp16": "fp16", "fp8_e4m3": "fp8e4m3"}
THREADS = 128
TILE_KV = 64
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
# the kernel's static shared memory (last_chunk_flag) beside the dynamic smem_bytes, and the unit a CTA's shared
# memory is allocated in: a kernel whose dynamic bytes fill the SM exactly holds one CTA fewer
SMEM_STATIC_BYTES = 4
SMEM_ALLOC_UNIT = 128
MAX_TRANSPOSED_GROUP = 16  # two n8 head tiles of O^T a warp (more would spill at d128)
MIN_REGISTERS_PER_THREAD = 128  # the kernels need ~120-165; fewer would spill in the tile loop
MAX_Q_LEN = 8  # query tokens a request (speculative decoding's verify step: the last token and its drafts)
MAX_ITEM_ROWS = 64  # query rows of a work item (tokens x heads): the normal pipeline's four m16 tiles

BASE_FIELDS = (
    *IO_FIELDS, *PAGED_KV_FIELDS,
    ParamField("partial_o", "float*", "ptr"), ParamField("partial_lse", "float*", "ptr"),
    *ptrs("kv_begin", "stream_prefix"), ParamField("meta", "const attnforge::StreamMeta*", "ptr"),
    ParamField("merge_count", "int*", "ptr"),  # [max_batch * num_kv_heads] chunks in, per split item
    *scalars("i64", "int64_t", "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h"),
    *scalars("i32", "int32_t", "num_qo_heads", "num_kv_heads"),  # num_kv_heads: the stream's items per
    # request (KV heads x DecodeKernel.head_splits)
    ParamField("v_scale", "float", "f32"),
    # 1: split chunks only write their partial states, and batch_decode_merge_kernel merges them (a second launch)
    ParamField("merge_launch", "int32_t", "i32"),
    *variants.COMMON_VARIANT_FIELDS,
    ParamField("q_len", "int32_t", "i32"),  # query tokens a request (<= DecodeKernel.max_q_len)
)


def merge_lse_blocks(group: int) -> int:
    """16-byte blocks a split item's merge copies of each chunk's lse row (`group` floats): the copy
    starts at the aligned block below the row, and rows start at multiples of `group` floats, so a row
    begins up to 4 - gcd(group, 4) floats into that block (0 when group % 4 == 0). Groups of 3 mod 4
    need one block more than group // 4 + 1 (the count before: group 3 read its third lse from past
    the copy); every other group keeps that count, so its kernel is unchanged."""
    offset = 0 if group % 4 == 0 else 4 - math.gcd(group, 4)
    return max(group // 4 + 1, -(-(offset + group) // 4))


MERGE_LSE_SLACK_BYTES = 32  # past the last lse row: the widest overshoot of those blocks is 5 floats


def default_head_splits(spec: AttentionSpec, max_q_len: int = 1) -> int:
    """Items per KV head: MQA-sized groups on the normal pipeline (at d <= 128) run as items of 16
    heads each, so a split item's partial states (group x head_dim floats per chunk) merge in a
    quarter of the time on twice the CTAs (MQA 32/1 d128 merged 25 chunks x 32 heads through one CTA:
    2.1x cuDNN's time, twelfth session); the items of one KV head read the same tokens side by side.
    The transposed pipeline's items hold at most 16 heads (two n8 tiles), so its multiples of 16 split too
    (fp8 MQA's default, spec.default_pipeline). With several query tokens a request, halved further while an
    item's rows (heads x tokens) pass MAX_ITEM_ROWS and the group divides."""
    g = spec.group_size
    sixteen_head_items = g > 16 and g % 16 == 0 and (spec.pipeline == "transposed" or spec.head_dim_qk <= 128)
    hs = g // 16 if sixteen_head_items else 1
    while g // hs * max_q_len > MAX_ITEM_ROWS and g % (2 * hs) == 0:
        hs *= 2
    return hs


def spec_for_rows(spec: AttentionSpec, max_q_len: int, head_splits: Optional[int] = None) -> AttentionSpec:
    """The spec with the pipeline for work items of group x max_q_len rows, where its pipeline is the one
    'auto' picks for its group (AttentionSpec resolves 'auto' knowing no q_len). Measured (suite `verify`,
    GQA 32/8 bf16, sixty-eighth session): 8 rows (q_len 2) the transposed pipeline's one n8 tile, 252.3 us
    against normal's 254.1 at B128 L2048; 16 rows (q_len 4) one m16 tile of the normal pipeline, 258.6
    against transposed's two n8 tiles 262.1 at B64 L4096, 245.4 against 253.0 on B32 of random lengths.
    fp8 KV keeps the transposed pipeline (widened in registers) up to 8 rows an item at d128 and up to its 16
    elsewhere; past them, normal, at d128 widened in registers there too (`DecodeKernel.normal_widen_in_registers`:
    19-31% faster than through shared memory past 16 rows, suite `verify_fp8_widen`, 113th session on an H100; and
    7.7-8.2% faster than the transposed kernel at 9-16 rows, 114th and 115th sessions; spec.py,
    AUTO_TRANSPOSED_MAX_ROWS_FP8_D128). At d64 and d256 the normal pipeline widens fp8 through shared memory.
    Splitting such items' heads into 2-4 items of at most 16 rows to stay transposed lost 19-79% on an H100
    (suite `verify_fp8_split`, 112th session, as in the seventy-third): a KV head's items run back to back, so
    each rereads its pages from DRAM. Explicit head_splits (BatchDecode's) set the item's rows."""
    if spec.family != "decode" or max_q_len == 1 or spec.pipeline != "transposed":
        return spec
    limit = auto_transposed_max_rows(spec.kv_dtype, spec.head_dim_qk)
    # (head_splits that do not divide the group: the default here, and DecodeKernel says what was wrong)
    valid = type(head_splits) is int and head_splits > 0 and spec.group_size % head_splits == 0
    item_heads = spec.group_size // (head_splits if valid else default_head_splits(spec))
    return replace(spec, pipeline="normal") if item_heads * max_q_len > limit else spec


def default_tiling(spec: AttentionSpec, group: Optional[int] = None) -> tuple[int, int]:
    """(tile_kv, num_warps): 64-token tiles of four warps, except at d256, where such a tile of 16-bit
    K and V in two stages (136 KB) leaves shared memory for one CTA per SM: 32-token tiles of two warps
    there (72 KB, 3 CTAs; benchmarks/bench_decode_tilings.py) where the group fits one head tile, and
    eight warps for larger groups on the normal pipeline."""
    # two warps hold one 16-head tile (normal) or one n8 head tile (transposed; two of them spill);
    # larger groups keep 64-token tiles (MQA's 64 partial rows also need their stage area for the merge)
    # (fp8 widened in registers, transposed: 2 CTAs per SM at 64-token tiles already, 168-206 registers)
    group = spec.group_size if group is None else group  # query heads per work item
    one_head_tile = group <= (8 if spec.pipeline == "transposed" else 16)
    fp8_in_registers = spec.kv_dtype == "fp8_e4m3" and spec.pipeline == "transposed"
    if spec.head_dim_qk > 128 and one_head_tile and not fp8_in_registers:
        return 32, 2
    if spec.head_dim_qk > 128 and spec.pipeline == "normal":
        # MQA-sized groups: eight warps split each tile's rows further (16-bit MQA-64 spilled 16 bytes
        # at four: 240 registers at eight), and an SM held to one CTA by shared memory gets 8 warps
        return TILE_KV, 8
    return TILE_KV, 4


@dataclass(frozen=True)
class WholeItemTiling:
    """A one-CTA-per-SM decode kernel's shape, and the plans it was measured to win on."""

    tile_kv: int
    stages: int
    warps: int
    # the most equal chunks k each of a plan's equal items may be cut into, items x k ~ one chunk per SM
    # (1: items read whole only, one a CTA), with split items merged on the kernel's tail
    max_chunks: int = 1
    # more (0: none) where split items are merged by the second launch (BatchDecode's merge_launch)
    max_chunks_merge_launch: int = 0
    pipeline: Optional[str] = None  # the kernel's pipeline where it is not the spec's (None: the spec's)


WHOLE_ITEM_TILING = WholeItemTiling(128, 3, 8)  # 192 KB of 16-bit K/V stages at d128
# fp8 K/V widened in registers wants as many warps as the default's four CTAs of four an SM: 16 warps, each
# one 16-token band of a 256-token tile, in two 64 KB stages
FP8_WHOLE_ITEM_TILING = WholeItemTiling(256, 2, 16, max_chunks=33)
# fp8 items of 9-16 rows read whole on the transposed kernel's two n8 tiles, eight warps (whole_item_tiling,
# verify_one_cta_tiling), from either pipeline's spec: d128's default for these rows is the normal one
FP8_SIXTEEN_ROW_WHOLE_ITEM_TILING = replace(WHOLE_ITEM_TILING, pipeline="transposed")
# A split item's merge (one CTA, at the kernel's end) reads k partial states of its item's query heads: the
# chunked plans won up to 66 chunks of 16 heads and 33 of 32 (~1056 head rows), and lost at 66 of 32 or 64.
MERGED_HEAD_ROWS = 1056
# Merged by the second launch instead (past scheduler.MERGE_LAUNCH_ROWS), MQA's one item of every query head
# won at every chunk count measured, up to one request on every SM (forty-seventh session)
MQA_MERGE_LAUNCH_CHUNKS = 132


# 32-token tiles of two warps in three stages hold 4 CTAs an SM against the default's 3, so a batch of about
# 4 x SMs equal items reads each whole, one a CTA: verify steps whose items fill the normal pipeline's one 16-bit
# m16 tile (verify_four_cta_tiling), and one token a request whose group fills one head tile (four_cta_tiling)
FOUR_CTA_WHOLE_ITEM_TILING = WholeItemTiling(32, 3, 2)
# ... on the normal pipeline's m16 tile for a group of 4 on either pipeline (four_cta_tiling) and for verify's
# items of 4-8 rows (verify_four_cta_tiling)
FOUR_CTA_M16_WHOLE_ITEM_TILING = WholeItemTiling(32, 3, 2, pipeline="normal")


def verify_four_cta_tiling(spec: AttentionSpec, max_q_len: int) -> Optional[WholeItemTiling]:
    """The 4-CTA whole-item tiling of a verify step's kernel (max_q_len > 1), or None. Measured (GQA 32/8 and 64/8,
    d128, page 16, H200, three rounds in rotation against the default t64s2w4 at 3 CTAs an SM, sixty-ninth
    session): B64 q4 L4096 (512 equal items on 528 CTAs, one each) 247.7 against 257.9 us, B64 q3 247.2 / 256.7,
    GQA 64/8 B64 q2 247.1 / 257.8, fp16 B64 q4 247.2 / 257.0 (-3.7..-4.2%). As the plain default it lost 1-3%
    wherever the items were not whole (uneven B32 +2.2%, B16 L8192 +2.6%, B8, B256, B1), and at one token a
    request it gained less (B64 -1.4%, B66 -2.4%), so it runs only on plans in the whole-item band, and only for
    verify steps (one token keeps WHOLE_ITEM_TILING's one CTA an SM). fp8 KV already holds 4 CTAs an SM on its
    default (transposed, widened in registers); d256 and affine hooks with run-time slopes were not measured.
    Items of 4-8 rows (the transposed pipeline's, e.g. GQA 32/8 q2) run it on the normal pipeline's m16 tile
    (FOUR_CTA_M16_WHOLE_ITEM_TILING: 168 registers, no spills, where the transposed n8 tile spills 8 bytes at
    the 128 its occupancy allows), as one token a request's group of 4 does (four_cta_tiling). Measured against
    whole_items=False (seventy-third session, three rounds, 8 KV heads, q2): GQA 32/8 B64 L4096 249.4 against
    255.3 us (-2.3%), B66 -3.3%, 7-token pages -1.2%, B64 L1024 -6.8%, GQA 16/8 B64 L4096 -2.4%."""
    if max_q_len == 1 or spec.kv_dtype == "fp8_e4m3" or not _in_measured_scope(spec):
        return None
    rows = spec.group_size // default_head_splits(spec, max_q_len) * max_q_len
    if spec.pipeline == "transposed":
        return FOUR_CTA_M16_WHOLE_ITEM_TILING if 4 <= rows <= 8 else None
    return FOUR_CTA_WHOLE_ITEM_TILING if 8 < rows <= 16 else None


def verify_one_cta_tiling(spec: AttentionSpec, max_q_len: int) -> Optional[WholeItemTiling]:
    """The one-CTA-an-SM whole-item tiling of a verify step's kernel (max_q_len > 1), for plans of about one
    equal item an SM (GQA 32/8: B16 is 128 items on 132 SMs), or of fewer equal items cut into equal chunks of
    about one an SM; None for shapes not measured to win. Measured (seventy-third session, three rounds in
    rotation against the split plan, spans aligned to items, d128, page 16):
    - 16-bit, the normal pipeline's m16 tiles: GQA 32/8 B16 q8 L8192 (32 rows) 128.9 against 138.1 us (-6.7%),
      L2048 -14.7%, chunked B8 q8 (2 chunks an item) -5.0%, B4 (4) -5.8%, B2 (8) -4.2%; B16 q4 (16 rows) -2.7%,
      B4 (4 chunks) -1.3%; GQA 128/8 q4 (64 rows) B16 -14%, B8 (2 chunks) -12%, B4 (4) -14.8%;
    - 16-bit, the transposed n8 tile: q2, GQA 32/8 (8 rows) -2.2%, 32/16 -2.0%, MHA -2.2% (whole items: one
      token's chunked transposed plans tied, whole_item_tiling);
    - fp8, two n8 tiles (16 rows, 196 registers): B16 q4 -2.6%, where FP8_WHOLE_ITEM_TILING's 16 warps, held to
      128 registers, spill 72 bytes and lost 19%. Re-measured on the widen-once kernel (seventy-fifth session,
      three rounds): B16 q4 L8192 -0.6..-0.7%, q3 (12 rows) -2.0..-2.1%, q4 L2048 -9.5..-10.3%. Since d128's
      default runs these rows on the normal pipeline (115th session), its spec takes this transposed kernel too:
      B16 q4 L16384 182.1 us against the normal kernel's split plan's 189.3 (H100);
    Measured and left out: fp8 on the normal pipeline (q8, 32 rows: +4.4%, when it widened through shared memory), fp8's
    8 rows (+3.4%: two CTAs an SM there, against its default's four), d64 (+3.8%). Not measured: d256, MQA-sized
    groups and items split by heads (a group of 16 at q5-8), more than 8 chunks an item (4 at 64 rows) and
    slopes read at run time."""
    if max_q_len == 1 or spec.group_size > 16 or not _in_measured_scope(spec) or \
            default_head_splits(spec, max_q_len) > 1:
        return None
    rows = spec.group_size * max_q_len
    if spec.kv_dtype == "fp8_e4m3":  # two n8 tiles on the transposed kernel, from either pipeline's spec
        return FP8_SIXTEEN_ROW_WHOLE_ITEM_TILING if 8 < rows <= 16 else None
    if spec.pipeline == "transposed":
        return WHOLE_ITEM_TILING if rows <= 8 else None
    return None if rows <= 8 else replace(WHOLE_ITEM_TILING, max_chunks=8 if rows <= 32 else 4)


def four_cta_tiling(spec: AttentionSpec) -> Optional[WholeItemTiling]:
    """The 4-CTA-an-SM whole-item tiling for one token a request, or None: beside whole_item_tiling's one CTA
    an SM (items ~ SMs), it takes batches of about 4 x SMs equal items, one whole item a CTA, where the
    default kernel's 3 CTAs an SM would split them (B64 x 8 KV heads: 512 items on 396 CTAs, spans of 1.29
    items). As a plain default it lost where items were not whole on it (B48, 384 items, whole on the
    default's 396 CTAs: +7%), hence the band. Measured against the plan without it (docs/perf-notes.md):
    - transposed, groups of 4-8 (one n8 head tile, half of it or more filled; seventy-first session):
      GQA 32/8 B64 L4096 -1.2%, B66 -2.9%, GQA 32/4 B128 L2048 -4.5%; group 3 (seventy-second session:
      24/8 B64 L4096 -2.1%). A group of 4 runs it on the normal pipeline's m16 tile instead (4 of 16 rows;
      seventy-second session, three rounds against the transposed 4-CTA kernel: GQA 32/8 B64 L4096 -0.7%,
      B64 L1024 -1.2%, B66 -0.4%, 7-token pages a tie; GQA 32/4, a group of 8, lost 0.4%), as does a normal
      spec's group of 4 (seventy-third session, against that spec's split plan: B64 L4096 -2.3%, B66 -3.4%,
      B64 L1024 -7.2%);
    - normal, groups of 9-16 (one m16 tile, every query head in one item: the verify step's item shape;
      168 registers, no spills; seventy-second session): GQA 128/8 B64 L4096 -3.9%, 96/8 B66 -4.6%,
      64/4 B128 L2048 -6.0%.
    Measured and left out, items mostly padding rows (seventy-second session, 512 items): MHA B16 L8192 +0.8%,
    L4096 -0.6%, GQA 32/16 B32 L4096 a tie. Not needed at d64 (its default kernel holds 4 CTAs an SM: ~4 x
    SMs items already run whole), nor for fp8 KV (4 CTAs an SM on its default). Not measured, so left out:
    d256, MQA (its m16 tile of 16 heads spills at 168 registers), the normal pipeline's groups of 1-3 and 5-8
    and slopes read at run time."""
    if spec.kv_dtype == "fp8_e4m3" or not _in_measured_scope(spec):
        return None
    g = spec.group_size
    if g == 4:
        return FOUR_CTA_M16_WHOLE_ITEM_TILING
    one_tile = 3 <= g <= 8 if spec.pipeline == "transposed" else 8 < g <= 16
    return FOUR_CTA_WHOLE_ITEM_TILING if one_tile else None


def whole_item_tilings(spec: AttentionSpec, max_q_len: int = 1) -> tuple[WholeItemTiling, ...]:
    """Every whole-item tiling a wrapper may launch beside its default kernel, in the order its plans try
    them: whole_item_tiling's (one CTA an SM), then four_cta_tiling's or, for verify steps,
    verify_four_cta_tiling's (their bands of items per CTA do not overlap: ~1 x SMs and ~4 x SMs)."""
    four = four_cta_tiling(spec) if max_q_len == 1 else verify_four_cta_tiling(spec, max_q_len)
    return tuple(t for t in (whole_item_tiling(spec, max_q_len), four) if t is not None)


def whole_item_tiling(spec: AttentionSpec, max_q_len: int = 1) -> Optional[WholeItemTiling]:
    """The tiling of a one-CTA-per-SM kernel for batches of about one equal item per SM, read whole, or (up to
    `max_chunks`) of equal items each cut into k equal chunks, one a CTA (BatchDecode(whole_items=...)); for
    verify steps (max_q_len > 1), verify_one_cta_tiling's; None where none was measured to win. Every entry
    below: d128, page 16, H200, against the default kernel (three CTAs of four warps an SM, fp8 four) in rotation.

    Whole items (128 equal items on 132 SMs; benchmarks/bench_decode_whole_items.py): transposed GQA 32/8
    B16 L2048 -5.5%, L8192 -2.3%, L65536 -1.4%, HND -2.3%; 32/4 B32 -2.2%; MHA 32/32 B4 -2.1%; normal 32/2
    (one 16-head tile) B64 L4096 -8.2%: no partial states, no merges, one prologue per item. Eight warps
    keep the tile loop fed (four ran 1.7x slower). Score modifiers keep it (soft-cap -2.3%), but see the
    slopes below. fp8 KV lost on eight warps (+18..28%: its widening wants the issue slots of more warps)
    and wins on sixteen (FP8_WHOLE_ITEM_TILING, forty-sixth session: B16 L8192 -6.6%, L4096 -9.1%, L65536
    -5.1%; two 64 KB stages beat three by 1-2%); fp8 groups of 16 (two n8 head tiles, 194 registers: sixteen
    warps held to 128 spill 64 bytes) on eight warps (seventy-fifth session, two rounds against the split plan:
    32/2 B64 L4096 -5.2..-5.4%, 128/8 B16 L8192 -0.3..-0.4%; a group of 12, +0.3%, is left out), also cut into
    equal chunks (seventy-sixth session, against the split plan: 32/2 B1 L131072 (2 x 66) 31.2 -> 30.5 us, -2.2%;
    B4 L32768 (8 x 16) -2.7%; predicted -15..-25%, so the split plan's merge was not what held B1 back).
    Chunked (forty-sixth session, three rounds): fp8 B1 L131072 (8 items x 16 chunks) -3.5%, GQA 8/2 B2 L65536
    (4 x 33) -4.8%, B8 L16384 (64 x 2) -1.8%; normal 32/2 B1 L131072 (2 x 66) **-29%**, B2 L65536 (4 x 33)
    -20%, B4 L32768 (8 x 16) -14%, B8 L16384 -8.6%, B16 L8192 -4.0%, B32 L4096 -1.6%; MQA 32/1 and 64/1 as
    one item of every query head (head_splits 1: the default kernel's 16-head items lost +6..+26% here) B16
    L8192 -2.3% and -13%, B32 L4096 -2.3%, B8 L16384 -3.5%, B4 L32768 (4 x 33) -5.5%, but B2 L65536 (2 x 66)
    +1% and +23%, B1 L131072 (132 chunks) +3%: a split item's merge, one CTA at the kernel's end, grows with
    chunks x heads (MERGED_HEAD_ROWS). With those merges in the second launch (forty-seventh session, three
    rounds against the default kernel, which merges there too): MQA 32/1 B1 L131072 (132 chunks) 40.8 ->
    33.8 us (-17%), B2 L65536 (2 x 66) -10%; 64/1 B1 -20%, B2 -22%, B4 L32768 (4 x 33) -26%
    (max_chunks_merge_launch). fp8 GQA 8/2 B1 L131072 (2 x 66, a merge of 264 rows on the kernel's tail) lost
    +8%. The transposed 16-bit kernel tied chunked (32/8 B1 L131072 -0.9%, B4
    L32768 +0.6%, B8 L16384 +0.3%; 32/4 B16 L8192 +1.0%), so it takes whole items only.
    Left out as measured: several whole items a CTA where items outnumber the SMs (B64 L4096 +4.6%,
    B256 L1024 +8.4%: each item's start drains the pipeline, which three CTAs an SM hide from each
    other); d64 (128-token tiles in six stages: B16 L8192 +6.4%, L2048 a tie). d256 was not measured, nor
    the transposed pipeline's two head tiles with 16-bit KV, nor MQA groups other than 32 and 64 (nor fp8 MQA).
    Nor an affine score hook whose slope is read at run time (ALiBi's per-head slopes): there ptxas held the
    kernel at 128 registers and moved work off the uniform datapath, and ALiBi B16 L8192 took 134.2 us on it
    against 130.2 on the default kernel (plain 126.9 / 130.1; a constant slope 126.5 / 130.0: forty-second
    session, medians of four rounds in one process)."""
    if max_q_len > 1:
        return verify_one_cta_tiling(spec, max_q_len)
    g = spec.group_size
    if not _in_measured_scope(spec):
        return None
    if spec.kv_dtype == "fp8_e4m3":
        # a group of 16: two n8 tiles, equal items read whole, or cut into up to 66 chunks as the 16-bit m16 tile's;
        # also for the normal default (115th session), whose own kernel's whole items were not measured
        if g == 16:
            return replace(FP8_SIXTEEN_ROW_WHOLE_ITEM_TILING, max_chunks=MERGED_HEAD_ROWS // g)
        return FP8_WHOLE_ITEM_TILING if g <= 8 and spec.pipeline == "transposed" else None
    if spec.pipeline == "transposed":
        return WHOLE_ITEM_TILING if g <= 8 else None  # one n8 head tile
    # normal: one m16 head tile that a smaller group would pad, or MQA-sized groups of two or four, every
    # query head in one item (head_splits 1)
    if 8 < g <= 16 or g in (32, 64):
        return replace(WHOLE_ITEM_TILING, max_chunks=MERGED_HEAD_ROWS // max(g, 16),
                       max_chunks_merge_launch=MQA_MERGE_LAUNCH_CHUNKS if g >= 32 else 0)
    return None


def _in_measured_scope(spec: AttentionSpec) -> bool:
    """Decode at d128 with no slope read at run time: where every whole-item band was measured."""
    return spec.family == "decode" and spec.head_dim_qk == 128 and not _slope_read_at_run_time(spec)


def _slope_read_at_run_time(spec: AttentionSpec) -> bool:
    """Whether the spec's score hook is affine in the key position (attnforge/mods/affine.py) with a slope
    that is not a constant (a captured tensor or a runtime scalar)."""
    return graph.reads_runtime_values(getattr(spec.score_mod, "kv_slope_root", None))


def whole_item_kernel(spec: AttentionSpec, max_q_len: int = 1) -> Optional["DecodeKernel"]:
    """The spec's first whole-item kernel (whole_item_tiling; for verify steps of max_q_len tokens,
    verify_one_cta_tiling), or None."""
    t = whole_item_tiling(spec, max_q_len) if spec.family == "decode" else None
    return kernel_for_tiling(spec, t, max_q_len) if t else None


def whole_item_kernels(spec: AttentionSpec, max_q_len: int = 1) -> tuple["DecodeKernel", ...]:
    """The kernels of whole_item_tilings: what BatchDecode may launch beside its default kernel, and what an
    AOT build of the spec builds beside it (presets.modules_for)."""
    if spec.family != "decode":
        return ()
    return tuple(kernel_for_tiling(spec, t, max_q_len) for t in whole_item_tilings(spec, max_q_len))


def kernel_for_tiling(spec: AttentionSpec, t: WholeItemTiling, max_q_len: int = 1) -> "DecodeKernel":
    """The whole-item kernel of tiling `t` for `spec`, on the tiling's pipeline where it names one."""
    # one token: every query head of a KV head in one item (MQA too: its 16-head items lost on this kernel);
    # a verify step: the default head splits (both verify rules take items no head split cut)
    spec = replace(spec, pipeline=t.pipeline) if t.pipeline else spec
    return DecodeKernel(spec, t.tile_kv, t.stages, t.warps, head_splits=1 if max_q_len == 1 else None,
                        max_q_len=max_q_len)


@dataclass(frozen=True)
class DecodeKernel:
    """Launch shape of one decode spec. tile_kv / num_stages override the measured defaults."""

    spec: AttentionSpec
    tile_kv: Optional[int] = None  # None (both): default_tiling(spec)
    stages: Optional[int] = None
    num_warps: Optional[int] = None
    head_splits: Optional[int] = None  # work items per KV head, each of group / head_splits query heads
    # transposed pipeline: independent MMA chains S^T's k steps accumulate into (1, 2 or 4). Two measured
    # -0.1..-0.5% against one on nine decode cases, none slower (H200, twenty-fourth session); four mixed
    qk_chains: int = 2
    # fp8 widened in registers with one 16-token sub-block a warp: each warp copies its own band of each
    # tile and waits for it with __syncwarp instead of a CTA barrier (False: every thread copies across
    # the tile and the loop waits at __syncthreads, the kernel before the twenty-fifth session)
    warp_rows: bool = True
    # query tokens a request at most (a plan's q_len, 1..this): a work item's rows are its heads for each
    # token, token-major (speculative decoding verifies the last token and its drafts in one pass over the KV)
    max_q_len: int = 1
    # rows written as float32, not rounded to the spec's out_dtype: for callers that merge them with other states
    # (CascadeDecode merges its levels and the suffix; a 16-bit row is rounded again by the merge)
    float_out: bool = False
    # fp8 KV on the normal pipeline (d128) widened in registers after ldmatrix, as the transposed pipeline does,
    # instead of by a shared-memory pass into a 16-bit copy of the tile. None: wherever it can (fp8 d128 on the normal
    # pipeline), measured faster at every item size, 4-64 rows (docs/perf-notes.md, suite verify_fp8_widen)
    normal_widen_in_registers: Optional[bool] = None

    def __post_init__(self):
        s = self.spec
        if self.head_splits is None:
            object.__setattr__(self, "head_splits", default_head_splits(s, self.max_q_len))
        hs = self.head_splits
        if not isinstance(hs, int) or isinstance(hs, bool) or hs < 1 or s.group_size % hs:
            raise ValueError(f"DecodeKernel.head_splits: expected a divisor of the group size {s.group_size}, got "
                             f"{self.head_splits!r}; pass None for the default")
        if type(self.float_out) is not bool:
            raise ValueError(f"DecodeKernel.float_out: expected True or False, got {self.float_out!r}")
        ql = self.max_q_len
        if type(ql) is not int or not 1 <= ql <= MAX_Q_LEN:
            raise ValueError(f"DecodeKernel.max_q_len: expected an int in [1, {MAX_Q_LEN}], got {ql!r}")
        if self.normal_widen_in_registers is None:
            object.__setattr__(self, "normal_widen_in_registers", (s.pipeline, s.kv_dtype, s.head_dim_qk) == (
                "normal", "fp8_e4m3", 128))
        if self.item_rows > MAX_ITEM_ROWS:
            raise ValueError(f"DecodeKernel.max_q_len: {ql} tokens x {self.item_heads} query heads a work item is "
                             f"{self.item_rows} rows, past the kernel's {MAX_ITEM_ROWS}; verify fewer tokens at "
                             f"once, or split the group's heads (head_splits)")
        g = self.item_rows
        if self.tile_kv is None or self.num_warps is None:
            tile, warps = default_tiling(s, g) if self.tile_kv is None and self.num_warps is None else (TILE_KV, 4)
            object.__setattr__(self, "tile_kv", tile if self.tile_kv is None else self.tile_kv)
            object.__setattr__(self, "num_warps", warps if self.num_warps is None else self.num_warps)
        if self.tile_kv not in (32, 64, 128, 256):
            raise ValueError(f"DecodeKernel.tile_kv: expected 32, 64, 128 or 256, got {self.tile_kv}; "
                             f"pass None for the measured default")
        if (self.tile_kv == 256 or self.num_warps == 16) and not (
                (self.tile_kv, self.num_warps) == (256, 16) and self.widens_in_registers and s.pipeline == "transposed"
                and s.head_dim_qk == 128):
            raise ValueError(f"DecodeKernel: tile_kv=256 and num_warps=16 go together, for fp8 KV on the transposed "
                             f"pipeline at head_dim 128 (FP8_WHOLE_ITEM_TILING: the only such shape measured and "
                             f"GPU-tested); got tile_kv={self.tile_kv}, num_warps={self.num_warps} for {s.kv_dtype} "
                             f"KV, pipeline {s.pipeline!r}, head_dim {s.head_dim_qk}. Use 32-128-token tiles of "
                             f"2-8 warps, or None for the defaults")
        if self.num_warps not in (2, 4, 8, 16) or self.tile_kv // 16 < self.num_warps // (
                1 if s.pipeline == "transposed" else -(-g // 16)):
            raise ValueError(f"DecodeKernel.num_warps: expected 2, 4, 8 or 16 with at least one 16-token "
                             f"sub-block per warp (tile_kv={self.tile_kv}), got {self.num_warps}; use fewer "
                             f"warps or a longer tile")
        if s.pipeline == "normal" and -(-g // 16) > self.num_warps:
            raise ValueError(f"DecodeKernel.num_warps: the normal pipeline gives each warp one 16-row tile; "
                             f"{g} query rows (heads x tokens) per work item need {-(-g // 16)} warps, got "
                             f"{self.num_warps}. Use more warps or the default.")
        if type(self.warp_rows) is not bool:
            raise ValueError(f"DecodeKernel.warp_rows: expected True or False, got {self.warp_rows!r}")
        if type(self.normal_widen_in_registers) is not bool:
            raise ValueError(f"DecodeKernel.normal_widen_in_registers: expected True or False, got "
                             f"{self.normal_widen_in_registers!r}")
        if self.normal_widen_in_registers and (s.pipeline, s.kv_dtype, s.head_dim_qk) != ("normal", "fp8_e4m3", 128):
            raise ValueError(f"DecodeKernel.normal_widen_in_registers: for fp8 KV on the normal pipeline at head_dim "
                             f"128 (the transposed pipeline always widens fp8 in registers), got {s.kv_dtype} KV, "
                             f"pipeline {s.pipeline!r}, head_dim {s.head_dim_qk}. Leave it False there.")
        if type(self.qk_chains) is not int or self.qk_chains not in (1, 2, 4):
            raise ValueError(f"DecodeKernel.qk_chains: expected 1, 2 or 4, got {self.qk_chains!r}")
        if self.stages is not None and (type(self.stages) is not int or not 2 <= self.stages <= 8):
            raise ValueError(f"DecodeKernel.stages (num_stages): expected an int in 2..8, got {self.stages!r}")
        if self.smem_bytes + SMEM_RESERVED_PER_CTA > SMEM_PER_SM:
            raise ValueError(f"DecodeKernel: {self.smem_bytes} B of shared memory per CTA exceeds the SM's "
                             f"{SMEM_PER_SM - SMEM_RESERVED_PER_CTA} B; use fewer stages or a smaller tile")
        if s.family != "decode":
            raise ValueError(f"DecodeKernel: expected a spec with family='decode', got {s.family!r}")
        if s.pipeline == "transposed" and g > MAX_TRANSPOSED_GROUP:
            where = (f" in {hs} items a KV head" if hs > 1 else "") + (f" x {ql} tokens a request" if ql > 1 else "")
            raise ValueError(f"AttentionSpec.pipeline: 'transposed' supports up to {MAX_TRANSPOSED_GROUP} query rows "
                             f"(heads x tokens) a work item, got {g} ({s.num_qo_heads}/{s.num_kv_heads} heads{where}). "
                             f"Use pipeline='normal' (or 'auto', which picks it there), or head_splits that leave at "
                             f"most {MAX_TRANSPOSED_GROUP} rows an item.")

    @property
    def name(self) -> str:  # (as AttentionSpec.name: what `python -m attnforge build` prints)
        return self.module().name

    @property
    def item_heads(self) -> int:
        """Query heads of one work item: the GQA group, or a 1/head_splits share of it."""
        return self.spec.group_size // self.head_splits

    @property
    def item_rows(self) -> int:
        """Query rows of one work item: its heads for each of max_q_len tokens."""
        return self.item_heads * self.max_q_len

    @property
    def kv_bytes(self) -> int:
        return 1 if self.spec.kv_dtype == "fp8_e4m3" else 2

    @property
    def widens_in_registers(self) -> bool:
        """fp8 KV on the transposed pipeline (or the normal one with normal_widen_in_registers): the kernel widens K
        and V in registers after ldmatrix (templates/batch_decode.cu.jinja, kRegWiden) and needs no 16-bit copy of
        the tile (d64 too since the seventy-fifth session, its 64-byte rows swizzled by pairs: kv_tile.cuh,
        fp8_swizzle)."""
        return self.kv_bytes == 1 and (self.spec.pipeline == "transposed" or self.normal_widen_in_registers)

    @property
    def num_stages(self) -> int:
        if self.stages is not None:
            return self.stages
        # Two stages, measured best (docs/perf-notes.md): 3 CTAs/SM at d128 beat deeper pipelines; fp8
        # widened in registers too: 4 CTAs/SM at d128 (77.4 vs 79.5 us at four stages), 2 at d256 by
        # registers (145.6 vs 218.7 us at four stages, which left shared memory for one)
        return 2

    @cached_property
    def smem_bytes(self) -> int:
        s, d = self.spec, self.spec.head_dim_qk
        head_tile = 8 if s.pipeline == "transposed" else 16
        q_rows = max(16, -(-self.item_rows // head_tile) * head_tile)
        pipe = self.pipe_bytes
        states = self.num_warps if s.pipeline == "transposed" else \
            self.num_warps // -(-self.item_rows // 16)
        merge = states * self.item_rows * (d + 4) * 4  # cross-warp merge scratch reuses the pipeline
        return q_rows * d * 2 + max(pipe, merge)

    @property
    def pipe_bytes(self) -> int:
        """The K/V stages (and fp8's widened tile): the area an item's merge of split chunks reuses."""
        d = self.spec.head_dim_qk
        wide = 2 * self.tile_kv * d * 2 if self.kv_bytes == 1 and not self.widens_in_registers else 0
        return self.num_stages * 2 * self.tile_kv * d * self.kv_bytes + wide

    @cached_property
    def merge_shape(self) -> tuple[int, int]:
        """(vectors a thread, ring slots) of a split item's merge (the template takes both and checks
        that the ring fits): the chunks stream through an even number of slots, at most 32, in the idle
        K/V stages (two halves: one merges while the other fills). A slot holds a pass of the group's
        vectors (4 dims each), up to 4 a thread, fewer where two slots would not fit the stages, and the
        16-byte blocks around the chunk's lse row (MQA's 16-head items at d128: 8 KB and 80 bytes)."""
        g = self.item_rows  # one work item's query rows
        vecs = g * self.spec.head_dim_qk // 4
        for per_thread in (4, 2, 1):
            if per_thread > 1 and vecs < per_thread * self.threads:
                continue  # one pass holds the group with fewer a thread
            slot_bytes = (min(vecs, self.threads * per_thread) + merge_lse_blocks(g)) * 16
            fit = min(32, self.pipe_bytes // slot_bytes)
            if fit >= 2 or per_thread == 1:
                return per_thread, fit - fit % 2
        raise AssertionError("unreachable")

    @cached_property  # (a run reads it; hashing its ~30 fields for params_for's cache cost ~10 us)
    def params(self) -> ParamsLayout:
        return variants.params_for("DecodeParams", BASE_FIELDS, self.spec)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def ctas_per_sm(self) -> int:
        """CTAs the persistent grid puts on an SM: what shared memory holds, capped where registers would
        drop below what the shape needs (registers_needed; d64 fits 6 by shared memory, 4 by registers:
        a grid of 6 per SM ran its last third as a second wave); where the MIN_REGISTERS_PER_THREAD
        floor binds, __launch_bounds__ makes ptxas honour it (register_bound_ctas)."""
        held = -(-(self.smem_bytes + SMEM_STATIC_BYTES) // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT
        by_smem = max(1, SMEM_PER_SM // (held + SMEM_RESERVED_PER_CTA))
        by_regs = max(1, REGISTERS_PER_SM // (self.threads * self.registers_needed))
        return min(by_smem, by_regs)

    @property
    def registers_needed(self) -> int:
        """Registers a thread needs without spilling, by shape (read from the cubins): at d256 up to 255
        (O's 256 dims), with the transposed pipeline's two n8 head tiles (groups 9-16) 200 at d128;
        else the floor the kernels are held to (__launch_bounds__ where it binds)."""
        if self.spec.head_dim_qk > 128:
            return 256
        if self.spec.pipeline == "transposed" and self.item_rows > 8:
            # fp8 widened in registers: held to 168 (3 CTAs an SM, 8 bytes spilled) it ran 3-4.5% faster than at
            # ptxas's 185 (2 CTAs) on verify steps of 4 tokens (GQA 32/8; 128, 4 CTAs, spilled 72 bytes: +8-15%).
            # d64 fits 128 (4 CTAs an SM, no spill: O's dims halve)
            if self.widens_in_registers and self.spec.head_dim_qk == 64:
                return MIN_REGISTERS_PER_THREAD
            return 168 if self.widens_in_registers else 200
        if self.spec.pipeline == "normal" and self.spec.head_dim_qk == 128 and self.item_rows in (5, 7):
            # one m16 tile of 5 or 7 rows: left to itself ptxas takes 212-216 registers (2 CTAs an SM; 1-4, 6 and
            # 8-16 rows fit 168). Held to 168 (3 CTAs, 64-80 bytes spilled), GQA 56/8 ran fp8 B64 L4096 in 229 us
            # against 245 planned for 2 CTAs, bf16 within -1..+3% of that (sixty-ninth session)
            return 168
        if self.spec.pipeline == "normal" and self.spec.head_dim_qk == 128 and self.kv_bytes == 1 \
                and self.item_rows > 16:
            # two m16 tiles of fp8 verify rows (groups 3, 5, 6 at 24-30 rows): left to itself ptxas took 182-183
            # registers where shared memory plans 3 CTAs, so the H100 ran the grid's last third as a second wave
            # (OccupancyWarning in the GPU fuzz, 111th session); held to 168 like the 5- and 7-row tiles above
            return 168
        return MIN_REGISTERS_PER_THREAD

    @property
    def register_bound_ctas(self) -> int:
        """The __launch_bounds__ minimum of CTAs per SM where it binds (MIN_REGISTERS_PER_THREAD or
        fewer per thread at ctas_per_sm) or where a register rule planned the shape, else 0: no bound,
        and ptxas allocates as it did when the defaults were measured (tests/jit/test_build.py checks
        that those still fit)."""
        binds = REGISTERS_PER_SM // (self.threads * self.ctas_per_sm) <= MIN_REGISTERS_PER_THREAD
        # shapes planned by a register rule (registers_needed) are held to the planned CTAs too: left to
        # itself ptxas may aim at more (a d256 fp8 kernel capped itself at 168 registers and spilled)
        return self.ctas_per_sm if binds or self.registers_needed > MIN_REGISTERS_PER_THREAD else 0

    def module(self) -> JitModule:
        s = self.spec
        ctx = {"q_dtype": _CPP[s.q_dtype], "kv_dtype": _CPP[s.kv_dtype],
               "out_dtype": "float" if self.float_out else _CPP[s.out_dtype],
               "head_dim": s.head_dim_qk, "group_size": self.item_heads, "head_splits": self.head_splits,
               "pipeline": s.pipeline,
               "tile_kv": self.tile_kv, "num_stages": self.num_stages, "num_warps": self.num_warps,
               "smem_bytes": self.smem_bytes, "merge_vectors": self.merge_shape[0], "merge_slots": self.merge_shape[1],
               "merge_lse_blocks": merge_lse_blocks(self.item_rows), "max_q_len": self.max_q_len,
               "qk_chains": self.qk_chains, "warp_rows": self.warp_rows,
               "normal_widen_in_registers": self.normal_widen_in_registers,
               "min_ctas_per_sm": self.register_bound_ctas,
               "variant_decl": variants.variant_decl(s),
               "chunk_fixed_cost": scheduler.CHUNK_FIXED_COST, "params_struct": self.params.cpp(), "trace": False,
               "row_merge": self.row_merge}
        # The name omits runtime-only fields (layout, page size): they don't change the code.
        name = "_".join(["decode", f"g{s.group_size}", f"d{s.head_dim_qk}", s.q_dtype,
                         f"kv{_CPP[s.kv_dtype]}", f"out{'f32' if self.float_out else s.out_dtype}", s.pipeline,
                         *(["softcap"] if s.logits_soft_cap > 0 else []),
                         *(["win"] if s.window_left >= 0 else []),
                         *(["mod"] if s.score_mod is not None else []),
                         *([f"hs{self.head_splits}"] if self.head_splits > 1 else []),
                         *([f"qc{self.qk_chains}"] if self.qk_chains != 2 else []),
                         *(["xb"] if not self.warp_rows else []),
                         *(["rw"] if self.normal_widen_in_registers else []),
                         *([f"q{self.max_q_len}"] if self.max_q_len > 1 else []),
                         f"t{self.tile_kv}s{self.num_stages}w{self.num_warps}"])
        names = ("batch_decode_kernel",) + (("batch_decode_merge_kernel",) if self.row_merge else ())
        return JitModule(name, "batch_decode.cu.jinja", ctx, names)

    @property
    def row_merge(self) -> bool:
        """Whether the module has batch_decode_merge_kernel (split items merged by a second launch, one block
        a query head's row, lanes of head_dim / 4 threads: whole warps, or two lanes a warp at d64)."""
        return self.spec.head_dim_vo % 128 == 0 or self.spec.head_dim_vo == 64

    # threads of batch_decode_merge_kernel's block: (dims / 4, 1, lanes), 256 in all
    @property
    def row_merge_block(self) -> tuple[int, int, int]:
        cols = self.spec.head_dim_vo // 4
        return cols, 1, 256 // cols

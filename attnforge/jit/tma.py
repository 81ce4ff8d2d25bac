"""Tensor maps (TMA descriptors) over a paged KV cache or ragged K/V, for the Hopper kernels' copy engine.

A kernel copies one KV tile [tile_kv rows][head_dim] as boxes of [rows][64 dims]: 128 bytes per row,
swizzled by the copy engine exactly like wgmma's sw128 operands (attnforge/wgmma.cuh), so one
instruction replaces rows x 8 cp.async. fp8 tiles (plain_rows: staged as stored, widened after) are
boxes of [rows][head_dim] bytes: swizzled the same way when a row is 128 bytes (head_dim 128: the
staging layout the prefill producer's widening reads without bank conflicts, its Fp8Loader's too), else
unswizzled. A box is a whole page when pages are no longer than a tile, else the tile's share of one
page; ragged K/V [tokens, heads, dim] is one "page" holding every token, so a box is a whole tile.
Whether a tensor qualifies is decided here in plain Python (tested without a GPU); encoding the 128-byte
map needs the driver (cuTensorMapEncodeTiled).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SWIZZLE_COLS = 64  # 16-bit elements per 128-byte swizzled row
MIN_BOX_ROWS = 8  # a box must start 1024-byte aligned in shared memory: 8 swizzled rows of 128 bytes


@dataclass(frozen=True)
class KVBox:
    """How one K (or V) matrix (a paged cache, or ragged K/V as one page) is described to the copy engine.

    dims / strides list the tensor innermost first: (head_dim, heads, tokens, pages) when a token's
    heads are adjacent (NHD), (head_dim, tokens, heads, pages) when a head's tokens are (HND)."""
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]  # bytes, of dims 1..3 (dim 0 is contiguous)
    box: tuple[int, int, int, int]
    rows: int  # KV rows per box
    heads_inner: bool  # NHD: the kernel's coordinates are (dim, head, token, page), else (dim, token, head, page)
    # bytes the L2 fetches around each request of a box row (L2_PROMOTION_SIZES): 256 fetches a 128-byte
    # box row's neighbour too (the other half of a 128-dim head row in prefill)
    l2_promotion: int = 256
    swizzle: bool = True  # 128-byte rows swizzled: 16-bit rows of 64 dims, or fp8 rows of 128; False: plain rows


def paged_kv_box(head_dim: int, num_heads: int, page_size: int, num_pages: int, stride_page: int,
                 stride_token: int, stride_head: int, elem_bytes: int, tile_kv: int,
                 plain_rows: bool = False) -> tuple[Optional[KVBox], str]:
    """(box, "") when TMA can copy this cache's tiles, else (None, why not). Strides in elements.
    plain_rows: one-byte (fp8) K/V as whole rows [rows][head_dim] (a staging ring's layout; swizzled at 128 bytes)."""
    rows = min(page_size, tile_kv)
    if rows < MIN_BOX_ROWS or (tile_kv % page_size if page_size <= tile_kv else page_size % tile_kv):
        return None, (f"page_size {page_size}: pages of >= {MIN_BOX_ROWS} tokens that divide, or are multiples of, "
                      f"the {tile_kv}-token tile")
    return _kv_box(head_dim, num_heads, page_size, num_pages, stride_page, stride_token, stride_head, elem_bytes, rows,
                   plain_rows)


def ragged_kv_box(head_dim: int, num_heads: int, num_tokens: int, stride_token: int, stride_head: int,
                  elem_bytes: int, tile_kv: int, plain_rows: bool = False) -> tuple[Optional[KVBox], str]:
    """Ragged K/V [tokens, heads, dim] (strides in elements) as one page of every token: a box is a
    whole tile; the kernel's token coordinate is the request's first token plus the tile's."""
    if not 0 < num_tokens < 2**32:
        return None, f"1 to 2^32 - 1 tokens, got {num_tokens}"
    # the one page's stride only has to step over the page (its single index is 0), 16-byte aligned
    page = -(-max(num_tokens * stride_token, num_heads * stride_head) // 8) * 8
    return _kv_box(head_dim, num_heads, num_tokens, 1, page, stride_token, stride_head, elem_bytes, tile_kv, plain_rows)


def q_box(head_dim: int, num_heads: int, group: int, tile_q: int, num_tokens: int, stride_token: int,
          stride_head: int, elem_bytes: int) -> tuple[Optional[KVBox], str]:
    """Queries [tokens, Hq, D] (strides in elements) for a prefill CTA's Q tile: tile_q packed rows
    (token, head of the KV head's group), the group's heads innermost, are one box [tile_q / group
    tokens][group heads][64 dims] per 64-column block, which lands row for row in the packed order."""
    if group > 256 or tile_q % group:
        return None, f"a query group that divides the {tile_q}-row tile (got {group})"
    if not 0 < num_tokens < 2**32 or stride_head >= stride_token:
        return None, f"[tokens, heads, dim] queries with heads innermost (strides {stride_token}, {stride_head})"
    page = -(-num_tokens * stride_token // 8) * 8
    box, why = _kv_box(head_dim, num_heads, num_tokens, 1, page, stride_token, stride_head, elem_bytes, tile_q // group)
    if box is None:
        return None, why
    return KVBox(box.dims, box.strides, (SWIZZLE_COLS, group, tile_q // group, 1), tile_q // group, True), ""


def _kv_box(head_dim, num_heads, tokens, pages, stride_page, stride_token, stride_head, elem_bytes, rows,
            plain_rows=False):
    if plain_rows and (elem_bytes != 1 or head_dim % 16 or head_dim > 256):
        return None, (f"plain rows: one-byte K/V, head_dim a multiple of 16 up to 256 (got {elem_bytes}-byte, "
                      f"{head_dim})")
    if not plain_rows and (elem_bytes != 2 or head_dim % SWIZZLE_COLS):
        return None, f"16-bit K/V with head_dim a multiple of {SWIZZLE_COLS} (got {elem_bytes}-byte, {head_dim})"
    heads_inner = stride_head < stride_token
    if heads_inner:
        inner, outer = (num_heads, stride_head), (tokens, stride_token)
    else:
        inner, outer = (tokens, stride_token), (num_heads, stride_head)
    strides = (inner[1] * elem_bytes, outer[1] * elem_bytes, stride_page * elem_bytes)
    extents = (head_dim * elem_bytes, inner[0] * strides[0], outer[0] * strides[1])
    if any(s % 16 for s in strides):
        return None, f"byte strides {strides} that are multiples of 16"
    if any(s < e for s, e in zip(strides, extents)):  # each dimension must step over the one inside it
        return None, f"non-overlapping strides (byte strides {strides} under extents {extents})"
    if pages >= 2**32 or strides[2] >= 2**40:
        return None, f"{pages} pages of {strides[2]} bytes: beyond the copy engine's 2^32 / 2^40 limits"
    cols = head_dim if plain_rows else SWIZZLE_COLS
    box = (cols, 1, rows, 1) if heads_inner else (cols, rows, 1, 1)
    swizzle = not plain_rows or head_dim == 128  # (the swizzle's unit: 128-byte rows)
    return KVBox((head_dim, inner[0], outer[0], pages), strides, box, rows, heads_inner, swizzle=swizzle), ""


L2_PROMOTION_SIZES = (0, 64, 128, 256)  # KVBox.l2_promotion: none, or the driver's L2_64B / 128B / 256B


def encode_args(drv, data_type, address: int, box: KVBox) -> tuple:
    """cuTensorMapEncodeTiled's arguments (cuda-python wants its array elements as cuuint32/64_t)."""
    if box.l2_promotion not in L2_PROMOTION_SIZES:
        raise ValueError(f"KVBox.l2_promotion: expected one of {L2_PROMOTION_SIZES} bytes, got {box.l2_promotion!r}; "
                         f"build the box with dataclasses.replace(box, l2_promotion=128) or another of those")
    u32, u64 = drv.cuuint32_t, drv.cuuint64_t
    promotion = getattr(drv.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" +
                        (f"L2_{box.l2_promotion}B" if box.l2_promotion else "NONE"))
    return (data_type, 4, address, [u64(x) for x in box.dims], [u64(x) for x in box.strides],
            [u32(x) for x in box.box], [u32(1)] * 4, drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(drv.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + ("128B" if box.swizzle else "NONE")), promotion,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


_MAPS: dict = {}  # (pointer, box, dtype) -> the encoded map; a cache's two maps per layer and step
# the driver's element types (fp8 moves as bytes: the copy engine does not convert)
_DATA_TYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16", torch.float8_e4m3fn: "UINT8"}


def encode(tensor: torch.Tensor, box: KVBox) -> bytes:
    """The 128-byte CUtensorMap of `tensor` (a K or V view whose storage starts at data_ptr)."""
    key = (tensor.data_ptr(), box, tensor.dtype)
    if key in _MAPS:
        return _MAPS[key]
    if tensor.dtype not in _DATA_TYPES or tensor.data_ptr() % 16:
        raise ValueError(f"tma.encode: expected a 16-byte aligned bf16/fp16/fp8 e4m3 tensor, got {tensor.dtype} at "
                         f"{tensor.data_ptr():#x}; pass tma=False to copy such K/V with cp.async")
    from .loader import check, driver, ensure_context
    drv = driver()
    ensure_context(tensor.device)  # driver calls need a current context (torch may not have made one yet)
    kind = getattr(drv.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + _DATA_TYPES[tensor.dtype])
    tmap = check(drv.cuTensorMapEncodeTiled(*encode_args(drv, kind, tensor.data_ptr(), box)), "cuTensorMapEncodeTiled")
    raw = b"".join(int(w).to_bytes(8, "little") for w in tmap.opaque)
    if len(_MAPS) >= 256:  # caches come and go (tests, benchmarks): keep the map table small
        _MAPS.clear()
    _MAPS[key] = raw
    return raw

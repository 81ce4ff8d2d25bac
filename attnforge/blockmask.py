"""Block sparsity for mask modifiers: which KV tiles a query tile must visit at all.

A KV tile is skipped when every (query row, key) pair of the tile pair is masked: the mask_mod
(evaluated in torch on the GPU, in chunks), the causal diagonal and the sliding window together,
exactly as the kernel masks elements. This costs a synchronisation at plan() time, like
FlexAttention's create_block_mask, and only happens when the spec has a mask_mod.
"""
from __future__ import annotations

import numpy as np
import torch

MAX_ELEMENTS = 1 << 26  # per evaluated chunk of the mask
FULL_TILE = 1 << 30  # flag on a tile id: every pair in it is visible, so the kernel skips the mask
CAUSAL_TILE = 1 << 29  # flag on a tile id: the mask_mod is kv_idx <= q position there (a document's
# diagonal under a causal document mask), so the kernel compares positions instead of calling it


def uses_input(node, name: str) -> bool:
    if not isinstance(node, tuple):
        return False
    if node[:2] == ("input", name):
        return True
    return any(uses_input(a, name) for a in node[1:])


def visible_tiles(mod, request: int, heads: torch.Tensor, qo_len: int, kv_len: int, tile_q: int, tile_kv: int,
                  causal: bool, window_left: int, device) -> np.ndarray:
    """(visible, full, causal): bool [n_q_tiles, n_kv_tiles] over packed rows (token, head) of one
    request and KV head: some pair of the tile pair is visible / every existing pair is / the
    mask_mod equals kv_idx <= q position on every existing pair."""
    g = len(heads)
    n_qt, n_kt = -(-(qo_len * g) // tile_q), -(-kv_len // tile_kv)
    out = np.zeros((n_qt, n_kt), dtype=bool)
    full = np.ones((n_qt, n_kt), dtype=bool)
    causal_eq = np.ones((n_qt, n_kt), dtype=bool)
    if kv_len == 0 or qo_len == 0:
        return out, full & False, causal_eq & False
    kv_idx = torch.arange(kv_len, device=device)
    rows_per_chunk = max(tile_q, (MAX_ELEMENTS // max(kv_len, 1)) // tile_q * tile_q)
    tokens_per_chunk = max(1, rows_per_chunk // g)
    b = torch.tensor(request, device=device)
    h = heads.to(device)[None, :, None]
    for t0 in range(0, qo_len, tokens_per_chunk):
        t1 = min(qo_len, t0 + tokens_per_chunk)
        pos = torch.arange(t0, t1, device=device) + (kv_len - qo_len)  # end-aligned positions
        keep = mod.torch_mask(b, h, pos[:, None, None], kv_idx[None, None, :]).to(device)
        keep = keep.expand(t1 - t0, g, kv_len)
        is_causal = (keep == (kv_idx[None, None, :] <= pos[:, None, None])).reshape((t1 - t0) * g, kv_len)
        if causal:
            keep = keep & (kv_idx[None, None, :] <= pos[:, None, None])
        if window_left >= 0:
            keep = keep & (kv_idx[None, None, :] >= pos[:, None, None] - window_left)
        rows = keep.reshape((t1 - t0) * g, kv_len)  # packed row = token * G + head
        # pad to whole tiles (a chunk may start inside a query tile): padding is neither visible
        # nor a reason for a tile not to be full
        first_tile, offset = divmod(t0 * g, tile_q)
        pad = (0, (-kv_len) % tile_kv, offset, (-(offset + rows.shape[0])) % tile_q)
        shape = (-1, tile_q, n_kt, tile_kv)
        vis = torch.nn.functional.pad(rows, pad, value=False).view(shape).any(dim=3).any(dim=1).cpu().numpy()
        all_ = torch.nn.functional.pad(rows, pad, value=True).view(shape).all(dim=3).all(dim=1).cpu().numpy()
        eq = torch.nn.functional.pad(is_causal, pad, value=True).view(shape).all(dim=3).all(dim=1).cpu().numpy()
        out[first_tile:first_tile + len(vis)] |= vis
        full[first_tile:first_tile + len(all_)] &= all_
        causal_eq[first_tile:first_tile + len(eq)] &= eq
    return out, full & out, causal_eq & out & ~full


def tile_lists(mod, spec, qo_len: np.ndarray, kv_len: np.ndarray, work: np.ndarray, tile_q: int, tile_kv: int,
               device) -> tuple[np.ndarray, np.ndarray]:
    """CSR (indptr [n_work + 1], kv tile ids) of the tiles each work item (request, kv_head, row0) visits;
    ids of full tiles carry FULL_TILE, of tiles where the mod is plain causal CAUSAL_TILE."""
    per_head = uses_input(mod.mask_root, "h")
    g = spec.group_size
    cache: dict = {}
    counts, ids = [], []
    for r, kvh, row0 in work.tolist():
        key = (r, kvh if per_head else 0)
        if key not in cache:
            heads = torch.arange(g) + (kvh * g if per_head else 0)
            cache[key] = visible_tiles(mod, r, heads, int(qo_len[r]), int(kv_len[r]), tile_q, tile_kv, spec.causal,
                                       spec.window_left, device)
        vis, full, causal_eq = cache[key]
        tiles = np.flatnonzero(vis[row0 // tile_q]) if vis.size else np.zeros(0, dtype=np.int64)
        if len(tiles):
            row = row0 // tile_q
            tiles = tiles | np.where(full[row][tiles], FULL_TILE, np.where(causal_eq[row][tiles], CAUSAL_TILE, 0))
        counts.append(len(tiles))
        ids.append(tiles)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))


def item_costs(indptr: np.ndarray, tile_kv: int) -> np.ndarray:
    """Each work item's cost in KV tokens (its visited tiles x tile_kv): the unit of
    scheduler.prefill_work's costs, to which the planner adds a fixed cost per item in tokens too."""
    return np.diff(indptr) * tile_kv

"""Block-sparse tile lists (CPU): a tile pair is kept iff some element in it is visible."""
import numpy as np
import pytest
import torch

import attnforge.mods as m
from attnforge import AttentionSpec, blockmask, scheduler


def brute(mod, request, heads, qo_len, kv_len, tq, tk, causal, window):
    g = len(heads)
    keep = np.zeros((qo_len * g, kv_len), dtype=bool)
    for t in range(qo_len):
        pos = t + kv_len - qo_len
        for gi, h in enumerate(heads.tolist()):
            for kv in range(kv_len):
                ok = bool(mod.torch_mask(torch.tensor(request), torch.tensor(h), torch.tensor(pos), torch.tensor(kv)))
                ok &= (not causal) or kv <= pos
                ok &= window < 0 or kv >= pos - window
                keep[t * g + gi, kv] = ok
    n_qt, n_kt = -(-(qo_len * g) // tq), -(-kv_len // tk)
    vis, full, causal_eq = (np.zeros((n_qt, n_kt), dtype=bool) for _ in range(3))
    for i in range(n_qt):
        for j in range(n_kt):
            block = keep[i * tq:(i + 1) * tq, j * tk:(j + 1) * tk]
            vis[i, j], full[i, j] = block.any(), block.all()
            # CAUSAL: on every existing pair the mod alone says exactly "kv <= position"
            pairs = [(t, gi, kv) for t in range(qo_len) for gi in range(g) for kv in range(kv_len)
                     if i * tq <= t * g + gi < (i + 1) * tq and j * tk <= kv < (j + 1) * tk]
            causal_eq[i, j] = vis[i, j] and not full[i, j] and all(
                bool(mod.torch_mask(torch.tensor(request), torch.tensor(heads[gi].item()),
                                    torch.tensor(t + kv_len - qo_len), torch.tensor(kv)))
                == (kv <= t + kv_len - qo_len) for t, gi, kv in pairs)
    return vis, full, causal_eq


@pytest.mark.parametrize("causal,window", [(False, -1), (True, -1), (True, 5)])
@pytest.mark.parametrize("max_elements", [1 << 26, 50])  # 50: many chunks, starting inside tiles
def test_visible_tiles_match_brute_force(causal, window, max_elements, monkeypatch):
    monkeypatch.setattr(blockmask, "MAX_ELEMENTS", max_elements)
    docs = torch.tensor([[0] * 9 + [1] * 14 + [2] * 7])
    per_head = m.compile_mod(mask_mod=lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) | (h == 1))
    flagged = {}
    for name, mod in (("document", m.document_mask(docs, causal=False)), ("document causal", m.document_mask(docs)),
                      ("per head", per_head)):
        heads = torch.arange(2)
        got = blockmask.visible_tiles(mod, 0, heads, 11, 30, 4, 8, causal, window, "cpu")
        want = brute(mod, 0, heads, 11, 30, 4, 8, causal, window)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), name
        flagged[name] = int(got[2].sum())
    assert flagged["document causal"] > 0  # its documents' diagonal tiles are plain causal


def test_tile_lists_follow_work_items():
    docs = torch.arange(256)[None] // 64
    mod = m.document_mask(docs)
    spec = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=8, score_mod=mod)
    work = np.array([[0, h, t * 64] for h in range(2) for t in range(4)])
    indptr, tiles = blockmask.tile_lists(mod, spec, np.array([256]), np.array([256]), work, 64, 64, "cpu")
    # causal within 4 equal documents of one tile each: query tile t sees exactly kv tile t, partly,
    # and there the document mask is plain causal: the kernel compares positions, no mod call
    assert np.diff(indptr).tolist() == [1] * 8
    assert tiles.tolist() == [t | blockmask.CAUSAL_TILE for t in (0, 1, 2, 3)] * 2
    mod2 = m.document_mask(docs, causal=False)  # whole-document tiles are full: no mask in the kernel
    spec2 = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=8, score_mod=mod2)
    _, tiles2 = blockmask.tile_lists(mod2, spec2, np.array([256]), np.array([256]), work, 64, 64, "cpu")
    assert tiles2.tolist() == [t | blockmask.FULL_TILE for t in (0, 1, 2, 3)] * 2
    assert not blockmask.uses_input(mod.mask_root, "h") and blockmask.uses_input(mod.mask_root, "q_idx")


def test_item_costs_count_kv_tokens_like_the_causal_planner():
    # The persistent balance adds a per-item fixed cost in tokens: the masked items' costs must be in
    # tokens too (counted in tiles, 1-16 against a fixed 256, the balance all but ignored the work)
    L, n_docs, tile_q, tile_kv, g = 512, 4, 64, 64, 2
    docs = torch.arange(L)[None] // (L // n_docs)
    mod = m.document_mask(docs)
    spec = AttentionSpec(family="prefill", num_qo_heads=2, num_kv_heads=1, score_mod=mod)
    work, _ = scheduler.prefill_work(np.array([L]), np.array([L]), g, 1, tile_q, False)
    indptr, _ = blockmask.tile_lists(mod, spec, np.array([L]), np.array([L]), work, tile_q, tile_kv, "cpu")
    doc_len = L // n_docs
    _, ragged_cost = scheduler.prefill_work(np.full(n_docs, doc_len), np.full(n_docs, doc_len), g, 1, tile_q, True)
    # the same items (documents are whole query tiles here), the ragged costs rounded up to whole tiles
    assert blockmask.item_costs(indptr, tile_kv).tolist() == (-(-ragged_cost // tile_kv) * tile_kv).tolist()


def full_grid(mod, request, heads, qo_len, kv_len, tq, tk, causal, window):
    """brute()'s tiles from the whole [rows, keys] grid evaluated at once (packed row = token * G + head)."""
    g = len(heads)
    pos = torch.arange(qo_len)[:, None, None] + (kv_len - qo_len)
    kv = torch.arange(kv_len)[None, None, :]
    own = mod.torch_mask(torch.tensor(request), heads[None, :, None], pos, kv).expand(qo_len, g, kv_len)
    keep = own & ((kv <= pos) if causal else True) & ((kv >= pos - window) if window >= 0 else True)
    keep, own = keep.reshape(qo_len * g, kv_len).numpy(), own.reshape(qo_len * g, kv_len).numpy()
    diag = np.broadcast_to((kv <= pos).numpy(), (qo_len, g, kv_len)).reshape(qo_len * g, kv_len)
    n_qt, n_kt = -(-(qo_len * g) // tq), -(-kv_len // tk)
    vis, full, causal_eq = (np.zeros((n_qt, n_kt), dtype=bool) for _ in range(3))
    for i in range(n_qt):
        for j in range(n_kt):
            tile = (slice(i * tq, (i + 1) * tq), slice(j * tk, (j + 1) * tk))
            vis[i, j], full[i, j] = keep[tile].any(), keep[tile].all()
            causal_eq[i, j] = vis[i, j] and not full[i, j] and (own[tile] == diag[tile]).all()
    return vis, full, causal_eq


@pytest.mark.parametrize("seed", range(3))
def test_visible_tiles_of_random_masks_match_the_whole_grid(seed, monkeypatch):
    """Random mask_mods (tests/mods/random_exprs.py) over random lengths, groups, tile sizes, causal and window
    settings and chunk sizes (chunks starting inside tiles): the chunked tile flags equal the whole grid's."""
    from mods.random_exprs import draw
    rng = np.random.default_rng(seed)
    for fn, _ in draw(900 + seed, 6, mask=True):
        mod = m.compile_mod(mask_mod=fn)
        g, qo_len = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        kv_len = qo_len + int(rng.integers(0, 60))
        tq, tk = int(rng.choice([4, 16, 64])), int(rng.choice([8, 16, 64]))
        causal, window = bool(rng.integers(0, 2)), int(rng.choice([-1, -1, 3, 20]))
        monkeypatch.setattr(blockmask, "MAX_ELEMENTS", int(rng.choice([1 << 26, 37, 200])))
        heads = torch.arange(g) + int(rng.integers(0, 2)) * g
        got = blockmask.visible_tiles(mod, 1, heads, qo_len, kv_len, tq, tk, causal, window, "cpu")
        want = full_grid(mod, 1, heads, qo_len, kv_len, tq, tk, causal, window)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (fn.source, g, qo_len, kv_len, tq, tk)

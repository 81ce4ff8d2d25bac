"""Where MLA decode's time goes (debug): the kernel built with trace=True stamps SM cycles per CTA and
work item (thread 0; template mla_decode), and this script prints, per case, the CTAs' start and exit
spread in %globaltimer ns, each CTA's wait for the prior grid, and per-item phases in cycles: prologue
(Q staged, the first tiles issued), tiles (and per tile), finish (rows' LSE and factors) and write
(output or partial state), plus each CTA's time between its last item and its exit; for the roles
schedule (h32-h128) also each tile's hand-offs between the two warpgroups (summarize_tiles).

Why: the 64-row kernel's time fitted F + r * span with F ~ 60 us a CTA (twenty-sixth session); this
trace found F in the output write (~37 us an item) and the query copy (~12 us), both fixed in the
twenty-seventh. What is left at h128 is the tile loop (~3700 cycles a tile against ~2200 of tensor
work): the per-tile hand-offs say which warpgroup's chain sets the period.

    python benchmarks/trace_mla.py [--json out.json] [--fields tma=True,...] [--pdl | --no-pdl] [--chained]
                                   ["h128 B64 L8192" ...]

--fields traces a kernel twin (MLADecodeKernel fields, as the bench's twin rows take them); --pdl /
--no-pdl override BatchMLADecode's launch default; --chained times two calls back to back, so the traced
call starts after the first one's merge (as in the bench's graphs, where PDL overlaps them), and reports
how far apart the two CTAs of each side-by-side pair started (`pair_entry_gap_ns`).
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnforge import AttentionSpec, BatchMLADecode  # noqa: E402
from attnforge.kernels import mla as kmla  # noqa: E402
from bench_mla import PAGE, inputs  # noqa: E402
from harness import kernel_fields  # noqa: E402
from trace_capture import build_traced, capture, save_json_if_asked  # noqa: E402

ITEMS = 32  # trace slots per CTA (the template's); slot 31 holds the CTA's entry, wait and exit
DEFAULT_CASES = ["h128 B16 L65536", "h128 B64 L8192", "h128 B128 L4096", "h128 B1 L131072", "h16 B16 L65536",
                 "h16 B64 L8192"]


def summarize(t: np.ndarray, kernel_ms: float) -> dict:
    """The phases of a trace: t [CTAs, ITEMS, 8] int64 as the template writes it."""
    entry = t[:, ITEMS - 1, 7]
    ctas = np.nonzero(entry)[0]
    t = t[ctas]
    entry, waited = t[:, ITEMS - 1, 7], t[:, ITEMS - 1, 4]
    items = t[:, :ITEMS - 1]
    used = items[:, :, 0] > 0
    meta = items[:, :, 5]
    tiles, partial = meta & 0xFFFF, (meta >> 17) & 1
    e = items[:, :, :5]
    ph = {"prologue": e[:, :, 1] - e[:, :, 0], "tiles": e[:, :, 2] - e[:, :, 1], "finish": e[:, :, 3] - e[:, :, 2],
          "write": e[:, :, 4] - e[:, :, 3],
          # the write's parts where the kernel stamps them (the staged wgmma output): staging the accumulators,
          # the row stores' issue, the closing barrier
          **{k: np.where(items[:, :, 6] > 0, v, 0) for k, v in (
              ("write_stage", items[:, :, 6] - e[:, :, 3]), ("write_store", items[:, :, 7] - items[:, :, 6]),
              ("write_sync", e[:, :, 4] - items[:, :, 7]))}}
    with_tiles = used & (tiles > 0)
    per_tile = ph["tiles"][with_tiles] / tiles[with_tiles]
    first = np.where(used[:, 0], e[:, 0, 0] - entry, 0)
    last_end = np.where(used, e[:, :, 4], 0).max(axis=1)
    g_entry, g_exit = t[:, ITEMS - 1, 6], t[:, ITEMS - 1, 5]  # %globaltimer (ns), comparable across SMs
    span_ns = np.maximum(g_exit - g_entry, 1)
    busy = used.any(axis=1)
    ghz = (last_end - entry)[busy] / span_ns[busy]  # cycles a ns over each busy CTA's own life
    # Exits after the first entry by how many busy CTAs shared the SM: a wide exit spread is benign when
    # only SMs holding one busy CTA (of two) finish early, imbalance when CTAs of fully shared SMs spread
    smid = np.where(used[:, 0], meta[:, 0] >> 32, -1)
    sharing = np.bincount(smid[busy])[smid] if busy.any() else np.zeros_like(smid)
    exit_ns = g_exit - g_entry.min()
    by_sharing = {str(k): [float(np.percentile(exit_ns[busy & (sharing == k)], q)) for q in (0, 50, 90, 100)]
                  for k in np.unique(sharing[busy])}
    return {"kernel_ms": kernel_ms, "ctas": int(len(ctas)), "busy_ctas": int(busy.sum()), "items": int(used.sum()),
            "split_items": int((partial[used] > 0).sum()), "tiles_mean": float(tiles[used].mean()) if used.any() else 0.0,
            "wait_cycles_median": float(np.median(waited - entry)),
            "entry_to_first_item_median": float(np.median(first[busy])) if busy.any() else 0.0,
            "phase_mean_cycles": {k: float(v[used].mean()) if used.any() else 0.0 for k, v in ph.items()},
            "tile_median_cycles": float(np.median(per_tile)) if len(per_tile) else None,
            "est_ghz_median": float(np.median(ghz)) if len(ghz) else None,
            "global_ns": {"entry_spread": float(g_entry.max() - g_entry.min()),
                          "exit_spread": float(g_exit[busy].max() - g_exit[busy].min()) if busy.any() else 0.0,
                          "first_entry_to_last_exit": float(g_exit.max() - g_entry.min()),
                          # {busy CTAs on the SM: [min, median, p90, max] exit ns after the first entry}
                          "exit_by_busy_ctas_on_sm": by_sharing}}


TILES = 64  # tile slots per CTA in af_tile_trace (the roles schedule's per-tile hand-offs)


def summarize_tiles(tt: np.ndarray) -> dict:
    """Median SM cycles of the roles schedule's per-tile steps, from af_tile_trace [CTAs, TILES, 8] as
    the template writes it (warpgroup 0: 0 S issued, 1 S done, 2 P published, 3 its P.V done;
    warpgroup 1: 4 waiting for P, 5 P ready, 6 its P.V done and tile t + 2's first part issued, 7 its
    second part issued).
    `period` is tile t to t + 1 on warpgroup 0; `wg0_waits_tile` the gap from its P.V(t) to S(t + 1)."""
    full = (tt > 0).all(axis=2)  # tiles both warpgroups stamped
    nxt = full[:, :-1] & full[:, 1:]  # and the tile after them too
    if not nxt.any():
        return {}
    a, b = tt[:, :-1][nxt], tt[:, 1:][nxt]  # [n, 8] stamps of tile t and of tile t + 1
    steps = {"period": b[:, 0] - a[:, 0], "wg0_S": a[:, 1] - a[:, 0], "wg0_softmax_P": a[:, 2] - a[:, 1],
             "wg0_PV": a[:, 3] - a[:, 2], "wg0_waits_tile": b[:, 0] - a[:, 3],
             "wg1_waits_P": a[:, 5] - a[:, 4], "wg1_PV": a[:, 6] - a[:, 5], "wg1_copies": a[:, 7] - a[:, 6],
             "wg1_to_next": b[:, 4] - a[:, 7], "P_handoff": a[:, 5] - a[:, 2]}
    return {"tiles": int(nxt.sum()), "median_cycles": {k: float(np.median(v)) for k, v in steps.items()}}


def summarize_transposed_tiles(tt: np.ndarray) -> dict:
    """Median SM cycles of the early-scores transposed kernel's tiles, from af_tile_trace [CTAs, TILES, 8]
    (0 the computing warpgroup takes tile t, 1 its P.V(t) done; 4 the copier has tile t's stage back,
    5 tile t issued): the period by the tile's place in its item (the first tiles carry the pipeline's
    fill), the compute, the wait for the next tile, and a refill's issue-to-use time."""
    took, done, back, issued = tt[:, :, 0], tt[:, :, 1], tt[:, :, 4], tt[:, :, 5]
    n = (took > 0).sum(axis=1)  # tiles of each CTA's last item (its stamps overwrite earlier items')
    if not n.any():
        return {}
    res = {"tiles_per_cta_median": float(np.median(n[n > 0]))}
    for name, lo, hi in (("period_t0_t1", 0, 1), ("period_t1_t2", 1, 2), ("period_t2_t3", 2, 3), ("period_t3_t4", 3, 4)):
        ok = n > hi
        if ok.any():
            res[name] = float(np.median(took[ok, hi] - took[ok, lo]))
    mid = [(c, k) for c in range(len(n)) for k in range(4, n[c] - 2)]
    if mid:
        c, k = np.array(mid).T
        res["period_steady"] = float(np.median(took[c, k + 1] - took[c, k]))
        res["compute_steady"] = float(np.median(done[c, k] - took[c, k]))
        res["wait_next_steady"] = float(np.median(took[c, k + 1] - done[c, k]))
        late = issued[c, k] > 0
        if late.any():
            res["issue_to_use_steady"] = float(np.median(took[c, k][late] - issued[c, k][late]))
            res["copier_issue"] = float(np.median(issued[c, k][late] - back[c, k][late]))
    last = [(c, n[c] - 1) for c in range(len(n)) if n[c] > 1]
    if last:
        c, k = np.array(last).T
        res["last_tile_compute"] = float(np.median(done[c, k] - took[c, k]))
    return res


def pair_entry_gaps(t: np.ndarray, side_blocks: int) -> dict:
    """How far apart (%globaltimer ns) the CTAs of each side-by-side group started: CTA c runs side
    c % side_blocks of virtual CTA c / side_blocks (templates/mla_decode.cu.jinja). {} with one side."""
    if side_blocks < 2:
        return {}
    entry = t[:, ITEMS - 1, 6]
    n = len(entry) // side_blocks * side_blocks
    groups = entry[:n].reshape(-1, side_blocks)
    groups = groups[(groups > 0).all(axis=1)]
    if not len(groups):
        return {}
    gap = groups.max(axis=1) - groups.min(axis=1)
    return {"groups": int(len(gap)), **{f"p{q}": float(np.percentile(gap, q)) for q in (50, 90, 100)}}


def option(flag: str):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None


def trace_case(name: str) -> dict:
    heads, batch, length = int(name.split()[0][1:]), int(name.split()[1][1:]), int(name.split()[2][1:])
    q_nope, q_pe, kv, indptr, indices, last = inputs(heads, batch, length)
    spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    pdl = True if "--pdl" in sys.argv else False if "--no-pdl" in sys.argv else None
    w = BatchMLADecode(spec, max_batch_size=max(256, batch), kernel_fields=kernel_fields(option("--fields") or ""),
                       pdl=pdl)
    w.plan(indptr, indices, last, page_size=PAGE)
    out = torch.empty_like(q_nope)

    def run():
        w.run(q_nope, q_pe, kv[..., :512], kv[..., 512:], out=out)
    calls = 2 if "--chained" in sys.argv else 1  # the stamps are the last call's (each overwrites them)
    hosts, ms = capture(w, lambda: [run() for _ in range(calls)], ("af_trace", "af_tile_trace"))
    t = hosts["af_trace"].reshape(-1, ITEMS, 8).astype(np.int64)
    res = {"case": name, "kernel": w.kernel.module().name, "pdl": w.pdl, "calls_timed": calls,
           **summarize(t, ms), "pair_entry_gap_ns": pair_entry_gaps(t, w.kernel.side_blocks(w.kernel.row_blocks(1))),
           "roles_tiles": summarize_tiles(hosts["af_tile_trace"].reshape(-1, TILES, 8).astype(np.int64)),
           "transposed_tiles": summarize_transposed_tiles(hosts["af_tile_trace"].reshape(-1, TILES, 8).astype(np.int64))
           if w.kernel.uses_early_scores else {}}
    print(res, flush=True)
    return res


if __name__ == "__main__":
    build_traced(kmla.MLADecodeKernel)
    names = [a for a in sys.argv[1:] if a.startswith("h") and a[1:2].isdigit()] or DEFAULT_CASES
    save_json_if_asked([trace_case(n) for n in names])

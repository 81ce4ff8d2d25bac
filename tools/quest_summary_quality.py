"""How much attention mass Quest's page selection keeps with coarser page summaries (CPU, torch).

Quest keeps per page and KV head the elementwise min / max of the keys and ranks pages by the bound
sum_i max(q_i min_i, q_i max_i). Narrower summaries read fewer bytes (the scoring kernel is at its
reads' floor, docs/perf-notes.md), but a coarser bound ranks pages worse. This measures, on
synthetic keys with per-channel scales, a few outlier channels and a content drift from page to
page (so key magnitudes differ between pages), the share of the exact attention mass (softmax over
all tokens, summed over a request's query heads) that the top-k pages of each summary format hold,
against the exact top-k by mass.

    python tools/quest_summary_quality.py [--pages 4096] [--budget 256] [--seeds 4] [--drift 0.2]
"""
from __future__ import annotations

import argparse

import torch

from attnforge.sparse.summaries import fp8_outward, int4_codes, int4_outward

PAGE, HKV, GROUP, D = 16, 8, 4, 128


def synthetic(pages: int, seed: int, drift_step: float = 0.2):
    """Keys [pages, PAGE, HKV, D] with lognormal channel scales, 4 outlier channels per head (x8),
    channel offsets, and slowly drifting content (neighbouring pages alike); queries [HKV*GROUP, D]
    correlated with a few planted 'relevant' pages."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.5 * torch.randn(HKV, D, generator=g))
    scale[:, torch.randperm(D, generator=g)[:4]] *= 8.0
    offset = 0.5 * torch.randn(HKV, D, generator=g) * scale
    drift = torch.cumsum(drift_step * torch.randn(pages, 1, HKV, D, generator=g), dim=0)
    k = (torch.randn(pages, PAGE, HKV, D, generator=g) + drift) * scale + offset
    q = torch.randn(HKV, GROUP, D, generator=g) / scale[:, None, :]  # queries in the keys' dual scale
    relevant = torch.randperm(pages, generator=g)[:8]
    k[relevant, 3] += 3.0 * q.mean(dim=1) * scale ** 2  # a key per planted page aligned with the group
    return k, q.reshape(HKV * GROUP, D)


def page_mass(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact attention mass per page [pages], summed over query heads (each head's softmax sums to 1)."""
    pages = k.shape[0]
    kh = k.permute(2, 0, 1, 3).reshape(HKV, pages * PAGE, D)  # [HKV, T, D]
    s = torch.einsum("hgd,htd->hgt", q.view(HKV, GROUP, D).double(), kh.double()) / D ** 0.5
    p = torch.softmax(s, dim=-1)
    return p.sum(dim=(0, 1)).view(pages, PAGE).sum(dim=1)


def bound(lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Quest's page score [pages] from summaries lo / hi [pages, HKV, D] (float)."""
    qg = q.view(HKV, GROUP, D).double()[None]  # [1, HKV, G, D]
    lo, hi = lo.double()[:, :, None, :], hi.double()[:, :, None, :]
    return torch.maximum(qg * lo, qg * hi).sum(dim=(1, 2, 3))


def int4_bounds(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor):
    """The library's int4 summaries (codes rounded outward, clamped to [-8, 7]) in key units."""
    return tuple(int4_codes(int4_outward(t, scale, up)) * scale for t, up in ((lo, False), (hi, True)))


def formats(k: torch.Tensor):
    lo, hi = k.amin(dim=1), k.amax(dim=1)  # [pages, HKV, D]
    out = {"exact": (lo, hi), "bf16": (lo.bfloat16().float(), hi.bfloat16().float())}
    s8 = float(torch.maximum(lo.abs().max(), hi.abs().max())) / 448
    # the default: rounded outward, so the bound holds; the error grows with |key| (3 mantissa bits)
    out["fp8, outward"] = (fp8_outward(lo, s8, up=False).float() * s8, fp8_outward(hi, s8, up=True).float() * s8)
    out["fp8, nearest"] = ((lo / s8).to(torch.float8_e4m3fn).float() * s8, (hi / s8).to(torch.float8_e4m3fn).float() * s8)
    per_channel = torch.maximum(lo.abs(), hi.abs()).amax(dim=0, keepdim=True) / 7  # [1, HKV, D], cache-wide
    out["int4 (per-channel scale), outward"] = int4_bounds(lo, hi, per_channel)
    per_page = torch.maximum(lo.abs(), hi.abs()).amax(dim=2, keepdim=True) / 7  # [pages, HKV, 1]
    out["int4 (per page-head scale)"] = int4_bounds(lo, hi, per_page)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--drift", type=float, default=0.2, help="per-page step of the keys' random-walk drift")
    args = ap.parse_args()
    kept: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        k, q = synthetic(args.pages, seed, args.drift)
        mass = page_mass(k, q)
        total = float(mass.sum())
        best = set(torch.topk(mass, args.budget).indices.tolist())
        kept.setdefault("oracle (top pages by mass)", []).append(float(mass[list(best)].sum()) / total)
        for name, (lo, hi) in formats(k).items():
            top = torch.topk(bound(lo, hi, q), args.budget).indices
            kept.setdefault(name, []).append(float(mass[top].sum()) / total)
    print(f"{args.pages} pages of {PAGE}, budget {args.budget} pages, GQA {HKV * GROUP}/{HKV}, D {D}, drift "
          f"{args.drift}, {args.seeds} seeds: attention mass kept (mean, min)")
    for name, v in kept.items():
        print(f"  {name:48s} {sum(v) / len(v):.4f}  {min(v):.4f}")


if __name__ == "__main__":
    main()

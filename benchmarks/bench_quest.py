"""Suite `quest`: Quest sparse decode end to end (scoring kernel + top-k + decode over the chosen
pages, one CUDA graph) against our dense decode over the same cache. B16, context 65536, page 16,
budget 4096 tokens, d128 bf16. Row `attnforge` keeps int4 page summaries with per-channel scales
(1/64 of the KV bytes, rounded outward so the score stays an upper bound; since the fourteenth
session), `attnforge-fp8` fp8 e4m3 ones (1/32, one scale), `attnforge-bf16-summaries` bf16 (1/16);
`-scoring` rows time the scoring kernel alone, `attnforge-select` the top-k kernel alone and
`attnforge-subset-decode` the decode over the selected pages alone (both as the fp8 path runs them).

ATTNFORGE_BENCH_QUEST_HEADS="32/8" runs one case (A/B calls).

GB/s counts the bytes each path must read: dense = all K and V; Quest = the summaries of every page
plus K and V of the selected pages.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode
from attnforge.sparse import QuestDecode, QuestIndex, channel_scales
from harness import Report, time_us

B, L, PAGE, BUDGET, D = 16, 65536, 16, 4096, 128


def case_inputs(hq: int, hkv: int, device="cuda"):
    """A case's cache [pages, 2, PAGE, hkv, D] (randn, pages in random order), its CSR page table,
    each page's key extremes and the queries: (cache, indptr, indices, last, kmin, kmax, q)."""
    pages = B * L // PAGE
    cache = torch.empty(pages, 2, PAGE, hkv, D, device=device, dtype=torch.bfloat16).normal_()
    indices = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).numpy().astype(np.int32)
    indptr = (np.arange(B + 1) * (L // PAGE)).astype(np.int32)
    last = np.full(B, PAGE, dtype=np.int32)
    kmin, kmax = cache[:, 0].amin(dim=1), cache[:, 0].amax(dim=1)
    q = torch.randn(B, hq, D, device=device, dtype=torch.bfloat16)
    return cache, indptr, indices, last, kmin, kmax, q


def int4_case(argv) -> tuple:
    """The default row's case for the debug scripts (`--heads 32/8` in argv, the default): its spec,
    int4 index (per-channel scales), cache, page table and queries."""
    heads = argv[argv.index("--heads") + 1] if "--heads" in argv else "32/8"
    hq, hkv = (int(x) for x in heads.split("/"))
    cache, indptr, indices, last, kmin, kmax, q = case_inputs(hq, hkv)
    index = QuestIndex(B * L // PAGE, hkv, D, device="cuda", dtype="int4", scale=channel_scales(cache[:, 0], "int4"))
    index.assign(kmin, kmax)
    spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D)
    return spec, index, cache, indptr, indices, last, q


def planned_quest(spec, index, indptr, indices, last, **kw) -> QuestDecode:
    """The suite's QuestDecode (graph mode, sized for the case) planned for the case's page table."""
    quest = QuestDecode(spec, index, budget_tokens=BUDGET, page_size=PAGE, max_batch_size=B, max_num_pages=B * L // PAGE,
                        max_pages_per_request=L // PAGE, use_cuda_graph=True, **kw)
    quest.plan(indptr, indices, last)
    return quest


def head_layouts() -> list[tuple[int, int]]:
    """(Hq, Hkv) of the suite's cases; ATTNFORGE_BENCH_QUEST_HEADS="32/8" keeps a subset (A/B calls)."""
    keep = os.environ.get("ATTNFORGE_BENCH_QUEST_HEADS")
    return [(hq, hkv) for hq, hkv in ((32, 32), (32, 8)) if not keep or f"{hq}/{hkv}" in keep.split(",")]


def run(report: Report, peers: bool = True) -> None:
    for hq, hkv in head_layouts():
        case = f"h{hq}/{hkv} B{B} L{L} budget{BUDGET}"
        pages = B * L // PAGE
        cache, indptr, indices, last, kmin, kmax, q = case_inputs(hq, hkv)
        index = QuestIndex(pages, hkv, D, device="cuda", dtype=torch.bfloat16)
        index.assign(kmin, kmax)
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D)
        kv_bytes = pages * PAGE * hkv * D * 2 * 2
        dense = BatchDecode(spec)
        dense.plan(indptr, indices, last, page_size=PAGE)
        out = torch.empty_like(q)
        report.add("quest", case, "attnforge-dense", time_us(lambda: dense.run(q, cache, out=out)), kv_bytes)
        quest = planned_quest(spec, index, indptr, indices, last)
        sparse_bytes = index.kmin.numel() * 2 * 2 + kv_bytes * BUDGET // L
        report.add("quest", case, "attnforge-bf16-summaries", time_us(lambda: quest.run(q, cache, out=out)), sparse_bytes)
        report.add("quest", case, "attnforge-bf16-scoring", time_us(lambda: quest.scores(q)), index.kmin.numel() * 4)
        slow = planned_quest(spec, index, indptr, indices, last, select="torch")  # topk: for the kernel's gain
        report.add("quest", case, "attnforge-torch-select", time_us(lambda: slow.run(q, cache, out=out)), sparse_bytes)
        # fp8 summaries (1/32 of the KV bytes, rounded outward from a bf16 master; scale for randn keys)
        scale8 = float(torch.maximum(kmin.abs().max(), kmax.abs().max())) / 448
        index8 = QuestIndex(pages, hkv, D, device="cuda", dtype=torch.float8_e4m3fn, scale=scale8)
        index8.assign(kmin, kmax)
        quest8 = planned_quest(spec, index8, indptr, indices, last)
        bytes8 = index8.kmin.numel() * 2 + kv_bytes * BUDGET // L
        report.add("quest", case, "attnforge-fp8", time_us(lambda: quest8.run(q, cache, out=out)), bytes8)
        report.add("quest", case, "attnforge-fp8-scoring", time_us(lambda: quest8.scores(q)), index8.kmin.numel() * 2)
        quest8.scores(q)
        report.add("quest", case, "attnforge-select", time_us(lambda: quest8._select(quest8._scores)))
        quest8.run(q, cache, out=out)  # the decode wrapper's page table now holds a selection
        report.add("quest", case, "attnforge-subset-decode", time_us(lambda: quest8.decode.run(q, cache, out=out)),
                   kv_bytes * BUDGET // L)
        # the default row: int4 codes with per-channel scales (1/64 of the KV bytes; the quality of exact
        # summaries on tools/quest_summary_quality.py's keys); the kernel's query sums are int8 (dp4a)
        index4 = QuestIndex(pages, hkv, D, device="cuda", dtype="int4", scale=channel_scales(cache[:, 0], "int4"))
        index4.assign(kmin, kmax)
        quest4 = planned_quest(spec, index4, indptr, indices, last)
        report.add("quest", case, "attnforge", time_us(lambda: quest4.run(q, cache, out=out)),
                   index4.kmin.numel() * 2 + kv_bytes * BUDGET // L)
        report.add("quest", case, "attnforge-scoring", time_us(lambda: quest4.scores(q)), index4.kmin.numel() * 2)
        del index8, quest8, index4, quest4
        del cache, index
        torch.cuda.empty_cache()

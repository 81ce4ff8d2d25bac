"""Suite `quest_scoring`: the Quest suite's scoring kernel alone (int4, fp8 and bf16 summaries) and the
int4 (`attnforge`) and fp8 paths end to end, and the top-k kernel alone on the int4 path's scores, without
the dense decode and torch-select rows: ~15 s a tree, for A/B rounds of a scoring or select change.
Same cases and byte counts as bench_quest.py."""
from __future__ import annotations

import torch

from attnforge import AttentionSpec
from attnforge.sparse import QuestIndex, channel_scales
from bench_quest import B, BUDGET, D, L, PAGE, case_inputs, planned_quest
from harness import Report, time_us


def run(report: Report, peers: bool = True) -> None:
    for hq, hkv in ((32, 32), (32, 8)):
        case = f"h{hq}/{hkv} B{B} L{L} budget{BUDGET}"
        pages = B * L // PAGE
        cache, indptr, indices, last, kmin, kmax, q = case_inputs(hq, hkv)
        out = torch.empty_like(q)
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=D)
        kv_bytes = pages * PAGE * hkv * D * 2 * 2
        scale8 = float(torch.maximum(kmin.abs().max(), kmax.abs().max())) / 448
        scale4 = channel_scales(cache[:, 0], "int4")
        for dtype, scale, tag in (("int4", scale4, ""), (torch.float8_e4m3fn, scale8, "-fp8"),
                                  (torch.bfloat16, 1.0, "-bf16")):
            index = QuestIndex(pages, hkv, D, device="cuda", dtype=dtype, scale=scale)
            index.assign(kmin, kmax)
            quest = planned_quest(spec, index, indptr, indices, last)
            summary_bytes = index.kmin.numel() * 2 * index.kmin.element_size()
            report.add("quest", case, f"attnforge{tag}-scoring", time_us(lambda: quest.scores(q)), summary_bytes)
            if tag != "-bf16":
                report.add("quest", case, f"attnforge{tag}", time_us(lambda: quest.run(q, cache, out=out)),
                           summary_bytes + kv_bytes * BUDGET // L)
            if tag == "":  # the top-k kernel alone, on this path's scores
                quest.scores(q)
                report.add("quest", case, "attnforge-select", time_us(lambda: quest._select(quest._scores)))
            del quest, index
        del cache
        torch.cuda.empty_cache()

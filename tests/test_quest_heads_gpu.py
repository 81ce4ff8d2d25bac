"""QuestHeadDecode on the GPU: one selection per (request, KV head) over an HND cache, in both cache
forms (a (K, V) pair: virtual pages Hkv heads apart; one [P, 2, ...] tensor: 2 * Hkv apart)."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, reference
from attnforge.sparse import QuestHeadDecode, QuestIndex, expand_per_head, page_scores, select_pages
from helpers import (int4_kernel_scores, queued_plans_match_dense, random_page_table, replays_after_replans,
                     summary_format)

pytestmark = pytest.mark.gpu
PAGE, HQ, HKV, D = 16, 32, 8, 128
SPEC = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, kv_layout="HND")


def build(lengths, form, seed=0, index_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages)
    cache = torch.randn(total, 2, HKV, PAGE, D, generator=g).bfloat16().cuda()
    kv = cache if form == "one_tensor" else (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    indices = torch.randperm(total, generator=g).cuda()
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)])).cuda()
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(lengths, pages)])
    index = QuestIndex(total, HKV, D, device="cuda", **summary_format(index_dtype, cache[:, 0].transpose(1, 2)))
    for b, n in enumerate(lengths):
        own = indices[indptr[b]:indptr[b + 1]]
        pos = torch.arange(n, device="cuda")
        page_ids = own[pos // PAGE]
        index.append(cache[page_ids, 0, :, pos % PAGE], page_ids)
    return cache, kv, indptr, indices, last, index


def kernel_scores_per_head(quest, q, index, indptr, indices):
    """The wrapper's scores (its scoring kernel's, rows b * Hkv + h) as [n pages, Hkv] in list order,
    checked against the torch bound. References select from these: float32 sums in another order
    tie-break a near-tie at the budget's boundary differently, which says nothing of the select."""
    want = page_scores(q, index, indptr, indices, per_head=True).float()
    rows = quest._scores[: want.numel()]
    got = torch.empty_like(want)
    for b in range(indptr.numel() - 1):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        got[lo:hi] = rows[lo * HKV:hi * HKV].view(HKV, hi - lo).T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    return got


def reference_per_head(q, cache, indptr, indices, lengths, index, budget_pages, quest):
    """float64 attention of each (request, KV head) over the torch oracle's per-head selection from
    the wrapper's scores."""
    per_head = kernel_scores_per_head(quest, q, index, indptr, indices)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    g = HQ // HKV
    for h in range(HKV):
        sel_ptr, sel = select_pages(per_head[:, h].contiguous(), indptr, indices, budget_pages)
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            last_page, tail = int(indices[indptr[b + 1] - 1]), n - (-(-n // PAGE) - 1) * PAGE
            ks, vs = [], []
            for p in sel[sel_ptr[b]:sel_ptr[b + 1]].tolist():  # in list order; the last page is partial
                used = tail if p == last_page else PAGE
                ks.append(cache[p, 0, h, :used])
                vs.append(cache[p, 1, h, :used])
            k, v = torch.cat(ks)[:, None].double(), torch.cat(vs)[:, None].double()
            o, _ = reference.attention(q[b, h * g:(h + 1) * g][None].double(), k, v)
            out[b, h * g:(h + 1) * g] = o[0]
    return out


@pytest.mark.parametrize("index_dtype", ["int4", "fp8-channels"])
def test_channel_scales_score_each_head_with_its_own_row(index_dtype):
    """The per-head view of summaries with per-channel scales: one KV head per row, the model's Hkv
    rows of scales cycling along the (request, head) rows; the kernel against the torch bound (int4:
    against its arithmetic in torch, int8 query sums)."""
    lengths = [3000, 17, 0, 900]
    cache, kv, indptr, indices, last, index = build(lengths, "pair", seed=6, index_dtype=index_dtype)
    q = torch.randn(len(lengths), HQ, D, device="cuda").bfloat16()
    quest = QuestHeadDecode(SPEC, index, budget_tokens=256, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    rows = q.reshape(len(lengths) * HKV, HQ // HKV, D)
    row_indptr, ids = expand_per_head(indptr, indices, HKV)
    quest._scores.fill_(float("nan"))
    got = quest.scores(rows)[: len(ids)].clone()
    view = index.per_head_view()
    want = int4_kernel_scores(rows, view, row_indptr, ids) if index_dtype == "int4" else \
        page_scores(rows, view, row_indptr, ids).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("form", ["pair", "one_tensor"])
def test_full_budget_equals_dense_attention(form):
    lengths = [1000, 17, 4096, 0]
    cache, kv, indptr, indices, last, index = build(lengths, form)
    q = torch.randn(len(lengths), HQ, D, device="cuda").bfloat16()
    quest = QuestHeadDecode(SPEC, index, budget_tokens=1 << 20, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    out = quest.run(q, kv)
    ref = reference_per_head(q, cache, indptr, indices, lengths, index, 1 << 20, quest)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert torch.all(out[3] == 0)


@pytest.mark.parametrize("form", ["pair", "one_tensor"])
@pytest.mark.parametrize("select", ["kernel", "torch"])
def test_each_head_attends_its_own_selection(form, select):
    lengths = [5000, 100, 2500, 16, 17]
    cache, kv, indptr, indices, last, index = build(lengths, form, seed=3)
    q = torch.randn(len(lengths), HQ, D, device="cuda").bfloat16()
    quest = QuestHeadDecode(SPEC, index, budget_tokens=512, page_size=PAGE, select=select)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    out, lse = quest.run(q, kv, return_lse=True)
    ref = reference_per_head(q, cache, indptr, indices, lengths, index, 512 // PAGE, quest)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert lse.shape == (len(lengths), HQ) and torch.isfinite(lse).all()


def test_needle_is_kept_by_its_own_head():
    """A key aligned with KV head 5's queries, planted in one page per request: the rows of head 5
    keep that page (read back from the decode page table the selection kernel wrote)."""
    lengths = [4096] * 2
    cache, kv, indptr, indices, last, index = build(lengths, "pair", seed=1)
    q = torch.randn(2, HQ, D, device="cuda").bfloat16()
    needles = []
    for b in range(2):
        p = int(indices[indptr[b] + 40 + b])
        kv[0][p, 5, 3] = (q[b, 20:24].float().mean(0) * 8).bfloat16()  # head 5's group: query heads 20..23
        index.append(kv[0][p, :, 3][None], torch.tensor([p], device="cuda"))
        needles.append(p)
    budget = 16
    quest = QuestHeadDecode(SPEC, index, budget_tokens=budget * PAGE, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    quest.run(q, kv)
    table = quest.decode._device_region("kv_indices").cpu()
    starts = quest._sel_indptr.cpu()
    for b, p in enumerate(needles):
        row = b * HKV + 5
        kept = table[int(starts[row]):int(starts[row]) + budget].tolist()
        assert p * HKV + 5 in kept and all(x % HKV == 5 for x in kept)


def graph_replays(rng, held: int, max_len: int, rounds: int):
    """QuestHeadDecode in graph mode over an index of 2048 pages, its run captured reading the cache's first `held`
    pages: replays after re-plans (tables drawn from those pages) against float64. Returns the wrapper."""
    pages_total, batch = 2048, 3
    cache = torch.randn(pages_total, 2, HKV, PAGE, D, device="cuda").bfloat16()
    index = QuestIndex(pages_total, HKV, D, device="cuda")
    index.append(cache[:, 0].permute(0, 2, 1, 3).reshape(-1, HKV, D),
                 torch.arange(pages_total, device="cuda").repeat_interleave(PAGE))
    read = cache[:held]
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    out = torch.empty_like(q)
    quest = QuestHeadDecode(SPEC, index, budget_tokens=512, page_size=PAGE, use_cuda_graph=True,
                            max_batch_size=batch, max_num_pages=pages_total, max_pages_per_request=512)

    def replan():
        lengths, indptr, indices, last = random_page_table(rng, batch, PAGE, held, max_len)
        quest.plan(indptr, indices, last)
        return lengths, torch.as_tensor(indptr).cuda(), torch.as_tensor(indices).cuda()

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(float("nan"))

    for i, (lengths, indptr, indices) in replays_after_replans(lambda: quest.run(q, read, out=out), replan,
                                                               refresh, rounds):
        ref = reference_per_head(q, read, indptr, indices, list(lengths), index, 512 // PAGE, quest)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=f"replay {i}")
    return quest


def test_cuda_graph_replay_after_replans():
    graph_replays(np.random.default_rng(0), held=2048, max_len=6000, rounds=6)


def test_plans_queued_back_to_back_expand_each_table():
    """plan() stages the request-level table and expands it per head on the device, never waiting for the
    GPU: four plans and runs queued without a synchronisation each decode their own table (full budget:
    dense decode of the table), and the last plan's expanded table is expand_per_head's."""
    rng = np.random.default_rng(6)
    pages_total = 256
    cache = torch.randn(pages_total, 2, HKV, PAGE, D, device="cuda").bfloat16()
    index = QuestIndex(pages_total, HKV, D, device="cuda")
    index.append(cache[:, 0].permute(0, 2, 1, 3).reshape(-1, HKV, D),
                 torch.arange(pages_total, device="cuda").repeat_interleave(PAGE))
    quest = QuestHeadDecode(SPEC, index, budget_tokens=1 << 20, page_size=PAGE, max_batch_size=6,
                            max_num_pages=pages_total)
    tables = [random_page_table(rng, b, PAGE, pages_total, 300)[1:] for b in (3, 6, 1, 4)]
    q = torch.randn(6, HQ, D, device="cuda").bfloat16()
    queued_plans_match_dense(quest, SPEC, cache, q, tables, PAGE)
    indptr, indices, last = tables[-1]
    row_indptr, head_ids = expand_per_head(torch.as_tensor(indptr), torch.as_tensor(indices), HKV)
    assert quest._meta.tolist() == [len(last) * HKV, len(indices) * HKV]
    assert quest._indptr[:len(row_indptr)].tolist() == row_indptr.tolist()
    assert quest._pages[:len(head_ids)].tolist() == head_ids.tolist()


@pytest.mark.parametrize("max_ctas", [1024, 3])
def test_expansion_kernel_matches_expand_per_head(monkeypatch, max_ctas):
    """plan()'s quest_expand_heads_kernel against its torch definition, on random tables with empty
    requests, one CTA a request and (max_ctas=3) CTAs striding over requests."""
    import attnforge.kernels.quest as kq
    monkeypatch.setattr(kq, "EXPAND_MAX_CTAS", max_ctas)
    rng = np.random.default_rng(7)
    pages_total = 600
    index = QuestIndex(pages_total, HKV, D, device="cuda")
    quest = QuestHeadDecode(SPEC, index, budget_tokens=64, page_size=PAGE, max_batch_size=40,
                            max_num_pages=pages_total)
    for batch in (1, 7, 40, 2):
        lengths, indptr, indices, last = random_page_table(rng, batch, PAGE, pages_total, 200)
        lengths[rng.integers(batch)] = 0  # an empty request (its rows are empty too)
        n = -(-lengths // PAGE)
        indptr = np.concatenate([[0], np.cumsum(n)])
        indices = rng.permutation(pages_total)[: indptr[-1]]
        last = np.where(n > 0, lengths - (n - 1) * PAGE, 0)
        quest._indptr.fill_(-7)
        quest._pages.fill_(-7)  # poison: every value the plan lists is written by the kernel
        quest.plan(indptr, indices, last)
        row_indptr, head_ids = expand_per_head(torch.as_tensor(indptr), torch.as_tensor(indices), HKV)
        assert quest._indptr[:len(row_indptr)].tolist() == row_indptr.tolist(), f"batch {batch}"
        assert quest._pages[:len(head_ids)].tolist() == head_ids.tolist(), f"batch {batch}"


def test_bad_specs_and_plans_are_refused():
    cache, kv, indptr, indices, last, index = build([100], "pair")
    with pytest.raises(ValueError, match="'HND'"):
        QuestHeadDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV), index, budget_tokens=64, page_size=PAGE)
    quest = QuestHeadDecode(SPEC, index, budget_tokens=64, page_size=PAGE)
    with pytest.raises(ValueError, match="below the QuestIndex's 7 pages"):  # the index's pages, not its rows
        quest.plan([0, 2], [3, 7], [4])
    # an out the decode cannot write is refused before the scoring kernel launches
    quest.plan(indptr.cpu(), indices.cpu(), last)
    quest._scores.fill_(-7.0)
    q = torch.randn(1, HQ, D, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="out"):
        quest.run(q, kv, out=torch.empty(1, HQ, D, device="cuda"))  # float32, the spec's out is bf16
    torch.cuda.synchronize()
    assert (quest._scores == -7.0).all(), "no scoring launched"


def test_a_captured_graph_bounds_later_plans_by_its_cache():
    """The captured run read a 1024-page cache of the index's 2048 pages: a replay reads that cache with no run()
    to check ids, so a plan naming page 1024 is refused, and plans within it still replay right."""
    held = 1024
    quest = graph_replays(np.random.default_rng(1), held=held, max_len=4000, rounds=2)  # (<= 750 pages)
    with pytest.raises(ValueError, match=r"page ids < 1024 \(the pages of the cache a captured graph reads\)"):
        quest.plan(np.array([0, 2]), np.array([5, held]), np.array([16]))

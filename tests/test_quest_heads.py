"""Quest with one selection per (request, KV head), on the CPU: the head-expanded page lists, the
single-head view of an HND cache, and that scoring the viewed summaries with the expanded lists and
selecting per row is Quest's per-head selection (the torch oracle, computed head by head)."""
import numpy as np
import pytest
import torch

from attnforge.sparse import QuestIndex, expand_per_head, page_scores, select_pages
from attnforge.sparse.quest_heads import head_pages_view


def random_table(rng, counts, num_pages):
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]))
    return indptr, torch.tensor(rng.permutation(num_pages)[: sum(counts)].astype(np.int32))


@pytest.mark.parametrize("hkv", [1, 3, 8])
def test_expanded_rows_list_each_requests_pages_once_per_head(hkv):
    rng = np.random.default_rng(hkv)
    counts = [4, 0, 1, 7, 2]
    indptr, pages = random_table(rng, counts, 40)
    row_indptr, ids = expand_per_head(indptr, pages, hkv)
    assert row_indptr.tolist() == np.concatenate([[0], np.cumsum(np.repeat(counts, hkv))]).tolist()
    want = [int(p) * hkv + h for b in range(len(counts)) for h in range(hkv)
            for p in pages[int(indptr[b]):int(indptr[b + 1])]]
    assert ids.tolist() == want


@pytest.mark.parametrize("form", ["pair", "one_tensor"])
def test_single_head_view_of_an_hnd_cache(form):
    g = torch.Generator().manual_seed(0)
    pages, hkv, page, d = 5, 3, 4, 8
    if form == "pair":
        k, v = torch.randn(pages, hkv, page, d, generator=g), torch.randn(pages, hkv, page, d, generator=g)
    else:
        cache = torch.randn(pages, 2, hkv, page, d, generator=g)
        k, v = cache[:, 0], cache[:, 1]
    k1, v1, r = head_pages_view(k, v, k.stride(0), k.stride(2), k.stride(1), hkv)
    assert r == (hkv if form == "pair" else 2 * hkv) and k1.shape[1:] == (1, page, d)
    for p in range(pages):
        for h in range(hkv):
            assert torch.equal(k1[p * r + h, 0], k[p, h]) and torch.equal(v1[p * r + h, 0], v[p, h])


def test_single_head_view_refuses_strides_it_cannot_express():
    k = torch.randn(4, 3, 16, 8).transpose(0, 1)  # heads outermost: a page is not a whole number of heads
    with pytest.raises(ValueError, match="page stride that is a multiple"):
        head_pages_view(k, k, k.stride(0), k.stride(2), k.stride(1), 4)


def test_scoring_the_viewed_summaries_and_selecting_per_row_is_quest_per_head():
    torch.manual_seed(4)
    rng = np.random.default_rng(4)
    hkv, group, d, num_pages, budget = 4, 2, 16, 60, 3
    idx = QuestIndex(num_pages, hkv, d)
    idx.append(torch.randn(num_pages * 8, hkv, d), torch.arange(num_pages * 8) % num_pages)
    counts = [7, 1, 0, 12, 3]
    indptr, pages = random_table(rng, counts, num_pages)
    q = torch.randn(len(counts), hkv * group, d)
    # the head-expanded form QuestHeadDecode runs: summaries [P*Hkv, 1, D], rows (b, h), q [B*Hkv, G, D]
    view = idx.per_head_view()
    row_indptr, ids = expand_per_head(indptr, pages, hkv)
    scores = page_scores(q.reshape(-1, group, d), view, row_indptr, ids)
    sel_ptr, sel = select_pages(scores, row_indptr, ids, budget)
    # Quest per head, one head at a time: the bound over the head's group, top pages of each request
    per_head = page_scores(q, idx, indptr, pages, per_head=True)  # [n, Hkv]
    for h in range(hkv):
        want_ptr, want = select_pages(per_head[:, h].contiguous(), indptr, pages, budget)
        for b in range(len(counts)):
            row = b * hkv + h
            got = sel[sel_ptr[row]:sel_ptr[row + 1]]
            assert torch.equal(got // hkv, want[want_ptr[b]:want_ptr[b + 1]].to(got.dtype)), (b, h)
            assert torch.all(got % hkv == h)


def test_head_wise_plans_stage_the_request_table_beside_the_expanded_regions():
    """QuestHeadDecode sizes its base regions for the head-expanded batch and stages the request-level
    table as given in two regions of its own, which its expansion kernel reads."""
    from attnforge.sparse import QuestHeadDecode
    from test_quest import staged_quest
    hkv = 4
    q = staged_quest(QuestHeadDecode, max_batch_size=3 * hkv, max_num_pages=50 * hkv, num_kv_heads=hkv)
    sizes = {name: size for name, (_, size) in q._regions.items()}
    assert sizes == {"meta": 2, "indptr": 3 * hkv + 1, "sel_indptr": 3 * hkv, "pages": 50 * hkv + 1,
                     "raw_indptr": 4, "raw_pages": 50}
    q._stage({"raw_indptr": np.array([0, 30, 50]), "raw_pages": np.arange(50)})
    assert q._region("raw_indptr")[:3].tolist() == [0, 30, 50] and q._region("raw_pages").tolist() == list(range(50))


def test_plans_are_bounded_by_a_captured_runs_real_cache():
    """In graph mode a replay reads the cache its captured run() read, with no run() to check the selection's
    page ids: plan() refuses real ids past that cache's pages before staging anything. (The decode's own bound
    counts the per-head view's virtual pages, which its placeholder ids never reach, so it cannot stand in.)"""
    from attnforge import paged
    from attnforge.sparse import QuestHeadDecode
    from test_quest import staged_quest

    class DecodeRecorder:
        def __init__(self):
            self._captured, self.calls = paged.CapturedPages(), 0

        def plan(self, *args, **kw):
            self.calls += 1

    hkv, index = 2, QuestIndex(8, 2, 64)
    quest = staged_quest(QuestHeadDecode, max_batch_size=2 * hkv, max_num_pages=8 * hkv, index=index.per_head_view(),
                         page_size=16, budget_pages=2, use_cuda_graph=True, max_pages_per_request=8,
                         _scores=torch.zeros(8 * hkv), num_kv_heads=hkv, decode=DecodeRecorder(),
                         _captured_cache=paged.CapturedPages())
    quest._captured_cache.pages = 5  # a graph captured over a 5-page cache (the index holds 8 pages)
    with pytest.raises(ValueError, match=r"page ids < 5 \(the pages of the cache a captured graph reads\)"):
        quest.plan(np.array([0, 3, 5]), np.array([0, 1, 2, 3, 5]), np.array([16, 5]))
    assert quest.decode.calls == 0 and (quest._upload.dev == -7).all(), "refused before planning or staging"

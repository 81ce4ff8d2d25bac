"""Quest end to end on the GPU: full budget equals dense decode; a needle's page is always kept."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode
from attnforge.sparse import QuestDecode, QuestIndex, page_scores, select_pages

pytestmark = pytest.mark.gpu
PAGE, HKV, D = 16, 8, 128


def build(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages)
    cache = torch.randn(total, 2, PAGE, HKV, D, generator=g).bfloat16().cuda()
    perm = torch.randperm(total, generator=g)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)])).cuda()
    indices = perm.cuda()
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lengths, pages)])
    index = QuestIndex(total, HKV, D, device="cuda")
    for b, n in enumerate(lengths):  # append every token's key to its page summary
        own = indices[indptr[b]:indptr[b + 1]]
        pos = torch.arange(n, device="cuda")
        page_ids = own[pos // PAGE]
        index.append(cache[page_ids, 0, pos % PAGE], page_ids)
    return cache, indptr, indices, last, index


def test_full_budget_equals_dense():
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=HKV)
    lengths = [1000, 17, 4096]
    cache, indptr, indices, last, index = build(lengths)
    q = torch.randn(3, 32, D, device="cuda").bfloat16()
    quest = QuestDecode(spec, index, budget_tokens=1 << 20, page_size=PAGE)
    dense = BatchDecode(spec)
    dense.plan(indptr.cpu(), indices.cpu(), last, page_size=PAGE)
    assert torch.equal(quest.run(q, cache, indptr, indices, last), dense.run(q, cache))


def test_needle_page_is_selected():
    lengths = [4096] * 4
    cache, indptr, indices, last, index = build(lengths, seed=1)
    q = torch.randn(4, 32, D, device="cuda").bfloat16()
    needle_pages = []
    for b in range(4):  # plant a key aligned with the queries of KV head 0 in one page per request
        p = int(indices[indptr[b] + 37 + b])
        cache[p, 0, 3, 0] = (q[b, :4].float().mean(0) * 8).bfloat16()
        index.append(cache[p, 0, 3][None], torch.tensor([p], device="cuda"))
        needle_pages.append(p)
    scores = page_scores(q, index, indptr, indices)
    sel_ptr, sel = select_pages(scores, indptr, indices, budget_pages=16)
    for b in range(4):
        assert needle_pages[b] in sel[sel_ptr[b]:sel_ptr[b + 1]].tolist()

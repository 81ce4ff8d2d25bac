"""Quest end to end on the GPU: full budget equals dense decode; a needle's page is always kept."""
import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, scheduler
from attnforge.sparse import QuestDecode, QuestIndex, page_scores, select_pages
from helpers import (count_calls, int4_kernel_scores, int4_query_codes, queued_plans_match_dense, random_page_table,
                     replays_after_replans, summary_format)

pytestmark = pytest.mark.gpu
PAGE, HKV, D = 16, 8, 128


def build(lengths, seed=0, index_dtype=torch.float32, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages)
    cache = torch.randn(total, 2, PAGE, hkv, D, generator=g).bfloat16().cuda()
    perm = torch.randperm(total, generator=g)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)])).cuda()
    indices = perm.cuda()
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lengths, pages)])
    index = QuestIndex(total, hkv, D, device="cuda", **summary_format(index_dtype, cache[:, 0]))
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
    quest.plan(indptr.cpu(), indices.cpu(), last)
    dense = BatchDecode(spec)
    dense.plan(indptr.cpu(), indices.cpu(), last, page_size=PAGE)
    assert torch.equal(quest.run(q, cache), dense.run(q, cache))


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


@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (12, 6), (4, 1)])
@pytest.mark.parametrize("index_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, "fp8-channels", "int4"])
def test_scoring_kernel_matches_the_torch_bound(index_dtype, heads):
    # heads pick the kernel's work split: 8 KV heads fill a warp or two per page, 32 the whole CTA,
    # 6 a page size that is not a power of two (masked lanes), 1 several pages per warp; the long
    # request gives every CTA several steps and request changes inside its run of pages
    hq, hkv = heads
    lengths = [300, 1, 0, 40000, 17, 2048, 5]
    cache, indptr, indices, last, index = build(lengths, seed=2, index_dtype=index_dtype, hkv=hkv)
    index.reset(indices[[3, 400]].cuda())  # listed pages with no key yet score 0
    q = torch.randn(len(lengths), hq, D, device="cuda").bfloat16()
    quest = QuestDecode(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv), index, budget_tokens=256, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    quest._scores.fill_(float("nan"))  # every listed page must be written
    got = quest.scores(q)[: len(indices)].clone()
    want = page_scores(q, index, indptr, indices)
    assert want[3] == 0 and want[400] == 0
    if index_dtype == "int4":  # the kernel's query sums are int8 (a scale per request and KV head)
        torch.testing.assert_close(got, int4_kernel_scores(q, index, indptr, indices), rtol=1e-4, atol=1e-2)
        assert (got - want.float()).abs().max() <= 0.02 * want.abs().max()
    else:
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-2)


def test_int4_query_codes_are_the_torch_models_bit_for_bit():
    """The query-sum kernel's int8 codes (in their widening order, each 8 dims even dims first) and steps
    equal the torch model's over many draws (scales 1-7x, so the rows' steps vary): the int4 score tests
    hold the kernel to that model, and a model a bit off flips a code now and then (4 in 13 million)."""
    b, hq = 64, 32
    cache, indptr, indices, last, index = build([300] * b, seed=1, index_dtype="int4")
    quest = QuestDecode(AttentionSpec(num_qo_heads=hq, num_kv_heads=HKV), index, budget_tokens=64, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    d = torch.arange(D, device="cuda")
    widening_order = d // 8 * 8 + d % 2 * 4 + d % 8 // 2  # where the kernel stores dim d's code in a row
    g = torch.Generator(device="cuda").manual_seed(5)
    for draw in range(24):
        q = (torch.randn(b, hq, D, device="cuda", generator=g) * (1 + draw % 7)).bfloat16()
        quest.scores(q)
        torch.cuda.synchronize()
        steps = quest._q_scale[: b * HKV].view(b, HKV, 2)
        for side, (codes, step) in enumerate(int4_query_codes(q, index)):
            raw = quest._q_split[side].reshape(-1).view(torch.int8)[: b * HKV * D].view(b, HKV, D)
            assert torch.equal(raw[..., widening_order], codes), f"draw {draw}: int8 codes of side {side}"
            assert torch.equal(steps[..., side:side + 1], step), f"draw {draw}: steps of side {side}"


def kernel_scores(quest, q, index, indptr, indices):
    """The scores the wrapper's selection read (its scoring kernel's), checked against the torch bound.
    References select from these: float32 sums in another order tie-break a near-tie at the budget's
    boundary differently (one page in ~40 selections flipped between runs), which says nothing of the
    select or the decode."""
    want = page_scores(q, index, indptr, indices).float()
    got = quest._scores[: want.numel()].clone()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    return got


def selection_reference(spec, q, cache, indptr, indices, last, index, budget_pages, quest):
    """Dense decode over the torch oracle's selection from the wrapper's scores."""
    scores = kernel_scores(quest, q, index, indptr, indices)
    sel_ptr, sel = select_pages(scores, indptr, indices, budget_pages)
    dense = BatchDecode(spec)
    dense.plan(sel_ptr.cpu(), sel.cpu(), last, page_size=PAGE)
    return dense.run(q, cache)


@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("select", ["kernel", "torch"])
def test_sparse_output_equals_dense_over_the_selected_pages(heads, select):
    spec = AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1])
    lengths = [5000, 100, 0, 2500, 16, 17]
    cache, indptr, indices, last, index = build(lengths, seed=3, hkv=heads[1])
    q = torch.randn(len(lengths), heads[0], D, device="cuda").bfloat16()
    quest = QuestDecode(spec, index, budget_tokens=512, page_size=PAGE, select=select)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    out = quest.run(q, cache)
    assert torch.equal(out, selection_reference(spec, q, cache, indptr, indices, last, index, 512 // PAGE, quest))


def test_lists_longer_than_the_register_path_select_the_same_pages():
    # 8201 pages: more than quest_select_kernel keeps in registers (1024 threads x 8), so the request
    # takes select_large beside a short one on the register path, in one launch
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=HKV)
    lengths = [8200 * PAGE + 3, 40]
    cache, indptr, indices, last, index = build(lengths, seed=5)
    q = torch.randn(len(lengths), 32, D, device="cuda").bfloat16()
    quest = QuestDecode(spec, index, budget_tokens=300 * PAGE, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    out = quest.run(q, cache)
    assert torch.equal(out, selection_reference(spec, q, cache, indptr, indices, last, index, 300, quest))


def graph_case(pages_total: int, batch: int, max_pages_per_request: int):
    """GQA 32/8 over a cache of pages_total random pages (each summarised), queries and an output buffer,
    and a QuestDecode in CUDA-graph mode with a 1024-token budget: (spec, cache, index, q, out, quest)."""
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=HKV)
    cache = torch.randn(pages_total, 2, PAGE, HKV, D, device="cuda").bfloat16()
    index = QuestIndex(pages_total, HKV, D, device="cuda")
    index.append(cache[:, 0].reshape(-1, HKV, D), torch.arange(pages_total, device="cuda").repeat_interleave(PAGE))
    q = torch.randn(batch, 32, D, device="cuda").bfloat16()
    quest = QuestDecode(spec, index, budget_tokens=1024, page_size=PAGE, use_cuda_graph=True, max_batch_size=batch,
                        max_num_pages=pages_total, max_pages_per_request=max_pages_per_request)
    return spec, cache, index, q, torch.empty_like(q), quest


def test_cuda_graph_replay_after_replans():
    rng = np.random.default_rng(0)
    pages_total, batch = 4096, 4
    spec, cache, index, q, out, quest = graph_case(pages_total, batch, 1024)

    def replan():
        _, indptr, indices, last = random_page_table(rng, batch, PAGE, pages_total, 12000)
        quest.plan(indptr, indices, last)
        return torch.as_tensor(indptr).cuda(), torch.as_tensor(indices).cuda(), torch.as_tensor(last)

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(float("nan"))

    for i, (indptr, indices, last) in replays_after_replans(lambda: quest.run(q, cache, out=out), replan, refresh, 10):
        ref = selection_reference(spec, q, cache, indptr, indices, last, index, 1024 // PAGE, quest)
        assert torch.equal(out, ref), f"replay {i}"


def test_one_selection_per_sm_decodes_whole_items_under_cuda_graphs():
    """B x 8 KV heads ~ the SMs (128 on the H200): the subset decode reads each selection whole on one CTA
    (BatchDecode(whole_items=True), as QuestDecode asks), selections near-equal by their last pages."""
    rng = np.random.default_rng(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pages_total, batch = 8192, sms // HKV
    spec, cache, index, q, out, quest = graph_case(pages_total, batch, 512)

    def replan():  # every request longer than the budget: 64 pages kept, the last one filled 1..16
        lengths = rng.integers(1100, 8000, size=batch)
        n = -(-lengths // PAGE)
        indptr = np.concatenate([[0], np.cumsum(n)])
        indices = rng.permutation(pages_total)[: indptr[-1]]
        last = lengths - (n - 1) * PAGE
        quest.plan(indptr, indices, last)
        return torch.as_tensor(indptr).cuda(), torch.as_tensor(indices).cuda(), torch.as_tensor(last)

    def refresh():
        q.copy_(torch.randn_like(q.float()).bfloat16())
        out.fill_(float("nan"))

    decode = quest.decode
    for i, (indptr, indices, last) in replays_after_replans(lambda: quest.run(q, cache, out=out), replan, refresh, 6):
        if decode._whole is None or not scheduler.in_whole_item_band(batch * HKV, decode._whole_ctas):
            pytest.skip("no whole-item kernel for this GPU's SM count")
        assert decode.planned_kernel == (decode._whole, sms) and scheduler.is_whole_item_plan(decode._plan["work"])
        ref = selection_reference(spec, q, cache, indptr, indices, last, index, 1024 // PAGE, quest)  # (whole items too)
        assert torch.equal(out, ref), f"replay {i}"


def test_plans_queued_back_to_back_stage_each_table_at_fixed_addresses():
    """plan() stages its arrays through two reused pinned buffers and never waits for the GPU: four
    plans and runs queued without a synchronisation each decode their own table (full budget: dense
    decode of the table), and the tables live at the addresses a graph would have captured."""
    rng = np.random.default_rng(5)
    pages_total = 512
    spec, cache, index, _, _, _ = graph_case(pages_total, 1, 64)
    quest = QuestDecode(spec, index, budget_tokens=1 << 20, page_size=PAGE, max_batch_size=8,
                        max_num_pages=pages_total)
    addresses = [t.data_ptr() for t in (quest._meta, quest._indptr, quest._sel_indptr, quest._pages)]
    tables = [random_page_table(rng, b, PAGE, pages_total, 400)[1:] for b in (3, 8, 1, 5)]
    q = torch.randn(8, 32, D, device="cuda").bfloat16()
    queued_plans_match_dense(quest, spec, cache, q, tables, PAGE)
    indptr, indices, last = tables[-1]
    assert quest._meta.tolist() == [len(last), len(indices)]
    assert quest._indptr[:len(indptr)].tolist() == indptr.tolist()
    assert quest._pages[:len(indices)].tolist() == indices.tolist()
    assert [t.data_ptr() for t in (quest._meta, quest._indptr, quest._sel_indptr, quest._pages)] == addresses


def test_plans_neither_synchronise_nor_make_torch_events(monkeypatch):
    """plan() stages through two reused pinned buffers with driver events: no torch event is made, recorded or
    waited for, and nothing synchronises the device (the plan before this one synchronised on the last
    plan's event, which waits for whatever the stream ran before it)."""
    rng = np.random.default_rng(8)
    spec, cache, index, _, _, quest = graph_case(256, 4, 64)
    waits = [count_calls(monkeypatch, torch.cuda.Event, name) for name in ("record", "synchronize", "wait")]
    syncs = count_calls(monkeypatch, torch.cuda, "synchronize")
    for _ in range(3):
        _, indptr, indices, last = random_page_table(rng, 4, PAGE, 256, 900)
        quest.plan(indptr, indices, last)
    assert [c["n"] for c in waits] == [0, 0, 0] and syncs["n"] == 0


def test_bad_arguments_raise():
    cache, indptr, indices, last, index = build([100])
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=HKV)
    with pytest.raises(ValueError, match="QuestIndex shape"):
        QuestDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=4), index, budget_tokens=64, page_size=PAGE)
    quest = QuestDecode(spec, index, budget_tokens=64, page_size=PAGE, max_num_pages=4)
    with pytest.raises(RuntimeError, match="call plan"):
        quest.run(torch.zeros(1, 32, D, device="cuda").bfloat16(), cache)
    with pytest.raises(RuntimeError, match="QuestDecode.scores: call plan"):
        quest.scores(torch.zeros(1, 32, D, device="cuda").bfloat16())
    quest.plan([0, 2], [3, 5], [4])
    with pytest.raises(ValueError, match="q.dtype"):  # scores() checks q itself: the kernel reads 16-byte rows
        quest.scores(torch.zeros(1, 32, D, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="q.shape"):
        quest.scores(torch.zeros(2, 32, D, device="cuda").bfloat16())  # planned for one request
    with pytest.raises(ValueError, match="16-byte aligned"):
        quest.scores(torch.zeros(1, 32, D + 1, device="cuda").bfloat16()[..., 1:])
    with pytest.raises(ValueError, match="max_num_pages=4"):
        quest.plan([0, 7], list(range(7)), [4])
    with pytest.raises(ValueError, match="below the QuestIndex's 7 pages"):  # page 7 has no summary
        quest.plan([0, 2], [3, 7], [4])
    g = QuestDecode(spec, index, budget_tokens=64, page_size=PAGE, use_cuda_graph=True, max_batch_size=1,
                    max_pages_per_request=2)
    with pytest.raises(ValueError, match="max_pages_per_request=2"):
        g.plan([0, 3], [0, 1, 2], [4])


@pytest.mark.parametrize("index_dtype", [torch.float8_e4m3fn, "int4"])
def test_quantized_summaries_keep_the_needle(index_dtype):
    """fp8 and int4 summaries (rounded outward) still select the page of a key aligned with the query."""
    lengths = [4096] * 3
    cache, indptr, indices, last, index = build(lengths, seed=9, index_dtype=index_dtype)
    q = torch.randn(len(lengths), 32, D, device="cuda").bfloat16()
    needle_pages = []
    for b in range(len(lengths)):
        page = int(indices[indptr[b] + 100])
        cache[page, 0, 5] = (q[b].float().view(HKV, 4, D).mean(dim=1) * 4).bfloat16()  # a key along q
        index.append(cache[page, 0, 5][None], torch.tensor([page], device="cuda"))
        needle_pages.append(page)
    quest = QuestDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=HKV), index, budget_tokens=256, page_size=PAGE)
    quest.plan(indptr.cpu(), indices.cpu(), last)
    scores = quest.scores(q)[: len(indices)]
    sel_ptr, sel = select_pages(scores.clone(), indptr, indices, budget_pages=16)
    for b in range(len(lengths)):
        assert needle_pages[b] in sel[sel_ptr[b]:sel_ptr[b + 1]].tolist()


def crafted_scores(kind: str, n: int, rng) -> np.ndarray:
    if kind == "distinct":
        return (50 + 10 * rng.standard_normal(n)).astype(np.float32)
    if kind == "all-equal":
        return np.full(n, 2.5, np.float32)
    if kind == "few-values":  # exact ties across the boundary
        return rng.integers(0, 4, n).astype(np.float32)
    if kind == "signs-and-magnitudes":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    if kind == "one-bit-apart":  # keys differ only in the last mantissa bits
        return (np.float32(1.0) + np.arange(n, dtype=np.float32) * np.float32(2 ** -23))[rng.permutation(n)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["distinct", "all-equal", "few-values", "signs-and-magnitudes", "one-bit-apart"])
@pytest.mark.parametrize("budget_pages", [1, 3, 256])
def test_select_kernel_on_crafted_scores(kind, budget_pages):
    """quest_select_kernel given scores directly: requests of 0, 1, budget, budget + 1, 3001, 4096, 5000
    and 8192 pages (runs of 1 to 8 keys a thread, in both of the register path's instantiations, kRun 4
    and 8, with the last thread's run cut short); each keeps its last page, its pages in list order, and
    scores equal (as a multiset) to torch.topk's."""
    rng = np.random.default_rng(len(kind) * 1000 + budget_pages)
    counts = [0, 1, budget_pages, budget_pages + 1, 3001, 4096, 5000, 8192]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    last = np.where(np.array(counts) > 0, PAGE, 0).astype(np.int32)
    index = QuestIndex(int(indptr[-1]), HKV, D, device="cuda")
    quest = QuestDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=HKV), index, budget_tokens=budget_pages * PAGE,
                        page_size=PAGE, max_num_pages=int(indptr[-1]))
    quest.plan(indptr, indices, last)
    scores = np.concatenate([crafted_scores(kind, c, rng) for c in counts])
    quest._scores[: len(scores)].copy_(torch.from_numpy(scores))
    table = quest._selection_out()
    table.fill_(-1)
    quest._select(quest._scores)
    ref_ptr, ref = select_pages(torch.from_numpy(scores), torch.from_numpy(indptr), torch.from_numpy(indices),
                                budget_pages)
    got_ptr = np.concatenate([[0], np.cumsum(np.minimum(counts, budget_pages))])
    assert np.array_equal(got_ptr, ref_ptr.numpy())
    got = table[: int(got_ptr[-1])].cpu().numpy()
    position = {int(p): j for j, p in enumerate(indices)}
    for b, c in enumerate(counts):
        mine, theirs = got[got_ptr[b]:got_ptr[b + 1]], ref.numpy()[ref_ptr[b]:ref_ptr[b + 1]]
        if c == 0:
            continue
        pos = [position[int(p)] for p in mine]
        assert pos == sorted(pos) and len(set(pos)) == len(pos), f"request {b}: not in list order"
        assert pos[-1] == indptr[b + 1] - 1, f"request {b}: the last page is not kept"
        assert sorted(scores[pos[:-1]].tolist()) == sorted(scores[[position[int(p)] for p in theirs[:-1]]].tolist()), \
            f"request {b} ({kind}): kept scores differ from torch.topk's"


def test_select_kernel_ranks_a_narrow_boundary_bin_with_exact_ties():
    """After one pass the boundary bin holds ~15 candidates, five of them equal, two of which fit: the
    kernel ranks the bin in one warp and keeps the first two copies in list order, as the CPU model."""
    from test_quest_select_model import kernel_model, narrow_bin_ties, register_path_select
    scores, k = narrow_bin_ties(0)
    assert register_path_select(scores, k)[-1]  # the model takes the warp rank here
    n = len(scores)
    indptr, last = np.array([0, n], np.int32), np.array([PAGE], np.int32)
    indices = np.random.default_rng(1).permutation(n).astype(np.int32)
    quest = QuestDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=HKV), QuestIndex(n, HKV, D, device="cuda"),
                        budget_tokens=k * PAGE, page_size=PAGE, max_num_pages=n)
    quest.plan(indptr, indices, last)
    quest._scores[:n].copy_(torch.from_numpy(scores))
    table = quest._selection_out()
    table.fill_(-1)
    quest._select(quest._scores)
    position = {int(p): j for j, p in enumerate(indices)}
    assert [position[int(p)] for p in table[:k].cpu().numpy()] == kernel_model(scores, k)


@pytest.mark.parametrize("index_dtype", [torch.float32, "fp8-channels", "int4"])
def test_device_page_ids_out_of_range_are_never_folded(index_dtype):
    """Page ids on the GPU are not read back: those outside [0, num_pages) are not folded (a CUDA index past the
    rows would end the process's CUDA context, and -1 would wrap onto the last page); check_indices=True counts
    them and raises before writing. The summaries equal an index given only the valid ids."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(6, 2, 16, generator=g).cuda()
    fmt = summary_format(index_dtype, k)
    idx, want = (QuestIndex(4, 2, 16, device="cuda", **fmt) for _ in range(2))
    idx.append(k, torch.tensor([0, -1, 4, 2**40, 3, 0], device="cuda"))
    idx.reset(torch.tensor([3, 7, -2], device="cuda"))  # page 3 forgotten, the others ignored
    want.append(k[[0, 5]], torch.tensor([0, 0], device="cuda"))
    with pytest.raises(ValueError, match=r"1 outside, first page_ids\[1\] = -1"):
        idx.append(k[:2], torch.tensor([2, -1], device="cuda"), check_indices=True)
    torch.cuda.synchronize()
    assert torch.equal(idx.kmin, want.kmin) and torch.equal(idx.kmax, want.kmax)

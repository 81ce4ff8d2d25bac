"""attnforge.append's kernel on the GPU: every cache it writes compared bit for bit with the torch formulation
(attnforge.reference) on a poisoned clone, across layouts, odd page sizes, index types, quantization, MLA
caches, slot mappings, bad indices and CUDA graphs; then a decode over appended fp8 pages. Every test runs on
both kernels: one unit a thread (a decode step's) and several units of a token a thread (a prefill's), which
the small cases here take only when the size rule is forced."""
import pytest
import torch

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True, params=["by-size", "wide"])
def kernel(request, monkeypatch):
    """Which append kernel the calls launch: "by-size" the size rule's choice (one unit a thread at these
    sizes), "wide" append_kv_kernel_wide on every size. Yields (mode, the names of the kernels launched).
    No memoised launch of another test (whose tensors' addresses the allocator may have handed on) runs."""
    from attnforge import append
    monkeypatch.setattr(append, "_LAUNCHES", {})
    if request.param == "wide":
        monkeypatch.setattr(append, "WIDE_FROM_UNITS_PER_SM", 0)
    launched = set()
    real = append._kernel_and_grid

    def recording(lib, units, device):
        kernel, grid = real(lib, units, device)
        launched.add(kernel.name)
        return kernel, grid

    monkeypatch.setattr(append, "_kernel_and_grid", recording)
    yield request.param, launched
    if request.param == "wide":
        assert launched <= {"append_kv_kernel_wide"}, f"the forced run launched {launched}"


def table(lengths, page, num_pages, index_dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lengths]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=index_dtype)
    indices = torch.randperm(num_pages, generator=g)[: int(indptr[-1])].to(index_dtype)
    batch = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)]).to(index_dtype)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(index_dtype)
    # the tokens in a shuffled order: the kernel must not depend on it
    order = torch.randperm(len(batch), generator=g)
    return [t.cuda() for t in (indptr, indices, batch[order], pos[order])]


def poisoned(shape, dtype):
    """A cache of random values (never zeros): rows the append must not touch keep them."""
    return (torch.randn(shape, device="cuda") * 3).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 7, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_append_matches_torch_indexing(layout, page, index_dtype):
    torch.manual_seed(page)
    lengths, hkv, d = [5, 0, 40, 17, 1], 8, 128
    num_pages = sum(-(-n // page) for n in lengths) + 5
    indptr, indices, batch, pos = table(lengths, page, num_pages, index_dtype)
    shape = (num_pages, 2, page, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, page, d)
    cache = poisoned(shape, torch.bfloat16)
    want = cache.clone()
    k = torch.randn(len(batch), hkv, d, device="cuda").bfloat16()
    v = torch.randn_like(k)
    reference.append_paged_kv(k, v, batch, pos, want, indices, indptr, layout)
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, kv_layout=layout)
    assert same_bits(cache, want)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_quantizing_append_gives_torchs_codes(src, layout):
    """value / scale rounded to e4m3 and saturated: the codes of torch's own conversion after a clamp, into a
    (K, V) pair; values past 448 x scale included."""
    torch.manual_seed(1)
    page, hkv, d, lengths = 7, 4, 64, [30, 3]
    num_pages = 8
    indptr, indices, batch, pos = table(lengths, page, num_pages)
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    kc, vc = poisoned(shape, FP8), poisoned(shape, FP8)
    want = (kc.clone(), vc.clone())
    k = (torch.randn(33, hkv, d, device="cuda") * 40).to(src)
    v = (torch.randn(33, hkv, d, device="cuda") * 0.01).to(src)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0, 0.0])
    reference.append_paged_kv(k, v, batch, pos, want, indices, indptr, layout, 0.25, 0.003)
    attnforge.append_paged_kv_cache(k, v, batch, pos, (kc, vc), indices, indptr, layout, k_scale=0.25, v_scale=0.003)
    assert same_bits(kc, want[0]) and same_bits(vc, want[1])
    assert not torch.isnan(kc.float()).any()


def test_fp8_tokens_into_an_fp8_cache_and_strided_sources():
    """fp8 rows copied as they are; and k / v taken as column slices of one fused projection (row stride 3 x
    the width), which the kernel reads in place."""
    torch.manual_seed(2)
    page, hkv, d = 16, 2, 128
    indptr, indices, batch, pos = table([21, 9], page, 6)
    cache = poisoned((6, 2, page, hkv, d), FP8)
    want = cache.clone()
    fused = torch.randn(30, 3, hkv, d, device="cuda").to(FP8)
    k, v = fused[:, 1], fused[:, 2]
    reference.append_paged_kv(k, v, batch, pos, want, indices, indptr)
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr)
    assert same_bits(cache, want)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_mla_append_matches_torch_indexing(unified, cache_dtype):
    torch.manual_seed(3)
    page, lengths = 64, [100, 1, 64, 0]
    num_pages = 6
    indptr, indices, batch, pos = table(lengths, page, num_pages)
    projected = torch.randn(len(batch), 576, device="cuda").bfloat16()  # kv_a_proj's output, split in place
    ckv, kpe = projected[:, :512], projected[:, 512:]
    scale = 1.0 if cache_dtype == torch.bfloat16 else 0.02
    if unified:
        cache, kpe_cache = poisoned((num_pages, page, 576), cache_dtype), None
        want = (cache.clone(), None)
    else:
        cache, kpe_cache = poisoned((num_pages, page, 512), cache_dtype), poisoned((num_pages, page, 64), cache_dtype)
        want = (cache.clone(), kpe_cache.clone())
    reference.append_paged_mla(ckv, kpe, batch, pos, want[0], want[1], indices, indptr, scale)
    attnforge.append_paged_mla_kv_cache(ckv, kpe, batch, pos, cache, kpe_cache, indices, indptr, kv_scale=scale)
    assert same_bits(cache, want[0]) and (unified or same_bits(kpe_cache, want[1]))


def test_slot_mapping_skips_padding():
    torch.manual_seed(4)
    page, hkv, d, num_pages = 16, 8, 64, 5
    cache = poisoned((num_pages, 2, hkv, page, d), torch.float16)
    want = cache.clone()
    slots = torch.tensor([3, -1, 79, 16, -1, 40], device="cuda")
    k, v = torch.randn(6, hkv, d, device="cuda").half(), torch.randn(6, hkv, d, device="cuda").half()
    reference.append_kv_slots(k, v, slots, want, "HND")
    attnforge.append_kv_by_slots(k, v, slots, cache, "HND", check_indices=True)
    assert same_bits(cache, want)


def test_bad_indices_write_nothing_and_are_reported_on_request():
    """Tokens outside the page table (a request past the batch, a position past its pages, a negative
    position) or the cache (a page id past it, a negative one) are never written: no illegal access, the
    other tokens land; check_indices=True raises naming the first bad token."""
    page, hkv, d = 4, 2, 16
    indptr = torch.tensor([0, 2, 3], device="cuda", dtype=torch.int32)
    indices = torch.tensor([0, 1, 7], device="cuda", dtype=torch.int32)  # page 7: past a 4-page cache
    cache = poisoned((4, 2, page, hkv, d), torch.bfloat16)
    batch = torch.tensor([0, 2, 0, 1, 0, 0], device="cuda", dtype=torch.int32)
    pos = torch.tensor([1, 0, 8, 0, -1, 7], device="cuda", dtype=torch.int32)
    k = torch.randn(6, hkv, d, device="cuda").bfloat16()
    want = cache.clone()
    good = torch.tensor([0, 5], device="cuda")
    reference.append_paged_kv(k[good], k[good], batch[good], pos[good], want, indices, indptr)
    attnforge.append_paged_kv_cache(k, k, batch, pos, cache, indices, indptr)
    torch.cuda.synchronize()
    assert same_bits(cache, want)
    with pytest.raises(ValueError, match="4 token\\(s\\) outside, first token 1: batch_indices\\[1\\] = 2"):
        attnforge.append_paged_kv_cache(k, k, batch, pos, cache, indices, indptr, check_indices=True)
    assert same_bits(cache, want)
    slots = torch.tensor([2, 16, -1, 5], device="cuda")
    with pytest.raises(ValueError, match="1 token\\(s\\) outside, first token 1: slot_mapping\\[1\\] = 16"):
        attnforge.append_kv_by_slots(k[:4], k[:4], slots, cache, check_indices=True)
    before = cache.clone()  # (the slots call above wrote its two valid tokens)
    empty = k[:0]  # no tokens: no launch, nothing reported, nothing written
    attnforge.append_paged_kv_cache(empty, empty, batch[:0], pos[:0], cache, indices, indptr, check_indices=True)
    assert same_bits(cache, before)


def test_append_replays_in_a_cuda_graph():
    torch.manual_seed(5)
    page, hkv, d = 16, 8, 128
    indptr, indices, batch, pos = table([33, 70], page, 10)
    cache = poisoned((10, 2, page, hkv, d), FP8)
    k = torch.randn(len(batch), hkv, d, device="cuda").bfloat16()
    v = torch.randn_like(k)
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, k_scale=0.5, v_scale=0.5)  # build
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, k_scale=0.5, v_scale=0.5)
    for step in range(2):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        if step:  # the same tokens in another order: the graph reads the index tensors anew
            pos.copy_(pos.flip(0))
            batch.copy_(batch.flip(0))
        want = cache.clone()
        reference.append_paged_kv(k, v, batch, pos, want, indices, indptr, "NHD", 0.5, 0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(cache, want)


def test_decode_reads_what_a_quantizing_append_wrote():
    """End to end: bf16 tokens appended into an fp8 cache with scales, then BatchDecode planned with the same
    scales matches the float64 reference over the dequantized cache."""
    torch.manual_seed(6)
    page, hkv, d, lengths = 16, 8, 128, [37, 300, 1]
    num_pages = sum(-(-n // page) for n in lengths)
    indptr, indices, batch, pos = table(lengths, page, num_pages)
    cache = poisoned((num_pages, 2, page, hkv, d), FP8)
    k = torch.randn(len(batch), hkv, d, device="cuda").bfloat16() * 2
    v = torch.randn_like(k)
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, k_scale=0.05, v_scale=0.02)
    dec = attnforge.BatchDecode(num_qo_heads=32, num_kv_heads=hkv, kv_dtype="fp8_e4m3")
    last = [(n - 1) % page + 1 for n in lengths]
    dec.plan(indptr.cpu().numpy(), indices.cpu().numpy(), last, page_size=page, k_scale=0.05, v_scale=0.02)
    q = torch.randn(len(lengths), 32, d, device="cuda").bfloat16()
    out = dec.run(q, cache)
    per = reference.gather_paged(cache[:, 0], cache[:, 1], "NHD", indptr.cpu().numpy(), indices.cpu().numpy(), last,
                                 page)
    for b, (kk, vv) in enumerate(per):
        want, _ = reference.attention(q[b:b + 1], kk.double() * 0.05, vv.double() * 0.02)
        assert kk.shape[0] == lengths[b]
        assert (out[b:b + 1].double() - want).abs().max().item() < 3e-2  # bf16 output rounding at |o| < 4


def test_indices_past_2_31_are_outside():
    """int64 slots and positions of 2^31 and beyond (the kernel's 64-bit division path) are counted outside
    and write nothing; the tokens beside them land."""
    page, hkv, d = 4, 2, 16
    cache = poisoned((4, 2, page, hkv, d), torch.bfloat16)
    k = torch.randn(3, hkv, d, device="cuda").bfloat16()
    slots = torch.tensor([5, 2 ** 40 + 1, 2 ** 31], device="cuda")
    want = cache.clone()
    reference.append_kv_slots(k[:1], k[:1], slots[:1], want)
    with pytest.raises(ValueError, match="2 token\\(s\\) outside, first token 1"):
        attnforge.append_kv_by_slots(k, k, slots, cache, check_indices=True)
    assert same_bits(cache, want)
    indptr = torch.tensor([0, 4], device="cuda", dtype=torch.int64)
    indices = torch.tensor([3, 2, 1, 0], device="cuda", dtype=torch.int64)
    batch = torch.zeros(3, device="cuda", dtype=torch.int64)
    pos = torch.tensor([2, 2 ** 33, 2 ** 31 + 3], device="cuda", dtype=torch.int64)
    reference.append_paged_kv(k[:1], k[:1], batch[:1], pos[:1], want, indices, indptr)
    with pytest.raises(ValueError, match="2 token\\(s\\) outside, first token 1"):
        attnforge.append_paged_kv_cache(k, k, batch, pos, cache, indices, indptr, check_indices=True)
    assert same_bits(cache, want)


def nhd_case(lengths, page, hkv, d, dtype, num_pages, seed):
    """Random tokens for a poisoned NHD cache: (append_paged_kv_cache's arguments, the cache torch's indexing
    leaves)."""
    torch.manual_seed(seed)
    indptr, indices, batch, pos = table(lengths, page, num_pages)
    cache = poisoned((num_pages, 2, page, hkv, d), dtype)
    want = cache.clone()
    k = torch.randn(len(batch), hkv, d, device="cuda").to(dtype)
    v = torch.randn_like(k)
    reference.append_paged_kv(k, v, batch, pos, want, indices, indptr)
    return (k, v, batch, pos, cache, indices, indptr), want


def test_units_a_token_not_a_multiple_of_the_wide_kernels():
    """3 heads of 24 dims (3 units a row): 18 units a token over the wide kernel's 5 threads a token, of which
    threads 3 and 4 hold three units and the others four (MLA's 64 + 8 a token, above, fill 18 threads)."""
    args, want = nhd_case([11, 4, 9], 5, 3, 24, torch.float16, 8, seed=7)
    attnforge.append_paged_kv_cache(*args)
    assert same_bits(args[4], want)


def test_a_prefill_takes_the_wide_kernel_by_the_size_rule(kernel):
    """8192 GQA 8x128 tokens (2.1M units) are past the size rule's threshold on any GPU of up to 1024 SMs: the
    rule itself (not forced) picks the wide kernel, and a decode step's 64 tokens one unit a thread; the
    caches equal torch's."""
    from attnforge import append
    mode, launched = kernel
    if mode == "wide":
        pytest.skip("the rule forced: the by-size run of this test checks the rule's own choice")
    hkv, d = 8, 128
    (k, v, batch, pos, cache, indices, indptr), want = nhd_case([8192], 16, hkv, d, torch.bfloat16, 515, seed=8)
    units = 8192 * hkv * 2 * d // append.UNIT
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert units >= append.WIDE_FROM_UNITS_PER_SM * sms, "the case no longer fills the device: grow it"
    attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr)
    assert launched == {"append_kv_kernel_wide"}
    assert same_bits(cache, want)
    attnforge.append_paged_kv_cache(k[:64], v[:64], batch[:64], pos[:64], cache, indices, indptr)
    assert launched == {"append_kv_kernel_wide", "append_kv_kernel"}  # a decode step's size: one unit a thread
    assert same_bits(cache, want)  # (the same tokens again)

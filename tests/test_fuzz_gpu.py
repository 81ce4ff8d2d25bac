"""Seeded random cases across every axis at once, against the float64 reference.

The other GPU files cover each option on a grid of two or three axes; these draw all of them together
(heads, head dim, dtypes, layout, pipeline, page size, lengths around tile and page edges, scales, soft-cap,
window, graph mode) for decode (one token a request and several), prefill, MLA, cascade and Quest, so a
combination no grid names still meets the reference. Each seed is one test id: a failure names its draw (the
spec and lengths are in the assertion message) and reruns alone."""
import dataclasses
import os

import numpy as np
import pytest
import torch

import attnforge
from attnforge import AttentionSpec, BatchPrefill, reference
from attnforge.cascade import CascadeDecode
from attnforge.sparse import QuestDecode, QuestHeadDecode, QuestIndex, expand_per_head, page_scores, select_pages
from attnforge.spec import PREFILL_QK_VO_DIMS
from helpers import assert_attention_close, assert_lse_close, decode_reference, int4_kernel_scores, \
    make_paged_case, poison, summary_format, weight_rounding_allowance
from test_decode_gpu import run_case as run_decode_case
from test_decode_verify_gpu import verify_case
from test_mla_gpu import mla_spec, run_case as run_mla_case
from test_prefill_gpu import check_against_reference, ragged_case
from test_prefill_split_dims_gpu import split_case

DEFAULT_SEEDS = range(10)


def fuzz_seeds(text) -> range:
    """The seeds to draw: ATTNFORGE_TEST_FUZZ_SEEDS="START:STOP" widens a long run's draws past the default
    0:10 (the GPU suite's), e.g. "10:210" on a GPU with time to spare. Seed s draws the same case in any range."""
    if not text:
        return DEFAULT_SEEDS
    parts = text.split(":")
    if len(parts) == 2 and all(p.strip().isdigit() for p in parts) and int(parts[0]) < int(parts[1]):
        return range(int(parts[0]), int(parts[1]))
    raise ValueError(f"ATTNFORGE_TEST_FUZZ_SEEDS: expected START:STOP with 0 <= START < STOP (e.g. 10:210), got "
                     f"{text!r}; unset it for the default seeds 0:10")


SEEDS = fuzz_seeds(os.environ.get("ATTNFORGE_TEST_FUZZ_SEEDS"))


def edge_lengths(rng, count: int, tile: int = 64, longest: int = 3000) -> list[int]:
    """Lengths that hit the edges: 0, 1, a tile or page boundary +-1, and uniform draws; one long."""
    picks = []
    for _ in range(count):
        kind = rng.integers(4)
        if kind == 0:
            picks.append(int(rng.choice([0, 1, 2])))
        elif kind == 1:
            picks.append(max(0, int(tile * rng.integers(1, 8) + rng.integers(-1, 2))))
        else:
            picks.append(int(rng.integers(1, longest)))
    if rng.random() < 0.3:
        picks[int(rng.integers(count))] = int(rng.integers(8000, 20000))  # a request split across CTAs
    if count > 1 and rng.random() < 0.3:
        picks[int(rng.integers(count))] = 0  # an empty request among others: zeros and LSE -inf
    return picks


def draw_decode(rng):
    hkv = int(rng.choice([1, 2, 4, 8]))
    group = int(rng.choice([1, 2, 3, 4, 5, 8, 16] if hkv > 1 else [1, 4, 8, 16, 32]))
    q_dtype = str(rng.choice(["bf16", "fp16"]))
    head_dim, kv_dtype = int(rng.choice([64, 128, 256])), str(rng.choice([q_dtype, "fp8_e4m3"]))
    layout, pipeline = str(rng.choice(["NHD", "HND"])), str(rng.choice(["auto", "normal", "transposed"]))
    # (a group of 32 on the transposed pipeline: two items of 16 heads a KV head, its head_splits default)
    spec = AttentionSpec(num_qo_heads=hkv * group, num_kv_heads=hkv, head_dim_qk=head_dim, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, kv_layout=layout, pipeline=pipeline,
                         logits_soft_cap=float(rng.choice([0.0, 30.0])),
                         window_left=int(rng.choice([-1, -1, int(rng.integers(1, 600))])))
    lengths = edge_lengths(rng, int(rng.integers(1, 10)))
    page = int(rng.choice([1, 3, 7, 16, 33, 64]))
    scales = {"k_scale": float(rng.uniform(0.25, 2)), "v_scale": float(rng.uniform(0.25, 2))} \
        if spec.kv_dtype == "fp8_e4m3" else {}
    return spec, lengths, page, scales, bool(rng.random() < 0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_decode(seed):
    spec, lengths, page, scales, graph = draw_decode(np.random.default_rng(1000 + seed))
    run_decode_case(spec, lengths, page, seed=seed, nan_unheld=True, use_cuda_graph=graph,
                    max_batch_size=len(lengths), **scales)


def draw_verify(rng):
    """Decode of several tokens a request (speculative decoding's verify step): q_len 1-8, a wrapper built for as
    many or more, the requests holding at least their own tokens, except sometimes one (fewer keys than
    tokens); the pipeline the wrapper picks for the rows, or one named (the transposed one only where its 16
    rows hold them)."""
    hkv = int(rng.choice([1, 2, 4, 8]))
    group = int(rng.choice([1, 2, 3, 4, 5, 8, 16] if hkv > 1 else [1, 4, 8, 16, 32]))
    q_len = int(rng.integers(1, 9))
    max_q_len = int(rng.choice([q_len, int(rng.integers(q_len, 9))]))
    q_dtype = str(rng.choice(["bf16", "fp16"]))
    head_dim, kv_dtype = int(rng.choice([64, 128, 256])), str(rng.choice([q_dtype, "fp8_e4m3"]))
    pipeline = str(rng.choice(["auto", "normal", "transposed"]))
    if pipeline == "transposed" and group * max_q_len > 16:
        pipeline = "normal"
    spec = AttentionSpec(num_qo_heads=hkv * group, num_kv_heads=hkv, head_dim_qk=head_dim, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, kv_layout=str(rng.choice(["NHD", "HND"])), pipeline=pipeline,
                         logits_soft_cap=float(rng.choice([0.0, 30.0])),
                         window_left=int(rng.choice([-1, -1, int(rng.integers(1, 600))])))
    lengths = [max(q_len, x) for x in edge_lengths(rng, int(rng.integers(1, 10)))]
    page = int(rng.choice([1, 3, 7, 16, 33, 64]))
    scales = {"k_scale": float(rng.uniform(0.25, 2)), "v_scale": float(rng.uniform(0.25, 2))} \
        if spec.kv_dtype == "fp8_e4m3" else {}
    merge_launch = bool(rng.random() < 0.3)
    if q_len > 1 and rng.random() < 0.5:  # (drawn last: the draws above stay as they were)
        # a request of fewer keys than tokens: its first tokens see no key (zero rows, LSE -inf)
        lengths[int(rng.integers(len(lengths)))] = int(rng.integers(1, q_len))
    return spec, lengths, page, q_len, max_q_len, scales, merge_launch


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_verify(seed):
    spec, lengths, page, q_len, max_q_len, scales, merge_launch = draw_verify(np.random.default_rng(7000 + seed))
    verify_case(spec, lengths, page, q_len, seed=seed, max_q_len=max_q_len, out_rows_extra=3,
                merge_launch=merge_launch, **scales)


def draw_prefill(rng):
    hkv = int(rng.choice([1, 2, 4, 8]))
    spec = AttentionSpec(family="prefill", num_kv_heads=hkv, num_qo_heads=hkv * int(rng.choice([1, 2, 4, 8])),
                         head_dim_qk=int(rng.choice([64, 128, 256])), q_dtype=str(rng.choice(["bf16", "fp16"])),
                         causal=bool(rng.random() < 0.6), kv_layout=str(rng.choice(["NHD", "HND"])),
                         logits_soft_cap=float(rng.choice([0.0, 0.0, 30.0])),
                         window_left=int(rng.choice([-1, -1, int(rng.integers(1, 400))])))
    kv_lens = [max(1, x) for x in edge_lengths(rng, int(rng.integers(1, 6)), tile=128, longest=2500)]
    kv_lens = [min(x, 2500) for x in kv_lens]  # (the float64 reference holds [heads, qo, kv] scores)
    # queries at most the keys (bottom-right causal: chunked prefill), now and then a single token
    qo_lens = [int(rng.choice([1, x, int(rng.integers(1, x + 1))])) for x in kv_lens]
    page = int(rng.choice([0, 1, 7, 16, 64]))  # 0: ragged K/V
    scales = {}
    if rng.random() < 0.5:  # fp8 K/V with its scales (drawn last: the draws above stay those of each seed)
        spec = dataclasses.replace(spec, kv_dtype="fp8_e4m3")
        scales = {"k_scale": float(rng.uniform(0.25, 2)), "v_scale": float(rng.uniform(0.25, 2))}
    return spec, qo_lens, kv_lens, page, scales


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_prefill(seed):
    spec, qo_lens, kv_lens, page, scales = draw_prefill(np.random.default_rng(2000 + seed))
    k_scale, v_scale = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)
    w = BatchPrefill(spec)
    if page == 0:
        q, k, v, qo, kv = ragged_case(spec, qo_lens, kv_lens, seed=seed)
        if spec.kv_dtype == "fp8_e4m3":
            k, v = (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
        w.plan(qo, kv, **scales)
        kv_arg, per = (k, v), [(k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]]) for b in range(len(kv_lens))]
    else:
        twin = AttentionSpec(num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                             head_dim_qk=spec.head_dim_qk, q_dtype=spec.q_dtype, kv_dtype=spec.kv_dtype,
                             kv_layout=spec.kv_layout)
        _, kv_arg, (indptr, indices, last), per = make_paged_case(twin, kv_lens, page, seed=seed)
        q = torch.randn(sum(qo_lens), spec.num_qo_heads, spec.head_dim_qk, device="cuda").to(
            attnforge.checks.TORCH_DTYPES[spec.q_dtype])
        qo = np.concatenate([[0], np.cumsum(qo_lens)])
        w.plan(qo, indptr, indices, last, page_size=page, **scales)
    # (fp8 values times the drawn scales may need more bits than q's type: the reference takes them in
    # float64, and the low-precision yardstick rounds them as the kernel's widening does not)
    per = [(k.double() * k_scale, v.double() * v_scale) for k, v in per]
    out, lse = w.run(q, kv_arg, out=poison(q.shape, q.dtype), return_lse=True)
    torch.cuda.synchronize()
    # (no allowance for split plans: their partial states are float32, each output rounds once; seed 917 read 2.8x
    # torch's error when they were 16-bit)
    check_against_reference(spec, q, out, lse, per, qo)


def draw_prefill_split_dims(rng):
    """Values narrower than keys (ragged 16-bit K/V only): every pair, with the prefill axes that apply."""
    hkv = int(rng.choice([1, 2, 4, 8]))
    dims = PREFILL_QK_VO_DIMS[int(rng.integers(len(PREFILL_QK_VO_DIMS)))]
    spec = AttentionSpec(family="prefill", num_kv_heads=hkv, num_qo_heads=hkv * int(rng.choice([1, 2, 4, 8])),
                         head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype=str(rng.choice(["bf16", "fp16"])),
                         causal=bool(rng.random() < 0.6), logits_soft_cap=float(rng.choice([0.0, 0.0, 30.0])),
                         window_left=int(rng.choice([-1, -1, int(rng.integers(1, 400))])))
    kv_lens = [min(x, 2500) for x in edge_lengths(rng, int(rng.integers(1, 6)), tile=128, longest=2500)]
    qo_lens = [int(rng.choice([1, x, int(rng.integers(1, x + 1))])) if x else int(rng.integers(0, 3)) for x in kv_lens]
    return spec, qo_lens, kv_lens


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_prefill_split_dims(seed):
    spec, qo_lens, kv_lens = draw_prefill_split_dims(np.random.default_rng(4000 + seed))
    q, k, v, qo, kv = split_case(spec, qo_lens, kv_lens, seed=seed, v_view=seed % 2 == 1)
    w = BatchPrefill(spec)
    w.plan(qo, kv)
    out, lse = w.run(q, (k, v), out=poison((q.shape[0], spec.num_qo_heads, spec.head_dim_vo), q.dtype),
                     return_lse=True)
    torch.cuda.synchronize()
    assert w.kernel.backend == "wgmma"
    per = [(k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]]) for b in range(len(kv_lens))]
    max_abs_v = v.abs().max().item() if v.numel() else 0.0  # (every request empty: seeds 30, 129, 151, 160)
    check_against_reference(spec, q, out, lse, per, qo,
                            dominant_weight_error=weight_rounding_allowance(q.dtype, max_abs_v))


def draw_mla(rng):
    heads = int(rng.choice([8, 16, 32, 64, 128]))
    q_dtype = str(rng.choice(["bf16", "fp16"]))
    kv_dtype = str(rng.choice([q_dtype, q_dtype, "fp8_e4m3"]))
    spec = mla_spec(heads, str(rng.choice(["normal", "transposed"])), q_dtype=q_dtype, kv_dtype=kv_dtype)
    lengths = edge_lengths(rng, int(rng.integers(1, 8)))
    scales = {"k_scale": float(rng.uniform(0.25, 2)), "v_scale": float(rng.uniform(0.25, 2))} \
        if kv_dtype == "fp8_e4m3" else {}
    return (spec, lengths, int(rng.choice([1, 7, 16, 32, 64])), int(rng.integers(1, 5)), bool(rng.random() < 0.5),
            bool(rng.random() < 0.3), scales)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_mla(seed):
    spec, lengths, page, q_len, unified, graph, scales = draw_mla(np.random.default_rng(3000 + seed))
    run_mla_case(spec, lengths, page, q_len=q_len, seed=seed, unified=unified, nan_unheld=True,
                 sm_scale=0.1 if seed % 3 == 0 else None, use_cuda_graph=graph, max_batch_size=len(lengths),
                 **scales)


def draw_cascade(rng):
    """A cascade batch: 1-3 shared levels, each a partition of the requests into groups (some empty), every
    group and every request's suffix of a drawn length (0 included)."""
    hkv = int(rng.choice([1, 2, 4, 8]))
    spec = AttentionSpec(num_kv_heads=hkv, num_qo_heads=hkv * int(rng.choice([1, 2, 4, 8])),
                         head_dim_qk=int(rng.choice([64, 128, 256])), q_dtype=str(rng.choice(["bf16", "fp16"])),
                         kv_layout=str(rng.choice(["NHD", "HND"])), logits_soft_cap=float(rng.choice([0.0, 0.0, 30.0])))
    batch = int(rng.integers(1, 9))
    levels = []
    for _ in range(int(rng.integers(1, 4))):
        cuts = np.sort(rng.integers(0, batch + 1, size=int(rng.integers(0, 4))))  # repeated cuts: empty groups
        groups = np.concatenate([[0], cuts, [batch]])
        levels.append((groups, edge_lengths(rng, len(groups) - 1)))
    suffix = edge_lengths(rng, batch)
    sm_scale = float(rng.uniform(0.05, 0.2)) if rng.random() < 0.3 else None
    scales = (1.0, 1.0)
    if rng.random() < 0.4:  # an fp8 cache: the levels' prefill and the suffix's decode read it with its scales
        spec = dataclasses.replace(spec, kv_dtype="fp8_e4m3")
        scales = (float(rng.uniform(0.25, 2)), float(rng.uniform(0.25, 2)))
    return spec, levels, suffix, int(rng.choice([1, 7, 16, 64])), sm_scale, scales


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_random_cascade(seed):
    """CascadeDecode against decode over each request's whole KV (its groups' pages on every level, then its
    own): outputs and LSE, with the dtype-relative bound of the decode tests."""
    spec, levels, suffix, page, sm_scale, (k_scale, v_scale) = draw_cascade(np.random.default_rng(5000 + seed))
    # every segment (a level's group or a request's suffix) as one request of one paged cache
    segments = [n for _, lens in levels for n in lens] + suffix
    q, cache, (indptr, indices, last), per_segment = make_paged_case(spec, segments, page, seed=seed)
    tables, first, batch = [], 0, len(suffix)

    def table(lo, hi):  # the CSR page table of segments lo..hi-1
        ptr = indptr[lo:hi + 1]
        return ptr - ptr[0], indices[ptr[0]:ptr[-1]], last[lo:hi]
    for groups, lens in levels:
        tables.append((groups, *table(first, first + len(lens))))
        first += len(lens)
    q = torch.randn(batch, spec.num_qo_heads, spec.head_dim_qk, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(seed)).to(q.dtype)
    c = CascadeDecode(spec, max_batch_size=batch)
    c.plan(levels=tables, suffix=table(first, first + batch), page_size=page, sm_scale=sm_scale, k_scale=k_scale,
           v_scale=v_scale)
    out, lse = c.run(q, cache, out=poison((batch, spec.num_qo_heads, spec.head_dim_vo), q.dtype), return_lse=True)
    torch.cuda.synchronize()
    per_request = []
    for b in range(batch):
        level_segments, at = [], 0
        for groups, lens in levels:
            level_segments.append(at + int(np.searchsorted(groups, b, side="right")) - 1)
            at += len(lens)
        own = [per_segment[i] for i in level_segments] + [per_segment[first + b]]
        per_request.append((torch.cat([k for k, _ in own]), torch.cat([v for _, v in own])))
    eff_scale = (sm_scale or spec.head_dim_qk ** -0.5) * k_scale  # (the stored values: k_scale folds in here)
    ref, ref_lse = decode_reference(spec, q, per_request, sm_scale=eff_scale, v_scale=v_scale)
    low, _ = decode_reference(spec, q.float(), [(k.to(q.dtype).float(), v.to(q.dtype).float())
                                                for k, v in per_request], sm_scale=eff_scale, v_scale=v_scale,
                              dtype=torch.float32)
    what = f"{spec.name} page{page} levels {[(g.tolist(), n) for g, n in levels]} suffix {suffix}"
    # no allowance for a second rounding: the levels and the suffix write float32 rows, rounded once by the merge
    # (with 16-bit level rows, seeds 10, 22 and 45 of 10:110 read up to 1.8x the bound)
    assert_attention_close(out, ref, low.to(q.dtype), what)
    assert_lse_close(lse, ref_lse, what)


QUEST_SUMMARIES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, "fp8-channels", "int4"]


def draw_quest(rng):
    """A Quest step: any decode spec QuestDecode takes, summaries of every format, budgets below and above
    the requests' page counts."""
    hkv = int(rng.choice([1, 2, 4, 8]))
    spec = AttentionSpec(num_kv_heads=hkv, num_qo_heads=hkv * int(rng.choice([1, 2, 4, 8])),
                         head_dim_qk=int(rng.choice([64, 128, 256])), q_dtype=str(rng.choice(["bf16", "fp16"])),
                         kv_layout=str(rng.choice(["NHD", "HND"])), logits_soft_cap=float(rng.choice([0.0, 0.0, 30.0])))
    lengths = edge_lengths(rng, int(rng.integers(1, 8)))
    page = int(rng.choice([1, 7, 16, 64]))
    summary = QUEST_SUMMARIES[int(rng.integers(len(QUEST_SUMMARIES)))]
    budget_pages, select = int(rng.integers(1, 48)), str(rng.choice(["kernel", "torch"]))
    sm_scale = float(rng.uniform(0.05, 0.2)) if rng.random() < 0.3 else None
    scales = (1.0, 1.0)
    if rng.random() < 0.3:  # an fp8 cache: the selection's decode reads it with the plan's scales
        spec = dataclasses.replace(spec, kv_dtype="fp8_e4m3")
        scales = (float(rng.uniform(0.25, 2)), float(rng.uniform(0.25, 2)))
    return spec, lengths, page, summary, budget_pages, select, sm_scale, scales


def quest_index_of(spec, cache, indptr, indices, lengths, page, summary):
    """A QuestIndex over make_paged_case's cache: every token's key folded into its page's summary."""
    keys = cache[:, 0] if spec.kv_layout == "NHD" else cache[:, 0].transpose(1, 2)  # [pages, page, Hkv, D]
    index = QuestIndex(cache.shape[0], spec.num_kv_heads, spec.head_dim_qk, device="cuda",
                       **summary_format(summary, keys.float()))
    for b, n in enumerate(lengths):
        pos = torch.arange(n, device="cuda")
        page_ids = torch.as_tensor(indices[indptr[b]:indptr[b + 1]], device="cuda").long()[pos // page]
        index.append(keys[page_ids, pos % page].float(), page_ids)
    return index


def quest_capacity(indptr) -> dict:
    return {"max_batch_size": len(indptr) - 1, "max_num_pages": max(int(indptr[-1]), 1),
            "max_pages_per_request": max(int(np.diff(indptr).max()), 1)}


def check_selected_attention(spec, q, cache, out, lse, tables, last, page, sm_scale, k_scale, v_scale, what):
    """out / lse against float64 attention over each selection: tables[h] is (sel_indptr, sel) for the query
    heads of KV head h (one table for every head: a per-request selection)."""
    hkv, g = spec.num_kv_heads, spec.group_size
    eff_scale = (sm_scale or spec.head_dim_qk ** -0.5) * k_scale
    refs, lows, ref_lses = [], [], []
    for h in range(hkv):
        sel_ptr, sel = tables[h if len(tables) > 1 else 0]
        k_h, v_h = (cache[:, i, h:h + 1] if spec.kv_layout == "HND" else cache[:, i, :, h:h + 1] for i in (0, 1))
        per = reference.gather_paged(k_h.float(), v_h.float(), spec.kv_layout, sel_ptr.cpu().numpy(),
                                     sel.cpu().numpy(), last, page)
        one = dataclasses.replace(spec, num_qo_heads=g, num_kv_heads=1)
        q_h = q[:, h * g:(h + 1) * g]
        ref, ref_lse = decode_reference(one, q_h, per, sm_scale=eff_scale, v_scale=v_scale)
        low, _ = decode_reference(one, q_h.float(), [(k.to(q.dtype).float(), v.to(q.dtype).float()) for k, v in per],
                                  sm_scale=eff_scale, v_scale=v_scale, dtype=torch.float32)
        refs.append(ref)
        lows.append(low)
        ref_lses.append(ref_lse)
    assert_attention_close(out, torch.cat(refs, 1), torch.cat(lows, 1).to(q.dtype), what)
    assert_lse_close(lse, torch.cat(ref_lses, 1), what)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True], ids=["request", "head"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_quest(seed, per_head):
    """QuestDecode (one selection a request) and QuestHeadDecode (one a request and KV head, HND) against
    float64 attention over the torch selection (select_pages) from the wrapper's own scores, which are
    checked against the torch bound (page_scores) first."""
    spec, lengths, page, summary, budget_pages, select, sm_scale, (k_scale, v_scale) = draw_quest(
        np.random.default_rng(6000 + seed + 1000 * per_head))
    if per_head:
        spec = dataclasses.replace(spec, kv_layout="HND")
    q, cache, (indptr, indices, last), _ = make_paged_case(spec, lengths, page, seed=seed)
    index = quest_index_of(spec, cache, indptr, indices, lengths, page, summary)
    wrapper = QuestHeadDecode if per_head else QuestDecode
    quest = wrapper(spec, index, budget_tokens=budget_pages * page, page_size=page, select=select,
                    **quest_capacity(indptr))
    quest.plan(indptr, indices, last, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    out, lse = quest.run(q, cache, out=poison(q.shape, q.dtype), return_lse=True)
    torch.cuda.synchronize()
    dev_ptr, dev_idx = torch.as_tensor(indptr, device="cuda"), torch.as_tensor(indices, device="cuda")
    hkv, rows, view, row_ptr, ids = spec.num_kv_heads, q, index, dev_ptr, dev_idx
    if per_head:  # the kernel's rows: (request, KV head), each its group's queries over a per-head view
        rows, view = q.reshape(q.shape[0] * hkv, spec.group_size, -1), index.per_head_view()
        row_ptr, ids = expand_per_head(dev_ptr, dev_idx, hkv)
    # the torch bound, or for int4 the kernel's arithmetic (its query sums are int8 codes)
    want = int4_kernel_scores(rows, view, row_ptr, ids) if summary == "int4" else \
        page_scores(rows, view, row_ptr, ids).float()
    got = quest._scores[:want.numel()]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)
    # select from the kernel's scores: float32 sums in another order may break a near-tie at the boundary otherwise
    heads = [got]
    if per_head:  # request b's pages once per KV head, head-major -> one [pages] score vector per KV head
        per_page = torch.cat([got[lo * hkv:hi * hkv].view(hkv, hi - lo).T
                              for lo, hi in zip(indptr[:-1].tolist(), indptr[1:].tolist())])
        heads = [per_page[:, h].contiguous() for h in range(hkv)]
    tables = [select_pages(s, dev_ptr, dev_idx, budget_pages) for s in heads]
    what = f"{spec.name} page{page} {summary} budget {budget_pages} {select} lengths {lengths}"
    check_selected_attention(spec, q, cache, out, lse, tables, last, page, sm_scale, k_scale, v_scale, what)


def test_fuzz_seeds_parse():
    assert fuzz_seeds(None) == fuzz_seeds("") == DEFAULT_SEEDS
    assert fuzz_seeds("10:210") == range(10, 210)
    for bad in ("10", "5:5", "9:3", "-1:4", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="START:STOP"):
            fuzz_seeds(bad)


def test_draws_cover_the_axes():
    """The default seeds reach each option of the main axes at least once (a CPU test: if a change to the draws
    loses an option, pick another seed range)."""
    SEEDS = DEFAULT_SEEDS  # (whatever range a long run draws)
    dec = [draw_decode(np.random.default_rng(1000 + s)) for s in SEEDS]
    pre = [draw_prefill(np.random.default_rng(2000 + s)) for s in SEEDS]
    mla = [draw_mla(np.random.default_rng(3000 + s)) for s in SEEDS]
    assert {d[0].head_dim_qk for d in dec} == {64, 128, 256}
    assert {d[0].kv_dtype == "fp8_e4m3" for d in dec} == {True, False}
    assert {d[0].kv_layout for d in dec} == {"NHD", "HND"}
    assert {d[0].pipeline for d in dec} == {"normal", "transposed"}
    assert any(0 in d[1] for d in dec) and any(d[4] for d in dec)
    assert {p[0].causal for p in pre} == {True, False} and {p[3] == 0 for p in pre} == {True, False}
    assert {p[0].head_dim_qk for p in pre} == {64, 128, 256}
    assert {p[0].kv_dtype == "fp8_e4m3" for p in pre} == {True, False}
    assert {p[3] == 0 for p in pre if p[0].kv_dtype == "fp8_e4m3"} == {True, False}  # fp8 ragged and paged
    split = [draw_prefill_split_dims(np.random.default_rng(4000 + s)) for s in SEEDS]
    assert {(p[0].head_dim_qk, p[0].head_dim_vo) for p in split} == set(PREFILL_QK_VO_DIMS)
    assert {p[0].causal for p in split} == {True, False} and any(0 in p[2] for p in split)
    assert any(p[0].window_left > 0 for p in split) and any(p[0].logits_soft_cap > 0 for p in split)
    assert {m[0].pipeline for m in mla} == {"normal", "transposed"}
    assert {m[0].kv_dtype == "fp8_e4m3" for m in mla} == {True, False}
    assert len({m[3] for m in mla}) >= 3 and any(m[5] for m in mla)
    cas = [draw_cascade(np.random.default_rng(5000 + s)) for s in SEEDS]
    assert {len(c[1]) for c in cas} == {1, 2, 3} and {c[0].head_dim_qk for c in cas} == {64, 128, 256}
    assert any(0 in np.diff(g) for c in cas for g, _ in c[1])  # an empty group
    assert any(0 in n for c in cas for _, n in c[1]) and any(0 in c[2] for c in cas)  # an empty group KV, suffix
    assert any(c[0].logits_soft_cap > 0 for c in cas) and any(c[4] is not None for c in cas)
    assert {c[0].kv_dtype == "fp8_e4m3" for c in cas} == {True, False}
    ver = [draw_verify(np.random.default_rng(7000 + s)) for s in SEEDS]
    assert {v[3] > 1 for v in ver} == {True, False} and any(v[4] > v[3] for v in ver)  # padding rows too
    assert {v[0].kv_dtype == "fp8_e4m3" for v in ver} == {True, False} and any(v[6] for v in ver)
    assert any(0 < n < v[3] for v in ver for n in v[1])  # a request of fewer keys than tokens
    quest = [draw_quest(np.random.default_rng(6000 + s)) for s in SEEDS]
    assert {d[0].head_dim_qk for d in quest} == {64, 128, 256} and {d[2] for d in quest} >= {1, 7}
    assert len({str(d[3]) for d in quest}) >= 4 and {d[5] for d in quest} == {"kernel", "torch"}
    assert {d[0].kv_dtype == "fp8_e4m3" for d in quest} == {True, False} and any(0 in d[1] for d in quest)

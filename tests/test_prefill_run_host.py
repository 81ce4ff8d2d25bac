"""BatchPrefill.run() and attention() on a machine without a GPU: the driver, the device checks, pinned memory,
the SM count and the TMA encoder are stubbed, and each launched params struct is read back. A run carries its
own tensors over the plan's fixed fields (checks.RunMemo, codegen.ParamsTemplate) with the bytes a full pack
gives; attention() plans once per call signature and again only when the scale or the mask's inputs change."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from attnforge import AttentionSpec, BatchPrefill, dense, variants
from attnforge.jit import tma as tma_maps
from attnforge.prefill import RAGGED_PAGE
from helpers import count_calls, stub_host_prefill


def fake_map(t, box) -> bytes:
    """A 'map' that names its tensor and box, so a test sees which map reached which field."""
    return (t.data_ptr().to_bytes(8, "little") + box.rows.to_bytes(8, "little")) * 8


@pytest.fixture
def recorder(monkeypatch):
    return stub_host_prefill(monkeypatch, fake_map)


def full_pack(w, q, k, v, out, lse, strides):
    """The params as every run packed them before the template: all fields, from the plan and the tensors."""
    pl = w._plan
    kernel = pl["kernel"]
    mod = w.spec.score_mod.param_values(w.device) if w.spec.score_mod is not None else {}
    return kernel.params.pack(
        q=q.data_ptr(), k_cache=k.data_ptr(), v_cache=v.data_ptr(), out=out.data_ptr(),
        lse=0 if lse is None else lse.data_ptr(), **pl["ptrs"], page_size=pl["page_size"], ragged=int(pl["ragged"]),
        work_count=pl["num_work"], **strides, **variants.variant_values(w.spec, pl["sm_scale"]), **mod,
        **kernel.tma_values(k, v, pl["page_size"], pl["ragged"], q=q),
        **({"v_scale": pl["v_scale"]} if kernel.fp8_kv else {}))


SPEC = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True)


def test_ragged_runs_carry_their_own_tensors_with_a_full_packs_bytes(recorder):
    w = BatchPrefill(SPEC, device="cpu")
    assert w.kernel.has_tma  # (the maps are per-run fields: each run must carry its own)
    q = [torch.randn(80, 32, 128).bfloat16() for _ in range(2)]
    kv = [(torch.randn(700, 8, 128).bfloat16(), torch.randn(700, 8, 128).bfloat16()) for _ in range(2)]
    for plan_lengths in ((80, 100), (80, 120)):  # two plans: each template takes the plan's fields
        w.plan(np.array([0, plan_lengths[0]]), np.array([0, plan_lengths[1]]))
        assert w._plan["num_slots"] == 1
        for qi, (k, v) in ((0, kv[0]), (1, kv[1]), (0, kv[1]), (0, kv[0])):
            out, lse = w.run(q[qi], (k, v), return_lse=True)
            p = recorder.last(w)
            strides = dict(stride_page=0, stride_token=k.stride(0), stride_head=k.stride(1), q_stride_n=32 * 128,
                           q_stride_h=128, out_stride_n=32 * 128, out_stride_h=128, out_stride_slot=0,
                           lse_stride_n=32, lse_stride_h=1, lse_stride_slot=0)
            assert bytes(p) == bytes(full_pack(w, q[qi], k, v, out, lse, strides))
            assert (p.q, p.k_cache, p.v_cache, p.out, p.lse) == (q[qi].data_ptr(), k.data_ptr(), v.data_ptr(),
                                                                 out.data_ptr(), lse.data_ptr())
            assert bytes(p.k_tmap)[:8] == k.data_ptr().to_bytes(8, "little")
            assert bytes(p.v_tmap)[:8] == v.data_ptr().to_bytes(8, "little")
            assert p.work_count == w._plan["num_work"] and p.page_size == RAGGED_PAGE
    w.plan(np.array([0, 80]), np.array([0, 700]))  # long keys: split, partial states [rows, slots, Hq, D]
    assert w._plan["num_slots"] == 2
    out = w.run(q[1], kv[1])
    p = recorder.last(w)
    assert p.out != out.data_ptr() and (p.out_stride_n, p.out_stride_slot, p.k_cache) == (
        2 * 32 * 128, 32 * 128, kv[1][0].data_ptr())
    with pytest.raises(ValueError, match="k.shape"):  # fewer tokens than the plan's: refused though seen before
        w.run(q[0], (kv[0][0][:600], kv[0][1][:600]))
    with pytest.raises(ValueError, match="q.dtype"):
        w.run(q[0].half(), kv[0])


def test_paged_runs_recheck_page_ids_and_what_differs(recorder):
    w = BatchPrefill(SPEC, device="cpu")
    cache = torch.randn(10, 2, 16, 8, 128).bfloat16()
    w.plan(np.array([0, 20]), np.array([0, 3]), np.array([4, 5, 6]), np.array([16]), page_size=16)
    q = torch.randn(20, 32, 128).bfloat16()
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    p = recorder.last(w)
    k, v = cache[:, 0], cache[:, 1]
    strides = dict(stride_page=k.stride(0), stride_token=k.stride(1), stride_head=k.stride(2), q_stride_n=32 * 128,
                   q_stride_h=128, out_stride_n=32 * 128, out_stride_h=128, out_stride_slot=0, lse_stride_n=32,
                   lse_stride_h=1, lse_stride_slot=0)
    assert bytes(p) == bytes(full_pack(w, q, k, v, out, None, strides))
    w.plan(np.array([0, 20]), np.array([0, 2]), np.array([4, 9]), np.array([16]), page_size=16)
    w.run(q, cache, out=out)
    with pytest.raises(ValueError, match="page ids <"):  # the cache passed before, but this plan reads page 9
        w.run(q, cache[:8], out=out)
    with pytest.raises(ValueError, match="out.shape"):
        w.run(q, cache, out=out[:10])
    with pytest.raises(ValueError, match="out.dtype"):
        w.run(q, cache, out=out.half())


def test_graph_mode_plans_name_only_pages_of_the_captured_cache(recorder, monkeypatch):
    """As decode's (tests/test_run_host.py): after a captured run over 8 pages, a plan naming page 8 is refused."""
    w = BatchPrefill(SPEC, device="cpu", use_cuda_graph=True, max_batch_size=1, max_num_pages=16)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    q = torch.randn(20, 32, 128).bfloat16()
    w.plan(np.array([0, 20]), np.array([0, 2]), np.array([4, 9]), np.array([16]), page_size=16)
    w.run(q, torch.randn(10, 2, 16, 8, 128).bfloat16())
    capturing["now"] = True
    w.run(q, torch.randn(10, 2, 16, 8, 128).bfloat16())
    w.run(q, torch.randn(12, 2, 16, 8, 128).bfloat16())
    w.plan(np.array([0, 20]), np.array([0, 2]), np.array([4, 9]), np.array([16]), page_size=16)
    with pytest.raises(ValueError, match=r"page ids < 10 \(the pages of the cache a captured graph reads\)"):
        w.plan(np.array([0, 20]), np.array([0, 2]), np.array([4, 10]), np.array([16]), page_size=16)


def test_a_plan_whose_offsets_overflow_int32_is_refused_before_any_launch(recorder):
    w = BatchPrefill(SPEC, device="cpu")
    with pytest.raises(ValueError, match=r"fit in int32 \(< 2\^31\), got 2147483648\. Split the batch"):
        w.plan(np.array([0, 16]), np.array([0, 64]), kv_offset=np.array([2**31]))
    # a query count past int32 is refused before its work items are built (2^33 tokens: 48 GiB of them)
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]: expected fewer than 2\^31 query tokens in one plan"):
        w.plan(np.array([0, 2**33]), np.array([0, 2**33]))
    # fewer tokens, but packed rows (tokens x group 4) past int32: refused before the work items too
    with pytest.raises(ValueError, match=r"expected fewer than 2\^31 packed query rows .*got 2147483648\."):
        w.plan(np.array([0, 2**29]), np.array([0, 2**29]))
    assert w._plan is None and not recorder.launches


@pytest.mark.parametrize("name", ["q_offset", "kv_offset"])
def test_a_long_plan_checks_its_offsets_though_it_skips_the_work_items(recorder, name):
    """Plans of 8192+ work values range-check every array but the work items (int32, bounded by what is checked):
    an offset past int32 is still refused there, as in a short plan."""
    w = BatchPrefill(SPEC, device="cpu")
    qo = np.arange(17) * 2048  # 16 requests: 1024 query tiles x 8 KV heads, 6 values an item
    offsets = qo[:-1].copy()
    w.plan(qo, qo, **{name: offsets})
    assert w._plan["num_work"] * 6 >= 8192, "a plan long enough to skip the work items"
    offsets[7] = 2**31
    with pytest.raises(ValueError, match=r"fit in int32 \(< 2\^31\), got 2147483648\. Split the batch"):
        w.plan(qo, qo, **{name: offsets})
    assert not recorder.launches


def test_repeated_prefill_inputs_skip_their_checks_across_plans(recorder, monkeypatch):
    from attnforge import paged
    calls = count_calls(monkeypatch, paged, "split_cache")
    w = BatchPrefill(SPEC, device="cpu")
    q, layers = torch.randn(20, 32, 128).bfloat16(), [torch.randn(10, 2, 16, 8, 128).bfloat16() for _ in range(3)]
    for step in range(3):
        w.plan(np.array([0, 20]), np.array([0, 3]), np.array([step, 4, 5]), np.array([16]), page_size=16)
        for cache in layers:
            w.run(q, cache)
    assert calls["n"] == len(layers) and len(recorder.launches) == 9


def sdpa_inputs(lq=64, lk=96, hq=8, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, lq, 128, generator=g).bfloat16()
    k, v = (torch.randn(2, hkv, lk, 128, generator=g).bfloat16() for _ in range(2))
    return q, k, v


def test_attention_plans_once_per_signature_and_scale(recorder, monkeypatch):
    calls = count_calls(monkeypatch, BatchPrefill, "plan")
    q, k, v = sdpa_inputs()
    dense.attention(q, k, v, enable_gqa=True)
    first = recorder.launches[-1][2]
    for _ in range(3):
        out = dense.attention(q, k, v, enable_gqa=True)
    p = recorder.launches[-1][2]
    assert calls["n"] == 1 and p.out == out.data_ptr()
    assert (p.q, p.k_cache, p.stride_token, p.stride_head, p.sm_scale) == (
        q.data_ptr(), k.data_ptr(), 128, 96 * 128, pytest.approx(1 / math.sqrt(128)))
    assert [getattr(p, n) for n in ("work", "kv_offset", "q_offset")] == \
        [getattr(first, n) for n in ("work", "kv_offset", "q_offset")]
    dense.attention(q, k, v, enable_gqa=True, scale=0.5)
    assert calls["n"] == 2 and recorder.launches[-1][2].sm_scale == 0.5
    dense.attention(q, k, v, enable_gqa=True, scale=0.5)
    q2, k2, v2 = sdpa_inputs(lq=32, lk=200)  # another signature: its own plan
    dense.attention(q2, k2, v2, enable_gqa=True)
    assert calls["n"] == 3 and recorder.launches[-1][2].stride_head == 200 * 128
    dense.attention(q, k, v, enable_gqa=True)  # the first signature kept its own plan (scale None now: a replan)
    dense.attention(q2, k2, v2, enable_gqa=True)
    assert calls["n"] == 4


@pytest.mark.parametrize("lk", [96, 4096])  # one slot; KV split over slots (few query tiles, long keys)
def test_attention_launches_a_full_packs_bytes_as_its_tensors_alternate(recorder, monkeypatch, lk):
    """attention() narrows the plan's template by q, k and v (dense templates): every launch carries the bytes a
    full pack of its own tensors, plan, output and modifier values gives, as two tensor sets alternate, across a
    replan (another scale) and as a captured 0-d tensor the score reads changes between calls."""
    import types
    from attnforge import codegen
    monkeypatch.setattr(dense, "_CALLS", {})
    narrowings = count_calls(monkeypatch, codegen.ParamsTemplate, "narrowed")
    sets = [sdpa_inputs(lq=64, lk=lk, seed=s) for s in (1, 2)]
    cap = torch.tensor(30.0)

    def capped(s, b, h, qi, ki):
        return cap * torch.tanh(s / cap)
    steps = [(0, None, 30.0), (1, None, 20.0), (0, None, 20.0), (0, 0.5, 10.0), (1, 0.5, 10.0), (0, 0.5, 5.0)]
    for i, scale, value in steps:
        cap.fill_(value)
        q, k, v = sets[i]
        dense.attention(q, k, v, score_mod=capped, scale=scale, enable_gqa=True, return_lse=True)
        w = dense.dense_call(q, k, v, dense.compiled_mod(capped, None), True).wrapper
        p, slots = recorder.last(w), w._plan["num_slots"]
        assert (slots > 1) == (lk == 4096)
        strides = dict(stride_page=0, stride_token=k.stride(2), stride_head=k.stride(1), q_stride_n=q.stride(2),
                       q_stride_h=q.stride(1), out_stride_n=slots * 128, out_stride_h=64 * slots * 128,
                       out_stride_slot=128 if slots > 1 else 0, lse_stride_n=slots, lse_stride_h=64 * slots,
                       lse_stride_slot=1 if slots > 1 else 0)
        out, lse = (types.SimpleNamespace(data_ptr=lambda at=at: at) for at in (p.out, p.lse))
        assert bytes(p) == bytes(full_pack(w, q, k, v, out, lse, strides))
        assert (p.q, p.k_cache, p.v_cache, p.mod_s0) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), value)
    assert len({id(p) for _, _, p in recorder.launches}) == len(recorder.launches), "each launch its own struct"
    assert narrowings["n"] == 4, "one narrowed template per (plan, tensor set): two sets under each of two plans"


def test_is_causal_plans_the_causal_kernel_as_batch_prefill_would(recorder, monkeypatch):
    """attention(is_causal=True) runs the prefill kernels' own causal tiles: its wrapper's spec is causal and its
    plan uploads what BatchPrefill(causal) plans for the same requests; a causal and a plain call of the same
    tensors keep a plan each; lengths that differ, or a flag that is not a bool, are refused before any launch."""
    monkeypatch.setattr(dense, "_CALLS", {})
    calls = count_calls(monkeypatch, BatchPrefill, "plan")
    q, k, v = sdpa_inputs(lq=300, lk=300)
    for causal in (True, False, True, False):
        dense.attention(q, k, v, enable_gqa=True, is_causal=causal)
        w = dense.dense_call(q, k, v, None, True, causal).wrapper
        assert w.spec.causal is causal and recorder.last(w) is recorder.launches[-1][2]
    assert calls["n"] == 2
    want = BatchPrefill(dataclasses.replace(w.spec, causal=True), device="cpu")
    want.plan(np.array([0, 300, 600]), np.array([0, 300, 600]), q_offset=np.array([0, 8 * 300]),
              kv_offset=np.array([0, 2 * 300]))
    got = dense.dense_call(q, k, v, None, True, True).wrapper
    assert np.array_equal(np.asarray(got._plan["host"]), np.asarray(want._plan["host"]))
    assert got._plan["kernel"].kernel_name == want._plan["kernel"].kernel_name
    masked = dense.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi // 100 == ki // 100, enable_gqa=True,
                             is_causal=True)  # (both: the mask within the causal tiles)
    assert masked.shape == q.shape and recorder.launches[-1][2].work_count > 0
    n = len(recorder.launches)
    with pytest.raises(ValueError, match=r"is_causal=True\): expected as many queries as keys, got Lq=64 and Lk=96\. "
                                         r"SDPA aligns .* top left .* q_idx - 32 >= kv_idx"):
        dense.attention(*sdpa_inputs(), enable_gqa=True, is_causal=True)
    with pytest.raises(ValueError, match=r"got Lq=96 and Lk=64\. .* q_idx \+ 32 >= kv_idx"):
        dense.attention(*sdpa_inputs(lq=96, lk=64), enable_gqa=True, is_causal=True)
    with pytest.raises(ValueError, match=r"is_causal=...\): expected a bool, got 1"):
        dense.attention(q, k, v, enable_gqa=True, is_causal=1)
    assert len(recorder.launches) == n


def test_attention_checks_each_new_signature_and_each_address(recorder, monkeypatch):
    monkeypatch.setattr(dense, "_CALLS", {})  # (an earlier test's call of these shapes holds its own recorder)
    q, k, v = sdpa_inputs()
    dense.attention(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="num heads"):
        dense.attention(q, k, v)  # enable_gqa is part of the signature
    with pytest.raises(ValueError, match="k/v dtype"):
        dense.attention(q, k.half(), v.half(), enable_gqa=True)
    with pytest.raises(ValueError, match="k/v shape"):
        dense.attention(q, k, v[:, :, :50], enable_gqa=True)
    with pytest.raises(ValueError, match="q.shape"):
        dense.attention(q[0], k, v, enable_gqa=True)
    buf = torch.randn(q.numel() + 1).bfloat16()
    shifted = buf[1:].view(q.shape)  # a layout seen before, at an address that is not 16-byte aligned
    dense.attention(shifted, k, v, enable_gqa=True)  # taken as SDPA takes it: through an aligned copy
    p = recorder.launches[-1][2]
    assert p.q != shifted.data_ptr() and p.q % 16 == 0 and p.k_cache == k.data_ptr()


def test_attention_copies_non_contiguous_inputs(recorder):
    q, k, v = sdpa_inputs()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, L, D] view of a [B, L, H, D] tensor
    dense.attention(qt, k, v, enable_gqa=True)
    p = recorder.launches[-1][2]
    assert p.q != qt.data_ptr() and (p.q_stride_n, p.q_stride_h) == (128, 64 * 128)


def test_each_modifier_object_launches_with_its_own_tensors(recorder):
    """Two modifiers of one expression are equal specs (one kernel) but hold different tensors: each call must
    launch with its own (a wrapper shared by spec launched the first modifier's tensors)."""
    q, k, v = sdpa_inputs()
    b1, b2 = torch.randn(8), torch.randn(8)
    dense.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + b1[h], enable_gqa=True)
    assert recorder.launches[-1][2].mod_t0 == b1.data_ptr()
    dense.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + b2[h], enable_gqa=True)
    assert recorder.launches[-1][2].mod_t0 == b2.data_ptr()


def test_single_prefill_launches_each_modifiers_own_tensors(recorder):
    from attnforge import mods
    from attnforge.prefill import single_prefill
    q, k, v = torch.randn(20, 8, 128).bfloat16(), torch.randn(40, 2, 128).bfloat16(), torch.randn(40, 2, 128).bfloat16()
    for slopes in (torch.rand(8), torch.rand(8)):
        single_prefill(q, k, v, score_mod=mods.alibi(slopes))
        assert recorder.launches[-1][2].mod_t0 == slopes.data_ptr()


def _uploaded(w, name: str, n: int) -> list:
    """n int32 values of one planned array, read back from the plan's (host-only) device buffer."""
    dev = w._upload.dev
    assert w._plan["dev"] is dev
    off = (w._plan["ptrs"][name] - dev.data_ptr()) // 4
    return dev[off:off + n].tolist()


def test_plans_upload_through_two_staged_buffers_that_grow_when_outgrown(recorder):
    """Outside graph mode a plan's int32 arrays go through two reused staging buffers (jit/upload.py),
    not a fresh pinned and device tensor a plan; a plan larger than the buffers gets new, larger ones,
    after every copy from the old ones is waited for."""
    from attnforge.jit.upload import HostOnlyUpload
    from attnforge.prefill import MIN_UPLOAD_INT32
    w = BatchPrefill(SPEC, device="cpu")
    region = lambda name, n: _uploaded(w, name, n)  # noqa: E731
    for kv in (100, 120, 140):
        w.plan(np.array([0, 80]), np.array([0, kv]))
        assert region("qo_indptr", 2) == [0, 80] and region("kv_indptr", 2) == [0, kv] and region("kv_len", 1) == [kv]
        work = np.array(region("work", 6 * w._plan["num_work"])).reshape(-1, 6)
        tile_q = w.kernel.tile_q  # 80 queries x group 4 = 320 packed rows a kv head
        assert sorted(map(tuple, work[:, :3].tolist())) == [(0, h, r) for h in range(8) for r in range(0, 320, tile_q)]
    first = w._upload
    assert isinstance(first, HostOnlyUpload) and first.dev.numel() == MIN_UPLOAD_INT32
    # buffers in turn: the third plan waits for the first plan's copy before it refills that buffer
    assert first.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 0)]
    w.plan(np.array([0, 16384]), np.array([0, 16384]))  # 4096 items: 24576 work values alone
    assert w._upload is not first and w._upload.dev.numel() >= max(2 * MIN_UPLOAD_INT32, len(w._plan["host"]))
    assert first.log[-2:] == [("wait", 0), ("wait", 1)]  # drained before its buffers were dropped
    assert region("qo_indptr", 2) == [0, 16384] and len(w._plan["host"]) > MIN_UPLOAD_INT32
    grown = w._upload
    w.plan(np.array([0, 80]), np.array([0, 100]))  # smaller again: the grown buffers serve it
    assert w._upload is grown and region("kv_len", 1) == [100]


def test_a_wrapper_asks_the_sm_count_once_across_plans(recorder, monkeypatch):
    """plan() needs the SM count up to three times (split, persistent grid, launch grid): asked of torch once."""
    calls = count_calls(monkeypatch, torch.cuda, "get_device_properties")
    w = BatchPrefill(SPEC, device="cpu")
    assert calls["n"] == 0  # (not at construction: a machine without a GPU builds wrappers too)
    for kv in (100, 5000, 40000):  # the last splits its long keys
        w.plan(np.array([0, 80]), np.array([0, kv]))
    assert calls["n"] == 1 and w._plan["num_slots"] > 1 and w._plan["grid"] <= 132


def test_graph_mode_plans_keep_their_addresses_and_copy_only_what_they_filled(recorder):
    """Graph mode: every array keeps its address across plans (a captured launch holds them), each plan
    copies the regions it filled (a few ranges, not the ~6 MB of capacity), and those hold its arrays."""
    w = BatchPrefill(SPEC, device="cpu", use_cuda_graph=True, max_batch_size=8, max_num_pages=4096)
    up = w._upload
    copies = []
    plain_copy = up._copy
    up._copy = lambda dst, src, nbytes, stream: copies.append(nbytes) or plain_copy(dst, src, nbytes, stream)
    up.dev.fill_(-7)  # (poison: what no plan wrote stays -7)
    first = None
    for qo_lens, pages in (([80, 3], [9, 40]), ([200, 1, 17], [13, 2, 60])):
        b = len(qo_lens)
        qo = np.concatenate([[0], np.cumsum(qo_lens)])
        kvp = np.concatenate([[0], np.cumsum(pages)])
        indices = np.random.default_rng(b).permutation(4096)[:kvp[-1]]
        last = np.full(b, 5)
        copies.clear()
        w.plan(qo, kvp, indices, last, page_size=16)
        ptrs = w._plan["ptrs"]
        region = lambda name, n: _uploaded(w, name, n)  # noqa: E731
        assert region("qo_indptr", b + 1) == qo.tolist() and region("kv_indptr", b + 1) == kvp.tolist()
        assert region("kv_indices", kvp[-1]) == indices.tolist()
        assert region("kv_len", b) == [(p - 1) * 16 + 5 for p in pages]
        assert region("num_work", 1) == [w._plan["num_work"]]
        work = np.array(region("work", 6 * w._plan["num_work"])).reshape(-1, 6)
        assert sorted(set(work[:, 0].tolist())) == list(range(b))
        assert region("work", 6 * w._plan["num_work"] + 1)[-1] == -7, "past the plan's items: never copied"
        assert ptrs["kv_tile_indptr"] == ptrs["kv_tiles"] == 0  # (no mask: no tile lists)
        assert len(copies) == 2 and sum(copies) < 4 * (300 + 6 * w._plan["num_work"] + kvp[-1])
        first = first or dict(ptrs)
        assert ptrs == first, "a captured launch keeps the addresses of the first plan"


def test_graph_mode_refuses_a_plan_past_its_capacities_or_captured_values_before_touching_its_buffers(recorder):
    """A plan that needs more than the constructor's capacities, or changes a value baked into the captured
    launch, is refused with what to do, and the buffers keep the last good plan (a graph may replay it)."""
    w = BatchPrefill(SPEC, device="cpu", use_cuda_graph=True, max_batch_size=4, max_work_items=64)
    w.plan(np.array([0, 80]), np.array([0, 100]))
    good, up, planned = _uploaded(w, "work", 6 * w._plan["num_work"]), w._upload, w._plan
    log = list(up.log)
    with pytest.raises(ValueError, match=r"plan in CUDA-graph mode: work items: expected at most max_work_items=64, "
                                         r"got 1024\. Construct BatchPrefill with a larger max_work_items"):
        w.plan(np.array([0, 4096]), np.array([0, 4096]))  # 4096 x 4 packed rows / 128-row tiles x 8 kv heads
    with pytest.raises(ValueError, match=r"CUDA-graph mode: requests: expected at most max_batch_size=4, got 5"):
        w.plan(np.arange(6) * 10, np.arange(6) * 20)
    paged = BatchPrefill(SPEC, device="cpu", use_cuda_graph=True, max_num_pages=8)
    with pytest.raises(ValueError, match=r"page ids: expected at most max_num_pages=8, got 9\. .*larger max_num_pages"):
        paged.plan(np.array([0, 80]), np.array([0, 9]), np.arange(9), np.array([1]), page_size=16)
    with pytest.raises(ValueError, match=r"plan in CUDA-graph mode: expected page_size, .* as captured .*"
                                         r"Capture one graph per configuration"):
        w.plan(np.array([0, 80]), np.array([0, 100]), sm_scale=0.5)
    assert up.log == log, "no refused plan copied a buffer"
    assert w._plan is planned and _uploaded(w, "work", len(good)) == good


@pytest.mark.parametrize("kind", ["ragged", "paged", "window", "mask"])
def test_graph_mode_uploads_the_arrays_an_eager_plan_uploads(recorder, kind):
    """On random batches a graph-mode plan's regions hold exactly the arrays the eager plan (the same wrapper
    options, no split) uploads contiguously: the fixed-region path and its partial copies lose nothing."""
    from attnforge import mods
    kw = {"window_left": 300} if kind == "window" else {}
    if kind == "mask":
        kw["score_mod"] = mods.compile_mod(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx // 64) % 3 != (kv_idx // 64) % 3)
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True, **kw)
    eager = BatchPrefill(spec, device="cpu", split_kv=False)
    graph = BatchPrefill(spec, device="cpu", use_cuda_graph=True, max_batch_size=8, max_num_pages=8192,
                         max_work_items=4096, max_tiles=1 << 16)
    rng = np.random.default_rng(len(kind))
    for _ in range(12):
        b = int(rng.integers(1, 9))
        qo = np.concatenate([[0], np.cumsum(rng.integers(1, 400, size=b))])
        kv_lens = np.diff(qo) + rng.integers(0, 1500, size=b)
        if kind == "paged":
            pages = -(-kv_lens // 16)
            kvp = np.concatenate([[0], np.cumsum(pages)])
            args = (qo, kvp, rng.permutation(8192)[:kvp[-1]], kv_lens - (pages - 1) * 16)
            kw_plan = {"page_size": 16}
        else:
            args, kw_plan = (qo, np.concatenate([[0], np.cumsum(kv_lens)])), {}
        for w in (eager, graph):
            w.plan(*args, **kw_plan)
        n = eager._plan["num_work"]
        assert graph._plan["num_work"] == n and _uploaded(graph, "num_work", 1) == [n]
        sizes = {"qo_indptr": b + 1, "q_offset": b, "kv_indptr": b + 1, "kv_len": b, "kv_offset": b, "work": 6 * n,
                 "kv_indices": len(args[2]) if kind == "paged" else 1}
        if kind == "mask":
            sizes["kv_tile_indptr"] = n + 1
            sizes["kv_tiles"] = _uploaded(eager, "kv_tile_indptr", n + 1)[-1]
            assert sizes["kv_tiles"] > 0
        else:
            assert graph._plan["ptrs"]["kv_tiles"] == eager._plan["ptrs"]["kv_tiles"] == 0
        for name, size in sizes.items():
            assert _uploaded(graph, name, size) == _uploaded(eager, name, size), name


def tile_lists(w) -> np.ndarray:
    """The plan's block-sparse tile ids, as uploaded (host copy of the plan's int32 arrays)."""
    host = w._plan["host"]  # (the int32 values this plan uploaded)
    start = (w._plan["ptrs"]["kv_tiles"] - w._plan["dev"].data_ptr()) // 4
    return host[start:]


def test_attention_replans_a_mask_whose_inputs_changed_by_any_path(recorder, monkeypatch):
    calls = count_calls(monkeypatch, BatchPrefill, "plan")
    q, k, v = sdpa_inputs(lq=256, lk=256)
    docs = torch.arange(256) // 128
    window = torch.tensor(300)

    def mask(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (qi - ki <= window)
    dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
    w = dense.dense_call(q, k, v, dense.compiled_mod(None, mask), True).wrapper
    two_docs = tile_lists(w).copy()
    dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
    assert calls["n"] == 1
    docs.data.zero_()  # no version bump: only the comparison of values sees it
    dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
    one_doc = tile_lists(w).copy()
    assert calls["n"] == 2 and len(one_doc) > len(two_docs)  # one document: the off-diagonal tiles are seen
    window.fill_(-1000)  # a captured 0-d tensor (a runtime scalar) the mask reads: no key visible
    dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
    assert calls["n"] == 3 and len(tile_lists(w)) < len(one_doc)
    dense.attention(q, k, v, mask_mod=mask, enable_gqa=True)
    assert calls["n"] == 3


def test_a_score_only_modifiers_tensors_change_no_plan(recorder, monkeypatch):
    calls = count_calls(monkeypatch, BatchPrefill, "plan")
    q, k, v = sdpa_inputs()
    bias, cap = torch.randn(8), torch.tensor(30.0)

    def biased(s, b, h, qi, ki):
        return cap * torch.tanh(s / cap) + bias[h]
    for value in (30.0, 20.0):
        bias.add_(1.0)  # read at run time by the kernel: no plan depends on it
        cap.fill_(value)  # a runtime scalar: each call launches with its current value
        dense.attention(q, k, v, score_mod=biased, enable_gqa=True)
        p = recorder.launches[-1][2]
        assert (p.mod_t0, p.mod_s0) == (bias.data_ptr(), value)
    assert calls["n"] == 1


def test_attention_plans_again_after_a_failed_plan(recorder, monkeypatch):
    q, k, v = sdpa_inputs()
    dense.attention(q, k, v, enable_gqa=True)
    real = BatchPrefill.plan

    def failing(self, *args, **kwargs):
        raise RuntimeError("plan failed")
    monkeypatch.setattr(BatchPrefill, "plan", failing)
    with pytest.raises(RuntimeError, match="plan failed"):
        dense.attention(q, k, v, enable_gqa=True, scale=0.3)
    monkeypatch.setattr(BatchPrefill, "plan", real)
    calls = count_calls(monkeypatch, BatchPrefill, "plan")
    dense.attention(q, k, v, enable_gqa=True)  # the first call's scale again, but its plan was given up
    assert calls["n"] == 1 and recorder.launches[-1][2].sm_scale == pytest.approx(1 / math.sqrt(128))


@pytest.mark.parametrize("form", ["ragged", "sdpa", "paged NHD", "paged HND"])
def test_kv_maps_describe_each_kv_form(recorder, monkeypatch, form):
    """PrefillKernel's K/V maps for each form the plans take, against the boxes jit.tma builds from the
    form's own (extent, stride) order: ragged [tokens, Hkv, D]; attention()'s [B, Hkv, Lk, D] (one page a
    request); pages [P, page, Hkv, D] (NHD) or [P, Hkv, page, D] (HND)."""
    layout = "HND" if form == "paged HND" else "NHD"
    kernel = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, kv_layout=layout),
                          device="cpu").kernel
    tile = kernel.tile_kv
    if form == "ragged":
        k = torch.randn(700, 8, 128).bfloat16()
        box = tma_maps.ragged_kv_box(128, 8, 700, k.stride(0), k.stride(1), 2, tile, False)[0]
        ragged, page, per_request = True, RAGGED_PAGE, 0
    elif form == "sdpa":
        k = torch.randn(2, 8, 512, 128).bfloat16()  # (Lk a multiple of the tile: a box per tile)
        box = tma_maps.paged_kv_box(128, 8, 512, 2, k.stride(0), k.stride(2), k.stride(1), 2, tile, False)[0]
        ragged, page, per_request = True, RAGGED_PAGE, 1
    else:
        k = torch.randn(10, 16, 8, 128).bfloat16() if layout == "NHD" else torch.randn(10, 8, 16, 128).bfloat16()
        tok, head = (1, 2) if layout == "NHD" else (2, 1)
        box = tma_maps.paged_kv_box(128, 8, 16, 10, k.stride(0), k.stride(tok), k.stride(head), 2, tile, False)[0]
        ragged, page, per_request = False, 16, 0
    v = k.clone()
    monkeypatch.setattr(tma_maps, "encode", lambda t, b: (t.data_ptr(), b))  # the whole box: extents, strides
    values = kernel.kv_tma_values(k, v, page, ragged)
    assert box is not None and values["tma_box_rows"] == box.rows > 0
    assert values["k_tmap"] == (k.data_ptr(), box) and values["v_tmap"] == (v.data_ptr(), box)
    assert values["tma_page_per_request"] == per_request and values["tma_heads_inner"] == int(box.heads_inner)


def test_attention_takes_a_flex_block_mask_for_its_mask_mod(recorder, monkeypatch):
    """A FlexAttention call carries over: block_mask=create_block_mask(fn, ...) plans the tile lists mask_mod=fn
    plans; noop_mask runs the plain kernel; a block mask of other lengths, fewer queries than keys (Flex's q_idx
    starts at 0, attnforge's is end-aligned), a second mask or another object is refused before any launch."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = sdpa_inputs(lq=256, lk=256)
    docs = torch.arange(256) // 100

    def same_doc(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (qi >= ki)
    dense.attention(q, k, v, mask_mod=same_doc, enable_gqa=True)
    want = tile_lists(dense.dense_call(q, k, v, dense.compiled_mod(None, same_doc), True).wrapper).copy()
    block_mask = flex.create_block_mask(same_doc, None, None, 256, 256, device="cpu")
    dense.attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    w = dense.dense_call(q, k, v, dense.compiled_mod(None, block_mask.mask_mod), True).wrapper
    assert recorder.launches[-1][0] == w._plan["kernel"].kernel_name and np.array_equal(tile_lists(w), want)
    mods = []
    monkeypatch.setattr(dense, "dense_call", lambda *a, call=dense.dense_call: mods.append(a[3]) or call(*a))
    dense.attention(q, k, v, block_mask=flex.create_block_mask(flex.noop_mask, None, None, 256, 256, device="cpu"),
                    enable_gqa=True)
    assert mods == [None]  # (the plain kernel)
    n = len(recorder.launches)
    for kw, error in (({"block_mask": flex.create_block_mask(same_doc, None, None, 128, 256, device="cpu")},
                       r"built for \(Q_LEN, KV_LEN\) = \(128, 256\).*create_block_mask\(mask_mod, B, H, 256, 256\)"),
                      ({"block_mask": block_mask, "q": q[:, :, :100]}, "as many queries as keys, got 100 and 256"),
                      ({"block_mask": block_mask, "mask_mod": same_doc}, "both a mask_mod and a block_mask"),
                      ({"block_mask": torch.ones(4)}, "must be a FlexAttention BlockMask")):
        with pytest.raises((ValueError, TypeError), match=error):
            dense.attention(kw.pop("q", q), k, v, enable_gqa=True, **kw)
    assert len(recorder.launches) == n


def test_a_block_masks_plan_follows_the_blockmask_object(recorder, monkeypatch):
    """block_mask= keys the plan by the BlockMask object, as Flex's block lists are made once: calls with the same
    BlockMask compare no values (no synchronisation on the GPU); a new BlockMask (or a mask_mod= call between)
    plans again, from the mask's values at that call."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    plans = count_calls(monkeypatch, BatchPrefill, "plan")
    compares = count_calls(monkeypatch, dense.MaskInputs, "same")
    q, k, v = sdpa_inputs(lq=256, lk=256)
    docs = torch.arange(256) // 128

    def same_doc(b, h, qi, ki):
        return docs[qi] == docs[ki]

    def block_mask():
        return flex.create_block_mask(same_doc, None, None, 256, 256, device="cpu")
    bm = block_mask()
    for _ in range(3):
        dense.attention(q, k, v, block_mask=bm, enable_gqa=True)
    w = dense.dense_call(q, k, v, dense.compiled_mod(None, same_doc), True).wrapper
    two_docs = tile_lists(w).copy()
    assert (plans["n"], compares["n"]) == (1, 0)
    docs.data.zero_()  # as for Flex, the BlockMask stands for the values it was built from
    dense.attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert plans["n"] == 1 and np.array_equal(tile_lists(w), two_docs)
    bm = block_mask()  # (the old one dies: its weak reference can never match the new object)
    dense.attention(q, k, v, block_mask=bm, enable_gqa=True)
    one_doc = tile_lists(w).copy()
    assert plans["n"] == 2 and len(one_doc) > len(two_docs)
    dense.attention(q, k, v, mask_mod=same_doc, enable_gqa=True)  # by values: the plan is no longer the mask's
    dense.attention(q, k, v, mask_mod=same_doc, enable_gqa=True)
    assert (plans["n"], compares["n"]) == (3, 1)
    dense.attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert (plans["n"], compares["n"]) == (4, 1) and np.array_equal(tile_lists(w), one_doc)


def test_single_prefills_wrappers_are_kept_in_a_bounded_table(monkeypatch):
    """single_prefill keys its cached wrapper by the modifier's identity: a caller that builds a modifier each
    call (ALiBi over fresh slopes) must not keep every wrapper, its buffers and the slopes for good."""
    import gc
    import weakref
    from attnforge import mods, prefill
    monkeypatch.setattr(prefill, "_WRAPPERS", {})
    first = None
    for _ in range(2 * prefill.MAX_WRAPPERS + 1):
        slopes = torch.rand(32)
        first = first or weakref.ref(slopes)
        spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, score_mod=mods.alibi(slopes))
        w = prefill._cached_wrapper(spec, "cpu")
        assert prefill._cached_wrapper(spec, "cpu") is w, "the same modifier's wrapper is reused"
        assert len(prefill._WRAPPERS) <= prefill.MAX_WRAPPERS
        del slopes, spec, w
    gc.collect()
    assert first() is None, "an evicted wrapper's modifier still holds its tensor"


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_plans_ordered_by_tiles_upload_what_the_item_sort_uploads(recorder, monkeypatch, kind):
    """plan() orders prefill_work's own items from their query tiles (scheduler.grouped_order_by_tiles) from
    GROUPED_BY_TILES_MIN items on: every byte it uploads is what the sort of all items gives (the bound raised
    past every batch here), on ragged and paged batches with empty, short and long requests."""
    from attnforge import scheduler
    rng = np.random.default_rng(5)
    batches = [np.array([100, 0, 30])] + [rng.choice([0, 1, 77, 640, 3000], size=b) for b in (3, 12, 40)]
    batches.append(np.full(16, 2048))
    items, least = [], scheduler.GROUPED_BY_TILES_MIN
    for qo in batches:
        kv = qo + rng.choice([0, 500], size=len(qo))
        qo_indptr = np.concatenate([[0], np.cumsum(qo)])
        if kind == "ragged":
            args, kw = (qo_indptr, np.concatenate([[0], np.cumsum(kv)])), {}
        else:
            pages = -(-kv // 16)
            indptr = np.concatenate([[0], np.cumsum(pages)])
            args = (qo_indptr, indptr, rng.permutation(int(indptr[-1])), np.where(pages > 0, kv - (pages - 1) * 16, 0))
            kw = {"page_size": 16}
        uploads = []
        for bound in (least, 1 << 40):
            monkeypatch.setattr(scheduler, "GROUPED_BY_TILES_MIN", bound)
            w = BatchPrefill(SPEC, device="cpu")
            w.plan(*args, **kw)
            uploads.append(np.array(w._plan["host"]))
        assert (uploads[0] == uploads[1]).all()
        items.append(w._plan["num_work"])
    assert min(items) < least <= max(items), "batches on both sides of the bound"


@pytest.mark.parametrize("graph", [False, True])
def test_a_block_table_plans_what_the_csr_arrays_plan(recorder, graph):
    """plan(seq_lens=, block_table=) (vLLM's form, as BatchDecode takes it) uploads every byte the CSR arrays
    upload: empty requests, a request of fewer keys than queries, -1 in the table's unused slots."""
    rng = np.random.default_rng(8)
    kv, qo = np.array([100, 0, 777, 5, 33]), np.array([37, 0, 700, 9, 33])
    pages = -(-kv // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = rng.permutation(int(indptr[-1])).astype(np.int32)
    last = np.where(pages > 0, kv - (pages - 1) * 16, 0)
    table = np.full((5, 64), -1, dtype=np.int32)
    for b in range(5):
        table[b, :pages[b]] = indices[indptr[b]:indptr[b + 1]]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    uploads = []
    for form in ("csr", "block_table"):
        w = BatchPrefill(SPEC, device="cpu", use_cuda_graph=graph, max_batch_size=8, max_work_items=4096,
                         max_num_pages=256)
        if form == "csr":
            w.plan(qo_indptr, indptr, indices, last, page_size=16)
        else:
            w.plan(qo_indptr, seq_lens=kv, block_table=table, page_size=16)
        uploads.append((np.array(w._plan["host"]), w._plan["num_work"], w._plan["max_page"]))
    assert (uploads[0][0] == uploads[1][0]).all() and uploads[0][1:] == uploads[1][1:]


def test_a_block_table_plan_refuses_a_mixed_or_missing_form(recorder):
    w = BatchPrefill(SPEC, device="cpu")
    qo = np.array([0, 4, 10])
    table = np.array([[0, -1], [1, 2]], dtype=np.int32)
    with pytest.raises(TypeError, match="got both"):
        w.plan(qo, np.array([0, 1, 3]), seq_lens=np.array([5, 20]), block_table=table, page_size=16)
    with pytest.raises(TypeError, match="got none of them"):
        w.plan(qo)
    with pytest.raises(ValueError, match=r"seq_lens.*3 entries"):
        w.plan(np.array([0, 4, 10, 12]), seq_lens=np.array([5, 20]), block_table=table, page_size=16)
    with pytest.raises(ValueError, match="block_table"):
        w.plan(qo, seq_lens=np.array([5, 40]), block_table=table, page_size=16)  # 3 pages, a row holds 2
    narrow = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, head_dim_qk=192,
                                        head_dim_vo=128), device="cpu", backend="wgmma")
    with pytest.raises(ValueError, match="ragged K/V"):
        narrow.plan(qo, seq_lens=np.array([5, 20]), block_table=table, page_size=16)
    w.plan(qo, seq_lens=np.array([5, 20]), block_table=table, page_size=16)  # the valid call plans
    assert w._plan["max_page"] == 2 and w._plan["kv_tokens"] == 25

"""VirtualKVCache on the GPU: tensors over mapped virtual memory, decode without a page table."""
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, BatchPrefill, append_kv_by_slots, reference
from attnforge.checks import TORCH_DTYPES
from attnforge.kvcache import OutOfPhysicalMemory, VirtualKVCache
from helpers import assert_attention_close, assert_lse_close, decode_reference, replays_after_replans
from test_prefill_gpu import check_against_reference

pytestmark = pytest.mark.gpu


def test_decode_reads_the_virtual_cache():
    torch.manual_seed(0)
    lengths = [1, 3000, 777, 0]
    c = VirtualKVCache(num_layers=1, max_batch=4, max_len=4096, num_kv_heads=8, head_dim=128)
    assert c.gran % (2 << 20) == 0
    k, v = c.tensors(0)
    for slot, n in enumerate(lengths):
        c.grow(slot, n)
        k[slot, :n] = torch.randn(n, 8, 128, device="cuda").bfloat16()
        v[slot, :n] = torch.randn(n, 8, 128, device="cuda").bfloat16()
    q = torch.randn(4, 32, 128, device="cuda").bfloat16()
    w = BatchDecode(AttentionSpec(num_qo_heads=32, num_kv_heads=8))
    w.plan(*c.decode_plan(range(4), lengths), page_size=c.max_len)
    out = w.run(q, (k, v))
    for b, n in enumerate(lengths):
        ref, _ = reference.attention(q[b:b + 1], k[b, :n], v[b, :n])
        assert (out[b].double() - ref[0]).abs().max().item() < 2e-2
    c.close()


def test_out_of_memory_and_free():
    c = VirtualKVCache(num_layers=2, max_batch=2, max_len=8192, num_kv_heads=8, head_dim=128,
                       max_physical_bytes=8 * (2 << 20))
    c.grow(0, 2048)  # 2 chunks x 4 regions = the whole budget
    k, _ = c.tensors(0)
    k[0, :2048] = 1.0
    with pytest.raises(OutOfPhysicalMemory):
        c.grow(1, 1)
    assert torch.all(k[0, :2048] == 1.0)  # the existing sequence is intact
    c.free(0)
    c.grow(1, 2048)
    assert c.created == 8
    c.close()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3"])
def test_graph_replays_while_slots_grow_and_take_appends(kv_dtype):
    """vAttention's serving loop: each step grows every slot by a token (mapping a chunk where it crosses one),
    appends the step's K/V by slot, re-plans and replays one captured decode: the graph stays valid because
    the slots' addresses never move. max_len 3000 is no multiple of a chunk's tokens, so slots lie 3072
    (16-bit) or 4096 (fp8) tokens apart, and the second layer's tensors are the ones read."""
    g = torch.Generator("cuda").manual_seed(7)
    q_dtype = "bf16" if kv_dtype == "fp8_e4m3" else kv_dtype
    kv_t, q_t = TORCH_DTYPES[kv_dtype], TORCH_DTYPES[q_dtype]
    spec = AttentionSpec(num_qo_heads=32, num_kv_heads=8, q_dtype=q_dtype, kv_dtype=kv_dtype)
    c = VirtualKVCache(num_layers=2, max_batch=3, max_len=3000, num_kv_heads=8, head_dim=128, dtype=kv_t)
    scales = (0.5, 1.5) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    lengths = [c.tokens_per_chunk - 2, 1, 0]  # slot 0 crosses into its second chunk on the second step
    k, v = c.tensors(1)
    for slot, n in enumerate(lengths):
        c.grow(slot, n)
        k[slot, :n] = (torch.randn(n, 8, 128, device="cuda", generator=g) * 2).to(kv_t)
        v[slot, :n] = (torch.randn(n, 8, 128, device="cuda", generator=g) * 2).to(kv_t)
    q = torch.randn(3, 32, 128, device="cuda", generator=g).to(q_t)
    out, lse = torch.empty(3, 32, 128, device="cuda", dtype=q_t), torch.empty(3, 32, device="cuda")
    w = BatchDecode(spec, use_cuda_graph=True, max_batch_size=3, max_num_pages=3)

    def step():
        k_new, v_new = (torch.randn(3, 8, 128, device="cuda", generator=g).to(q_t) for _ in range(2))
        slots = torch.tensor([s * c.max_len + n for s, n in enumerate(lengths)], device="cuda")
        for slot in range(3):
            c.grow(slot, lengths[slot] + 1)
        append_kv_by_slots(k_new, v_new, slots, (k, v), k_scale=scales[0], v_scale=scales[1])
        for slot in range(3):
            lengths[slot] += 1
        w.plan(*c.decode_plan(range(3), lengths), page_size=c.max_len, k_scale=scales[0],
               v_scale=scales[1])
        return k_new, v_new

    def refresh():
        q.copy_(torch.randn(3, 32, 128, device="cuda", generator=g).to(q_t))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    crossed = False
    for _, (k_new, v_new) in replays_after_replans(lambda: w.run(q, (k, v), out=out, lse=lse), step, refresh, 3):
        crossed |= int(c.chunks[0]) == 2
        if kv_dtype != "fp8_e4m3":  # the step's tokens landed where the next plan reads them
            assert torch.equal(k[[0, 1, 2], [n - 1 for n in lengths]], k_new)
            assert torch.equal(v[[0, 1, 2], [n - 1 for n in lengths]], v_new)
        per = [(k[b, :n].float(), v[b, :n].float()) for b, n in enumerate(lengths)]
        eff = scales[0] / 128 ** 0.5
        ref, ref_lse = decode_reference(spec, q, per, sm_scale=eff, v_scale=scales[1])
        low, _ = decode_reference(spec, q.float(), [(kk.to(q_t).float(), vv.to(q_t).float()) for kk, vv in per],
                                  sm_scale=eff, v_scale=scales[1], dtype=torch.float32)
        assert_attention_close(out, ref, low.to(q_t), f"vmm {kv_dtype} lengths {lengths}")
        assert_lse_close(lse, ref_lse, f"vmm {kv_dtype}")
    assert crossed and c.chunks.tolist() == [2, 1, 1]
    c.close()


@pytest.mark.parametrize("backend", [None, "mma"])
@pytest.mark.parametrize("max_len", [3000, 3072])
def test_chunked_prefill_reads_the_virtual_cache(backend, max_len):
    """A prefill chunk's queries against its slots' whole prefixes (causal, bottom-right), the slots as pages
    of max_len tokens 3072 apart: on the wgmma kernel 3072-token pages take TMA boxes, 3000-token ones (no
    multiple of its tile) cp.async rows; and the portable mma kernel."""
    g = torch.Generator("cuda").manual_seed(3)
    c = VirtualKVCache(num_layers=1, max_batch=3, max_len=max_len, num_kv_heads=8, head_dim=128)
    kv_lens, qo_lens = [2500, 0, 700], [300, 0, 700]
    k, v = c.tensors(0)
    for slot, n in enumerate(kv_lens):
        c.grow(slot, n)
        k[slot, :n] = torch.randn(n, 8, 128, device="cuda", generator=g).bfloat16()
        v[slot, :n] = torch.randn(n, 8, 128, device="cuda", generator=g).bfloat16()
    spec = AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, causal=True)
    q = torch.randn(sum(qo_lens), 32, 128, device="cuda", generator=g).bfloat16()
    qo = [0, 300, 300, 1000]
    w = BatchPrefill(spec, backend=backend)
    w.plan(qo, *c.decode_plan(range(3), kv_lens), page_size=c.max_len)
    out, lse = w.run(q, (k, v), out=torch.full_like(q, float("nan")), return_lse=True)
    torch.cuda.synchronize()
    check_against_reference(spec, q, out, lse, [(k[b, :n], v[b, :n]) for b, n in enumerate(kv_lens)], qo)
    if backend is None:  # the copy path the docstring names
        assert (w.kernel.kv_tma_values(k, v, c.max_len, False).get("tma_box_rows", 0) > 0) == (max_len == 3072)
    c.close()

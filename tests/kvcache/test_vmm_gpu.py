"""VirtualKVCache on the GPU: tensors over mapped virtual memory, decode without a page table."""
import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, reference
from attnforge.kvcache import OutOfPhysicalMemory, VirtualKVCache

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
    w.plan(*VirtualKVCache.decode_plan(range(4), lengths), page_size=c.max_len)
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

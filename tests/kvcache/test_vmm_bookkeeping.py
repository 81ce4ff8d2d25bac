"""VirtualKVCache bookkeeping on the CPU, against a fake driver that checks every call."""
import numpy as np
import pytest
import torch

from attnforge.kvcache import OutOfPhysicalMemory, VirtualKVCache, paged_bytes

GRAN = 2 << 20


class FakeVMM:
    def __init__(self, capacity_chunks=10_000):
        self.capacity, self.live, self.next_handle, self.next_va = capacity_chunks, set(), 0, 1 << 40
        self.maps, self.reserved = {}, {}

    def granularity(self):
        return GRAN

    def reserve(self, size):
        va = self.next_va
        self.next_va += size + GRAN
        self.reserved[va] = size
        return va

    def create(self, size):
        assert size == GRAN
        if len(self.live) >= self.capacity:
            return None
        self.next_handle += 1
        self.live.add(self.next_handle)
        return self.next_handle

    def map(self, va, size, handle):
        assert va % GRAN == 0 and va not in self.maps and handle in self.live
        assert handle not in self.maps.values(), "a chunk mapped twice"
        assert any(base <= va and va + size <= base + n for base, n in self.reserved.items())
        self.maps[va] = handle

    def unmap(self, va, size):
        assert va in self.maps
        del self.maps[va]

    def release(self, handle):
        assert handle in self.live and handle not in self.maps.values()
        self.live.remove(handle)

    def free_va(self, va, size):
        assert self.reserved.pop(va) == size and not any(base for base in self.maps if va <= base < va + size)


def cache(capacity=10_000, **kw):
    args = dict(num_layers=2, max_batch=4, max_len=5000, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                device="cpu")
    args.update(kw)
    return VirtualKVCache(**args, backend=FakeVMM(capacity))


def test_grow_maps_chunks_on_demand_in_every_region():
    c = cache()
    assert c.tokens_per_chunk == 1024 and c.chunks_per_slot == 5  # 2 MB / (8 heads x 128 x 2 B)
    c.grow(1, 1)
    assert c.mapped_bytes == 1 * 4 * GRAN  # one chunk x (K, V) x 2 layers
    c.grow(1, 1024)
    assert c.mapped_bytes == 4 * GRAN and c.backed_tokens(1) == 1024
    c.grow(1, 1025)
    c.grow(2, 5000)
    assert c.mapped_bytes == (2 + 5) * 4 * GRAN and c.backed_tokens(2) == 5000
    c.grow(1, 10)  # shrinking requests nothing
    assert c.mapped_bytes == 7 * 4 * GRAN


def test_free_recycles_chunks_and_ten_thousand_cycles_do_not_leak():
    c = cache()
    rng = np.random.default_rng(0)
    for _ in range(10_000):
        slot = int(rng.integers(4))
        if rng.random() < 0.5:
            c.grow(slot, int(rng.integers(0, 5001)))
        else:
            c.free(slot)
    peak = c.created
    assert peak <= 4 * 5 * 4  # never more chunks than every slot at max_len needs
    for slot in range(4):
        c.free(slot)
    assert c.mapped_bytes == 0 and not c.backend.maps and len(c.pool) == c.created == peak
    c.trim_pool()
    assert c.created == 0 and not c.backend.live
    c.close()
    assert not c.backend.reserved


def test_out_of_memory_is_clear_and_leaves_sequences_intact():
    c = cache(capacity=9)  # 9 chunks: slot 0 takes 2 x 4 regions = 8
    c.grow(0, 2000)
    before = dict(c.backend.maps)
    with pytest.raises(OutOfPhysicalMemory, match="Existing sequences are intact"):
        c.grow(1, 2000)  # needs 8 more chunks; only 1 left
    assert c.backend.maps == before and c.backed_tokens(1) == 0 and c.backed_tokens(0) == 2048
    c.free(0)
    c.grow(1, 2000)  # the freed chunks serve the new sequence
    assert c.created <= 9


def test_physical_limit_and_argument_errors():
    c = cache(max_physical_bytes=3 * GRAN)
    with pytest.raises(OutOfPhysicalMemory):
        c.grow(0, 1)  # 4 regions need 4 chunks
    assert c.mapped_bytes == 0
    with pytest.raises(ValueError, match="slot"):
        c.grow(4, 1)
    with pytest.raises(ValueError, match="max_len=5000"):
        c.grow(0, 5001)
    with pytest.raises(ValueError, match=r"dtype: expected .*float8_e4m3fn.*got torch.int8"):
        cache(dtype=torch.int8)  # before any reservation: no tensor could expose it


def test_fp8_tokens_are_one_byte():
    c = cache(dtype=torch.float8_e4m3fn)
    assert c.token_bytes == 8 * 128 and c.tokens_per_chunk == GRAN // 1024


def test_memory_against_a_paged_cache_and_decode_plan():
    c = cache()
    lengths = [100, 1500, 0, 4097]
    for slot, n in enumerate(lengths):
        c.grow(slot, n)
    vmm = c.mapped_bytes
    paged = paged_bytes(lengths, 16, c.token_bytes, 2)
    assert paged <= vmm <= paged + 4 * 2 * 2 * GRAN  # at most one partial chunk per slot and region
    indptr, indices, last = c.decode_plan([0, 1, 2, 3], lengths)
    assert indptr.tolist() == [0, 1, 2, 2, 3] and indices.tolist() == [0, 1, 3] and last.tolist() == [100, 1500, 0, 4097]


def test_decode_plan_refuses_lengths_past_the_backed_tokens():
    """Past backed_tokens a slot is unmapped virtual memory: a kernel reading it would fault (and end the CUDA
    context), so the page table is refused before any plan, naming the slot and how to back it."""
    c = cache()
    c.grow(0, 1500)  # two chunks: 2048 tokens backed
    c.grow(1, 1)
    assert c.decode_plan([0, 1], [2048, 1024])[2].tolist() == [2048, 1024]
    bad = [([0, 1], [2049, 1], r"lengths\)\[0\]: expected a length in \[0, 2048\] \(the tokens backed in slot 0\)"),
           ([0, 2], [5, 1], r"lengths\)\[1\]: expected a length in \[0, 0\] \(the tokens backed in slot 2\), got 1"),
           ([1], [-1], r"got -1"), ([4], [0], r"slots in \[0, max_batch=4\)"), ([-1], [0], r"got -1..-1"),
           ([0, 1], [5], r"two 1-D arrays"), ([0.5], [5], r"an integer array")]
    for slots, lengths, message in bad:
        with pytest.raises(ValueError, match=message):
            c.decode_plan(slots, lengths)


def test_slot_arguments_are_ints_in_range():
    """numpy indexing would wrap free(-1) onto the last slot, unmapping a live sequence a kernel may still read, and
    refuse a float slot with an IndexError: every slot (and layer) argument is checked first, and nothing changes."""
    c = cache()
    c.grow(3, 100)
    before = c.mapped_bytes
    for call in (lambda: c.free(-1), lambda: c.grow(4, 1), lambda: c.grow(1.0, 5), lambda: c.grow(True, 5),
                 lambda: c.backed_tokens("3"), lambda: c.grow(0, 10.5), lambda: c.grow(0, 5001),
                 lambda: c.tensors(-1), lambda: c.tensors(2)):
        with pytest.raises(ValueError, match=r"expected an int in \[0, (max_|num_layers)"):
            call()
    assert c.mapped_bytes == before and c.backed_tokens(np.int64(3)) == 1024  # (one chunk)


@pytest.mark.parametrize("kw,name,got", [({"num_layers": 2.5}, "num_layers", "2.5"),
                                         ({"head_dim": 128.0}, "head_dim", "128.0"),
                                         ({"max_len": "4096"}, "max_len", "'4096'"),
                                         ({"max_batch": 0}, "max_batch", "0"),
                                         ({"max_physical_bytes": -5}, "max_physical_bytes", "-5")])
def test_sizes_and_the_byte_budget_are_checked_at_construction(kw, name, got):
    """A float or string size failed inside range() or a comparison, and a byte budget of -5 or "x" was taken
    (the first compared at the first grow): each now names its argument before anything is reserved."""
    backend = FakeVMM()
    sizes = {**dict(num_layers=2, max_batch=4, max_len=4096, num_kv_heads=8, head_dim=128), **kw}
    with pytest.raises(ValueError, match=rf"VirtualKVCache\({name}=...\): expected an int >= 1, got {got}"):
        VirtualKVCache(**sizes, device="cpu", backend=backend)
    assert backend.reserved == {}


def test_trim_pool_keeps_a_count_it_checks():
    """trim_pool(-3) emptied the pool and then popped an empty list (IndexError): the count is checked first."""
    backend = FakeVMM()
    c = VirtualKVCache(1, 2, 4096, 8, 128, device="cpu", backend=backend)
    c.grow(0, 4096)
    c.free(0)
    pooled = len(c.pool)
    assert pooled > 1
    with pytest.raises(ValueError, match=r"trim_pool\(keep=...\): expected an int >= 0, got -3"):
        c.trim_pool(-3)
    assert len(c.pool) == pooled
    c.trim_pool(1)
    assert len(c.pool) == 1 and c.physical_bytes == GRAN

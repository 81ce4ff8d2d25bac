"""VirtualKVCache: per-layer K and V tensors [max_batch, max_len, Hkv, D] whose virtual addresses are
reserved up front and whose physical memory is mapped on demand as sequences grow (vAttention).

Each request slot is a contiguous run of virtual memory, so kernels read KV with per-request
lengths and no page table: batch decode sees it as a paged cache with one page per slot
(page_size = max_len, page id = slot; see `decode_plan`). Physical memory comes in chunks of the
allocation granularity (2 MB on the H200); freeing a slot unmaps its chunks and keeps their handles
in a pool for the next grow, so steady-state serving creates no new allocations.

The driver calls live in a small backend (CudaVMM, cuda-python); the bookkeeping is backend
independent and tested on the CPU with a fake one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..checks import check_count, cuda_device, fail
from ..paged import host_int_array


def _int_below(what: str, value, limit: int, allowed: str, fix: str) -> int:
    """value as an int in [0, limit), `allowed` saying so (numpy ints too; a bool, a float or a string is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < limit:
        raise fail(what, f"an int in {allowed}", repr(value), fix)
    return int(value)


class OutOfPhysicalMemory(RuntimeError):
    """grow() could not get the physical memory it needs; every existing sequence is intact."""


class CudaVMM:
    """The CUDA virtual-memory calls the cache needs (cuMem* through cuda-python)."""

    def __init__(self, device: torch.device):
        from ..jit.loader import check, driver, ensure_context
        self.drv, self.check = driver(), check
        ensure_context(device)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        d = self.drv
        self.prop = d.CUmemAllocationProp()
        self.prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = self.device_index
        self.access = d.CUmemAccessDesc()
        self.access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = self.device_index
        self.access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def granularity(self) -> int:
        flag = self.drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(self.check(self.drv.cuMemGetAllocationGranularity(self.prop, flag), "cuMemGetAllocationGranularity"))

    def reserve(self, size: int) -> int:
        return int(self.check(self.drv.cuMemAddressReserve(size, 0, 0, 0), f"cuMemAddressReserve({size})"))

    def create(self, size: int):
        """A physical chunk, or None when the device has no memory left (never a partial state)."""
        err, handle = self.drv.cuMemCreate(size, self.prop, 0)
        if err == self.drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            return None
        self.check((err, handle), f"cuMemCreate({size})")
        return handle

    def map(self, va: int, size: int, handle) -> None:
        self.check(self.drv.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
        self.check(self.drv.cuMemSetAccess(va, size, [self.access], 1), "cuMemSetAccess")

    def unmap(self, va: int, size: int) -> None:
        self.check(self.drv.cuMemUnmap(va, size), "cuMemUnmap")

    def release(self, handle) -> None:
        self.check(self.drv.cuMemRelease(handle), "cuMemRelease")

    def free_va(self, va: int, size: int) -> None:
        self.check(self.drv.cuMemAddressFree(va, size), "cuMemAddressFree")


@dataclass
class _Region:  # one layer's K or V
    va: int
    size: int
    mapped: dict = field(default_factory=dict)  # (slot, chunk) -> handle


class _DeviceArray:
    """Exposes a virtual range as a CUDA array (zero copy) for torch.as_tensor."""

    def __init__(self, ptr: int, shape, strides_bytes, typestr: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": tuple(strides_bytes), "version": 3}


# the array-interface type each dtype is exposed as (bf16 and fp8 have none: exposed as ints, then viewed)
_TYPESTR = {torch.bfloat16: "<i2", torch.float16: "<f2", torch.float32: "<f4", torch.float8_e4m3fn: "|u1"}


class VirtualKVCache:
    def __init__(self, num_layers: int, max_batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_physical_bytes: Optional[int] = None,
                 backend=None):
        for name, value in (("num_layers", num_layers), ("max_batch", max_batch), ("max_len", max_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_count("VirtualKVCache", name, value, fix="Pass the model's sizes.")
        if max_physical_bytes is not None:  # (a string or -5 compared at the first grow, or never refused anything)
            check_count("VirtualKVCache", "max_physical_bytes", max_physical_bytes, fix="Pass a byte budget, or None "
                        "for the device's memory.")
        if dtype not in _TYPESTR:
            raise fail("VirtualKVCache dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn (fp8 KV) or "
                       "torch.float32", dtype, "Allocate the cache in the dtype decode reads (spec.kv_dtype).")
        self.device = cuda_device(device, "VirtualKVCache", host_ok=backend is not None)  # (cpu: a fake driver's tests)
        self.backend = backend if backend is not None else CudaVMM(self.device)
        self.gran = self.backend.granularity()
        self.dtype, self.num_layers, self.max_batch = dtype, num_layers, max_batch
        self.token_bytes = num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if self.gran % self.token_bytes:
            raise fail("VirtualKVCache", f"a token size dividing the {self.gran}-byte granularity",
                       self.token_bytes, "Use power-of-two heads x head_dim.")
        self.tokens_per_chunk = self.gran // self.token_bytes
        self.chunks_per_slot = -(-max_len // self.tokens_per_chunk)
        self.max_len = max_len
        self.slot_stride_tokens = self.chunks_per_slot * self.tokens_per_chunk  # slots start on chunk bounds
        self.shape = (max_batch, max_len, num_kv_heads, head_dim)
        self.max_physical_bytes = max_physical_bytes
        size = max_batch * self.chunks_per_slot * self.gran
        self.regions = [[_Region(self.backend.reserve(size), size) for _ in range(2)] for _ in range(num_layers)]
        self.pool: list = []  # unmapped physical chunks kept for reuse
        self.created = 0
        self.chunks = np.zeros(max_batch, dtype=np.int64)  # mapped chunks per slot (the same in every region)

    # -- accounting -----------------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int:
        return self.created * self.gran

    @property
    def mapped_bytes(self) -> int:
        return sum(len(r.mapped) for layer in self.regions for r in layer) * self.gran

    def chunks_needed(self, length: int) -> int:
        return -(-length // self.tokens_per_chunk)

    # -- growth --------------------------------------------------------------------------------
    def _chunk(self):
        if self.pool:
            return self.pool.pop()
        if self.max_physical_bytes is not None and (self.created + 1) * self.gran > self.max_physical_bytes:
            return None
        handle = self.backend.create(self.gran)
        if handle is not None:
            self.created += 1
        return handle

    def _slot(self, call: str, slot) -> int:
        """A slot index: numpy would wrap -1 onto the last slot (free(-1) unmapped a live sequence's memory) and
        refuse a float with an IndexError."""
        return _int_below(f"{call}(slot)", slot, self.max_batch, f"[0, max_batch={self.max_batch})",
                          "Use a slot the cache was sized for.")

    def grow(self, slot: int, new_len: int) -> None:
        """Back tokens [0, new_len) of `slot` in every layer's K and V. All or nothing."""
        slot = self._slot("grow", slot)
        new_len = _int_below("grow(new_len)", new_len, self.max_len + 1, f"[0, max_len={self.max_len}]",
                             "Build the cache with a larger max_len.")
        have, need = int(self.chunks[slot]), self.chunks_needed(new_len)
        done = []
        try:
            for layer in self.regions:
                for region in layer:
                    for c in range(have, need):
                        handle = self._chunk()
                        if handle is None:
                            raise OutOfPhysicalMemory(
                                f"grow(slot={slot}, new_len={new_len}): no physical memory for chunk {c} "
                                f"({self.physical_bytes / 2**20:.0f} MiB in use, limit "
                                f"{'device' if self.max_physical_bytes is None else self.max_physical_bytes}); "
                                "free finished sequences or lower the batch. Existing sequences are intact.")
                        va = region.va + (slot * self.chunks_per_slot + c) * self.gran
                        self.backend.map(va, self.gran, handle)
                        region.mapped[(slot, c)] = handle
                        done.append((region, slot, c))
        except Exception:
            for region, s, c in done:  # roll back this call's mappings only
                self.backend.unmap(region.va + (s * self.chunks_per_slot + c) * self.gran, self.gran)
                self.pool.append(region.mapped.pop((s, c)))
            raise
        self.chunks[slot] = max(have, need)

    def free(self, slot: int) -> None:
        """Unmap the slot's chunks and keep them for reuse."""
        slot = self._slot("free", slot)
        for layer in self.regions:
            for region in layer:
                for c in range(int(self.chunks[slot])):
                    self.backend.unmap(region.va + (slot * self.chunks_per_slot + c) * self.gran, self.gran)
                    self.pool.append(region.mapped.pop((slot, c)))
        self.chunks[slot] = 0

    def trim_pool(self, keep: int = 0) -> None:
        """Give pooled chunks back to the device, keeping `keep` of them for the next grows."""
        check_count("trim_pool", "keep", keep, least=0, fix="Pass how many pooled chunks to keep (0: none).")
        while len(self.pool) > keep:
            self.backend.release(self.pool.pop())
            self.created -= 1

    def close(self) -> None:
        for slot in range(self.max_batch):
            self.free(slot)
        self.trim_pool()
        for layer in self.regions:
            for region in layer:
                self.backend.free_va(region.va, region.size)
        self.regions = []

    # -- tensors -------------------------------------------------------------------------------
    def backed_tokens(self, slot: int) -> int:
        slot = self._slot("backed_tokens", slot)
        return min(int(self.chunks[slot]) * self.tokens_per_chunk, self.max_len)

    def tensors(self, layer: int):
        """(K, V) of one layer: [max_batch, max_len, Hkv, D] views of the virtual ranges (zero copy).
        Only the backed part of each slot (backed_tokens) may be read or written."""
        layer = _int_below("tensors(layer)", layer, len(self.regions), f"[0, num_layers={len(self.regions)})",
                           "Pass the layer's index (a closed cache has none).")
        esz = torch.empty((), dtype=self.dtype).element_size()
        b, n, h, d = self.shape
        strides = (self.slot_stride_tokens * h * d * esz, h * d * esz, d * esz, esz)
        out = []
        for region in self.regions[layer]:
            # bf16 has no array-interface type string: expose int16 and reinterpret
            t = torch.as_tensor(_DeviceArray(region.va, self.shape, strides, _TYPESTR[self.dtype]), device=self.device)
            out.append(t.view(self.dtype))
        return tuple(out)

    def decode_plan(self, slots, lengths):
        """CSR page-table arguments for BatchDecode and BatchPrefill's paged K/V: one page per slot, page_size =
        max_len. Each request's length must be backed (grow(slot, length) first): past backed_tokens a slot is
        unmapped memory, and a kernel reading it would fault, which ends the process's CUDA context."""
        slots = host_int_array("decode_plan(slots)", slots)
        lengths = host_int_array("decode_plan(lengths)", lengths)
        if slots.ndim != 1 or lengths.shape != slots.shape:
            raise fail("decode_plan(slots, lengths)", "two 1-D arrays, a slot and a length per request",
                       f"shapes {list(slots.shape)} and {list(lengths.shape)}", "Pass one slot and one length each.")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.max_batch):
            raise fail("decode_plan(slots)", f"slots in [0, max_batch={self.max_batch})",
                       f"{int(slots.min())}..{int(slots.max())}", "Use slots the cache was sized for.")
        backed = np.minimum(self.chunks[slots] * self.tokens_per_chunk, self.max_len)
        short = (lengths < 0) | (lengths > backed)
        if short.any():
            i = int(np.argmax(short))
            raise fail(f"decode_plan(lengths)[{i}]", f"a length in [0, {int(backed[i])}] (the tokens backed in slot "
                       f"{int(slots[i])})", int(lengths[i]), "Call grow(slot, length) before planning over it.")
        has = lengths > 0
        indptr = np.concatenate([[0], np.cumsum(has)])
        return indptr, slots[has], np.where(has, lengths, 0)


def paged_bytes(lengths, page_size: int, token_bytes: int, num_layers: int) -> int:
    """Physical bytes a paged cache needs for the same sequences (K and V, every layer)."""
    pages = sum(-(-int(n) // page_size) for n in lengths)
    return pages * page_size * token_bytes * 2 * num_layers

"""Suite `vmm`: decode over a VirtualKVCache (contiguous per-slot virtual memory, no page table)
against decode over a paged cache (page 16) holding the same tokens; GQA 32/8 d128 bf16.
Also notes the physical memory each needs for the workload."""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode
from attnforge.kvcache import VirtualKVCache
from attnforge.kvcache.vmm import paged_bytes
from harness import Report, time_us

HQ, HKV, D, PAGE = 32, 8, 128, 16


def cases():
    torch.manual_seed(0)
    return [("B16 L8192", [8192] * 16), ("B64 Lrand", torch.randint(512, 32768, (64,)).tolist())]


def run(report: Report, peers: bool = True) -> None:
    spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D)
    for case, lengths in cases():
        b, max_len = len(lengths), max(lengths)
        nbytes = sum(lengths) * HKV * D * 2 * 2
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        vc = VirtualKVCache(num_layers=1, max_batch=b, max_len=max_len, num_kv_heads=HKV, head_dim=D)
        k, v = vc.tensors(0)
        for slot, n in enumerate(lengths):
            vc.grow(slot, n)
            k[slot, :n].normal_()
            v[slot, :n].normal_()
        w = BatchDecode(spec, max_batch_size=max(b, 256))
        w.plan(*vc.decode_plan(range(b), lengths), page_size=vc.max_len)
        out = torch.empty_like(q)
        report.add("vmm", case, "attnforge-vmm", time_us(lambda: w.run(q, (k, v), out=out)), nbytes)
        pages = [-(-n // PAGE) for n in lengths]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = torch.randperm(int(indptr[-1]), generator=torch.Generator().manual_seed(1)).numpy().astype(np.int32)
        last = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, pages)], dtype=np.int32)
        cache = torch.empty(int(indptr[-1]), 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16).normal_()
        wp = BatchDecode(spec, max_batch_size=max(b, 256))
        wp.plan(indptr, indices, last, page_size=PAGE)
        report.add("vmm", case, "attnforge-paged", time_us(lambda: wp.run(q, cache, out=out)), nbytes)
        report.note(f"vmm {case}: physical memory {vc.physical_bytes / 2**20:.0f} MiB (2 MiB chunks) vs paged16 "
                    f"{paged_bytes(lengths, PAGE, vc.token_bytes, 1) / 2**20:.0f} MiB")
        del cache, k, v
        vc.close()
        torch.cuda.empty_cache()

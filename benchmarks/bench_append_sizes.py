"""Suite `append_sizes`: where the append's size rule should switch kernels. GQA 8x128 and MLA appends of
growing token counts, each with the rule's kernel beside both kernels forced (one unit a thread; several
units of a token a thread), timed in rotation. The rule: attnforge.append.WIDE_FROM_UNITS_PER_SM."""
from __future__ import annotations

import torch

import attnforge
from bench_append import _kernel_forced, _new_tokens, _table
from harness import Report, time_interleaved

PAGE = 16


def _timed(report: Report, case: str, fn, nbytes: float) -> None:
    fns = {"attnforge": fn, "attnforge-one-unit": _kernel_forced(fn, False), "attnforge-wide": _kernel_forced(fn, True)}
    for impl, us in time_interleaved(fns).items():
        report.add("append_sizes", case, impl, us, nbytes)


def run(report: Report, peers: bool = False) -> None:
    torch.manual_seed(0)
    hkv, d = 8, 128
    for n in (256, 512, 1024, 2048, 4096):
        num_pages = -(-n // PAGE) + 8
        cache = torch.randn(num_pages, 2, PAGE, hkv, d, device="cuda").bfloat16()
        indptr, indices = _table([n], PAGE, num_pages)
        batch, pos = _new_tokens([n], n)
        k, v = torch.randn(n, hkv, d, device="cuda").bfloat16(), torch.randn(n, hkv, d, device="cuda").bfloat16()
        units = n * hkv * 2 * d // 8
        _timed(report, f"GQA 8x128 {n} tokens ({units // 1000}K units)",
               lambda: attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr), n * hkv * d * 8)
    for n in (1024, 2048, 4096):
        num_pages = -(-n // 64) + 4
        ckv_cache = torch.randn(num_pages, 64, 576, device="cuda").bfloat16()
        indptr, indices = _table([n], 64, num_pages)
        batch, pos = _new_tokens([n], n)
        ckv, kpe = torch.randn(n, 512, device="cuda").bfloat16(), torch.randn(n, 64, device="cuda").bfloat16()
        _timed(report, f"MLA {n} tokens ({n * 72 // 1000}K units)",
               lambda: attnforge.append_paged_mla_kv_cache(ckv, kpe, batch, pos, ckv_cache, None, indices, indptr),
               n * 576 * 4)

"""Suite `append`: writing a step's new tokens into the KV cache (attnforge.append) against FlashInfer's
append_paged_kv_cache / append_paged_mla_kv_cache and the torch-indexing formulation (attnforge.reference,
what attnforge did before its kernel). Device time in CUDA-graph replays (bytes: the rows read and written)
and, as `host ...` cases, the host time of an eager call (an engine appends once a layer)."""
from __future__ import annotations

import torch

import attnforge
from attnforge import reference
from harness import Report, host_us, time_interleaved, time_us

PAGE = 16


def _table(lengths, page: int, num_pages: int):
    """A CSR page table of random pages for requests of `lengths` tokens, and each request's last new token
    (a decode step) or all its tokens (prefill: new == lengths)."""
    pages = [-(-n // page) for n in lengths]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32, device="cuda")
    indices = torch.randperm(num_pages, device="cuda")[: int(indptr[-1])].int()
    return indptr, indices


def _new_tokens(lengths, new: int):
    """(batch_indices, positions) of the last `new` tokens of each request (all of them when new >= length)."""
    b, p = [], []
    for i, n in enumerate(lengths):
        k = min(new, n)
        b += [i] * k
        p += list(range(n - k, n))
    return (torch.tensor(b, dtype=torch.int32, device="cuda"), torch.tensor(p, dtype=torch.int32, device="cuda"))


def _kernel_forced(fn, wide: bool):
    """fn with attnforge's append kernel forced: the wide one (several units of a token a thread) or one unit a
    thread, whatever the size rule would take (rows attnforge-wide / attnforge-one-unit beside the rule's)."""
    from attnforge import append

    def forced():
        rule = append.WIDE_FROM_UNITS_PER_SM
        append.WIDE_FROM_UNITS_PER_SM = 0 if wide else 2 ** 62
        append._LAUNCHES.clear()  # (a memoised launch keeps the kernel its first call took)
        try:
            return fn()
        finally:
            append.WIDE_FROM_UNITS_PER_SM = rule
            append._LAUNCHES.clear()
    return forced


def _case(report: Report, case: str, fns: dict, nbytes: float, host: bool) -> None:
    # attnforge's kernels in rotation (the rule's choice beside each forced one), then the others
    ours = {"attnforge": fns["attnforge"], "attnforge-one-unit": _kernel_forced(fns["attnforge"], False),
            "attnforge-wide": _kernel_forced(fns["attnforge"], True)}
    try:
        for impl, us in time_interleaved(ours).items():
            report.add("append", case, impl, us, nbytes)
    except Exception as e:  # noqa: BLE001
        report.note(f"append {case}: attnforge: {type(e).__name__}: {str(e)[:160]}")
    for impl, fn in fns.items():
        try:
            if impl != "attnforge":
                report.add("append", case, impl, time_us(fn), nbytes)
            if host:
                report.add("append", f"host {case}", impl, host_us(fn, calls=500))
        except Exception as e:  # noqa: BLE001 (a peer's failure is a note, not a stop)
            report.note(f"append {case}: {impl}: {type(e).__name__}: {str(e)[:160]}")


def _kv_cases(report: Report, peers: bool) -> None:
    hkv, d = 8, 128
    for case, lengths, new, dtype in (("GQA 8x128 B64 decode step", [4096] * 64, 1, torch.bfloat16),
                                      ("GQA 8x128 B64 decode step fp8", [4096] * 64, 1, torch.float8_e4m3fn),
                                      ("GQA 8x128 prefill 8192 tokens", [8192], 8192, torch.bfloat16),
                                      ("GQA 8x128 prefill 8192 tokens fp8", [8192], 8192, torch.float8_e4m3fn)):
        num_pages = sum(-(-n // PAGE) for n in lengths) + 64
        cache = torch.randn(num_pages, 2, PAGE, hkv, d, device="cuda").to(dtype)
        indptr, indices = _table(lengths, PAGE, num_pages)
        batch, pos = _new_tokens(lengths, new)
        k = torch.randn(batch.shape[0], hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scale = 1.0 if dtype == torch.bfloat16 else 0.5
        nbytes = batch.shape[0] * hkv * d * 2 * (2 + cache.element_size())
        fns = {"attnforge": lambda: attnforge.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr,
                                                                    k_scale=scale, v_scale=scale),
               "torch": lambda: reference.append_paged_kv(k, v, batch, pos, cache, indices, indptr, "NHD",
                                                          scale, scale)}
        if peers and dtype == torch.bfloat16:
            try:
                import flashinfer
                last = torch.tensor([(n - 1) % PAGE + 1 for n in lengths], dtype=torch.int32, device="cuda")
                fns["flashinfer"] = lambda: flashinfer.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr,
                                                                            last, "NHD")
            except Exception as e:  # noqa: BLE001 (a peer's failure is a note, not a stop)
                report.note(f"append: flashinfer: {type(e).__name__}: {str(e)[:160]}")
        _case(report, case, fns, nbytes, host=new == 1)


def _mla_cases(report: Report, peers: bool) -> None:
    page = 64
    for case, lengths, new in (("MLA B64 decode step", [4096] * 64, 1), ("MLA prefill 8192 tokens", [8192], 8192)):
        num_pages = sum(-(-n // page) for n in lengths) + 16
        ckv_cache = torch.randn(num_pages, page, 512, device="cuda", dtype=torch.bfloat16)
        kpe_cache = torch.randn(num_pages, page, 64, device="cuda", dtype=torch.bfloat16)
        indptr, indices = _table(lengths, page, num_pages)
        batch, pos = _new_tokens(lengths, new)
        ckv = torch.randn(batch.shape[0], 512, device="cuda", dtype=torch.bfloat16)
        kpe = torch.randn(batch.shape[0], 64, device="cuda", dtype=torch.bfloat16)
        nbytes = batch.shape[0] * 576 * 2 * 2
        fns = {"attnforge": lambda: attnforge.append_paged_mla_kv_cache(ckv, kpe, batch, pos, ckv_cache, kpe_cache,
                                                                        indices, indptr),
               "torch": lambda: reference.append_paged_mla(ckv, kpe, batch, pos, ckv_cache, kpe_cache, indices,
                                                           indptr)}
        if peers:
            try:
                import flashinfer
                last = torch.tensor([(n - 1) % page + 1 for n in lengths], dtype=torch.int32, device="cuda")
                fns["flashinfer"] = lambda: flashinfer.page.append_paged_mla_kv_cache(
                    ckv, kpe, batch, pos, ckv_cache, kpe_cache, indices, indptr, last)
            except Exception as e:  # noqa: BLE001
                report.note(f"append: flashinfer MLA: {type(e).__name__}: {str(e)[:160]}")
        _case(report, case, fns, nbytes, host=new == 1)


def run(report: Report, peers: bool = True) -> None:
    torch.manual_seed(0)
    _kv_cases(report, peers)
    _mla_cases(report, peers)

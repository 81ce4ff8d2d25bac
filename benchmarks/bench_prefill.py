"""Suite `prefill`: GQA 32/8, head_dim 128, bf16, causal. TFLOP/s count only the causal half."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from attnforge import AttentionSpec, BatchPrefill
from harness import (Report, compute_bound_suite, flashinfer_workspace, kernel_twins, sdpa_backends,
                     time_interleaved, time_sdpa_peers, time_us)

HQ, HKV, D = 32, 8, 128


def cases():
    """(name, lengths); ATTNFORGE_BENCH_PREFILL_CASES="B1 S8192,..." runs a subset."""
    torch.manual_seed(0)
    rag = torch.randint(128, 8193, (16,)).tolist()
    out = [("B1 S8192", [8192]), ("B1 S32768", [32768]), ("B16 S2048", [2048] * 16),
           ("ragged 16 random 128-8192", rag), ("B1 S8192 paged16", [8192])]
    keep = os.environ.get("ATTNFORGE_BENCH_PREFILL_CASES")
    return [c for c in out if c[0] in keep.split(",")] if keep else out


def ablations(backend):
    """attnforge-mma, plus ATTNFORGE_BENCH_PREFILL_ABLATION="kv_tile:stages[:ws[:pp]],..." wgmma configurations."""
    out = [("attnforge-mma", {"backend": "mma"})] if backend != "mma" else []
    for item in filter(None, os.environ.get("ATTNFORGE_BENCH_PREFILL_ABLATION", "").split(",")):
        tile, stages, *flags = item.split(":")  # "128:3:ws": a producer warpgroup; ":pp": ping-pong; ":pers": persistent
        out.append((f"attnforge-t{tile}s{stages}" + "".join(f"-{f}" for f in flags),
                    {"backend": "wgmma", "kv_tile": int(tile), "num_stages": int(stages), "producer": "ws" in flags,
                     "pingpong": "pp" in flags, "persistent": "pers" in flags}))
    return out


# the default is work_order="grouped" (measured: +4-17% on every case but B1 S8192, -3%)
SCHEDULE_VARIANTS = [("attnforge-cta-per-item", {"persistent": False}),
                     ("attnforge-longest-first", {"work_order": "longest_first"})]


def causal_flops(lengths):
    return sum(4 * D * HQ * L * (L + 1) / 2 for L in lengths)


def ragged(lengths):
    n = sum(lengths)
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return q, k, v, np.concatenate([[0], np.cumsum(lengths)])


@compute_bound_suite
def run(report: Report, peers: bool = True) -> None:
    spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True)
    for case, lengths in cases():
        q, k, v, indptr = ragged(lengths)
        flops = causal_flops(lengths)
        w = BatchPrefill(spec)
        if "paged16" in case:
            n_pages = -(-sum(lengths) // 16)
            cache = torch.randn(n_pages, 2, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
            perm = np.random.default_rng(0).permutation(n_pages)
            last = [sum(lengths) - (n_pages - 1) * 16]
            plan_args = (indptr, [0, n_pages], perm, last)
            # the "paged within 5% of ragged" compares two kernels: time the ragged K/V of the
            # same lengths in the same rotation, not minutes apart in another case (by then the GPU has
            # run B1 S32768 and clocks differently: 8-11% apart that way, 3.6% in prefill_copies)
            wr = BatchPrefill(spec)
            wr.plan(indptr, indptr)
            # the same pages in fp8 e4m3 (scales 1): the default (wgmma, its producer widening each tile
            # from a staging ring) and the portable mma kernel (widening in shared memory by every warp)
            cache8 = cache.to(torch.float8_e4m3fn)
            spec8 = dataclasses.replace(spec, kv_dtype="fp8_e4m3")
            w8, w8m = BatchPrefill(spec8), BatchPrefill(spec8, backend="mma")
            for wf in (w8, w8m):
                wf.plan(*plan_args, page_size=16)
            # and fp8 ragged K/V (the default stages it by TMA on a twin kernel: PrefillKernel.for_kv)
            k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            w8r = BatchPrefill(spec8)
            w8r.plan(indptr, indptr)
            # FlashInfer's paged fa3 (bf16) and fa2 (fp8) in the same rotation as ours, each output checked first
            peer_fns = {}
            if peers:
                w.plan(*plan_args, page_size=16)
                peer_fns = {**flashinfer_paged(report, case, q, cache, indptr, perm, last, want=w.run(q, cache)),
                            **flashinfer_paged(report, case, q, cache8, indptr, perm, last, backend="fa2",
                                               want=w8.run(q, cache8))}
            time_schedules(report, case, spec, plan_args, {"page_size": 16}, lambda wv: wv.run(q, cache), flops,
                           extra={"attnforge-ragged-kv": lambda: wr.run(q, (k, v)),
                                  "attnforge-fp8kv": lambda: w8.run(q, cache8),
                                  "attnforge-fp8kv-ragged-kv": lambda: w8r.run(q, (k8, v8)),
                                  "attnforge-fp8kv-mma": lambda: w8m.run(q, cache8), **peer_fns})
            continue
        w.plan(indptr, indptr)
        # FlashInfer fa2 / fa3 in the same rotation as ours: timed one after another, the H200 record read fa3
        # level with us on B1 S8192; in one rotation on an H100 (ninety-third session) it led by 1.1-3.6%
        peer_fns = flashinfer_ragged(report, case, q, k, v, indptr, want=w.run(q, (k, v))) if peers else {}
        time_schedules(report, case, spec, (indptr, indptr), {}, lambda wv: wv.run(q, (k, v)), flops, extra=peer_fns)
        if case == "B1 S8192":  # the portable kernel and the tiling ablation, for the record
            for name, kw in ablations(w.kernel.backend):
                wa = BatchPrefill(spec, **kw)
                wa.plan(indptr, indptr)
                report.add("prefill", case, name, time_us(lambda: wa.run(q, (k, v)), calls=2, reps=10), None, flops)
        if peers and len(set(lengths)) == 1:
            bench_dense(report, case, len(lengths), lengths[0], flops)


def time_schedules(report, case, spec, plan_args, plan_kw, run, flops, extra=None):
    """The default and the SCHEDULE_VARIANTS (persistent CTAs, the other launch order), and the
    `extra` {impl: fn} rows, timed in rotation (harness.time_interleaved) so their differences are
    not the order they ran in."""
    wrappers = {"attnforge": BatchPrefill(spec)}
    # ATTNFORGE_BENCH_PREFILL_TWINS="pingpong=True,persistent=True;num_stages=2": BatchPrefill arguments,
    # one `attnforge-twin<i>` row each, in the same rotation (an A/B of kernel choices on every case)
    for i, fields in enumerate(kernel_twins("ATTNFORGE_BENCH_PREFILL_TWINS")):
        wrappers[f"attnforge-twin{i}"] = BatchPrefill(spec, **fields)
    for name, kw in SCHEDULE_VARIANTS:
        wrappers[name] = BatchPrefill(spec, **kw)
    for wv in wrappers.values():
        wv.plan(*plan_args, **plan_kw)
    fns = {name: (lambda wv=wv: run(wv)) for name, wv in wrappers.items()}
    times = time_interleaved({**fns, **(extra or {})}, calls=2, reps=10)
    for name, us in times.items():
        report.add("prefill", case, name, us, None, flops)


def bench_dense(report, case, b, L, flops):
    q = torch.randn(b, HQ, L, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    time_sdpa_peers(report, "prefill", case, q, k, v, True, sdpa_backends("cudnn-sdpa", "fa2-sdpa"), None, flops,
                    calls=2, reps=10)
    try:  # FlexAttention, compiled, with its causal block mask (built once, outside the timing)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bm = create_block_mask(lambda b_, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cuda")
        flex = _compiled_flex(flex_attention)
        report.add("prefill", case, "flex", time_us(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True), calls=2,
                                                     reps=10), None, flops)
    except Exception as e:
        report.note(f"flex on {case}: {type(e).__name__}: {str(e)[:160]}")


_FLEX: dict = {}


def _compiled_flex(flex_attention):
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flashinfer_ragged(report, case, q, k, v, indptr, want=None) -> dict:
    """FlashInfer's ragged prefill (fa2, fa3) on the same q, k, v (heads and widths read from them), as
    {impl: fn}, planned (and JIT-built) here so that the caller times them in rotation with its own rows. With
    `want` (our output), a backend whose output differs is left out with a note."""
    try:
        import flashinfer
    except Exception as e:
        report.note(f"flashinfer unavailable: {e}")
        return {}
    ws = flashinfer_workspace()  # shared: the wrappers run in turn
    fns = {}
    for backend in ("fa2", "fa3"):
        try:
            w = flashinfer_ragged_wrapper(flashinfer, backend, indptr, q.shape[1], k.shape[1], k.shape[2], v.shape[2],
                                          ws)
            fn = (lambda w=w: w.run(q, k, v))
            if want is None or agrees(report, f"flashinfer-{backend} on {case}", fn(), want):
                fns[f"flashinfer-{backend}"] = fn
        except Exception as e:
            report.note(f"flashinfer-{backend} on {case}: {type(e).__name__}: {str(e)[:160]}")
    return fns


def flashinfer_ragged_wrapper(flashinfer, backend: str, indptr, hq: int, hkv: int, d: int, dv: int, ws=None,
                              **plan_kw):
    """A FlashInfer ragged causal prefill wrapper, planned (plan() JIT-builds its module); plan_kw: the modes of
    FlashInfer's plan (logits_soft_cap, pos_encoding_mode, ...)."""
    ws = flashinfer_workspace() if ws is None else ws
    ind = torch.as_tensor(indptr, device="cuda", dtype=torch.int32)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(ind, ind, hq, hkv, d, head_dim_vo=dv, causal=True, q_data_type=torch.bfloat16, **plan_kw)
    return w


def bench_flashinfer(report, case, q, k, v, indptr, flops, suite="prefill"):
    """FlashInfer's ragged prefill rows, each timed on its own (suites without a rotation of their own)."""
    for impl, fn in flashinfer_ragged(report, case, q, k, v, indptr).items():
        report.add(suite, case, impl, time_us(fn, calls=2, reps=10), None, flops)


def flashinfer_paged(report, case, q, cache, indptr, perm, last, backend="fa3", want=None) -> dict:
    """FlashInfer's paged prefill on the same pages as {impl: fn} (an fp8 cache: `flashinfer-<backend>-fp8kv`).
    With `want` (our output on those pages), a backend whose output differs is left out with a note."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    impl = f"flashinfer-{backend}" + ("-fp8kv" if fp8 else "")
    try:
        import flashinfer
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(flashinfer_workspace(q.device), "NHD", backend=backend)
        dev = lambda a: torch.as_tensor(np.asarray(a), device=q.device, dtype=torch.int32)  # noqa: E731
        w.plan(dev(indptr), dev([0, len(perm)]), dev(perm), dev(last), HQ, HKV, D, 16, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=cache.dtype)
        fn = (lambda: w.run(q, cache))
        return {impl: fn} if want is None or agrees(report, f"{impl} paged on {case}", fn(), want) else {}
    except Exception as e:
        report.note(f"{impl} paged on {case}: {type(e).__name__}: {str(e)[:160]}")
        return {}


def agrees(report, what: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a peer computed the case we time (its output against ours, [tokens, heads, dim]); a note where
    it did not, and the caller leaves it out."""
    err = (got.float() - want.float()).abs().max().item()
    if err > 0.05:
        report.note(f"{what}: max |difference| to attnforge's output {err:.3g}; left out")
    return err <= 0.05

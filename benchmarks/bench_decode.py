"""Suite `decode`: GQA 32/8, head_dim 128, bf16, page 16 (case names from h200-peers.md).

GB/s counts the KV bytes read (fp8: the bytes actually read). Peers in the same run: cuDNN SDPA,
FA2 (SDPA flash) and FlexAttention on equal-length cases (contiguous KV), FlashInfer on all. On those cases
attnforge.attention() too, on the decode and on the prefill kernels (bench_dense_attention).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode
from harness import (Report, flashinfer_workspace, fresh_allocator, kernel_fields, sdpa_backends, time_interleaved,
                     time_sdpa_peers, time_us)

HQ, HKV, D = 32, 8, 128


def cases():
    """(name, lengths, page size, kv dtype, layout); ATTNFORGE_BENCH_DECODE_CASES="B16 L8192,..." runs a subset."""
    torch.manual_seed(0)
    rand = torch.randint(512, 32768, (64,)).tolist()
    out = [("B1 L131072", [131072] * 1, 16, "bf16"), ("B16 L8192", [8192] * 16, 16, "bf16"),
           ("B64 L4096", [4096] * 64, 16, "bf16"), ("B256 L1024", [1024] * 256, 16, "bf16"),
           ("B16 L65536", [65536] * 16, 16, "bf16"), ("B64 Lrand", rand, 16, "bf16"),
           ("skew 1x65536+127x512", [65536] + [512] * 127, 16, "bf16"),
           ("B64 Lrand page1", rand, 1, "bf16"), ("B64 Lrand page64", rand, 64, "bf16"),
           ("B16 L8192 fp8kv", [8192] * 16, 16, "fp8_e4m3"),
           # unequal short requests: span boundaries snap to item ends here (scheduler.snap_pays)
           ("B256 Lrand64-1024", torch.randint(64, 1024, (256,)).tolist(), 16, "bf16")]
    # HND: a page holds each head's tokens contiguously (4 KB runs instead of 256-byte rows 2 KB apart)
    out = [(*c, "NHD") for c in out] + [("B16 L8192 HND", [8192] * 16, 16, "bf16", "HND")]
    keep = os.environ.get("ATTNFORGE_BENCH_DECODE_CASES")
    return [c for c in out if c[0] in keep.split(",")] if keep else out


def paged_inputs(lengths, page_size, kv_dtype, layout="NHD", hq=HQ, hkv=HKV, d=D):
    pages = [-(-L // page_size) for L in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = torch.randperm(int(indptr[-1]), generator=torch.Generator().manual_seed(1)).numpy().astype(np.int32)
    last = np.array([L - (n - 1) * page_size for L, n in zip(lengths, pages)], dtype=np.int32)
    shape = (page_size, hkv, d) if layout == "NHD" else (hkv, page_size, d)
    cache = torch.empty(int(indptr[-1]), 2, *shape, device="cuda", dtype=torch.bfloat16).normal_()
    if kv_dtype == "fp8_e4m3":
        cache = cache.to(torch.float8_e4m3fn)
    q = torch.randn(len(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    return q, cache, indptr, indices, last


def kv_bytes(lengths, kv_dtype):
    return sum(lengths) * HKV * D * 2 * (1 if kv_dtype == "fp8_e4m3" else 2)


def kernel_twin_changes() -> dict:
    """ATTNFORGE_BENCH_DECODE_KERNEL_TWIN="warp_rows=False,qk_chains=1": DecodeKernel fields to change in
    an `attnforge-twin` row, timed in rotation beside the default (an A/B of one kernel choice in one process)."""
    return kernel_fields(os.environ.get("ATTNFORGE_BENCH_DECODE_KERNEL_TWIN", ""))


def kernel_twin(changes: dict) -> type:
    """BatchDecode with `changes` applied to every kernel it builds (the split and whole-item ones)."""
    class Twin(BatchDecode):
        def _make_kernel(self, *args):
            return dataclasses.replace(super()._make_kernel(*args), **changes)

        def _make_whole_kernel(self, kernel):
            return dataclasses.replace(super()._make_whole_kernel(kernel), **changes)
    return Twin


def bench_attnforge(report, case, lengths, page_size, kv_dtype, layout, q, cache, indptr, indices, last):
    nbytes = kv_bytes(lengths, kv_dtype)
    variants = [(p, None) for p in ("auto", "normal", "transposed")]
    # ATTNFORGE_BENCH_DECODE_ABLATION="3,4": the default pipeline with other stage counts (fewer stages,
    # more CTAs per SM), for docs/perf-notes.md
    variants += [("auto", int(x)) for x in filter(None, os.environ.get("ATTNFORGE_BENCH_DECODE_ABLATION", "").split(","))]
    runs = {}
    for pipeline, stages in variants:
        spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, kv_dtype=kv_dtype,
                             pipeline=pipeline, kv_layout=layout)
        try:
            w = BatchDecode(spec, max_batch_size=max(256, len(lengths)), num_stages=stages)
        except ValueError as e:  # an ablation that does not fit
            report.note(f"decode {case} stages={stages}: {e}")
            continue
        w.plan(indptr, indices, last, page_size=page_size)
        out = torch.empty_like(q)
        impl = "attnforge" if pipeline == "auto" else f"attnforge-{pipeline}"  # auto: the default
        if stages is not None:
            impl = f"attnforge-s{stages}-{w.kernel.ctas_per_sm}cta"
        runs[impl] = (lambda w, out: lambda: w.run(q, cache, out=out))(w, out)
        if pipeline != "auto" or stages is not None:
            continue
        # the default beside itself with one choice undone: a plain launch (the default's PDL overlaps
        # consecutive calls), where the plan snapped its cuts the same plan unsnapped, and where it took a
        # whole-item kernel the default kernel's plan
        twins = {"attnforge-no-pdl": {"pdl": False}, **({"attnforge-no-snap": {"span_snap": 0}}
                                                         if w._plan["work"].snap else {}),
                 **({"attnforge-no-whole-items": {"whole_items": False}} if w.planned_kernel[0] is not w.kernel
                    else {})}
        for name, change in twins.items():
            twin = BatchDecode(spec, max_batch_size=max(256, len(lengths)), pdl=change.get("pdl", True),
                               whole_items=change.get("whole_items"))
            twin.span_snap = change.get("span_snap")  # None: the scheduler's default
            twin.plan(indptr, indices, last, page_size=page_size)
            runs[name] = (lambda w, out: lambda: w.run(q, cache, out=out))(twin, torch.empty_like(q))
        if kernel_twin_changes():
            twin = kernel_twin(kernel_twin_changes())(spec, max_batch_size=max(256, len(lengths)))
            twin.plan(indptr, indices, last, page_size=page_size)
            runs["attnforge-twin"] = (lambda w, out: lambda: w.run(q, cache, out=out))(twin, torch.empty_like(q))
    # in rotation: timed one after another, the first (the default, often the same kernel as a forced
    # pipeline) read 7% slower than its twin on the skew case (seventeenth session)
    for impl, us in time_interleaved(runs).items():
        report.add("decode", case, impl, us, nbytes)


def flashinfer_decode_us(q, cache, indptr, indices, last, page_size, layout="NHD", hq=HQ, hkv=HKV, d=D) -> float:
    """FlashInfer's paged decode (tensor-core path) on the same pages, timed as ours."""
    import flashinfer
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(flashinfer_workspace(), layout, use_tensor_cores=True)
    dev = lambda a: torch.as_tensor(a, device="cuda")  # noqa: E731
    w.plan(dev(indptr), dev(indices), dev(last), hq, hkv, d, page_size, q_data_type=torch.bfloat16,
           kv_data_type=cache.dtype)
    return time_us(lambda: w.run(q, cache))


def bench_flashinfer(report, case, lengths, page_size, kv_dtype, layout, q, cache, indptr, indices, last):
    us = flashinfer_decode_us(q, cache, indptr, indices, last, page_size, layout)
    report.add("decode", case, "flashinfer-tc", us, kv_bytes(lengths, kv_dtype))


def bench_dense_peers(report, case, lengths, flex_cache):
    from torch.nn.attention.flex_attention import flex_attention
    b, L = len(lengths), lengths[0]
    k = torch.randn(b, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    nbytes = kv_bytes(lengths, "bf16")
    bench_dense_attention(report, case, q, k, v, nbytes)
    time_sdpa_peers(report, "decode", case, q, k, v, False, sdpa_backends("cudnn-sdpa", "fa2-sdpa"), nbytes)
    try:
        if "fn" not in flex_cache:
            flex_cache["fn"] = torch.compile(flex_attention, dynamic=False)
        flex = flex_cache["fn"]
        report.add("decode", case, "flex", time_us(lambda: flex(q, k, v, enable_gqa=True)), nbytes)
    except Exception as e:
        report.note(f"flex on {case}: {type(e).__name__}: {str(e)[:120]}")
    del k, v


STATIC_CACHE_CASES = ("B16 L8192",)  # dense cases also timed on a sliced static cache


def bench_dense_attention(report, case, q, k, v, nbytes):
    """attnforge.attention() on the dense peers' tensors, in rotation: `attnforge-dense` on the decode kernels
    (ATTNFORGE_ATTENTION_DECODE=1, K/V read in place as one page a request), `attnforge-dense-prefill` on the
    prefill kernels (the knob's default); the knob is read as each variant is captured. On STATIC_CACHE_CASES also
    `-static` rows: K/V the first L positions of a [B, Hkv, 2L, D] cache (gpt-fast's static cache), which the
    decode route reads in place and the prefill route copies; and `-verify4` rows: 4 queries a request under the
    mask q_idx >= kv_idx (a verify step: the decode route runs the verify kernels)."""
    import attnforge
    was = os.environ.get("ATTNFORGE_ATTENTION_DECODE")

    def routed(flag: str, k, v, q=q, mask_mod=None):
        def fn():
            os.environ["ATTNFORGE_ATTENTION_DECODE"] = flag
            return attnforge.attention(q, k, v, mask_mod=mask_mod, enable_gqa=True)
        return fn
    variants = {"attnforge-dense": routed("1", k, v), "attnforge-dense-prefill": routed("0", k, v)}
    if case in STATIC_CACHE_CASES:
        length = k.shape[2]
        ks, vs = (t.new_empty(t.shape[0], t.shape[1], 2 * length, t.shape[3]) for t in (k, v))
        ks[:, :, :length], vs[:, :, :length] = k, v
        ks, vs = ks[:, :, :length], vs[:, :, :length]
        q4 = torch.cat([q] * 4, dim=2)  # [B, Hq, 4, D]

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        variants |= {"attnforge-dense-static": routed("1", ks, vs),
                     "attnforge-dense-static-prefill": routed("0", ks, vs),
                     "attnforge-dense-verify4": routed("1", k, v, q4, causal),
                     "attnforge-dense-verify4-prefill": routed("0", k, v, q4, causal)}
    try:
        for impl, us in time_interleaved(variants).items():
            report.add("decode", case, impl, us, nbytes)
    except Exception as e:
        report.note(f"attnforge.attention on {case}: {type(e).__name__}: {str(e)[:160]}")
    finally:
        if was is None:
            os.environ.pop("ATTNFORGE_ATTENTION_DECODE", None)
        else:
            os.environ["ATTNFORGE_ATTENTION_DECODE"] = was


def bench_plan(report):
    """`plan B256`: 256 requests of 1024 tokens from the CSR arrays (#3's target); `plan B256 block-table rand`:
    vLLM's form, lengths uniform in [1, 8192) (numpy seed 0) in a table of 2048 slots (32K tokens a request)."""
    lengths = np.full(256, 1024)
    pages = -(-lengths // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.arange(indptr[-1], dtype=np.int32)
    last = np.full(256, 16, dtype=np.int32)
    w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV), max_batch_size=256)
    times = plan_times(lambda: w.plan(indptr, indices, last, page_size=16))
    report.add("decode", "plan B256", "attnforge-plan", float(np.median(times)))
    # the host's spread between machines exceeded 1.5x on one code path (60 vs 102 us): keep its shape,
    # and the speed of a fixed numpy workload in this process at this moment, to read it against
    report.note(f"plan B256: min {min(times):.1f} us, median {np.median(times):.1f}, "
                f"p90 {np.percentile(times, 90):.1f} (200 calls); host probe {host_probe_us():.1f} us here, "
                f"{fresh_process_probe_us():.1f} us in a fresh process")
    table = np.arange(256 * 2048, dtype=np.int32).reshape(256, 2048)
    seq_lens = np.random.default_rng(0).integers(1, 8192, size=256)
    times = plan_times(lambda: w.plan(seq_lens=seq_lens, block_table=table, page_size=16))
    report.add("decode", "plan B256 block-table rand", "attnforge-plan", float(np.median(times)))


def plan_times(plan, calls: int = 200) -> list[float]:
    """Microseconds of each of `calls` plan() calls, after 20 untimed ones."""
    for _ in range(20):
        plan()
    torch.cuda.synchronize()
    gc.collect()  # a collection of an earlier suite's garbage must not land in the timed loop
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t) * 1e6)
    return times


def fresh_process_probe_us() -> float:
    """host_probe_us in a new interpreter at this moment: a slow CPU slows both, a slow process state
    (allocator, caches after the suites before) only the in-process one."""
    import subprocess
    import sys
    code = "import bench_decode; print(bench_decode.host_probe_us())"
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=120)
        return float(out.stdout.strip().splitlines()[-1])
    except Exception:  # a probe, not a result: never fail the suite over it
        return float("nan")


def host_probe_us() -> float:
    """Median time of ten small numpy calls (256-element int32 arrays; 15 us on the CI-like dev machine)."""
    a = np.arange(257, dtype=np.int32)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        for _ in range(2):
            d = a[1:] - a[:-1]
            np.cumsum(d)
            d.min()
            (d > 0).any()
            np.where(d > 0, d, 0)
        times.append((time.perf_counter() - t) * 1e6)
    return float(np.median(times))


def run(report: Report, peers: bool = True) -> None:
    flex_cache = {}
    have_fi = True
    try:
        import flashinfer  # noqa: F401
    except Exception as e:
        have_fi = False
        report.note(f"FlashInfer not importable, skipped: {e}")
    for case, lengths, page_size, kv_dtype, layout in cases():
        inputs = paged_inputs(lengths, page_size, kv_dtype, layout)
        bench_attnforge(report, case, lengths, page_size, kv_dtype, layout, *inputs)
        if peers and have_fi:
            try:
                bench_flashinfer(report, case, lengths, page_size, kv_dtype, layout, *inputs)
            except Exception as e:
                report.note(f"flashinfer on {case}: {type(e).__name__}: {str(e)[:160]}")
        del inputs
        fresh_allocator()
        # dense peers read a contiguous [B, H, L, D] cache: once per shape, under the NHD case's name
        if peers and len(set(lengths)) == 1 and kv_dtype == "bf16" and page_size == 16 and layout == "NHD":
            bench_dense_peers(report, case, lengths, flex_cache)
            fresh_allocator()  # the next case's inputs must not be carved from the dense K / V just freed
    if not os.environ.get("ATTNFORGE_BENCH_DECODE_CASES"):
        bench_plan(report)

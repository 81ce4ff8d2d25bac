"""Suite `head_dims`: the default kernels at head_dim 64, 128 and 256 (GQA 32/8, bf16), and at d128
with other head layouts (MHA 32/32, GQA 32/4 and 32/2, MQA 32/1), beside cuDNN SDPA in the same run, so a
tiling chosen for d128 GQA-4 does not hide a cliff elsewhere (d256 fp8 decode ran at one CTA per SM
until the eleventh session, d256 prefill on one consumer warpgroup until the twelfth).
Cases: `decode d{D} B16 L8192` (page 16; GB/s of KV read) and `prefill d{D} B1 S8192` (causal;
TFLOP/s of the causal half); other layouts insert `h{Hq}/{Hkv}` after the head_dim."""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode, BatchPrefill
from harness import Report, fresh_allocator, sdpa_backends, time_sdpa_peers, time_us

HQ, HKV, HEAD_DIMS = 32, 8, (64, 128, 256)
LAYOUTS = ((32, 32), (32, 4), (32, 2), (32, 1))  # at d128, beside GQA 32/8
DECODE_B, DECODE_L, PAGE = 16, 8192, 16
PREFILL_L = 8192


def run(report: Report, peers: bool = True) -> None:
    for d in HEAD_DIMS:
        decode_case(report, d, peers)
    for heads in LAYOUTS:
        decode_case(report, 128, peers, *heads)
    for d in HEAD_DIMS:
        prefill_case(report, d, peers)
    for heads in LAYOUTS:
        prefill_case(report, 128, peers, *heads)


def layout(d: int, hq: int, hkv: int) -> str:
    return f"d{d}" + ("" if (hq, hkv) == (HQ, HKV) else f" h{hq}/{hkv}")


def decode_case(report: Report, d: int, peers: bool, hq: int = HQ, hkv: int = HKV) -> None:
    case = f"decode {layout(d, hq, hkv)} B{DECODE_B} L{DECODE_L}"
    fresh_allocator()
    pages_per = DECODE_L // PAGE
    n_pages = DECODE_B * pages_per
    cache = torch.randn(n_pages, 2, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    perm = np.random.default_rng(0).permutation(n_pages).astype(np.int32)  # pages in no order
    indptr = np.arange(DECODE_B + 1, dtype=np.int32) * pages_per
    last = np.full(DECODE_B, PAGE, dtype=np.int32)
    q = torch.randn(DECODE_B, hq, d, device="cuda", dtype=torch.bfloat16)
    kv_bytes = DECODE_B * DECODE_L * hkv * d * 2 * 2
    w = BatchDecode(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d), max_num_pages=n_pages)
    w.plan(indptr, perm, last, page_size=PAGE)
    out = torch.empty_like(q)
    report.add("head_dims", case, "attnforge", time_us(lambda: w.run(q, cache, out=out)), kv_bytes)
    if peers:  # cuDNN on contiguous K / V of the same size
        dense_peer(report, case, torch.randn(DECODE_B, hq, 1, d, device="cuda", dtype=torch.bfloat16), hkv,
                   DECODE_L, causal=False, nbytes=kv_bytes)


def prefill_case(report: Report, d: int, peers: bool, hq: int = HQ, hkv: int = HKV) -> None:
    case = f"prefill {layout(d, hq, hkv)} B1 S{PREFILL_L}"
    fresh_allocator()
    flops = 4 * d * hq * PREFILL_L * (PREFILL_L + 1) / 2
    q = torch.randn(PREFILL_L, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(PREFILL_L, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    indptr = np.array([0, PREFILL_L])
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, causal=True))
    w.plan(indptr, indptr)
    report.add("head_dims", case, "attnforge", time_us(lambda: w.run(q, (k, v)), calls=2, reps=10), None, flops)
    if peers:
        dense_peer(report, case, q.transpose(0, 1).unsqueeze(0).contiguous(), hkv, PREFILL_L, causal=True, flops=flops)


def dense_peer(report: Report, case: str, q: torch.Tensor, hkv: int, kv_len: int, causal: bool, nbytes=None,
               flops=None):
    """cuDNN SDPA on q [B, Hq, Lq, D] against fresh contiguous K / V [B, hkv, kv_len, D]."""
    b, d = q.shape[0], q.shape[-1]
    k = torch.randn(b, hkv, kv_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    calls, reps = (5, 20) if nbytes else (2, 10)
    time_sdpa_peers(report, "head_dims", case, q, k, v, causal, sdpa_backends("cudnn-sdpa"), nbytes, flops,
                    calls=calls, reps=reps)

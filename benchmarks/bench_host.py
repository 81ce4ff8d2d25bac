"""Suite `host`: host time a call, where the GPU does not set the pace (eager use, no CUDA graph).

- `decode B1 L512 run`: one small decode run after its plan, 2000 back to back: attnforge against FlashInfer's
  BatchDecodeWithPagedKVCacheWrapper.run (tensor cores), GQA 32/8, d128, bf16, page 16.
- `decode step B8 L512 x32 layers`: an engine's decode step: plan() from host arrays, then one run per layer,
  each layer with its own cache (32 caches), 200 steps; FlashInfer planned from CPU tensors (its host-side form).
- `mla h16 B1 L512 run`: one MLA decode run (DeepSeek 576/512, page 64) against FlashInfer's
  BatchMLAPagedAttentionWrapper (fa2 and fa3 backends).

Rows report microseconds of wall time a call (or a step), GPU synchronised before and after the loop.
"""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode, BatchMLADecode
from attnforge.mla import DEEPSEEK_SM_SCALE
from harness import host_us

HQ, HKV, D, PAGE = 32, 8, 128, 16
LAYERS = 32


def csr(batch: int, length: int, page: int):
    pages = -(-length // page)
    return (np.arange(batch + 1, dtype=np.int32) * pages, np.arange(batch * pages, dtype=np.int32),
            np.full(batch, length - (pages - 1) * page, np.int32))


def caches(batch: int, length: int, layers: int):
    pages = batch * -(-length // PAGE)
    return [torch.randn(pages, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]


def run(report, peers: bool = True) -> None:
    q1, q8 = (torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16) for b in (1, 8))
    one, layers = caches(1, 512, 1)[0], caches(8, 512, LAYERS)
    w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV))
    w.plan(*csr(1, 512, PAGE), page_size=PAGE)
    report.add("host", "decode B1 L512 run", "attnforge", host_us(lambda: w.run(q1, one)))
    table8 = csr(8, 512, PAGE)

    def step():
        w.plan(*table8, page_size=PAGE)
        for c in layers:
            w.run(q8, c)
    report.add("host", f"decode step B8 L512 x{LAYERS} layers", "attnforge", host_us(step, calls=200, warmup=10))
    mla_case(report, peers)
    if not peers:
        return
    try:
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        f = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        cpu = lambda a: torch.as_tensor(a, dtype=torch.int32)  # noqa: E731
        plan_args = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        f.plan(*map(cpu, csr(1, 512, PAGE)), HQ, HKV, D, PAGE, **plan_args)
        report.add("host", "decode B1 L512 run", "flashinfer", host_us(lambda: f.run(q1, one)))
        table8_cpu = tuple(map(cpu, table8))

        def fi_step():
            f.plan(*table8_cpu, HQ, HKV, D, PAGE, **plan_args)
            for c in layers:
                f.run(q8, c)
        report.add("host", f"decode step B8 L512 x{LAYERS} layers", "flashinfer",
                   host_us(fi_step, calls=200, warmup=10))
    except Exception as e:
        report.note(f"host: flashinfer decode: {type(e).__name__}: {str(e)[:160]}")


def mla_case(report, peers: bool) -> None:
    case, heads, page = "mla h16 B1 L512 run", 16, 64
    spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512)
    indptr, indices, last = csr(1, 512, page)
    kv = torch.randn(len(indices), page, 576, device="cuda", dtype=torch.bfloat16)
    q_nope = torch.randn(1, heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(1, heads, 64, device="cuda", dtype=torch.bfloat16)
    m = BatchMLADecode(spec)
    m.plan(indptr, indices, last, page_size=page, sm_scale=DEEPSEEK_SM_SCALE)
    report.add("host", case, "attnforge", host_us(lambda: m.run(q_nope, q_pe, kv)))
    if not peers:
        return
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dev = lambda a: torch.as_tensor(a, device="cuda", dtype=torch.int32)  # noqa: E731
    for backend in ("fa2", "fa3"):
        try:
            import flashinfer
            f = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
            f.plan(dev([0, 1]), dev(indptr), dev(indices), dev([512]), heads, 512, 64, page, False, DEEPSEEK_SM_SCALE,
                   torch.bfloat16, torch.bfloat16)
            ckv, kpe = kv[..., :512], kv[..., 512:]
            report.add("host", case, f"flashinfer-{backend}", host_us(lambda: f.run(q_nope, q_pe, ckv, kpe)))
        except Exception as e:
            report.note(f"host: flashinfer-{backend} MLA: {type(e).__name__}: {str(e)[:160]}")

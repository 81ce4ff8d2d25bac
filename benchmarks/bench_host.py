"""Suite `host`: host time a call, where the GPU does not set the pace (eager use, no CUDA graph).

- `decode B1 L512 run`: one small decode run after its plan, 2000 back to back: attnforge against FlashInfer's
  BatchDecodeWithPagedKVCacheWrapper.run (tensor cores), GQA 32/8, d128, bf16, page 16.
- `decode step B8 L512 x32 layers`: an engine's decode step: plan() from host arrays, then one run per layer,
  each layer with its own cache (32 caches), 200 steps; FlashInfer planned from CPU tensors (its host-side form).
- `mla h16 B1 L512 run`: one MLA decode run (DeepSeek 576/512, page 64) against FlashInfer's
  BatchMLAPagedAttentionWrapper (fa2 and fa3 backends).
- `prefill run q16 kv512`: a short ragged causal chunk's run after its plan, against FlashInfer's
  BatchPrefillWithRaggedKVCacheWrapper.run (fa2 and fa3).
- `prefill plan q16 kv512`: that chunk's plan() from host arrays (FlashInfer's from CPU tensors, its host-side
  form), 2000 back to back: what an engine pays once a step before the layers' runs.
- `attention L128` / `attention docmask L1024`: the one-shot SDPA-layout call on [1, 32, L, 128] queries, GQA 32/8,
  against torch SDPA and FlexAttention (compiled; the document mask's block mask built once, as Flex users do);
  attnforge's own mask call compares the mask's document ids with the plan's at each call (a synchronisation);
  `attnforge-blockmask` takes Flex's BlockMask instead, which keys the plan (no comparison).

Rows report microseconds of wall time a call (or a step), GPU synchronised before and after the loop.
"""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode, BatchMLADecode
from attnforge.mla import DEEPSEEK_SM_SCALE
from harness import flashinfer_workspace, host_us

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
    prefill_case(report, peers)
    attention_cases(report, peers)
    if not peers:
        return
    try:
        import flashinfer
        ws = flashinfer_workspace()
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
    ws = flashinfer_workspace()
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


PREFILL_PLAN = "prefill plan q16 kv512"


def prefill_case(report, peers: bool) -> None:
    from attnforge import BatchPrefill
    case = "prefill run q16 kv512"
    q = torch.randn(16, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(512, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, causal=True))
    w.plan(np.array([0, 16], np.int32), np.array([0, 512], np.int32))
    report.add("host", case, "attnforge", host_us(lambda: w.run(q, (k, v))))
    qo_kv = (np.array([0, 16], np.int32), np.array([0, 512], np.int32))
    report.add("host", PREFILL_PLAN, "attnforge", host_us(lambda: w.plan(*qo_kv)))
    if not peers:
        return
    ws = flashinfer_workspace()
    for backend in ("fa2", "fa3"):
        try:
            import flashinfer
            f = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            qo_t, kv_t = (torch.tensor([0, n], dtype=torch.int32) for n in (16, 512))  # (built once, as ours)
            fi_plan = lambda: f.plan(qo_t, kv_t, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)  # noqa: E731
            fi_plan()
            report.add("host", case, f"flashinfer-{backend}", host_us(lambda: f.run(q, k, v)))
            report.add("host", PREFILL_PLAN, f"flashinfer-{backend}", host_us(fi_plan))
        except Exception as e:
            report.note(f"host: flashinfer-{backend} prefill: {type(e).__name__}: {str(e)[:160]}")


def attention_cases(report, peers: bool) -> None:
    import attnforge
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flex = torch.compile(flex_attention)
    for length, masked in ((128, False), (1024, True)):
        case = f"attention docmask L{length}" if masked else f"attention L{length}"
        q = torch.randn(1, HQ, length, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, length, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        docs = torch.arange(length, device="cuda") // (length // 8)

        def doc_causal(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
        mask = doc_causal if masked else None
        report.add("host", case, "attnforge",
                   host_us(lambda: attnforge.attention(q, k, v, mask_mod=mask, enable_gqa=True), calls=500))
        if masked:  # Flex's form: the plan keyed by the BlockMask object, no comparison of the mask's inputs
            bm = create_block_mask(doc_causal, 1, 1, length, length, device="cuda")
            report.add("host", case, "attnforge-blockmask", host_us(
                lambda: attnforge.attention(q, k, v, block_mask=bm, enable_gqa=True), calls=500))
        if not peers:
            continue
        if not masked:
            report.add("host", case, "sdpa", host_us(lambda: sdpa(q, k, v, enable_gqa=True), calls=500))
        try:
            bm = create_block_mask(doc_causal if masked else (lambda b, h, q_idx, kv_idx: q_idx >= 0), 1, 1, length,
                                   length, device="cuda")
            report.add("host", case, "flex", host_us(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True), calls=500))
        except Exception as e:
            report.note(f"host: flex {case}: {type(e).__name__}: {str(e)[:160]}")

"""Suite `mods`: the cost of score modifiers (rows attnforge = with the mod, attnforge-plain = without),
and a document mask against FlexAttention (compiled, block mask prebuilt)."""
from __future__ import annotations

import numpy as np
import torch

import attnforge.mods as mods
from attnforge import AttentionSpec, BatchDecode, BatchPrefill
from bench_decode import kv_bytes, paged_inputs
from bench_prefill import causal_flops, ragged
from harness import Report, time_interleaved, time_us

HQ, HKV, D = 32, 8, 128


def the_mods():
    return {"softcap": mods.softcap(50.0), "alibi": mods.alibi(_slopes()), "window4096": mods.sliding_window(4096)}


def _slopes():
    from attnforge.mods.alibi import default_slopes
    return default_slopes(HQ, "cuda")


def run(report: Report, peers: bool = True) -> None:
    # A modifier's cost is a few percent of the kernel: every variant of a family is timed in rotation
    # (harness.time_interleaved), so drift during the run falls on the plain kernel and the mods alike.
    lengths = [8192] * 16
    q, cache, indptr, indices, last = paged_inputs(lengths, 16, "bf16")
    fns = {}
    for name, mod in [("plain", None), *the_mods().items()]:
        w = BatchDecode(AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, score_mod=mod))
        w.plan(indptr, indices, last, page_size=16)
        fns[name] = lambda w=w, q=q, cache=cache: w.run(q, cache)
    report_mods(report, "decode B16 L8192", time_interleaved(fns), kv_bytes(lengths, "bf16"), None)
    del q, cache, fns
    qp, kp, vp, ind = ragged([8192])
    fns = {}
    for name, mod in [("plain", None), *the_mods().items()]:
        w = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                                       causal=True, score_mod=mod))
        w.plan(ind, ind)
        fns[name] = lambda w=w: w.run(qp, (kp, vp))
    report_mods(report, "prefill B1 S8192", time_interleaved(fns, calls=2, reps=10), None, causal_flops([8192]))
    bench_document_mask(report, peers)


def report_mods(report: Report, shape: str, times: dict, nbytes, flops) -> None:
    """Rows `<mod> <shape>`: attnforge (with the mod) and attnforge-plain (the same kernel without)."""
    for name in the_mods():
        report.add("mods", f"{name} {shape}", "attnforge-plain", times["plain"], nbytes, flops)
        report.add("mods", f"{name} {shape}", "attnforge", times[name], nbytes, flops)


def bench_document_mask(report: Report, peers: bool) -> None:
    """Causal attention within 8 equal documents; both sides build their block structure once."""
    L = 16384
    docs = torch.arange(L, device="cuda") // (L // 8)

    def doc_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
    flops = causal_flops([L // 8] * 8)
    spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                         score_mod=mods.compile_mod(mask_mod=doc_causal))
    q, k, v, ind = ragged([L])
    w = BatchPrefill(spec)
    w.plan(ind, ind)  # evaluates the mask once and keeps only tiles with a visible pair
    # the same documents as a ragged causal batch (the varlen form a user could pass instead), timed
    # in rotation with the mask: what the mask path costs over the plain kernel on equal work
    varlen = BatchPrefill(AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True))
    docs_ind = np.arange(9) * (L // 8)
    varlen.plan(docs_ind, docs_ind)
    times = time_interleaved({"attnforge": lambda: w.run(q, (k, v)), "attnforge-ragged-docs": lambda: varlen.run(q, (k, v))},
                             calls=2, reps=10)
    for impl, us in times.items():
        report.add("mods", "document-mask B1 S16384", impl, us, None, flops)
    if not peers:
        return
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        qd, kd, vd = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
        bm = create_block_mask(doc_causal, None, None, L, L, device="cuda")
        flex = torch.compile(flex_attention)
        report.add("mods", "document-mask B1 S16384", "flex",
                   time_us(lambda: flex(qd, kd, vd, block_mask=bm, enable_gqa=True), calls=2, reps=10), None, flops)
    except Exception as e:
        report.note(f"flex document mask: {type(e).__name__}: {str(e)[:160]}")

"""Suite `mods`: the cost of score modifiers (rows attnforge = with the mod, attnforge-plain = without),
and a document mask against FlexAttention (compiled, block mask prebuilt)."""
from __future__ import annotations

import torch

import attnforge.mods as mods
from attnforge import AttentionSpec, BatchDecode, BatchPrefill
from bench_decode import kv_bytes, paged_inputs
from bench_prefill import causal_flops, ragged
from harness import Report, time_us

HQ, HKV, D = 32, 8, 128


def the_mods():
    return {"softcap": mods.softcap(50.0), "alibi": mods.alibi(_slopes()), "window4096": mods.sliding_window(4096)}


def _slopes():
    from attnforge.mods.alibi import default_slopes
    return default_slopes(HQ, "cuda")


def run(report: Report, peers: bool = True) -> None:
    lengths = [8192] * 16
    q, cache, indptr, indices, last = paged_inputs(lengths, 16, "bf16")
    for name, mod in [("plain", None), *the_mods().items()]:
        spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, score_mod=mod)
        w = BatchDecode(spec)
        w.plan(indptr, indices, last, page_size=16)
        t = time_us(lambda: w.run(q, cache))
        for n in (the_mods() if mod is None else [name]):  # the plain time is the baseline of every case
            report.add("mods", f"{n} decode B16 L8192", "attnforge-plain" if mod is None else "attnforge", t,
                       kv_bytes(lengths, "bf16"))
    del q, cache
    qp, kp, vp, ind = ragged([8192])
    flops = causal_flops([8192])
    for name, mod in [("plain", None), *the_mods().items()]:
        spec = AttentionSpec(family="prefill", num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, causal=True,
                             score_mod=mod)
        w = BatchPrefill(spec)
        w.plan(ind, ind)
        t = time_us(lambda: w.run(qp, (kp, vp)), calls=2, reps=10)
        for n in (the_mods() if mod is None else [name]):
            report.add("mods", f"{n} prefill B1 S8192", "attnforge-plain" if mod is None else "attnforge", t, None,
                       flops)
    bench_document_mask(report, peers)


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
    report.add("mods", "document-mask B1 S16384", "attnforge", time_us(lambda: w.run(q, (k, v)), calls=2, reps=10),
               None, flops)
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

"""Suite `mods`: the cost of score modifiers (rows attnforge = with the mod, attnforge-plain = without),
and a document mask against FlexAttention (compiled, block mask prebuilt). With peers, the prefill rows
also give each peer's own cost of the same modifier (`<peer>` with it, `<peer>-plain` without, timed in
rotation), so a target on the cost can be read against what FlashInfer and FlexAttention pay.
`python benchmarks/bench_mods.py prebuild <backend> <mode>` builds one FlashInfer module (to run several at once
before the suite: each takes minutes)."""
from __future__ import annotations

import importlib.util as importlib_util

import numpy as np
import torch

import attnforge.mods as mods
from attnforge import AttentionSpec, BatchDecode, BatchPrefill
from bench_decode import kv_bytes, paged_inputs
from bench_prefill import agrees, causal_flops, flashinfer_ragged_wrapper, ragged
from harness import Report, compute_bound_suite, flashinfer_workspace, time_interleaved, time_us

HQ, HKV, D = 32, 8, 128


def the_mods():
    return {"softcap": mods.softcap(50.0), "alibi": mods.alibi(_slopes()), "window4096": mods.sliding_window(4096)}


def _slopes():
    from attnforge.mods.alibi import default_slopes
    return default_slopes(HQ, "cuda")


@compute_bound_suite
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
        fns[name] = lambda w=w, q=qp, kv=(kp, vp): w.run(q, kv)
    times = time_interleaved(fns, calls=2, reps=10)
    report_mods(report, "prefill B1 S8192", times, None, causal_flops([8192]))
    ours = {}
    if peers:
        ours = {name: fn().clone() for name, fn in fns.items()}  # each peer's output is checked against ours
        bench_flashinfer_mods(report, qp, kp, vp, ind, ours)
        bench_flex_mods(report, qp, kp, vp, ours)
    del qp, kp, vp, fns, ours  # the document mask's inputs get fresh memory
    bench_document_mask(report, peers)


def report_mods(report: Report, shape: str, times: dict, nbytes, flops) -> None:
    """Rows `<mod> <shape>`: attnforge (with the mod) and attnforge-plain (the same kernel without)."""
    for name in the_mods():
        report.add("mods", f"{name} {shape}", "attnforge-plain", times["plain"], nbytes, flops)
        report.add("mods", f"{name} {shape}", "attnforge", times[name], nbytes, flops)


def peer_mods_report(report: Report, peer: str, times: dict) -> None:
    """A peer's rows: `<peer>-plain` and `<peer>` (with the mod) under each mod it ran."""
    for name in (n for n in times if n != "plain"):
        report.add("mods", f"{name} prefill B1 S8192", f"{peer}-plain", times["plain"], None, causal_flops([8192]))
        report.add("mods", f"{name} prefill B1 S8192", peer, times[name], None, causal_flops([8192]))


# FlashInfer's JIT builds one module per (backend, mode) on first use, minutes each for fa3: the modes that
# answer a question. fa3 has no ALiBi (FlashInfer's is_fa3_backend_supported takes no position encoding), so
# ALiBi's cost is fa2's; soft-cap's is fa3's, the Hopper kernel ours is held against.
FLASHINFER_MODES = {"fa2": ("plain", "alibi"), "fa3": ("plain", "softcap")}
FLASHINFER_PLAN_KW = {"plain": {}, "softcap": {"logits_soft_cap": 50.0}, "alibi": {"pos_encoding_mode": "ALIBI"}}


def flashinfer_prefill(backend: str, mode: str, indptr, ws=None):
    """The suite's FlashInfer ragged causal prefill wrapper planned for `mode` (plan() JIT-builds its module)."""
    import flashinfer
    return flashinfer_ragged_wrapper(flashinfer, backend, indptr, HQ, HKV, D, D, ws, **FLASHINFER_PLAN_KW[mode])


def bench_flashinfer_mods(report: Report, q, k, v, indptr, ours: dict) -> None:
    """FlashInfer's ragged causal prefill without and with a mode (FLASHINFER_MODES: soft-cap by
    logits_soft_cap, ALiBi by pos_encoding_mode with the same geometric slopes), timed in rotation."""
    if importlib_util.find_spec("flashinfer") is None:
        report.note("flashinfer unavailable: not importable (PYTHONPATH=.anchors/flashinfer on the GPU machine)")
        return
    ws = flashinfer_workspace()  # shared: the wrappers run in turn
    for backend, modes in FLASHINFER_MODES.items():
        fns = {}
        for name in modes:
            try:
                fn = (lambda w=flashinfer_prefill(backend, name, indptr, ws): w.run(q, k, v))
                if agrees(report, f"flashinfer-{backend} {name} prefill", fn(), ours[name]):
                    fns[name] = fn
            except Exception as e:
                report.note(f"flashinfer-{backend} {name} prefill: {type(e).__name__}: {str(e)[:160]}")
        if "plain" in fns and len(fns) > 1:
            peer_mods_report(report, f"flashinfer-{backend}", time_interleaved(fns, calls=2, reps=10))


def bench_flex_mods(report: Report, q, k, v, ours: dict) -> None:
    """FlexAttention (compiled) without and with each prefill mod: soft-cap and ALiBi as its score_mod over
    the causal block mask, the window as a block mask of its own."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        L, slopes = q.shape[0], _slopes()
        qd, kd, vd = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
        causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device="cuda")
        window = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 4096), None, None, L, L, device="cuda")
        flex = torch.compile(flex_attention)
        variants = {"plain": (None, causal), "softcap": (lambda s, b, h, qi, ki: 50.0 * torch.tanh(s / 50.0), causal),
                    "alibi": (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), causal), "window4096": (None, window)}
        fns = {name: (lambda m=m, bm=bm: flex(qd, kd, vd, score_mod=m, block_mask=bm, enable_gqa=True))
               for name, (m, bm) in variants.items()}
        fns = {name: fn for name, fn in fns.items() if agrees(report, f"flex {name} prefill", fn()[0].transpose(0, 1),
                                                               ours[name])}
        peer_mods_report(report, "flex", time_interleaved(fns, calls=2, reps=10))
    except Exception as e:
        report.note(f"flex prefill mods: {type(e).__name__}: {str(e)[:160]}")


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


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 4 and sys.argv[1] == "prebuild":
        flashinfer_prefill(sys.argv[2], sys.argv[3], [0, 128])
        print(f"flashinfer-{sys.argv[2]} {sys.argv[3]}: built")
    else:
        sys.exit("usage: python benchmarks/bench_mods.py prebuild <fa2|fa3> <plain|softcap|alibi>")

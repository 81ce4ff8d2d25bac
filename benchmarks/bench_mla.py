"""Suite `mla`: MLA decode (512 latent + 64 rope, bf16, page 64) against FlashInfer's MLA (fa2, fa3)
and plain torch, in the same run.

GB/s counts the latent cache read once (576 x 2 bytes per token); TFLOP/s counts
2 * (576 + 512) FLOPs per head per KV token (the issue's definition).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from attnforge import AttentionSpec, BatchMLADecode
from attnforge.jit import registry
from attnforge.kernels.mla import MLA_MERGE_KERNELS
from attnforge.mla import DEEPSEEK_SM_SCALE
from harness import Report, flashinfer_workspace, prepare, time_interleaved, time_us
from harness import kernel_twins as env_kernel_twins

PAGE = 64


def cases():
    if os.environ.get("ATTNFORGE_BENCH_MLA_CASES"):  # a subset, e.g. for ablations
        keep = os.environ["ATTNFORGE_BENCH_MLA_CASES"].split(",")
        return [c for c in _all_cases() if c[0] in keep]
    return _all_cases()


def _all_cases():
    base = [("B16 L65536", 16, 65536), ("B64 L8192", 64, 8192), ("B128 L4096", 128, 4096), ("B1 L131072", 1, 131072)]
    # ATTNFORGE_BENCH_MLA_HEADS="8": every batch shape at these head counts too (a crossover check)
    more = [int(h) for h in filter(None, os.environ.get("ATTNFORGE_BENCH_MLA_HEADS", "").split(","))]
    out = [(f"h{h} {name}", h, b, L) for h in (16, 128) for name, b, L in base]
    out += [(f"h{h} B16 L65536", h, 16, 65536) for h in (8, 32, 64)]
    out += [(f"h{h} {name}", h, b, L) for h in more for name, b, L in base]
    # ATTNFORGE_BENCH_MLA_SHAPES="B8 L32768,B32 L16384": these batch shapes at 16 heads too (a crossover check)
    for name in filter(None, (x.strip() for x in os.environ.get("ATTNFORGE_BENCH_MLA_SHAPES", "").split(","))):
        b, L = (int(part[1:]) for part in name.split())
        out.append((f"h16 {name}", 16, b, L))
    return list({c[0]: c for c in out}.values())  # each case once, in order


def kernel_twins() -> list[dict]:
    """ATTNFORGE_BENCH_MLA_KERNEL_TWINS: ';'-separated sets of kernel_fields."""
    return env_kernel_twins("ATTNFORGE_BENCH_MLA_KERNEL_TWINS")


def twin_fields(impl: str, twins: list, transposed_twins: list) -> Optional[dict]:
    """The MLADecodeKernel fields of a row: a twin's set, the one-warpgroup kernel's, else None."""
    if impl.startswith("attnforge-wgmma-transposed-twin"):
        return transposed_twins[int(impl[len("attnforge-wgmma-transposed-twin"):])]
    if impl.startswith("attnforge-twin"):
        return twins[int(impl[len("attnforge-twin"):])]
    return {"producer": False} if impl.endswith("-1wg") else None


def selected_rows(variants: list) -> list:
    """ATTNFORGE_BENCH_MLA_ROWS="attnforge,attnforge-twin0": only the variants (row name first) named there,
    so an A/B times only what it compares; unset, all of them."""
    keep = set(filter(None, (x.strip() for x in os.environ.get("ATTNFORGE_BENCH_MLA_ROWS", "").split(","))))
    return [v for v in variants if not keep or v[0] in keep]


def query_tokens() -> int:
    """ATTNFORGE_BENCH_MLA_Q_LEN="2": every case with that many query tokens a request (speculative decoding,
    causal within the request as FlashInfer's causal plan), its rows named "<case> q2"; 1 unset."""
    raw = os.environ.get("ATTNFORGE_BENCH_MLA_Q_LEN", "1").strip()
    if not raw.isdigit() or not 1 <= int(raw) <= 4:
        raise ValueError(f"ATTNFORGE_BENCH_MLA_Q_LEN: expected 1..4 query tokens a request, got {raw!r}; "
                         f"set it to 1, 2, 3 or 4, or unset it")
    return int(raw)


def case_name(case: str, q: int) -> str:
    return case if q == 1 else f"{case} q{q}"


def inputs(heads, batch, length, q=1):
    pages = -(-length // PAGE)
    indptr = (np.arange(batch + 1) * pages).astype(np.int32)
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(1)).numpy().astype(np.int32)
    last = np.full(batch, length - (pages - 1) * PAGE, dtype=np.int32)
    kv = torch.empty(batch * pages, PAGE, 576, device="cuda", dtype=torch.bfloat16).normal_()
    q_nope = torch.randn(batch * q, heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch * q, heads, 64, device="cuda", dtype=torch.bfloat16)
    return q_nope, q_pe, kv, indptr, indices, last


def bench_attnforge(report, case, heads, q_nope, q_pe, kv, indptr, indices, last, nbytes, flops, q=1):
    ckv, kpe = kv[..., :512], kv[..., 512:]
    # (row name, pipeline, backend, schedule, tile, stages, CTAs per SM): "attnforge" is the defaults;
    # -normal and -transposed the mma.sync kernels; -wgmma* the sm_90a warpgroup kernels
    variants = [("attnforge", "auto", None, None, None, None, None),
                ("attnforge-pdl", "auto", None, None, None, None, None),  # the default kernel, launched with PDL
                ("attnforge-no-pdl", "auto", None, None, None, None, None),  # ... and plainly
                ("attnforge-graph", "auto", None, None, None, None, None),  # use_cuda_graph=True: merge always launched
                ("attnforge-normal", "normal", "mma", None, None, None, None),
                ("attnforge-transposed", "transposed", "mma", None, None, None, None),
                ("attnforge-wgmma", "normal", "wgmma", None, None, None, None),
                ("attnforge-wgmma-roles", "normal", "wgmma", "roles", None, None, None),
                ("attnforge-wgmma-transposed", "transposed", "wgmma", None, None, None, None),
                # ... with one warpgroup that also copies (MLADecodeKernel.producer=False; the default has two)
                ("attnforge-wgmma-transposed-1wg", "transposed", "wgmma", None, None, None, None)]
    # ATTNFORGE_BENCH_ABLATION="32:3,64:2": other (tile, stages) of the normal pipeline, for docs/perf-notes.md
    for item in filter(None, os.environ.get("ATTNFORGE_BENCH_ABLATION", "").split(",")):
        tile, stages = (int(x) for x in item.split(":"))
        variants.append((f"attnforge-normal-t{tile}s{stages}", "normal", "mma", None, tile, stages, None))
    # ATTNFORGE_BENCH_MLA_CTAS_PER_SM="1": the default kernel on fewer persistent CTAs (longer spans:
    # fewer chunk fills and partial states to merge), for the single-request cases' overheads
    ctas = [int(x) for x in filter(None, os.environ.get("ATTNFORGE_BENCH_MLA_CTAS_PER_SM", "").split(","))]
    variants += [(f"attnforge-{c}cta", "auto", None, None, None, None, c) for c in ctas]
    # ATTNFORGE_BENCH_MLA_ALIGN_SLACK="100000": the default kernel with that bound on aligned spans (equal
    # requests cut into equal chunks, or several whole a span where they outnumber the CTAs)
    slacks = [int(x) for x in filter(None, os.environ.get("ATTNFORGE_BENCH_MLA_ALIGN_SLACK", "").split(","))]
    variants += [(f"attnforge-slack{x}", "auto", None, None, None, None, None) for x in slacks]
    # ATTNFORGE_BENCH_MLA_ALIGN_TILE="0": the default kernel with aligned chunks' cuts rounded to that many
    # tokens (0: unrounded; BatchMLADecode.align_tile), to compare with the default's tile-rounded cuts
    tiles = [int(x) for x in filter(None, os.environ.get("ATTNFORGE_BENCH_MLA_ALIGN_TILE", "").split(","))]
    variants += [(f"attnforge-tile{x}", "auto", None, None, None, None, None) for x in tiles]
    # ATTNFORGE_BENCH_MLA_KERNEL_TWINS="roles_q_steps=4,roles_pv_rs=False;roles_q_steps=16": the default
    # kernel with these MLADecodeKernel fields changed, one `attnforge-twin<i>` row each, timed in rotation
    # beside the default (an A/B of kernel choices in one process)
    twins = kernel_twins()
    variants += [(f"attnforge-twin{i}", "auto", None, None, None, None, None) for i in range(len(twins))]
    # ATTNFORGE_BENCH_MLA_TRANSPOSED_TWINS="copies_by_block=False;early_scores=False": the wgmma transposed kernel (the
    # attnforge-wgmma-transposed row) with these fields, one `attnforge-wgmma-transposed-twin<i>` row each: its
    # A/B at every head count (a wrapper given kernel_fields keeps the default kernel, normal from 16 heads)
    t_twins = env_kernel_twins("ATTNFORGE_BENCH_MLA_TRANSPOSED_TWINS")
    variants += [(f"attnforge-wgmma-transposed-twin{i}", "transposed", "wgmma", None, None, None, None)
                 for i in range(len(t_twins))]
    variants = selected_rows(variants)
    runs = {}
    for impl, pipeline, backend, schedule, tile, stages, per_sm in variants:
        spec = AttentionSpec(family="mla_decode", num_qo_heads=heads, num_kv_heads=1, head_dim_qk=576,
                             head_dim_vo=512, pipeline=pipeline)
        try:
            graph = impl == "attnforge-graph"  # (the harness captures every row in a graph; this is the
            # wrapper's graph mode: fixed buffers, and the merge kernel launched whatever the plan splits)
            w = BatchMLADecode(spec, max_batch_size=len(last) if graph else max(256, len(last)), max_q_len=q,
                               tile_kv=tile, num_stages=stages, backend=backend, schedule=schedule, ctas_per_sm=per_sm,
                               pdl={"attnforge-pdl": True, "attnforge-no-pdl": False}.get(impl), use_cuda_graph=graph,
                               kernel_fields=twin_fields(impl, twins, t_twins))
        except ValueError as e:  # an ablation that does not fit this head count
            report.note(f"mla {case} {impl}: {e}")
            continue
        if impl.startswith("attnforge-slack"):
            w.align_slack = int(impl[len("attnforge-slack"):])
        if impl.startswith("attnforge-tile"):
            w.align_tile = int(impl[len("attnforge-tile"):])
        w.plan(indptr, indices, last, page_size=PAGE, q_len=q)
        runs[impl] = lambda w=w, out=torch.empty_like(q_nope): w.run(q_nope, q_pe, ckv, kpe, out=out)
        if impl == "attnforge" and len(last) == 1:  # one long request: what its chunks' merge costs
            no_merge = (lambda f=runs[impl]: f())  # its own function object: the marker below is its alone
            no_merge.wrapper = w
            runs["attnforge-no-merge"] = no_merge
    for impl, us in time_interleaved(runs, reps=10, prepare_fn=prepare_without_merge).items():
        report.add("mla", case, impl, us, nbytes, flops)  # in rotation: no order effect between kernels


class _NoLaunch:
    def launch(self, *args, **kwargs) -> None:
        pass


def prepare_without_merge(fn, calls, use_graph):
    """harness.prepare, except for the `attnforge-no-merge` row (a function with a `wrapper`): its graph is
    captured with the merge kernel's launch left out, so the row times the decode kernel alone (its
    output is not the attention: the split chunks stay unmerged)."""
    w = getattr(fn, "wrapper", None)
    if w is None:
        return prepare(fn, calls, use_graph)
    lib = registry.get_library(w.kernel, w.kernel.module, w.device)
    merges = {name: lib.kernels[name] for name in MLA_MERGE_KERNELS}
    lib.kernels.update({name: _NoLaunch() for name in merges})
    try:
        return prepare(fn, calls, use_graph)
    finally:
        lib.kernels.update(merges)


def bench_flashinfer(report, case, heads, q_nope, q_pe, kv, indptr, indices, last, nbytes, flops, q=1):
    import flashinfer
    ws = flashinfer_workspace()
    b = len(last)
    dev = lambda a: torch.as_tensor(a, device="cuda", dtype=torch.int32)  # noqa: E731
    kv_len = dev((np.diff(indptr) - 1) * PAGE + last)
    ckv, kpe = kv[..., :512], kv[..., 512:]
    for backend in ("fa2", "fa3"):
        try:
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
            w.plan(dev(np.arange(b + 1) * q), dev(indptr), dev(indices), kv_len, heads, 512, 64, PAGE, q > 1,
                   DEEPSEEK_SM_SCALE, torch.bfloat16, torch.bfloat16)
            report.add("mla", case, f"flashinfer-{backend}", time_us(lambda: w.run(q_nope, q_pe, ckv, kpe), reps=10),
                       nbytes, flops)
        except Exception as e:
            report.note(f"flashinfer-{backend} on {case}: {type(e).__name__}: {str(e)[:160]}")


def bench_torch(report, case, q_nope, q_pe, kv, batch, length, nbytes, flops):
    """Plain torch on a contiguous copy of the cache: S = Q K^T, softmax in fp32, O = P V."""
    k = kv.view(batch, -1, 576)[:, :length]
    q = torch.cat([q_nope, q_pe], dim=-1)

    def fn():
        s = torch.matmul(q, k.transpose(1, 2)).float() * DEEPSEEK_SM_SCALE
        return torch.matmul(torch.softmax(s, dim=-1).bfloat16(), k[..., :512])
    try:
        report.add("mla", case, "torch", time_us(fn, reps=5), nbytes, flops)
    except Exception as e:
        report.note(f"torch on {case}: {type(e).__name__}: {str(e)[:120]}")


def accuracy(report: Report) -> None:
    """RMSE against float64 for each pipeline and dtype (the ETAP paper reports 1.25e-5 in fp16)."""
    from attnforge import reference
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        q_nope, q_pe, kv, indptr, indices, last = inputs(16, 4, 4096)
        q_nope, q_pe, kv = q_nope.to(dtype), q_pe.to(dtype), kv.to(dtype)
        rows = [kv[torch.as_tensor(indices[indptr[b]:indptr[b + 1]], dtype=torch.long)].reshape(-1, 576).double()
                for b in range(4)]
        ref = torch.cat([reference.mla_attention(q_nope[b:b + 1].double(), q_pe[b:b + 1].double(), r[:, :512],
                                                 r[:, 512:], sm_scale=DEEPSEEK_SM_SCALE)[0] for b, r in enumerate(rows)])
        # (name, pipeline, backend, kernel_fields): the four kernels, and the transposed wgmma kernel with its
        # split items' partial states in scaled fp16 (MLADecodeKernel.partial_16bit, off by default)
        kernels = [("normal", "normal", "mma", None), ("transposed", "transposed", "mma", None),
                   ("wgmma", "normal", "wgmma", None), ("wgmma-transposed", "transposed", "wgmma", None),
                   ("wgmma-transposed scaled-fp16 partials", "transposed", "wgmma", {"partial_16bit": True})]
        for name, pipeline, backend, fields in kernels:
            spec = AttentionSpec(family="mla_decode", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                 head_dim_vo=512, q_dtype=str(dtype).split(".")[1], pipeline=pipeline)
            w = BatchMLADecode(spec, backend=backend, kernel_fields=fields)
            w.plan(indptr, indices, last, page_size=PAGE)
            out = w.run(q_nope, q_pe, kv[..., :512], kv[..., 512:])
            rmse = (out.double() - ref).pow(2).mean().sqrt().item()
            report.note(f"mla accuracy h16 B4 L4096 {spec.q_dtype} {name}: RMSE vs float64 {rmse:.3e}")


PDL_NOTE = ("mla: attnforge's rows launch with programmatic dependent launch where it is the kernel's default "
            "(BatchMLADecode(pdl=None): every kernel but h128's roles kernel, which launches plainly); attnforge-pdl "
            "and attnforge-no-pdl are the default kernel launched each way; FlashInfer 0.2.14's MLA wrapper has no "
            "PDL option, so its rows launch plainly")


def run(report: Report, peers: bool = True) -> None:
    if not os.environ.get("ATTNFORGE_BENCH_MLA_ROWS"):  # (an A/B of a few rows skips the RMSE's 8 kernels)
        accuracy(report)
    report.note(PDL_NOTE)
    q = query_tokens()
    for case, heads, batch, length in cases():
        q_nope, q_pe, kv, indptr, indices, last = inputs(heads, batch, length, q)
        tokens, case = batch * length, case_name(case, q)
        nbytes, flops = tokens * 576 * 2, 2 * (576 + 512) * heads * tokens * q  # (each query token: about every key)
        bench_attnforge(report, case, heads, q_nope, q_pe, kv, indptr, indices, last, nbytes, flops, q)
        if peers:
            bench_flashinfer(report, case, heads, q_nope, q_pe, kv, indptr, indices, last, nbytes, flops, q)
            if q == 1 and batch * heads * length * 4 <= 2**31:  # (one query token a request: no causal mask)
                bench_torch(report, case, q_nope, q_pe, kv, batch, length, nbytes, flops)
        del q_nope, q_pe, kv
        torch.cuda.empty_cache()

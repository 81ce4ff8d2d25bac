"""Suite `cascade`: B256 requests sharing one 32768-token prefix, each with 512 own tokens, GQA 32/8
d128 bf16, page 16. Rows: attnforge (CascadeDecode: Hopper levels with an exact row max),
attnforge-lagging-levels (exact_max=False) and attnforge-mma-levels (levels on the mma.sync prefill kernel), the
three timed in rotation (`level_kwargs`), attnforge-noshare (plain decode over prefix +
own pages), flashinfer-cascade (MultiLevelCascadeAttentionWrapper, two levels). Pages are shuffled
(the issue's case); a second case holds the prefix in consecutive pages, as an engine that allocated
the shared prompt in one go would (rows attnforge, its shared level, flashinfer-cascade).

GB/s counts the KV bytes that must be read once: the prefix once plus every request's own tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from attnforge import AttentionSpec, BatchDecode
from attnforge.cascade import CascadeDecode
from harness import Report, flashinfer_workspace, time_interleaved, time_us

B, PREFIX, OWN, PAGE, HQ, HKV, D = 256, 32768, 512, 16, 32, 8, 128
CASE = f"B{B} shared{PREFIX}+{OWN}"


def run(report: Report, peers: bool = True) -> None:
    run_case(report, peers, CASE, prefix_in_order=False)
    run_case(report, peers, CASE + " prefix in order", prefix_in_order=True)
    torch.cuda.empty_cache()


def run_case(report: Report, peers: bool, case: str, prefix_in_order: bool) -> None:
    pp, op = PREFIX // PAGE, OWN // PAGE
    total = pp + B * op
    cache = torch.empty(total, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16).normal_()
    rng = np.random.default_rng(0)
    if prefix_in_order:  # the prefix in pages 0..pp-1, the requests' own pages shuffled after it
        perm = np.concatenate([np.arange(pp), pp + rng.permutation(total - pp)]).astype(np.int32)
    else:
        perm = rng.permutation(total).astype(np.int32)
    prefix, own = perm[:pp], perm[pp:]
    own_indptr = (np.arange(B + 1) * op).astype(np.int32)
    last = np.full(B, PAGE, dtype=np.int32)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D)
    nbytes = (PREFIX + B * OWN) * HKV * D * 2 * 2
    kinds = {"attnforge": {}} if prefix_in_order else {
        "attnforge": {}, "attnforge-lagging-levels": {"exact_max": False}, "attnforge-mma-levels": {"backend": "mma"}}
    cascades = {name: CascadeDecode(spec, level_kwargs=kw) for name, kw in kinds.items()}
    for c in cascades.values():
        c.plan(levels=[([0, B], [0, pp], prefix, [PAGE])], suffix=(own_indptr, own, last), page_size=PAGE)
    # the default's exact row max rounds a peaked row more closely than a lagging one, as mma.sync levels do
    # (perf-notes, Next steps 13): what each costs in time, timed in rotation
    times = time_interleaved({name: (lambda c=c: c.run(q, cache)) for name, c in cascades.items()})
    for name, us in times.items():
        report.add("cascade", case, name, us, nbytes)
    c = cascades["attnforge"]
    # where the time goes: the shared level (a prefill of B*HQ/HKV packed rows per KV head; the lagging one beside
    # it) and the suffix decode alone (each with its own split-KV merge); the final merge is the remainder
    level_flops = 4 * B * HQ * PREFIX * D
    levels = {"attnforge-shared-level": c.levels[0]}
    if "attnforge-lagging-levels" in cascades:
        levels["attnforge-shared-level-lagging"] = cascades["attnforge-lagging-levels"].levels[0]
    times = time_interleaved({name: (lambda w=w: w.run(q, cache, return_lse=True)) for name, w in levels.items()})
    for name, us in times.items():
        report.add("cascade", case, name, us, PREFIX * HKV * D * 4, level_flops)
    if prefix_in_order:  # the suffix and the unshared decode do not depend on the prefix's order
        bench_flashinfer(report, case, peers, cache, q, pp, prefix, own, own_indptr, last, nbytes)
        return
    report.add("cascade", case, "attnforge-suffix", time_us(lambda: c.suffix.run(q, cache, return_lse=True)),
               B * OWN * HKV * D * 4)
    full_indptr = (np.arange(B + 1) * (pp + op)).astype(np.int32)
    full = np.concatenate([np.concatenate([prefix, own[b * op:(b + 1) * op]]) for b in range(B)])
    plain = BatchDecode(spec)
    plain.plan(full_indptr, full, last, page_size=PAGE)
    report.add("cascade", case, "attnforge-noshare", time_us(lambda: plain.run(q, cache)), nbytes)
    bench_flashinfer(report, case, peers, cache, q, pp, prefix, own, own_indptr, last, nbytes)


def bench_flashinfer(report, case, peers, cache, q, pp, prefix, own, own_indptr, last, nbytes) -> None:
    if not peers:
        return
    try:
        import flashinfer
        ws = flashinfer_workspace()
        w = flashinfer.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
        dev = lambda a: torch.as_tensor(np.asarray(a), device="cuda", dtype=torch.int32)  # noqa: E731
        w.plan([dev([0, B]), dev(np.arange(B + 1))], [dev([0, pp]), dev(own_indptr)], [dev(prefix), dev(own)],
               [dev([PAGE]), dev(last)], HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
        report.add("cascade", case, "flashinfer-cascade", time_us(lambda: w.run(q, cache)), nbytes)
    except Exception as e:
        report.note(f"flashinfer-cascade on {case}: {type(e).__name__}: {str(e)[:160]}")

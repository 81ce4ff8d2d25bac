"""plan() on one stream, run() on another: the run waits for the plan's copy, and the next plan's copy waits for the
run (StagedUpload.order_run). A long sleep kernel ahead of one side makes the missing order visible: without it the
run reads the work arrays before they land, or after the next plan overwrote them. Each wrapper first plans and runs
the test's own plan and then another one on the current stream: a first run builds its kernels (a plan's kernel
depends on its shape), which outlasts the sleep. With one warm-up plan of another shape, the normal-pipeline and
prefill tests passed on main too (eighty-eighth session). The poisoned output is filled before the sleep: a kernel's
first launch in a process (CUDA's lazy module loading) waits for the running sleep, so the first test's poison fill
let the copy land before its run (the normal-pipeline test passed on the package before order_run; ninetieth
session)."""
from __future__ import annotations

import pytest
import torch

from attnforge import AttentionSpec, BatchDecode, BatchPrefill, reference
from helpers import assert_attention_close, decode_expected, make_paged_case, poison

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H100's / H200's clocks: far longer than a plan's copy


@pytest.mark.parametrize("pipeline", ["normal", "transposed"])
def test_decode_planned_on_a_side_stream_run_on_the_current_one(pipeline):
    spec = AttentionSpec(pipeline=pipeline)
    q, cache, table, per_req = make_paged_case(spec, [0, 17, 900, 5000], 16)
    w = BatchDecode(spec)
    _, _, warm, _ = make_paged_case(spec, [33, 7], 16, seed=5)  # (another plan: this one's arrays must land late)
    w.plan(*table, page_size=16)
    w.run(q, cache)  # (this plan's kernels built)
    w.plan(*warm, page_size=16)
    w.run(q[:2], cache)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (q and the cache are written)
    out = poison(q.shape, q.dtype)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy lands ~0.1 s from now
        w.plan(*table, page_size=16)
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    ref, _, low = decode_expected(spec, q, per_req)
    assert_attention_close(out.cpu(), ref, low, "planned on a side stream")


def test_the_next_plan_waits_for_a_run_on_another_stream():
    spec = AttentionSpec()
    q, cache, table, per_req = make_paged_case(spec, [3000, 40, 7000, 1], 16, seed=1)
    _, _, other, _ = make_paged_case(spec, [1, 9000, 2, 600], 16, seed=2)
    w = BatchDecode(spec)
    w.plan(*table, page_size=16)
    w.run(q, cache)  # (the kernel built)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = poison(q.shape, q.dtype)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the run starts ~0.1 s from now
        w.run(q, cache, out=out)
    w.plan(*other, page_size=16)  # its copy, on the current stream, would land before that run reads
    torch.cuda.synchronize()
    ref, _, low = decode_expected(spec, q, per_req)
    assert_attention_close(out.cpu(), ref, low, "the first plan's run")


def test_prefill_planned_on_a_side_stream():
    spec = AttentionSpec(family="prefill", num_qo_heads=8, num_kv_heads=2, causal=True)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, 128, generator=g).bfloat16().cuda() for n, h in ((500, 8), (900, 2), (900, 2)))
    w = BatchPrefill(spec)
    w.plan([0, 500], [0, 900])
    w.run(q, (k, v))  # (this plan's kernels built)
    w.plan([0, 20], [0, 40])
    w.run(q[:20], (k[:40], v[:40]))  # (this plan's arrays are the ones to land late)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = poison(q.shape, q.dtype)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        w.plan([0, 500], [0, 900])
    w.run(q, (k, v), out=out)
    torch.cuda.synchronize()
    ref, _ = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    low, _ = reference.attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal=True, dtype=torch.float32)
    assert_attention_close(out.cpu(), ref, low.bfloat16(), "prefill planned on a side stream")

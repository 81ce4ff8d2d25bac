"""A/B for the d64 decode lead (docs/perf-notes.md, state item 0): deeper pipelines or longer tiles at head_dim 64
(fp8's one- and two-head-tile kernels, bf16 beside), each against the default kernel, in one process, in
rotation, two rounds; no code change (BatchDecode's explicit tiling options). Every tiling here compiles for
sm_90a without spills (110-128 registers; bf16's deeper ones drop to 3 CTAs an SM). Run from the repo root with
PYTHONPATH=$PWD; writes $OUT/stages.json."""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
from bench_decode import paged_inputs
from harness import time_interleaved
from attnforge import AttentionSpec, BatchDecode
rand = torch.randint(512, 16384, (64,), generator=torch.Generator().manual_seed(0)).tolist()
CASES = [("fp8 d64 32/8 B16 L8192", 32, 8, "fp8_e4m3", [8192] * 16),
         ("fp8 d64 32/8 B64 Lrand", 32, 8, "fp8_e4m3", rand),
         ("fp8 d64 32/2 B64 L8192", 32, 2, "fp8_e4m3", [8192] * 64),
         ("bf16 d64 32/8 B16 L8192", 32, 8, "bf16", [8192] * 16)]
TILINGS = {"default": {}, "t64s3": dict(tile_kv=64, num_stages=3, num_warps=4),
           "t64s4": dict(tile_kv=64, num_stages=4, num_warps=4), "t128s2": dict(tile_kv=128, num_stages=2, num_warps=4)}
res = {}
for rnd in range(2):
    for name, hq, hkv, kv, lengths in CASES:
        torch.manual_seed(0)
        q, cache, indptr, indices, last = paged_inputs(lengths, 16, kv, "NHD", hq, hkv, 64)
        runs, outs = {}, {}
        for label, kw in TILINGS.items():
            try:
                w = BatchDecode(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=64, kv_dtype=kv), **kw)
                w.plan(indptr, indices, last, page_size=16)
            except ValueError as e:
                print(name, label, "no:", str(e)[:120]); continue
            o = torch.full_like(q, float("nan")); outs[label] = o
            kernel, ctas = w.planned_kernel
            runs[f"{label} ({kernel.name.split('_')[-1]} x {ctas})"] = (lambda w=w, o=o: w.run(q, cache, out=o))
        t = time_interleaved(runs)
        d = max((outs[k].float() - outs["default"].float()).abs().max().item() for k in outs)
        print(f"r{rnd} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()) + f"; max diff {d:.1e}", flush=True)
        res.setdefault(name, []).append(t)
        del cache
json.dump(res, open(f"{os.environ.get('OUT', '/tmp')}/stages.json", "w"), indent=1)

"""A/B for fp8-d64-in-registers.patch: fp8 KV at d64 widened in registers on the transposed pipeline (this tree,
the patch applied) against the tile widened through shared memory (main, staged before applying the patch by
`bash tools/stage_package.sh main HEAD`), in one process, in rotation, three rounds. Run from the repo root with
PYTHONPATH=$PWD:$PWD/.stage_main (carry .stage_main in the device call); writes $OUT/d64_ab.json."""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
from bench_decode import paged_inputs
from harness import time_interleaved
import attnforge, attnforge_main

CASES = [  # name, hq, hkv, lengths, q_len, pipeline
    ("d64 32/8 B16 L8192", 32, 8, [8192] * 16, 1, "auto"),
    ("d64 64/8 B32 L8192", 64, 8, [8192] * 32, 1, "auto"),
    ("d64 32/8 B64 Lrand", 32, 8,
     torch.randint(512, 16384, (64,), generator=torch.Generator().manual_seed(0)).tolist(), 1, "auto"),
    ("d64 32/2 B64 L8192 transposed", 32, 2, [8192] * 64, 1, "transposed"),
    ("d64 32/2 B64 L8192 normal (auto)", 32, 2, [8192] * 64, 1, "normal"),
    ("d64 32/8 verify q4 B64 L4096", 32, 8, [4096] * 64, 4, "auto"),
]
results = {}
for rnd in range(3):
    for name, hq, hkv, lengths, q, pipe in CASES:
        torch.manual_seed(0)
        _, cache, indptr, indices, last = paged_inputs(lengths, 16, "fp8_e4m3", "NHD", hq, hkv, 64)
        qt = torch.randn(len(lengths) * q, hq, 64, device="cuda", dtype=torch.bfloat16)
        runs, outs, ws = {}, {}, {}
        for label, pkg in (("new", attnforge), ("main", attnforge_main)):
            spec = pkg.AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=64, kv_dtype="fp8_e4m3",
                                     pipeline=pipe)
            w = pkg.BatchDecode(spec, max_q_len=q)
            w.plan(indptr, indices, last, page_size=16, q_len=q)
            o = torch.full_like(qt, float("nan"))
            outs[label], ws[label] = o, w
            runs[label] = (lambda w=w, o=o: w.run(qt, cache, out=o))
        t = time_interleaved(runs)
        diff = (outs["new"].float() - outs["main"].float()).abs().max().item()
        kn, km = ws["new"].planned_kernel, ws["main"].planned_kernel
        print(f"r{rnd} {name}: new {t['new']:.1f} us ({kn[0].name} x {kn[1]}), main {t['main']:.1f} "
              f"({km[0].name} x {km[1]}): {(t['new'] / t['main'] - 1) * 100:+.1f}%, max diff {diff:.1e}", flush=True)
        results.setdefault(name, []).append({**t, "max_diff": diff})
        del cache
json.dump(results, open(f"{os.environ.get('OUT', '/tmp')}/d64_ab.json", "w"), indent=1)

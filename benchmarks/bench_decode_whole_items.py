"""Decode (d128, page 16; GQA 32/8 unless a case names its heads) with one CTA per SM reading whole items
(or equal chunks of them, about one a CTA), against the default three CTAs of four warps per SM, each
case's variants timed in rotation.

Where a batch has at most one item (request x KV head) per SM and the items are equal, a 1-CTA-per-SM
tiling can read each item whole (no partial states, no merge, one prologue per item) if the planner
lets spans grow to a whole item. BatchDecode does so where whole_item_tiling(spec) has a tiling
(whole_items); this measures the rule's cases and the shapes it leaves out.

    python benchmarks/bench_decode_whole_items.py [--out X.json] ["B16 L8192" ...]  ("normal B16 L8192": that pipeline)
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D, HKV, HQ, cases, paged_inputs  # noqa: E402
from harness import time_interleaved  # noqa: E402

from attnforge import AttentionSpec, BatchDecode  # noqa: E402


def _equal(batch: int, length: int, heads: tuple = (32, 8), head_dim: int = 128, kv: str = "bf16") -> tuple:
    """A case of `batch` equal requests on 16-token NHD pages."""
    return [length] * batch, 16, kv, "NHD", heads, head_dim


# name: (lengths, page, kv dtype, layout[, (hq, hkv)[, head_dim]]); cases() supplies bench_decode's (GQA 32/8).
# B32 L8192, B128 L2048 and mha B16 L8192 have more items than SMs: the twenty-first session timed several whole
# items a CTA on them with a planner change since reverted (docs/perf-notes.md)
EXTRA_CASES = {"B16 L4096": _equal(16, 4096), "B16 L16384": _equal(16, 16384), "B12 L8192": _equal(12, 8192),
               "B15 L8192": _equal(15, 8192), "B16 L2048": _equal(16, 2048),
               "B16 L4096 fp8kv": _equal(16, 4096, kv="fp8_e4m3"), "g8 B32 L8192": _equal(32, 8192, (32, 4)),
               "mha B4 L32768": _equal(4, 32768, (32, 32)), "g16 B64 L4096": _equal(64, 4096, (32, 2)),
               "g16 B4 L32768": _equal(4, 32768, (32, 2)), "mqa B16 L8192": _equal(16, 8192, (32, 1)),
               "mqa64 B16 L8192": _equal(16, 8192, (64, 1)), "B16 L8192 fp8kv": _equal(16, 8192, kv="fp8_e4m3"),
               "B1 L131072 fp8kv": _equal(1, 131072, kv="fp8_e4m3"), "mqa B64 L4096": _equal(64, 4096, (32, 1)),
               "B32 L8192": _equal(32, 8192), "B128 L2048": _equal(128, 2048),
               "mha B16 L8192": _equal(16, 8192, (32, 32)), "alibi B16 L8192": _equal(16, 8192),
               "softcap B16 L8192": _equal(16, 8192), "d64 B16 L8192": _equal(16, 8192, head_dim=64),
               "d64 B16 L2048": _equal(16, 2048, head_dim=64),
               # about 4 x SMs equal items: the 4-CTA whole-item band (kernels.decode.four_cta_tiling), transposed
               # groups of 3-8 (a group of 4 on the normal pipeline's m16 tile) and the normal pipeline's one m16 tile
               "B66 L4096": _equal(66, 4096), "B64 L1024": _equal(64, 1024),
               "g8 B128 L2048": _equal(128, 2048, (32, 4)),
               "g16x8 B64 L4096": _equal(64, 4096, (128, 8)), "g12 B66 L4096": _equal(66, 4096, (96, 8)),
               "g16 B128 L2048": _equal(128, 2048, (64, 4)),
               # groups of 1-3 on it, 512 items (mha B16 L8192 above: head_dims' MHA row; L4096: Quest's MHA step)
               "mha B16 L4096": _equal(16, 4096, (32, 32)), "g2 B32 L4096": _equal(32, 4096, (32, 16)),
               "g3 B64 L4096": _equal(64, 4096, (24, 8)),
               "B96 L4096": _equal(96, 4096),  # 768 items: past the 4-CTA band
               # fp8 groups of 9-16 ('auto': transposed, two n8 head tiles widened in registers), 128 items
               "fp8 g16 B64 L4096": _equal(64, 4096, (32, 2), kv="fp8_e4m3"),
               "fp8 g16x8 B16 L8192": _equal(16, 8192, (128, 8), kv="fp8_e4m3"),
               "fp8 g12 B16 L8192": _equal(16, 8192, (96, 8), kv="fp8_e4m3"),
               # ... and fewer of them, cut into equal chunks (2 items x 66, 8 x 16)
               "fp8 g16 B1 L131072": _equal(1, 131072, (32, 2), kv="fp8_e4m3"),
               "fp8 g16 B4 L32768": _equal(4, 32768, (32, 2), kv="fp8_e4m3"),
               # fp8 at d64, widened in registers since the seventy-sixth session (whole_item_tiling: d128 only)
               "d64 fp8 B16 L8192": _equal(16, 8192, head_dim=64, kv="fp8_e4m3"),
               "d64 fp8 g16 B64 L8192": _equal(64, 8192, (32, 2), head_dim=64, kv="fp8_e4m3")}
# forced one-CTA-per-SM tilings by head_dim (d64: 128-token tiles of 64 dims fill 192 KB in six stages;
# three stages there fit two CTAs an SM)
WHOLE = {128: [(128, 3, 8)], 64: [(128, 6, 8), (128, 3, 8)]}
DEFAULT_CASES = ["B16 L8192", "B16 L2048", "B16 L65536", "B15 L8192", "B16 L8192 HND", "g8 B32 L8192",
                 "mha B4 L32768", "g16 B64 L4096", "mqa B64 L4096"]


def variants(spec, requests: int) -> dict:
    """label -> wrapper: `split` (whole_items=False: the three-CTAs-per-SM default), `auto` (BatchDecode's
    choice: about 4 x SMs equal items may take the 4-CTA whole-item kernel), `t128s3w8 aligned` (that tiling
    forced, spans grown to whole items or cut into equal chunks of about one a CTA), the spec's own
    whole-item tiling where it is another (fp8's 16 warps, MQA's one item of every query head), and where
    items outnumber 2 x SMs the 4-CTA tiling forced (`t32s3w2 aligned`: groups four_cta_tiling leaves out)."""
    from attnforge.kernels.decode import FOUR_CTA_WHOLE_ITEM_TILING as FOUR, DecodeKernel, whole_item_tiling
    out = {"split": BatchDecode(spec, whole_items=False), "auto": BatchDecode(spec)}
    splits = DecodeKernel(spec).head_splits  # a forced tiling keeps the default kernel's head splits
    many = requests * spec.num_kv_heads * splits > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    tilings = [dict(zip(("tile_kv", "num_stages", "num_warps"), t), head_splits=splits)
               for t in WHOLE[spec.head_dim_qk] + ([(FOUR.tile_kv, FOUR.stages, FOUR.warps)] if many else [])]
    own = whole_item_tiling(spec)
    if own is not None:
        own = dict(tile_kv=own.tile_kv, num_stages=own.stages, num_warps=own.warps, head_splits=1)
        tilings += [own] if own not in tilings else []
    for kw in tilings:
        label = "t{tile_kv}s{num_stages}w{num_warps}".format(**kw)
        label += f" hs{kw['head_splits']}" if kw["head_splits"] != splits else ""
        try:
            forced = BatchDecode(spec, **kw)
        except ValueError as e:
            print(f"{spec.name}: no {label} ({e})")
            continue
        forced.align_slack = 1 << 30
        out[f"{label} aligned"] = forced
    return out


def _mod(prefix: str, hq: int):
    """A case named `alibi ...` / `softcap ...` runs that library mod."""
    import attnforge.mods as mods
    from attnforge.mods.alibi import default_slopes
    return {"alibi": lambda: mods.alibi(default_slopes(hq, "cuda")), "softcap": lambda: mods.softcap(50.0)}.get(
        prefix, lambda: None)()


def main(argv: list[str]) -> None:
    out_path = argv[argv.index("--out") + 1] if "--out" in argv else None
    names = [a for a in argv if a != "--out" and a != out_path] or DEFAULT_CASES
    known = {c[0]: c[1:] for c in cases()}
    known.update(EXTRA_CASES)
    results = {}
    for name in names:
        pipeline = "normal" if name.startswith("normal ") else "auto"  # `normal X`: case X on that pipeline
        lengths, page, kv_dtype, layout, *rest = known[name.removeprefix("normal ")]
        (hq, hkv), d = (rest + [(HQ, HKV), D][len(rest):])[:2]
        q, cache, indptr, indices, last = paged_inputs(lengths, page, kv_dtype, layout, hq, hkv, d)
        mod = _mod(name.split()[0], hq)
        spec = AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, kv_dtype=kv_dtype, kv_layout=layout,
                             pipeline=pipeline, score_mod=mod)
        ws = variants(spec, len(lengths))
        runs = {}
        for label, w in ws.items():
            w.plan(indptr, indices, last, page_size=page)
            out = torch.empty_like(q)
            runs[label] = (lambda w=w, out=out: w.run(q, cache, out=out))
        t = time_interleaved(runs)
        gb = sum(lengths) * hkv * d * 2 * (1 if kv_dtype == "fp8_e4m3" else 2)
        results[name] = {label: {"us": us, "gbps": gb / us / 1e3, "ctas": ws[label].planned_kernel[1],
                                 "spans": ws[label]._plan["work"].num_spans, "pipeline": spec.pipeline}
                         for label, us in t.items()}
        print(f"{name}: " + ", ".join(f"{k} {v['us']:.1f} us ({v['gbps']:.0f} GB/s, {v['spans']} spans)"
                                      for k, v in results[name].items()), flush=True)
        del q, cache
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

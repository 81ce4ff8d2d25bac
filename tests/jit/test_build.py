"""The JIT cache: content hashing, locking, atomic artifacts, compile errors (CPU only; needs nvcc)."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnforge import AttentionSpec, codegen
from attnforge.jit import JitBuildError, JitModule, MissingModuleError, build, build_many
from attnforge.jit.builder import _Job
from attnforge.kernels import module_for_attention
from attnforge.merge import MergeSpec

ARCHS = ("9.0a",)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def counting_nvcc(tmp_path, monkeypatch):
    """CUDA_HOME whose nvcc logs each compile, then runs the real one (slowly, to widen races)."""
    real = shutil.which("nvcc")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    log = tmp_path / "compiles.log"
    script = home / "bin" / "nvcc"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in *--cubin*|*--fatbin*) echo compile >> {log}; sleep 1;; esac
        exec {real} "$@"
        """))
    script.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def merge_module():
    return MergeSpec(torch.float16, torch.float16).module()


def test_hash_tracks_header_content_only(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    shutil.copytree(codegen.include_dir(), inc)
    monkeypatch.setattr(codegen, "include_dir", lambda: inc)
    mod = merge_module()
    h0 = mod.content_hash(ARCHS)
    os.utime(inc / "attnforge" / "common.cuh", (1, 1))  # mtime alone: same hash
    assert mod.content_hash(ARCHS) == h0
    with open(inc / "attnforge" / "mma.cuh", "a") as f:  # a header merge_states does not include
        f.write("\n// unrelated edit\n")
    assert mod.content_hash(ARCHS) == h0
    with open(inc / "attnforge" / "common.cuh", "a") as f:  # an included header: new hash
        f.write("\n// edit\n")
    assert mod.content_hash(ARCHS) != h0


def test_hash_tracks_flags_and_archs(monkeypatch):
    mod = merge_module()
    h0 = mod.content_hash(ARCHS)
    assert mod.content_hash(("8.0", "9.0a")) != h0
    monkeypatch.setenv("ATTNFORGE_NVCC_FLAGS", "-DFOO=1")
    assert mod.content_hash(ARCHS) != h0


def test_build_writes_manifest_and_reuses(cache, counting_nvcc):
    path = build(merge_module(), ARCHS)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["archs"] == ["9.0a"] and manifest["bytes"] == path.stat().st_size
    assert path.read_bytes()[:4] == b"\x7fELF"  # a cubin is an ELF image
    assert str(path).startswith(str(cache / "0.1.0" / "cu13.0" / "90a" / "merge_states_fp16_outfp16-"))
    assert build(merge_module(), ARCHS) == path and counting_nvcc() == 1


def test_truncated_artifact_is_rebuilt(cache, counting_nvcc):
    path = build(merge_module(), ARCHS)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    assert not _Job(merge_module(), ARCHS).is_valid()
    assert build(merge_module(), ARCHS) == path
    # nvcc output is not bit-reproducible (embedded temp names), so check validity and size
    assert _Job(merge_module(), ARCHS).is_valid() and len(path.read_bytes()) == len(good)
    assert counting_nvcc() == 2


def test_missing_manifest_after_killed_build_is_rebuilt(cache, counting_nvcc):
    path = build(merge_module(), ARCHS)
    (path.parent / "manifest.json").unlink()  # what a build killed before its last step leaves
    assert build(merge_module(), ARCHS) == path and counting_nvcc() == 2


def test_concurrent_processes_compile_once(cache, counting_nvcc):
    code = ("import torch, attnforge.merge as m, attnforge.jit as j;"
            "print(j.build(m.MergeSpec(torch.float16, torch.float16).module(), ('9.0a',)))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and counting_nvcc() == 1
    assert _Job(merge_module(), ARCHS).is_valid()


def test_lock_of_killed_process_does_not_block(cache, monkeypatch):
    job = _Job(merge_module(), ARCHS)
    job.dir.mkdir(parents=True)
    code = (f"import os, filelock; l = filelock.FileLock({str(job.dir / '.lock')!r}); l.acquire();"
            "os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", code])
    assert (job.dir / ".lock").exists()  # the killed holder left its lock file behind
    monkeypatch.setenv("ATTNFORGE_LOCK_TIMEOUT", "30")
    assert build(merge_module(), ARCHS).is_file()


def test_disable_jit_says_how_to_prebuild(cache, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_DISABLE_JIT", "1")
    with pytest.raises(MissingModuleError, match="python -m attnforge build"):
        build(merge_module(), ARCHS)
    monkeypatch.delenv("ATTNFORGE_DISABLE_JIT")
    build(merge_module(), ARCHS)
    monkeypatch.setenv("ATTNFORGE_DISABLE_JIT", "1")
    assert build(merge_module(), ARCHS).is_file()  # cached modules still load


def test_compile_error_carries_output_and_source_path(cache):
    bad = JitModule("broken", "merge_states.cu.jinja",
                    {"dtype": "not_a_type", "out_dtype": "float", "params_struct": "struct MergeParams {};"},
                    ("merge_states_kernel",))
    with pytest.raises(JitBuildError) as e:
        build(bad, ARCHS)
    msg = str(e.value)
    assert "not_a_type" in msg and "kernel.cu" in msg and "Compiler output" in msg


VARIANT_MATRIX = [  # one representative per template option, not the cross product
    AttentionSpec(),  # decode, transposed pipeline (the default for this group size)
    AttentionSpec(pipeline="normal"),
    AttentionSpec(q_dtype="fp16"),
    AttentionSpec(kv_dtype="fp8_e4m3"),
    AttentionSpec(q_dtype="fp16", kv_dtype="fp8_e4m3", pipeline="transposed"),
    AttentionSpec(kv_dtype="fp8_e4m3", head_dim_qk=256),  # fp8 widened in registers at d256 (206 registers)
    AttentionSpec(kv_dtype="fp8_e4m3", head_dim_qk=64),  # fp8 widened in shared memory (d < 128)
    AttentionSpec(head_dim_qk=64, num_qo_heads=8, num_kv_heads=8),
    AttentionSpec(head_dim_qk=256, num_qo_heads=16, num_kv_heads=2),
    AttentionSpec(head_dim_qk=256, num_qo_heads=16, num_kv_heads=1, pipeline="transposed"),  # two head tiles
    AttentionSpec(num_qo_heads=64, num_kv_heads=1),
    AttentionSpec(num_qo_heads=24, num_kv_heads=8, out_dtype="fp16"),
    AttentionSpec(logits_soft_cap=30.0, window_left=256),
    AttentionSpec(family="prefill", causal=True),
    AttentionSpec(family="prefill", head_dim_qk=256, num_qo_heads=8, num_kv_heads=8, q_dtype="fp16"),
    AttentionSpec(family="prefill", head_dim_qk=64, window_left=64, logits_soft_cap=20.0),
    AttentionSpec(family="prefill", kv_dtype="fp8_e4m3", causal=True),  # fp8 tiles widened (wgmma's producer; mma)
    *[AttentionSpec(family="mla_decode", num_qo_heads=h, num_kv_heads=1, head_dim_qk=576, head_dim_vo=512,
                    pipeline=p, **kw) for h, p, kw in
      ((16, "normal", {}), (128, "normal", {"q_dtype": "fp16"}), (8, "transposed", {"kv_dtype": "fp8_e4m3"}),
       (128, "transposed", {"logits_soft_cap": 30.0}))],
]


# DeepSeek's prefill before absorption: values narrower than keys (the wgmma kernel alone)
SPLIT_DIMS = AttentionSpec(family="prefill", num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128,
                           causal=True)


def _mod_specs():
    import attnforge.mods as m
    from mod_library import every_operation
    return [AttentionSpec(score_mod=m.document_mask(torch.zeros(2, 8, dtype=torch.int32))),
            AttentionSpec(family="prefill", score_mod=m.attention_sink(torch.zeros(32))),
            AttentionSpec(score_mod=every_operation("cpu"))]  # (the C++ of every traced operation, for nvcc)


def _wgmma_mla_kernels(normal):
    """The sm_90a MLA kernels of the matrix: h16 (64 rows, the even split), h128 (the 192-dim split, Q
    partly and P in registers) with soft-cap, ALiBi, a document mask and plain scores, plain scores with
    P.V from shared memory, and the transposed pipeline."""
    from attnforge.kernels.mla import MLADecodeKernel
    import attnforge.mods as m
    h128 = normal[1]
    return [MLADecodeKernel(normal[0], backend="wgmma"),
            MLADecodeKernel(dataclasses.replace(h128, logits_soft_cap=30.0), backend="wgmma"),
            MLADecodeKernel(dataclasses.replace(h128, score_mod=m.alibi(torch.ones(128))), backend="wgmma"),
            MLADecodeKernel(dataclasses.replace(h128, score_mod=m.document_mask(torch.zeros(2, 8, dtype=torch.int32))),
                            backend="wgmma"),
            MLADecodeKernel(dataclasses.replace(h128, q_dtype="bf16", kv_dtype="bf16", out_dtype="bf16"), backend="wgmma"),
            MLADecodeKernel(h128, backend="wgmma", roles_pv_rs=True),
            MLADecodeKernel(dataclasses.replace(normal[0], pipeline="transposed"), backend="wgmma")]


def _partials_twins(prefill):
    """The float32-partials twins split plans run (PrefillKernel.for_partials): wgmma at d128 (its epilogue in one
    pass, not deferred) and d256, split dims, and the mma kernel."""
    from attnforge.kernels.prefill import PrefillKernel
    return [PrefillKernel(prefill[0], "wgmma").for_partials(), PrefillKernel(prefill[1], "wgmma").for_partials(),
            PrefillKernel(SPLIT_DIMS, "wgmma").for_partials(), PrefillKernel(prefill[1], "mma").for_partials()]


def _float_out_decode_twins():
    """The float32-rows decode kernels a cascade's suffix runs (DecodeKernel.float_out): both pipelines, fp8 K/V
    widened in registers, and the one-CTA-an-SM whole-item kernel."""
    from attnforge.kernels.decode import DecodeKernel, whole_item_kernel
    return [DecodeKernel(AttentionSpec(), float_out=True),
            DecodeKernel(AttentionSpec(num_kv_heads=2, pipeline="normal"), float_out=True),
            DecodeKernel(AttentionSpec(kv_dtype="fp8_e4m3"), float_out=True),
            dataclasses.replace(whole_item_kernel(AttentionSpec()), float_out=True)]


def test_nvcc_compiles_the_variant_matrix():
    mods = [module_for_attention(s) for s in VARIANT_MATRIX + _mod_specs()]
    # both prefill kernels: module_for_attention picks wgmma (sm_90a) where it applies
    from attnforge.kernels.prefill import PrefillKernel, wgmma_applies
    prefill = [s for s in VARIANT_MATRIX + _mod_specs() if s.family == "prefill"]
    mods += [PrefillKernel(s, "mma").module() for s in prefill if wgmma_applies(s) is None]
    mods.append(PrefillKernel(prefill[0], "wgmma", persistent=False).module())  # one CTA per item (not the default)
    mods.append(PrefillKernel(prefill[0], "wgmma", tma=False).module())  # paged tiles by cp.async only
    mods.append(PrefillKernel(prefill[1], "wgmma", producer=False).module())  # d256: no split ring, one consumer
    fp8 = AttentionSpec(family="prefill", kv_dtype="fp8_e4m3", causal=True)  # its options, and d64's shared ring
    mods += [PrefillKernel(fp8, "wgmma", tma=True).module(), PrefillKernel(fp8, "wgmma", fp8_int_widen=True).module(),
             PrefillKernel(dataclasses.replace(fp8, head_dim_qk=64, head_dim_vo=64, q_dtype="fp16"), "wgmma").module()]
    mods += [PrefillKernel(SPLIT_DIMS, "wgmma").module(), PrefillKernel(SPLIT_DIMS, "wgmma", producer=False).module()]
    mods += [k.module() for k in _partials_twins(prefill)] + [k.module() for k in _float_out_decode_twins()]
    assert sum("wgmma" in m.name for m in mods) >= 3, "the sm_90a prefill kernel is in the matrix"
    mla = [s for s in VARIANT_MATRIX if s.family == "mla_decode" and s.pipeline == "normal"]
    mods += [k.module() for k in _wgmma_mla_kernels(mla)]
    from attnforge.kernels.decode import DecodeKernel  # S^T in one and in four MMA chains (the default: two)
    mods += [DecodeKernel(AttentionSpec(), qk_chains=1).module(),
             DecodeKernel(AttentionSpec(kv_dtype="fp8_e4m3"), qk_chains=4).module()]
    # fp8 on the normal pipeline widened in registers (an option), at two m16 tiles of verify rows; and the normal
    # pipeline at d256, whose Q fragments stay in shared memory (the option's code is compiled there too)
    mods.append(DecodeKernel(AttentionSpec(num_qo_heads=64, num_kv_heads=8, kv_dtype="fp8_e4m3", pipeline="normal"),
                             max_q_len=4, normal_widen_in_registers=True).module())
    mods += [DecodeKernel(AttentionSpec(head_dim_qk=256, num_qo_heads=32, num_kv_heads=2, kv_dtype=kv,
                                        pipeline="normal")).module() for kv in ("bf16", "fp8_e4m3")]
    mods += [MergeSpec(d, o).module() for d, o in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16))]
    from attnforge.presets import PRESETS  # the append kernels: a copy, a quantizing one and an fp8 copy
    mods += [s.module() for s in PRESETS["append"]() if s.name in (
        "append_kv_bf16_to_bf16", "append_kv_fp16_to_fp8e4m3", "append_kv_fp8e4m3_to_fp8e4m3")]
    from attnforge.kernels.quest import QuestScoreKernel
    mods += [QuestScoreKernel("bf16", "fp32", 128, 8, 4).module(), QuestScoreKernel("fp16", "bf16", 64, 32, 1).module(),
             QuestScoreKernel("bf16", "fp8", 128, 8, 4).module()] + [k.module() for k in QUEST_SPLITS]
    paths = build_many(mods, ARCHS)
    assert len(set(paths)) == len(mods)
    for m, p in zip(mods, paths):
        data = p.read_bytes()
        assert data[:4] == b"\x7fELF"
        for k in m.kernel_names:  # every exported kernel is in the image under its C name
            assert k.encode() in data, f"{m.name}: {k} missing"


def _shared_memory_problems(k, res) -> list:
    """Shared memory as the SM allocates it, against the CTAs the planner puts there: the dynamic bytes in 128-byte
    units, then the function's static section (sm_90's reserved 1 KB, then the __shared__ variables, which the
    decode planner counts as SMEM_STATIC_BYTES)."""
    from attnforge.kernels.decode import SMEM_PER_SM
    name, section = k.module().name, res.shared_section_bytes
    if section < 1024:
        return [f"{name}: a static shared section of {section} B, expected sm_90's reserved 1 KB in it"]
    taken = -(-k.smem_bytes // 128) * 128 + section
    if k.ctas_per_sm * taken > SMEM_PER_SM:
        return [f"{name}: {k.ctas_per_sm} CTAs x ({k.smem_bytes} dynamic + {section} static section) B of shared "
                f"memory, the SM holds {SMEM_PER_SM}"]
    return []


def test_variant_matrix_has_no_spills_and_the_occupancy_the_planners_assume():
    """Grids and split-KV work are sized SMs x ctas_per_sm, which the kernel classes derive from shared
    memory and rules of thumb: each kernel's register count (read from the cubin) must let that many
    CTAs share an SM, and no kernel may use local memory (a non-zero stack frame: spills in a hot loop).
    Builds hit the cache of the test above."""
    from attnforge.jit.cubin import kernel_resources
    from attnforge.kernels.decode import DecodeKernel
    from attnforge.kernels.mla import MLADecodeKernel
    from attnforge.kernels.prefill import PrefillKernel, default_backend
    kernels = [DecodeKernel(s) for s in VARIANT_MATRIX if s.family == "decode"]
    kernels.append(DecodeKernel(AttentionSpec(head_dim_qk=256), tile_kv=32, stages=2, num_warps=2))  # 64 threads
    from attnforge.kernels.decode import spec_for_rows, whole_item_kernel, whole_item_kernels
    # the whole-item kernels (one CTA per SM): transposed, fp8 on 16 warps, normal (one 16-head tile) and MQA
    # (every query head of 32 or 64 in one item)
    whole_specs = ({}, {"kv_dtype": "fp8_e4m3"}, {"num_kv_heads": 2}, {"num_kv_heads": 1},
                   {"num_qo_heads": 64, "num_kv_heads": 1})
    kernels += [whole_item_kernel(AttentionSpec(**kw)) for kw in whole_specs]
    # several query tokens a request (speculative verify): one n8 row tile and two (transposed, 16-bit and fp8
    # widened in registers), one m16 tile and two (normal)
    kernels += [DecodeKernel(AttentionSpec(pipeline=p, kv_dtype=kv), max_q_len=q)
                for p, kv, q in (("transposed", "bf16", 2), ("transposed", "bf16", 4), ("transposed", "fp8_e4m3", 4),
                                 ("normal", "bf16", 4), ("normal", "bf16", 8))]
    # verify's whole items, one CTA an SM and 4 (kernels.decode.whole_item_tilings): m16 tiles of 12, 32 and 64
    # rows, 8 rows (n8; 4-CTA: the m16 tile), fp8's two n8 tiles (one CTA an SM only)
    kernels += [k for kw, q in (({"pipeline": "normal"}, 3), ({}, 8), ({"num_qo_heads": 128}, 4), ({}, 2),
                                ({"kv_dtype": "fp8_e4m3"}, 4))
                for k in whole_item_kernels(spec_for_rows(AttentionSpec(**kw), q), q)]
    kernels += list(whole_item_kernels(AttentionSpec()))  # one token's 4-CTA whole items (a group of 4: normal)
    kernels.append(DecodeKernel(AttentionSpec(num_kv_heads=4), 32, 3, 2, head_splits=1))  # ... transposed
    kernels.append(DecodeKernel(AttentionSpec(num_qo_heads=128), 32, 3, 2, head_splits=1))  # ... one m16 tile
    kernels.append(DecodeKernel(AttentionSpec(num_qo_heads=24), 32, 3, 2, head_splits=1))  # ... a group of 3
    # fp8 at d64 widened in registers: two n8 head tiles (a group of 16, MQA's 16-head items, verify's 16 rows)
    # held to 128 registers for 4 CTAs an SM (registers_needed), which must not spill
    kernels += [DecodeKernel(AttentionSpec(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=64, kv_dtype="fp8_e4m3"),
                             max_q_len=q) for hq, hkv, q in ((32, 2, 1), (32, 1, 1), (32, 8, 4))]
    # dynamic shared memory of exactly half an SM (114 KB): the static section (sm_90's reserved 1 KB, the flag)
    # leaves room for one CTA, not two (decode's SMEM_STATIC_BYTES, SMEM_RESERVED_PER_CTA)
    kernels.append(DecodeKernel(AttentionSpec(head_dim_qk=64, kv_dtype="fp8_e4m3", pipeline="normal"), 128, 5))
    # an m16 tile of 7 rows, which ptxas alone gives 216 registers where the planner holds it to 168
    kernels.append(DecodeKernel(AttentionSpec(num_qo_heads=56, num_kv_heads=8, kv_dtype="fp8_e4m3", pipeline="normal")))
    mla = [s for s in VARIANT_MATRIX if s.family == "mla_decode"]
    normal = [s for s in mla if s.pipeline == "normal"]
    kernels += [MLADecodeKernel(s) for s in mla]  # and the wgmma ones the matrix test builds
    kernels += _wgmma_mla_kernels(normal)
    prefill = [s for s in VARIANT_MATRIX if s.family == "prefill"]
    kernels += [PrefillKernel(s, default_backend(s)) for s in prefill] + [PrefillKernel(s, "mma") for s in prefill]
    kernels.append(PrefillKernel(SPLIT_DIMS, "wgmma"))
    kernels += _partials_twins(prefill) + _float_out_decode_twins()
    paths = build_many([k.module() for k in kernels], ARCHS)
    checked, problems = 0, []
    for k, path in zip(kernels, paths):
        res = kernel_resources(path.read_bytes())
        name = k.module().name
        assert res, f"{name}: no register counts in the cubin's .nv.info"
        problems += [f"{name}: {fn} uses {r.frame_bytes} bytes of local memory (spills)"
                     for fn, r in res.items() if r.frame_bytes and name not in ALLOWED_SPILLS]
        main = k.module().kernel_names[0]  # the attention kernel (merge kernels follow it)
        if main in res:
            fit = res[main].ctas_by_registers(k.threads)
            if fit < k.ctas_per_sm:
                problems.append(f"{name}: {res[main].registers} registers x {k.threads} threads fit {fit} CTAs "
                                f"per SM, the planner assumes {k.ctas_per_sm}")
            problems += _shared_memory_problems(k, res[main])
            checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 10


def test_every_d128_decode_group_holds_the_ctas_its_planner_assumes():
    """The planner's occupancy rules (registers_needed, shared memory) against the cubins over every group of 1-16
    query heads at d128 on both pipelines and both KV widths, and verify steps of 2-8 tokens at GQA 4 and 8 on the
    pipeline the wrapper picks, and fp8 verify steps at groups 3, 5, 6 and 7: ptxas once gave m16 tiles of 5 and 7
    rows 216 registers where 3 CTAs were planned (a silent second wave), and fp8 rows 24-30 183. Spills are the
    matrix test's concern; this scan checks the occupancy only (registers and shared memory)."""
    from attnforge.jit.cubin import kernel_resources
    from attnforge.kernels.decode import DecodeKernel, spec_for_rows
    kernels = {}
    for group in range(1, 17):
        for kv in ("bf16", "fp8_e4m3"):
            for pipeline in ("normal", "transposed"):
                k = DecodeKernel(AttentionSpec(num_qo_heads=2 * group, num_kv_heads=2, kv_dtype=kv, pipeline=pipeline))
                kernels[k.module().name] = k
    for group in (4, 8):
        for tokens in range(2, 9):
            for kv in ("bf16", "fp8_e4m3"):
                spec = spec_for_rows(AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype=kv), tokens)
                k = DecodeKernel(spec, max_q_len=tokens)
                kernels[k.module().name] = k
    # fp8 verify rows over two m16 tiles at groups 3, 5 and 6 (24-30 rows): ptxas alone took 182-183 registers where
    # 3 CTAs were planned (the GPU fuzz's OccupancyWarning, 111th session); group 7's shapes beside them; and 49-54
    # rows, whose 48 KB of dynamic shared memory sit beside the static section (114th session)
    for group, tokens in ((3, 8), (5, 5), (5, 6), (6, 4), (6, 5), (7, 4), (7, 5), (7, 7), (9, 6)):
        spec = spec_for_rows(AttentionSpec(num_qo_heads=8 * group, num_kv_heads=8, kv_dtype="fp8_e4m3"), tokens)
        k = DecodeKernel(spec, max_q_len=tokens)
        kernels[k.module().name] = k
    paths = build_many([k.module() for k in kernels.values()], ARCHS)
    problems = []
    for k, path in zip(kernels.values(), paths):
        res = kernel_resources(path.read_bytes())[k.module().kernel_names[0]]
        if res.ctas_by_registers(k.threads) < k.ctas_per_sm:
            problems.append(f"{k.module().name}: {res.registers} registers x {k.threads} threads fit "
                            f"{res.ctas_by_registers(k.threads)} CTAs per SM, the planner assumes {k.ctas_per_sm}")
        problems += _shared_memory_problems(k, res)
    assert len(kernels) >= 95 and not problems, "\n".join(problems)


# The scoring kernel's work splits: a CTA per page at fp32 (4 vectors per thread), a page over a
# masked part of a CTA (6 KV heads), several pages per warp (one KV head: QuestHeadDecode's view), and
# int4 codes (dp4a over int8 query sums) for MHA and for a masked split at d64.
def _quest_splits():
    from attnforge.kernels.quest import QuestScoreKernel
    return [QuestScoreKernel("bf16", "fp32", 128, 32, 1), QuestScoreKernel("bf16", "fp8", 128, 6, 2),
            QuestScoreKernel("bf16", "fp8", 128, 1, 4), QuestScoreKernel("bf16", "bf16", 128, 32, 1),
            QuestScoreKernel("bf16", "int4", 128, 32, 1), QuestScoreKernel("fp16", "int4", 64, 6, 2)]


QUEST_SPLITS = _quest_splits()


def test_quest_scoring_keeps_its_summaries_in_registers_at_its_grid():
    """quest_score_kernel's grid is SMs x score_ctas_per_sm with P / N cached in registers: no spills,
    and the registers must let that many CTAs share an SM. Builds hit the matrix test's cache."""
    from attnforge.jit.cubin import kernel_resources
    from attnforge.kernels.quest import SCORE_THREADS
    for k, path in zip(QUEST_SPLITS, build_many([k.module() for k in QUEST_SPLITS], ARCHS)):
        res = kernel_resources(path.read_bytes())["quest_score_kernel"]
        assert res.frame_bytes == 0, f"{k}: {res.frame_bytes} bytes of local memory"
        assert res.ctas_by_registers(SCORE_THREADS) >= k.score_ctas_per_sm, (k, res.registers)


# Explicit, non-default choices whose small spills are known (auto never picks them), and defaults whose
# spills were measured against the spill-free alternative and won anyway.
ALLOWED_SPILLS = {
    "decode_g4_d128_bf16_kvfp8e4m3_outbf16_transposed_q4_t64s2w4": "8 bytes at 168 registers (3 CTAs an SM), "
    "measured faster than 185 without spills at 2 (sixty-eighth session)",
    "decode_g16_d256_bf16_kvbf16_outbf16_transposed_t64s2w4": "two n8 head tiles of O^T at d256 (auto: normal)",
    "decode_g7_d128_bf16_kvfp8e4m3_outbf16_normal_t64s2w4": "80 bytes at 168 registers (3 CTAs an SM), measured "
    "faster than ptxas's 216 at 2 (sixty-ninth session; auto: transposed)",
    "mla_h8_bf16_kvfp8e4m3_outbf16_transposed_r8t32s2": "8 bytes; MLA auto picks the normal pipeline",
    "prefill_g4_d128_bf16_kvfp8_outbf16_causal_m2_s2": "88 bytes at two m16 tiles a warp (fp8 prefill); against one "
    "tile a warp (no spills) -14.9% at B1 S8192 causal paged16 (kernels.prefill.mma_m_tiles)",
}


def test_cold_build_logs_start_and_elapsed_and_verbose_streams(cache, monkeypatch, capfd, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="attnforge.jit")
    monkeypatch.setenv("ATTNFORGE_JIT_VERBOSE", "1")
    logging.getLogger("attnforge").propagate = True  # let caplog see the package's records
    try:
        build(merge_module(), ARCHS)
    finally:
        logging.getLogger("attnforge").propagate = False
    messages = [r.getMessage() for r in caplog.records]
    assert any("building merge_states_fp16_outfp16" in m for m in messages)
    assert any(m.startswith("attnforge: built merge_states_fp16_outfp16 in") and " s -> " in m for m in messages)
    err = capfd.readouterr().err
    assert "nvcc" in err and "-gencode=arch=compute_90a,code=sm_90a" in err  # ninja -v streamed the command
    caplog.clear()
    build(merge_module(), ARCHS)  # warm: no build, no log line
    assert not [r for r in caplog.records if "building" in r.getMessage()]


def test_kernel_resources_refuses_what_is_not_a_cubin():
    from attnforge.jit.cubin import kernel_resources
    with pytest.raises(ValueError, match="ELF cubin"):
        kernel_resources(b"\x50\xed\x55\xba" + bytes(60))  # a fatbin's magic, for instance


def test_16_bit_d256_decode_compiles_without_warnings(tmp_path):
    """kv_tile.cuh checks its fp8 swizzle with a constexpr function; instantiated for 16-bit rows at d256 (32
    chunks) it shifted 1 by 32 and nvcc warned (#63-D). The check is instantiated for swizzled fp8 rows only."""
    from attnforge.jit import arch
    from attnforge.kernels.decode import DecodeKernel
    m = DecodeKernel(AttentionSpec(head_dim_qk=256, head_dim_vo=256, num_qo_heads=32, num_kv_heads=2,
                                   pipeline="normal")).module()
    (tmp_path / "kernel.cu").write_text(m.source)
    done = subprocess.run([arch.nvcc_path(), *m.flags(ARCHS), f"-I{codegen.include_dir()}", "--cubin",
                           "-o", str(tmp_path / "kernel.cubin"), str(tmp_path / "kernel.cu")],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "warning" not in (done.stdout + done.stderr), done.stdout + done.stderr

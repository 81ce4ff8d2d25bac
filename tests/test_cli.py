"""python -m attnforge: build (presets and spec files, one parallel ninja run), info, cache clear, demo."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def cli(*args, cache):
    env = {**os.environ, "ATTNFORGE_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), "ATTNFORGE_CUDA_ARCH_LIST": "9.0a"}
    return subprocess.run([sys.executable, "-m", "attnforge", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_build_spec_file_info_and_clear(tmp_path):
    cache = tmp_path / "cache"
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([{"family": "decode", "num_qo_heads": 8, "num_kv_heads": 8, "head_dim_qk": 64},
                                 {"family": "prefill", "causal": True}]))
    r = cli("build", "--spec-file", str(specs), cache=cache)
    assert r.returncode == 0, r.stderr
    # the decode kernel, the prefill kernel, and its twin (float32 partial states) and the merge for plans that
    # split KV
    assert "building 4 modules" in r.stderr and "decode_mha_d64" in r.stdout and "prefill_gqa4" in r.stdout
    assert "_outf32_" in r.stdout and "merge_states_float_outbf16" in r.stdout
    cubins = list(cache.rglob("kernel.cubin"))
    assert len(cubins) == 4
    r = cli("info", cache=cache)
    assert r.returncode == 0 and str(cache) in r.stdout and "ATTNFORGE_CACHE_DIR" in r.stdout
    assert "MiB" in r.stdout
    r = cli("cache", "list", cache=cache)
    assert r.returncode == 0 and "4 modules" in r.stdout, r.stderr
    assert "batch_decode_kernel" in r.stdout and "registers, stack 0 B" in r.stdout  # read from the cubins
    r = cli("cache", "clear", cache=cache)
    assert r.returncode == 0 and not cache.exists()


def test_build_covers_the_whole_item_kernels_a_decode_spec_may_launch(tmp_path):
    """GQA 32/8 d128 bf16 decode has two whole-item kernels (kernels.decode.whole_item_tilings: one CTA an SM,
    and 4 CTAs an SM): an AOT build of the spec builds them beside the default one, so a run without JIT finds
    all three."""
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([{"family": "decode"}]))
    r = cli("build", "--spec-file", str(specs), cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "building 3 modules" in r.stderr
    assert all(f"_{tiling})" in r.stdout for tiling in ("t64s2w4", "t128s3w8", "t32s3w2"))


def test_a_cascade_entry_lists_the_kernels_cascade_decode_may_launch(tmp_path):
    """A spec file's decode entry with "cascade": true stands for CascadeDecode(spec): its suffix's decode kernels
    and its levels' prefill kernels, all writing float32 rows, and the two merges (a split level's partials into
    float32, the levels with the suffix into the spec's out_dtype). Bad forms say which entry and why."""
    from attnforge import presets
    from attnforge.cascade import CascadeDecode
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([{"family": "decode", "cascade": True}]))
    (entry,) = presets.load_spec_file(specs)
    assert isinstance(entry, CascadeDecode) and entry.name == "cascade_" + entry.spec.name
    names = [m.name for m in presets.modules_for(entry)]
    assert names == [m.name for m in (k.module() for k in entry.launchable_kernels())] and len(set(names)) == 6
    assert sum(n.startswith("decode_") and "_outf32_" in n for n in names) == 3  # the default, two whole-item
    assert sum(n.startswith("prefill_") and "_outf32_" in n for n in names) == 1  # (pages and ragged K/V alike)
    # the levels' kernel as CascadeDecode(spec) builds it: exact_max by default (on Hopper, name suffix _xm)
    (level,) = [k for k in entry.launchable_kernels() if type(k).__name__ == "PrefillKernel"]
    assert level.exact_max and level.rescale_slack == 0.0
    assert ("_xm_" in level.module().name) == (level.backend == "wgmma")
    assert {"merge_states_float_outfloat", "merge_states_float_outbf16"} <= set(names)
    for bad, why in (({"cascade": 1}, "cascade: expected true"), ({"cascade": True, "max_q_len": 2}, "no max_q_len"),
                     ({"cascade": True, "window_left": 64}, "no score_mod and no sliding window")):
        specs.write_text(json.dumps([{"family": "decode", **bad}]))
        with pytest.raises(ValueError, match=f"entry 0: .*{why}"):
            presets.load_spec_file(specs)


def test_build_preset(tmp_path):
    r = cli("build", "--preset", "merge", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 6 and len(list(tmp_path.rglob("manifest.json"))) == 6


def test_build_errors_are_clear(tmp_path):
    r = cli("build", cache=tmp_path)
    assert r.returncode == 2 and "--preset" in r.stderr
    r = cli("build", "--preset", "nope", cache=tmp_path)
    assert r.returncode == 2 and "llama-decode" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"family": "decode", "head_dim_qk": 96}]))
    r = cli("build", "--spec-file", str(bad), cache=tmp_path)
    assert r.returncode == 2 and "bad.json: entry 0: AttentionSpec.head_dim_qk" in r.stderr
    assert "Traceback" not in r.stderr  # (the reason alone, for a missing file or bad JSON too)
    bad.write_text("[{'family': 'decode'}]")
    r = cli("build", "--spec-file", str(bad), cache=tmp_path)
    assert r.returncode == 2 and "got invalid JSON" in r.stderr and "Traceback" not in r.stderr
    r = cli("build", "--spec-file", str(tmp_path / "missing.json"), cache=tmp_path)
    assert r.returncode == 2 and "No such file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path of the demo runs in the gpu suite")
def test_demo_without_gpu_builds_and_says_so(tmp_path):
    r = cli("demo", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and "kernel.cubin" in r.stdout


@pytest.mark.gpu
def test_demo_on_gpu(tmp_path):
    r = cli("demo", cache=tmp_path / "cache")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr

"""Named lists of specs for `python -m attnforge build --preset NAME` (AOT prebuilds)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .spec import AttentionSpec


def _llama_decode():
    return [AttentionSpec(family="decode", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128,
                          q_dtype=dt, kv_dtype=kv, kv_layout=layout)
            for dt in ("bf16", "fp16") for kv in (dt, "fp8_e4m3") for layout in ("NHD", "HND")]


def _llama_prefill():
    """The prefill kernels of the same model: causal, 16-bit K/V and an fp8 cache (the Hopper kernel where
    sm_90a is built, else mma.sync); one kernel serves ragged and paged K/V in either layout, but fp8's ragged
    K/V runs a TMA-built twin (modules_for builds both)."""
    return [AttentionSpec(family="prefill", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, q_dtype=dt,
                          kv_dtype=kv, causal=True)
            for dt in ("bf16", "fp16") for kv in (dt, "fp8_e4m3")]


def _deepseek_prefill():
    """DeepSeek-V2/V3's prefill before absorption: keys 192 wide, values 128, MHA, causal (the kernel is the
    same for any head count: specialised on the group, 1 here)."""
    return [AttentionSpec(family="prefill", num_qo_heads=128, num_kv_heads=128, head_dim_qk=192, head_dim_vo=128,
                          q_dtype=dt, causal=True) for dt in ("bf16", "fp16")]


def _merge():
    from .merge import MergeSpec
    return [MergeSpec(d, o) for d in (torch.bfloat16, torch.float16, torch.float32)
            for o in (torch.bfloat16, torch.float16)]


def _append():
    """The KV-cache append kernels: each 16-bit type into its own cache or into fp8, and fp8 into fp8."""
    from .append import AppendSpec
    fp8 = torch.float8_e4m3fn
    return [AppendSpec(s, c) for s in (torch.bfloat16, torch.float16) for c in (s, fp8)] + [AppendSpec(fp8, fp8)]


PRESETS = {"merge": _merge, "append": _append, "llama-decode": _llama_decode, "llama-prefill": _llama_prefill,
           "deepseek-prefill": _deepseek_prefill}


def load_spec_file(path: str | Path) -> list:
    """A JSON list of AttentionSpec field dicts, e.g. [{"family": "decode", "num_qo_heads": 32}]. A decode
    entry may add "max_q_len" (speculative decoding's verify step): the kernel BatchDecode(spec, max_q_len=...)
    launches, in place of the spec's one-token kernels; or "cascade": true, the kernels CascadeDecode(spec) may
    launch (its levels' prefill and its suffix's decode, writing float32 rows, and their merges)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: expected a JSON list of spec objects, got invalid JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of spec objects, got {type(data).__name__}")
    for i, d in enumerate(data):
        if not isinstance(d, dict):
            raise ValueError(f"{path}: entry {i}: expected an object of AttentionSpec fields (and \"max_q_len\" for a "
                             f"decode verify kernel), got {type(d).__name__} {d!r}; write it as {{\"family\": ...}}")
    specs = []
    for i, d in enumerate(data):
        try:
            specs.append(_spec_entry(dict(d)))
        except ValueError as e:  # (which entry of a long file)
            raise ValueError(f"{path}: entry {i}: {e}") from None
    return specs


def _spec_entry(d: dict):
    max_q_len, cascade = d.pop("max_q_len", 1), d.pop("cascade", False)
    spec = AttentionSpec.from_dict(d)
    if cascade is not False:
        if cascade is not True or max_q_len != 1:
            raise ValueError(f"cascade: expected true (and no max_q_len) in a decode entry, got cascade={cascade!r}"
                             f"{f' with max_q_len={max_q_len!r}' if max_q_len != 1 else ''}; write \"cascade\": true "
                             f"beside the decode spec's fields")
        from .cascade import CascadeDecode  # (checks that the spec is a decode spec a cascade takes)
        return CascadeDecode.host_only(spec)
    if max_q_len == 1:
        return spec
    if spec.family != "decode":
        raise ValueError(f"max_q_len: expected only in decode entries, got it with family {spec.family!r}; "
                         f"MLA's multi-token kernels are chosen per plan: build them by running a plan")
    return verify_kernel(spec, max_q_len)


def verify_kernel(spec: AttentionSpec, max_q_len: int):
    """The kernel BatchDecode(spec, max_q_len=max_q_len) launches (its pipeline picked for the item's rows)."""
    from .kernels.decode import DecodeKernel, spec_for_rows
    return DecodeKernel(spec_for_rows(spec, max_q_len), max_q_len=max_q_len)


def modules_for(spec) -> list:
    """Every JitModule a spec may launch: a decode spec's default kernel and, where it has them, its
    whole-item kernels (BatchDecode(whole_items=...) picks one per plan), a verify entry's too; a prefill spec's
    or a cascade entry's, what its wrapper lists (launchable_kernels: for prefill the kernel, a twin for ragged
    K/V where it runs one, their float32-partials twins and the merge of plans that split KV); so an AOT build
    covers what plans pick."""
    from .cascade import CascadeDecode
    if isinstance(spec, CascadeDecode):  # a spec file's cascade entry
        return [k.module() for k in spec.launchable_kernels()]
    if isinstance(spec, AttentionSpec) and spec.family == "prefill":
        from .prefill import BatchPrefill  # (a host-side wrapper: nothing is allocated outside CUDA-graph mode)
        return [k.module() for k in BatchPrefill(spec, device="cpu").launchable_kernels()]
    mods = [module_for(spec)]
    from .kernels.decode import DecodeKernel, whole_item_kernels
    if isinstance(spec, AttentionSpec) and spec.family == "decode":
        mods += [whole.module() for whole in whole_item_kernels(spec)]
    if isinstance(spec, DecodeKernel) and spec.max_q_len > 1:  # a spec file's verify entry (verify_kernel)
        mods += [whole.module() for whole in whole_item_kernels(spec.spec, spec.max_q_len)]
    return mods


def module_for(spec):
    """Any buildable spec -> its JitModule."""
    if hasattr(spec, "module"):
        return spec.module()
    from .kernels import module_for_attention
    return module_for_attention(spec)

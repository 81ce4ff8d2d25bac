"""Shared-prefix (cascade) decode: attention over each shared KV level is computed once for all the
queries that share it (those queries form one multi-row query block against one KV, i.e. a prefill
problem), each request's own suffix by batch decode, and the levels are merged by LSE.

    c = CascadeDecode(spec)                                    # spec: a decode spec
    c.plan(levels=[(group_indptr, kv_indptr, kv_indices, kv_last_page_len)],   # shared prefixes
           suffix=(kv_indptr, kv_indices, kv_last_page_len), page_size=16)     # per request
    out = c.run(q, kv_cache)

A level's `group_indptr` [G+1] splits the batch's requests (in order) into groups sharing one
KV range, given as a CSR page table over the same cache. Levels nest like FlashInfer's multi-level
cascade: level 0 is the longest-shared prefix. With use_cuda_graph=True every level plans into
persistent buffers, so `run` can be captured once and replayed after re-plans with the same number
of levels and batch size. An fp8 cache passes its k_scale / v_scale to plan: the levels then run fp8 prefill
and the suffix fp8 decode. The levels and the suffix write float32 rows (float_out), so a merged row is rounded to
the output type once, as a single-level decode's is.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from . import checks, ops, paged
from .decode import BatchDecode
from .jit import registry
from .merge import MergeSpec, check_merge_out, merge_state, merge_states
from .prefill import BatchPrefill
from .spec import AttentionSpec


def suffix_batch(suffix) -> int:
    """The batch size a plan's suffix table (kv_indptr, kv_indices, kv_last_page_len) names, its form checked."""
    if not isinstance(suffix, (tuple, list)) or len(suffix) != 3:
        raise checks.fail("plan(suffix=...)", "(kv_indptr, kv_indices, kv_last_page_len) of each request's own pages",
                          f"{type(suffix).__name__} of {len(suffix) if hasattr(suffix, '__len__') else 1}",
                          "Pass the suffix's page table as three host arrays.")
    indptr = paged.host_int_array("suffix kv_indptr", suffix[0])
    if indptr.ndim != 1 or len(indptr) < 1:
        raise checks.fail("suffix kv_indptr", "a 1-D array [B + 1]", f"shape {list(indptr.shape)}",
                          "Build it as a prefix sum of each request's own pages.")
    return len(indptr) - 1


def check_levels(batch: int, levels: Sequence[tuple]) -> None:
    """Each level's groups must cover requests 0..B-1 in order (host-side, before any launch)."""
    for i, level in enumerate(levels):
        if len(level) != 4:
            raise checks.fail(f"levels[{i}]", "(group_indptr, kv_indptr, kv_indices, kv_last_page_len)",
                              f"a tuple of {len(level)}", "Give each level its groups and their page table.")
        groups = paged.host_int_array(f"levels[{i}].group_indptr", level[0])
        if groups.ndim != 1 or len(groups) < 2 or groups[0] != 0 or groups[-1] != batch or np.any(np.diff(groups) < 0):
            raise checks.fail(f"levels[{i}].group_indptr", f"a non-decreasing array from 0 to the batch size {batch}",
                              paged.preview(groups), "Groups are contiguous runs of requests covering the whole batch.")
        kv = paged.host_int_array(f"levels[{i}].kv_indptr", level[1])
        if len(kv) != len(groups):
            raise checks.fail(f"levels[{i}].kv_indptr", f"{len(groups)} entries (one page range per group)", len(kv),
                              "Give every group of the level its shared pages.")


# BatchPrefill arguments a cascade sets for its levels itself (level_kwargs may not)
_OWN_LEVEL_ARGS = ("spec", "device", "use_cuda_graph", "max_batch_size", "float_out")
# the levels' defaults, which level_kwargs may override: an exact row max (+0.2% of a cascade's time, H100)
_LEVEL_DEFAULTS = {"exact_max": True}


class CascadeDecode:
    def __init__(self, spec: AttentionSpec, device=None, use_cuda_graph: bool = False,
                 level_kwargs: Optional[dict] = None, **decode_kwargs):
        """decode_kwargs: the suffix's BatchDecode arguments; level_kwargs: the shared levels' BatchPrefill
        arguments (e.g. backend="mma"). The levels default to exact_max=True: the Hopper kernel's row max then
        follows every new maximum, so a peaked row's dominant weight is exactly 1 (with the lag, exact_max=False,
        a 4000-token level cost ~1.25x the RMS error of one decode; the exact level cost the cascade +0.2% on an
        H100, docs/perf-notes.md)."""
        self._check_spec(spec)
        self.spec = spec
        self.use_cuda_graph = use_cuda_graph
        if "float_out" in decode_kwargs:
            raise checks.fail("CascadeDecode(float_out=...)", "no float_out (the levels and the suffix always write "
                              "float32 rows, merged once into the spec's out_dtype)", decode_kwargs["float_out"],
                              "Leave it out; pass out= to run() for the merged rows' buffer.")
        if level_kwargs is not None and not isinstance(level_kwargs, dict):
            raise checks.fail("CascadeDecode(level_kwargs=...)", "None or a dict of BatchPrefill arguments",
                              type(level_kwargs).__name__, "Pass e.g. level_kwargs={'backend': 'mma'}.")
        own = sorted(set(level_kwargs or ()) & set(_OWN_LEVEL_ARGS))
        if own:
            raise checks.fail("CascadeDecode(level_kwargs=...)", f"no {', '.join(_OWN_LEVEL_ARGS)} (the cascade "
                              "sets them for every level)", own, "Pass device and use_cuda_graph to CascadeDecode.")
        self.level_kwargs = {**_LEVEL_DEFAULTS, **(level_kwargs or {})}
        self.level_spec = self.level_spec_for(spec)
        self._host_level()  # (the levels' arguments checked now, before any device work, not at the first plan)
        self.suffix = BatchDecode(spec, device=device, use_cuda_graph=use_cuda_graph, float_out=True,
                                  **decode_kwargs)
        self.device = self.suffix.device
        self.levels: list[BatchPrefill] = []

    def _make_level(self) -> BatchPrefill:
        return BatchPrefill(self.level_spec, device=self.device, use_cuda_graph=self.use_cuda_graph,
                            max_batch_size=self.suffix.max_batch_size, float_out=True, **self.level_kwargs)

    def _host_level(self) -> BatchPrefill:
        """A level's host-side twin, which lists its kernels. It is eager (a graph-mode wrapper pins its staging
        buffers), so under CUDA graphs it is told that a level never splits KV, as BatchPrefill decides."""
        level = BatchPrefill(self.level_spec, device="cpu", float_out=True, **self.level_kwargs)
        level.split_kv = level.split_kv and not self.use_cuda_graph
        return level

    @staticmethod
    def _check_spec(spec) -> None:
        checks.check_spec("CascadeDecode", spec, "decode", "Pass a decode spec.")
        if spec.score_mod is not None or spec.window_left >= 0:
            raise checks.fail("CascadeDecode spec", "no score_mod and no sliding window (positions differ per level)",
                              spec.name, "Use BatchDecode for those variants.")

    @property
    def name(self) -> str:  # (the build command's listing of a spec file's cascade entry)
        return f"cascade_{self.spec.name}"

    @classmethod
    def host_only(cls, spec: AttentionSpec, use_cuda_graph: bool = False) -> "CascadeDecode":
        """A cascade built without a GPU (its suffix BatchDecode.host_only), to list the kernels its plans may
        launch (launchable_kernels: an AOT build's spec-file entry with "cascade": true); plans need a GPU."""
        cls._check_spec(spec)
        c = cls.__new__(cls)
        c.spec, c.level_spec, c.use_cuda_graph, c.levels = spec, cls.level_spec_for(spec), use_cuda_graph, []
        c.level_kwargs = dict(_LEVEL_DEFAULTS)
        c.suffix, c.device = BatchDecode.host_only(spec, float_out=True), torch.device("cpu")
        c.suffix.use_cuda_graph = use_cuda_graph
        return c

    @staticmethod
    def level_spec_for(spec: AttentionSpec) -> AttentionSpec:
        """The shared levels' prefill spec: the decode spec's heads, dims, dtypes (fp8 KV too), layout and
        soft-cap, not causal (every key of a shared prefix precedes the queries that share it)."""
        return AttentionSpec(family="prefill", num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                             head_dim_qk=spec.head_dim_qk, q_dtype=spec.q_dtype, kv_dtype=spec.kv_dtype,
                             out_dtype=spec.out_dtype, kv_layout=spec.kv_layout, logits_soft_cap=spec.logits_soft_cap)

    def launchable_kernels(self) -> tuple:
        """Every kernel spec a plan may launch: the suffix's decode kernels and the levels' prefill kernels (all
        writing float32 rows), and the merges of float32 rows (a split level's partials, the levels with the
        suffix into the output type)."""
        level = self._host_level()
        merge = MergeSpec(torch.float32, checks.TORCH_DTYPES[self.spec.out_dtype])
        return tuple(dict.fromkeys(self.suffix.launchable_kernels() + level.launchable_kernels() + (merge,)))

    def load_kernels(self) -> tuple[str, ...]:
        """Build (where the cache lacks them) and load on this cascade's GPU every kernel its plans may launch;
        returns their module names (BatchDecode.load_kernels: call it at start-up)."""
        return registry.load_all(self.launchable_kernels(), self.device)

    def plan(self, levels: Sequence[tuple], suffix: tuple, *, page_size: int, sm_scale=None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
        """levels: [(group_indptr, kv_indptr, kv_indices, kv_last_page_len)] per shared level; suffix: each
        request's own (kv_indptr, kv_indices, kv_last_page_len). k_scale / v_scale: an fp8 cache's per-tensor
        scales, read alike by every level and the suffix."""
        batch = suffix_batch(suffix)
        check_levels(batch, levels)
        if self.use_cuda_graph and self.levels and len(self.levels) != len(levels):
            raise checks.fail("plan: number of levels in CUDA-graph mode", f"{len(self.levels)} (as captured)",
                              len(levels), "Capture one graph per number of levels.")
        if len(self.levels) != len(levels):  # kept while the count holds: their buffers, pinned staging and run memos
            self.levels = [self._make_level() for _ in levels]
        for w, (group_indptr, kv_indptr, kv_indices, last) in zip(self.levels, levels):
            # the group's queries (one decode token per request) form one query block
            w.plan(paged.host_int_array("group_indptr", group_indptr), kv_indptr, kv_indices, last,
                   page_size=page_size, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        self.suffix.plan(*suffix, page_size=page_size, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
        self.batch = batch

    def run(self, q: torch.Tensor, kv_cache, out=None, return_lse: bool = False):
        checks.check_untracked("CascadeDecode.run", ("q", q), ("kv_cache", kv_cache), ("out", out))
        if not hasattr(self, "batch"):
            raise RuntimeError("CascadeDecode.run: call plan(...) first")
        if not ops.compiling():  # (traced, each launch is a custom op that checks its inputs when it runs)
            self.suffix.check_inputs(q, kv_cache)  # before the levels launch: q and the cache as decode's, and out
            if out is not None:  # as the final merge writes it, in the spec's out_dtype (the suffix's rows: float32)
                checks.check_dtype("out", out, (checks.TORCH_DTYPES[self.spec.out_dtype],))
                check_merge_out(out, q.device, tuple(q.shape[:2]) + (self.spec.head_dim_vo,))
        outs, lses = [], []
        for w in self.levels:
            o, s = w.run(q, kv_cache, return_lse=True)
            outs.append(o)
            lses.append(s)
        o, s = self.suffix.run(q, kv_cache, return_lse=True)
        dtype = checks.TORCH_DTYPES[self.spec.out_dtype]  # (float32 rows in, rounded once here; out's dtype too)
        if len(outs) == 1:  # one shared level (the common case): merge the pair, no stacked copies
            merged, lse = merge_state(outs[0], lses[0], o, s, out=out, out_dtype=dtype)
        else:
            merged, lse = merge_states(torch.stack(outs + [o], dim=1), torch.stack(lses + [s], dim=1), out=out,
                                       out_dtype=dtype)
        return (merged, lse) if return_lse else merged

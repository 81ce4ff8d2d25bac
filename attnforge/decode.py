"""BatchDecode: plan/run batch decode over a paged KV cache, CUDA-graph capturable.

    wrapper = BatchDecode(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128)
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, page_size=16)  # host arrays, once per step
    out = wrapper.run(q, kv_cache)                                        # every layer
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from . import checks, codegen, ops, paged, scheduler, variants
from .kernels.decode import (MAX_Q_LEN, MERGE_LSE_SLACK_BYTES, DecodeKernel, WholeItemTiling, kernel_for_tiling,
                             spec_for_rows, whole_item_tilings)
from .jit import registry
from .jit.loader import on_device
from .jit.upload import HostOnlyUpload, StagedUpload
from .spec import AttentionSpec

# the decode params a run sets (its tensors and strides); plan() fixes the rest (BatchDecode._params_template)
RUN_FIELDS = ("q", "k_cache", "v_cache", "out", "lse", "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h",
              "stride_page", "stride_token", "stride_head")
# the device buffers plan() copies, read by the decode and MLA kernels (BatchDecode._plan_fields)
PLAN_BUFFERS = ("kv_indptr", "kv_indices", "kv_len", "kv_begin", "stream_prefix", "meta")

KVCache = Union[torch.Tensor, Sequence[torch.Tensor]]


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits_device_smem(props, kernel: DecodeKernel) -> bool:
    """Whether a kernel's dynamic shared memory fits the device's opt-in limit per CTA (torch's device
    properties): the whole-item kernel's 196 KB does on Hopper (227 KB), not on Ampere (163 KB)."""
    optin = getattr(props, "shared_memory_per_block_optin", 0) or (227 * 1024 if props.major >= 9 else 48 * 1024)
    return kernel.smem_bytes <= optin


def grid_ctas(num_sms: int, kernel_ctas_per_sm: int, ctas_per_sm: Optional[int] = None) -> int:
    """The persistent grid: SMs x CTAs per SM, the kernel's occupancy unless fewer are asked for (each
    CTA then streams a longer span: fewer chunk fills and partial states to merge, fewer bytes in flight)."""
    if ctas_per_sm is None:
        return num_sms * kernel_ctas_per_sm
    valid = isinstance(ctas_per_sm, int) and not isinstance(ctas_per_sm, bool)
    if not (valid and 1 <= ctas_per_sm <= kernel_ctas_per_sm):
        raise checks.fail("ctas_per_sm", f"an int in [1, {kernel_ctas_per_sm}] (the kernel's occupancy)", ctas_per_sm,
                          "Pass None for the kernel's occupancy.")
    return num_sms * ctas_per_sm


class WholeItemLaunch(NamedTuple):
    """A whole-item kernel a wrapper may launch beside its default kernel: its grid and measured tiling."""
    kernel: DecodeKernel
    ctas: int
    tiling: WholeItemTiling


class BatchDecode:
    FAMILY = "decode"  # the spec family this wrapper runs (subclasses: other decode-shaped families)
    MAX_Q_LEN = MAX_Q_LEN  # query tokens a request at most (max_q_len)
    # How much longer (token-equivalents) a span may grow so that equal items split into equal whole-span
    # chunks (scheduler.plan_stream); None: the scheduler's ALIGN_SLACK (benchmarks set it to compare)
    align_slack: Optional[int] = None
    # Span boundaries within this many token-equivalents of an item's start or end move there, so short
    # items are not split into slivers (scheduler.span_cuts); None: the scheduler's SPAN_SNAP
    span_snap: Optional[int] = None

    def __init__(self, spec: Optional[AttentionSpec] = None, workspace: Optional[torch.Tensor] = None, *,
                 use_cuda_graph: bool = False, max_batch_size: int = 256, max_num_pages: int = 1 << 16,
                 device: Union[str, torch.device, None] = None, tile_kv: Optional[int] = None,
                 num_stages: Optional[int] = None, num_warps: Optional[int] = None, ctas_per_sm: Optional[int] = None,
                 head_splits: Optional[int] = None, whole_items: Optional[bool] = None, pdl: bool = True,
                 merge_launch: Optional[bool] = None, max_q_len: int = 1, float_out: bool = False, **spec_kwargs):
        # tile_kv / num_stages / num_warps: the kernel's tiling (None: attnforge.kernels.decode's measured
        # defaults); ctas_per_sm: a persistent grid below the kernel's occupancy (grid_ctas), None for the default;
        # head_splits: work items per KV head (None: kernels.decode.default_head_splits);
        # whole_items: where a plan has about one (near-)equal item per SM, run a one-CTA-per-SM kernel that
        # reads each item whole, or for some specs equal items cut into equal chunks of about one per SM
        # (kernels.decode.whole_item_tiling; specs without one, and explicit tilings, keep one kernel); where
        # it has about one equal item a CTA of a 4-CTA-an-SM kernel, that kernel (one token a request, a group
        # filling one head tile: kernels.decode.four_cta_tiling; verify steps of 4-16 rows an item:
        # kernels.decode.verify_four_cta_tiling; their one-CTA-an-SM kernel: verify_one_cta_tiling).
        # None: plan by plan, except under CUDA graphs (a graph keeps the kernel it captured, and a capture's
        # placeholder lengths say little about later batches); True: also under CUDA graphs,
        # chosen by the first plan's batch size (a fixed batch keeps the kernel; unequal lengths then
        # stream over its grid); False: never
        # pdl: launch with programmatic dependent launch (on sm_90+; elsewhere an ordinary launch), so the
        # kernel's CTAs are placed and walk their share of the plan while the kernel before it in the stream
        # finishes; they read the queries, the page table and the cache only after that kernel completes
        # (wait_for_prior_grid). Safe after any kernel: before the wait it reads only what plan() copied.
        # Measured -0.1..-2.6% on the decode suite's back-to-back calls (FlashInfer's decode also launches
        # so by default on sm_90); False for a plain launch
        # merge_launch: split items merged by a second launch (batch_decode_merge_kernel: a block a query head's
        # row, its chunks over 8 lanes) instead of by the CTA that finishes an item's last chunk, on the first
        # kernel's tail. None: where an item's merge would read more than scheduler.MERGE_LAUNCH_ROWS partial
        # rows (few long requests of many query heads), except under CUDA graphs; True / False: always / never
        # (under CUDA graphs as the first plan decides). Needs head_dim a multiple of 128
        # max_q_len: query tokens a request at most (plan(q_len=...)): speculative decoding's verify step
        # (the last token and its drafts, causal among themselves) in one pass over each request's KV; a
        # work item then holds its heads' rows for every token (kernels.decode.DecodeKernel.max_q_len), and a
        # spec on its group's default pipeline takes the one measured for those rows (kernels.decode.spec_for_rows)
        # float_out: rows written as float32 instead of the spec's out_dtype, for callers that merge them with
        # other attention states (a 16-bit row is rounded once more by the merge; CascadeDecode passes it)
        if not isinstance(max_q_len, int) or isinstance(max_q_len, bool) or not 1 <= max_q_len <= self.MAX_Q_LEN:
            raise checks.fail("max_q_len", f"an int in [1, {self.MAX_Q_LEN}]", repr(max_q_len),
                              "Query tokens per request (1 + speculative draft tokens).")
        self.max_q_len = max_q_len
        who = type(self).__name__
        checks.check_flag(who, "pdl", pdl, fix="Pass pdl=False for a plain launch.")
        checks.check_flag(who, "use_cuda_graph", use_cuda_graph)
        checks.check_count(who, "max_batch_size", max_batch_size)
        checks.check_count(who, "max_num_pages", max_num_pages)
        self.pdl = pdl
        checks.check_flag(who, "float_out", float_out)
        if float_out and self.FAMILY != "decode":
            raise checks.fail(f"{who}(float_out=True)", "float_out on BatchDecode only", who,
                              "Merge this wrapper's rows as returned, or run the decode through BatchDecode.")
        self.float_out = float_out
        checks.check_flag(who, "whole_items", whole_items, optional=True)
        if spec is None:
            spec = AttentionSpec(family="decode", **spec_kwargs)
        elif spec_kwargs:
            raise TypeError(f"BatchDecode: pass either a spec or spec keyword arguments, not both "
                            f"(got extra {sorted(spec_kwargs)})")
        checks.check_spec(who, spec, self.FAMILY, "Use the wrapper of that family.")
        if self.FAMILY == "decode":  # several tokens a request: the pipeline 'auto' picks for the item's rows
            spec = spec_for_rows(spec, max_q_len, head_splits)
        self._head_splits = head_splits
        self.spec, self.kernel = spec, self._make_kernel(spec, tile_kv, num_stages, num_warps)
        checks.check_flag(who, "merge_launch", merge_launch, optional=True)
        self.merge_in_launch = merge_launch  # (BatchMLADecode.merge_launch() is a method: another name)
        if workspace is not None and not isinstance(workspace, torch.Tensor):
            raise TypeError(f"{who}(workspace=...): expected None or a CUDA tensor of at least "
                            f"{who}.workspace_bytes(spec, num_ctas) bytes, got {checks.describe(workspace)}. Leave it "
                            f"out and the wrapper allocates its own.")
        if device is None and workspace is not None:
            device = workspace.device  # (a given workspace names the GPU)
        self.device = checks.cuda_device(device, type(self).__name__)
        self.use_cuda_graph = use_cuda_graph
        # set by pipelines whose kernel runs right before this one (Quest's selection): the decode kernel
        # is then launched with PDL and waits for it in-kernel (wait_for_prior_grid), hiding the gap
        self.launch_after_own_kernel = False
        self.num_sms = _num_sms(self.device)
        self.num_ctas = grid_ctas(self.num_sms, self.kernel.ctas_per_sm, ctas_per_sm)
        explicit = (tile_kv, num_stages, num_warps, ctas_per_sm, head_splits) != (None,) * 5
        self.whole_items = whole_items
        props = torch.cuda.get_device_properties(self.device)
        # (a GPU with less shared memory per CTA than Hopper keeps one kernel)
        self._wholes = () if explicit or whole_items is False else self._whole_launches(
            spec, lambda k: fits_device_smem(props, k))
        self.max_batch_size = max_batch_size
        self.max_num_pages = max_num_pages
        d, rows = self.spec.head_dim_vo, self.partial_slot_rows()
        need = self._workspace_need()
        if workspace is None:  # zeroed once: the merges copy aligned 16-byte blocks around a chunk's LSEs, whose
            # neighbours (other slots, the slack) may never be written; their values go unused, but initcheck
            # reports reads of memory nothing wrote (ninety-fifth session: merge_item's, in batch_decode_kernel)
            workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)
        checks.check_cuda("workspace", workspace, self.device)
        ws = checks.workspace_floats(workspace, need, type(self).__name__)
        self._partial_o = ws[: 2 * rows * d]
        self._partial_lse = ws[2 * rows * d:]
        # chunks finished per split (request, work item): the last one merges and resets it to 0
        self._merge_count = torch.zeros(max_batch_size * self._stream_items(), dtype=torch.int32, device=self.device)
        self._alloc_int_buffers(max_num_pages)
        self._plan = None
        self._captured = paged.CapturedPages()  # (use_cuda_graph: the captured caches' pages bound each plan)
        self._memo = checks.RunMemo()  # run()'s checked inputs and the plan's params template
        ops.handle(self)  # (its name in compiled graphs: attnforge.ops)

    def _make_kernel(self, spec, tile_kv, num_stages, num_warps):
        return DecodeKernel(spec, tile_kv, num_stages, num_warps, self._head_splits, max_q_len=self.max_q_len,
                            float_out=self.float_out)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of run()'s rows: the spec's out_dtype, or float32 with float_out."""
        return torch.float32 if self.float_out else checks.TORCH_DTYPES[self.spec.out_dtype]

    def partial_slot_rows(self) -> int:
        """Query rows of one of the two partial-state slots per CTA (attnforge/scheduler.py), summed over the
        CTAs, for every kernel a plan may pick: a whole-item kernel has fewer CTAs, whose items may hold more
        rows (MQA's every query head, against the default kernel's 16-head items), or more CTAs (4 an SM)."""
        whole = max((w.ctas * w.kernel.item_rows for w in self._wholes), default=0)
        return max(self.num_ctas * self._rows_per_slot(), whole)

    @property
    def _whole(self) -> Optional[DecodeKernel]:
        """The first whole-item kernel (whole_item_tiling's one CTA an SM where the spec has it, else its 4-CTA
        kernel), or None."""
        return self._wholes[0].kernel if self._wholes else None

    @property
    def _whole_ctas(self) -> int:
        return self._wholes[0].ctas if self._wholes else 0

    def _whole_max_chunks(self, tiling: WholeItemTiling) -> int:
        """The most chunks an item may be cut into on a whole-item kernel (1: whole items only): past the
        tiling's cap for merges on the kernel's tail only where the second launch merges such plans (it
        takes every merge past scheduler.MERGE_LAUNCH_ROWS rows: see merge_launch)."""
        launch = not self.use_cuda_graph if self.merge_in_launch is None else self.merge_in_launch
        return max(tiling.max_chunks, tiling.max_chunks_merge_launch) if launch else tiling.max_chunks

    def _whole_launches(self, spec, fits=lambda kernel: True) -> tuple[WholeItemLaunch, ...]:
        """The whole-item kernels this wrapper may launch (kernels.decode.whole_item_tilings), those that `fits`."""
        if self.FAMILY != "decode":
            return ()
        # (built only without explicit tilings or head splits: the default head splits, as the AOT build's)
        pairs = [(t, self._make_whole_kernel(dataclasses.replace(kernel_for_tiling(spec, t, self.max_q_len),
                                                                 float_out=self.float_out)))
                 for t in whole_item_tilings(spec, self.max_q_len)]
        return tuple(WholeItemLaunch(k, grid_ctas(self.num_sms, k.ctas_per_sm), t) for t, k in pairs if fits(k))

    def _make_whole_kernel(self, kernel: DecodeKernel) -> DecodeKernel:
        return kernel  # (a hook for the benchmarks' kernel twins)

    def _host_only_defaults(self) -> None:
        """The constructor arguments _make_kernel and plan() read, at their defaults (host_only skips __init__)."""
        self._head_splits, self.merge_in_launch, self.max_q_len, self.float_out = None, None, 1, False
        self._captured = paged.CapturedPages()

    def _rows_per_slot(self) -> int:  # query rows of one work item (its partial-output slot)
        return self.kernel.item_rows

    def _stream_items(self) -> int:
        """Work items per request in the split-KV stream: KV heads x head splits (kernels.decode)."""
        return self.spec.num_kv_heads * self.kernel.head_splits

    def _any_split(self, work) -> bool:
        """StreamMeta.any_split: decode's kernels merge in-kernel and never read it; True spares plan()
        the check (MLA computes it: its separate merge kernel exits on False)."""
        return True

    # -- buffers -----------------------------------------------------------------------------------
    def _alloc_int_buffers(self, max_pages: int) -> None:
        b = self.max_batch_size
        sizes = {"meta": 5, "kv_indptr": b + 1, "kv_len": b, "kv_begin": b, "stream_prefix": b + 1,
                 "kv_indices": max(max_pages, 1)}
        self._offsets, total = {}, 0
        for k, n in sizes.items():
            self._offsets[k] = (total, n)
            total += -(-n // 4) * 4  # keep each region 16-byte aligned
        self._starts = {name: off for name, (off, _) in self._offsets.items()}
        if getattr(self, "_upload", None) is not None:
            self._upload.drain()  # its pinned buffers go back to torch's allocator: no copy may still read them
        self._upload = self._staged_upload(total)
        self.max_num_pages = max_pages

    def _staged_upload(self, num_int32: int) -> StagedUpload:
        return StagedUpload(num_int32, self.device)

    @classmethod
    def host_only(cls, spec: AttentionSpec, max_batch_size: int = 256, max_num_pages: int = 1 << 16,
                  num_sms: int = 132, max_q_len: int = 1, float_out: bool = False) -> "BatchDecode":
        """A wrapper whose plan() runs without a GPU (HostOnlyUpload buffers in host memory; run() is
        not available): for tests of plan()'s host side and tools/plan_host_cost.py."""
        w = cls.__new__(cls)
        w._host_only_defaults()
        w.max_q_len, w.float_out = max_q_len, float_out
        spec = spec_for_rows(spec, max_q_len) if cls.FAMILY == "decode" else spec
        w.spec, w.kernel = spec, w._make_kernel(spec, None, None, None)
        w.device, w.use_cuda_graph, w._plan, w._memo = torch.device("cpu"), False, None, checks.RunMemo()
        w.num_sms, w.num_ctas, w.max_batch_size = num_sms, num_sms * w.kernel.ctas_per_sm, max_batch_size
        w.whole_items, w._wholes = None, w._whole_launches(spec)
        w._staged_upload = HostOnlyUpload  # the instance attribute shadows the GPU upload
        w._alloc_int_buffers(max_num_pages)
        ops.handle(w)
        return w

    def _device_region(self, name: str) -> torch.Tensor:
        """The device copy of one planned int32 region (e.g. kv_indices, which Quest rewrites in place)."""
        off, n = self._offsets[name]
        return self._upload.dev[off:off + n]

    def _dev_ptr(self, name: str) -> int:
        return self._upload.dev.data_ptr() + 4 * self._offsets[name][0]

    def _workspace_need(self) -> int:
        # the largest grid of the kernels a plan may pick (a 4-CTA whole-item kernel against the default's 3:
        # slots for its CTAs, or its partial states overran the lse region)
        ctas = max([self.num_ctas] + [w.ctas for w in self._wholes])
        return self.workspace_bytes(self.spec, ctas, self.max_q_len)

    @staticmethod
    def workspace_bytes(spec: AttentionSpec, num_ctas: int, max_q_len: int = 1) -> int:
        """Float workspace for `num_ctas` persistent CTAs: two partial (o, lse) slots per CTA (a work item's
        rows: group x max_q_len), and 32 bytes past them (the merge copies the lse values in aligned 16-byte
        blocks). A wrapper needs it for the largest of its grids (num_ctas, and its whole-item kernels' CTAs:
        4 an SM for the 4-CTA ones, kernels.decode.whole_item_tilings); its constructor says how many bytes
        where a given workspace is smaller. A workspace the wrapper allocates starts zeroed; one you pass is used as
        it is (zero it once, torch.zeros, if compute-sanitizer's initcheck should see no read of unwritten bytes:
        the merges read a few that no plan writes, and use none of them)."""
        return 2 * num_ctas * spec.group_size * max_q_len * (spec.head_dim_vo + 1) * 4 + MERGE_LSE_SLACK_BYTES

    # -- plan ----------------------------------------------------------------------------------------
    def plan(self, kv_indptr=None, kv_indices=None, kv_last_page_len=None, *, page_size: Optional[int] = None,
             seq_lens=None, block_table=None, sm_scale: Optional[float] = None, k_scale: float = 1.0,
             v_scale: float = 1.0, q_len: int = 1) -> None:
        """Host arrays in, one async copy out; no device-to-host synchronisation. q_len: query tokens a
        request (1..max_q_len), token t at position kv_len - q_len + t; run() then takes q [batch * q_len, ...].
        A request of fewer keys than q_len gives its first tokens (negative positions) no key: zero rows and
        LSE -inf, as every family treats a row with no visible key (attnforge.reference; MLA, prefill)."""
        self._check_q_len(q_len)
        table, page_size = self._page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, seq_lens, block_table)
        self._commit_plan(table, page_size, self._stream_items(), q_len, sm_scale, k_scale, v_scale)

    def _check_q_len(self, q_len) -> None:
        """plan()'s q_len (decode's and MLA's): an int in [1, max_q_len]."""
        if type(q_len) is not int or not 1 <= q_len <= self.max_q_len:
            raise checks.fail("plan(q_len=...)", f"an int in [1, max_q_len={self.max_q_len}]", repr(q_len),
                              "Construct the wrapper with max_q_len >= the tokens per request.")

    def _page_table(self, kv_indptr, kv_indices, kv_last_page_len, page_size, seq_lens, block_table):
        page_size = page_size if page_size is not None else self.spec.page_size
        if page_size is None:
            raise checks.fail("plan(page_size=...)", "an int >= 1", page_size,
                              "Pass the cache's tokens per page (or set it in the spec).")
        paged.check_page_size("plan(page_size=...)", page_size)
        if self.spec.page_size is not None and page_size != self.spec.page_size:
            raise checks.fail("plan(page_size=...)", f"{self.spec.page_size} (the spec's)", page_size,
                              "Use one page size or leave spec.page_size=None.")
        table = paged.from_either_form(kv_indptr, kv_indices, kv_last_page_len, seq_lens, block_table, page_size)
        self._captured.check(table.max_page_index)
        if len(table.indices) > self.max_num_pages:
            if self.use_cuda_graph:
                raise checks.fail("plan: number of pages", f"at most max_num_pages={self.max_num_pages}",
                                  len(table.indices), "Construct the wrapper with a larger max_num_pages.")
            self._alloc_int_buffers(2 * len(table.indices))
        if table.batch_size > self.max_batch_size:
            raise checks.fail("plan: batch size", f"at most max_batch_size={self.max_batch_size}", table.batch_size,
                              "Construct the wrapper with a larger max_batch_size.")
        return table, page_size

    def _commit_plan(self, table, page_size: int, items_per_request: int, q_len: int, sm_scale, k_scale,
                     v_scale) -> None:
        checks.check_plan_scales(sm_scale, k_scale, v_scale)  # (MLA's plan too)
        if self.use_cuda_graph and self._plan is not None and table.batch_size != self._plan["batch"]:
            raise checks.fail("plan: batch size in CUDA-graph mode", f"{self._plan['batch']} (as captured)",
                              table.batch_size, "Capture one graph per batch size.")
        kv_end = table.kv_len
        kv_begin = scheduler.zero_begins(len(kv_end))
        if self.spec.window_left >= 0:  # keys before the window are never read
            kv_begin = np.maximum(kv_end - q_len - self.spec.window_left, 0)
        kernel, ctas, work, items_per_request = self._launch_plan(kv_begin, kv_end, items_per_request)
        merge_launch = self._merge_launch_for(kernel, work)

        h = self._upload.host()  # waits for that buffer's copy of two plans ago
        b, at = table.batch_size, self._starts
        # plain slices of the staging buffer (a helper call per region costs more than its copy)
        h[at["meta"]], h[at["meta"] + 1], h[at["meta"] + 2], h[at["meta"] + 3] = b, work.span, work.total, work.snap
        any_split = self._any_split(work)
        h[at["meta"] + 4] = any_split
        h[at["kv_indptr"]:at["kv_indptr"] + b + 1] = table.indptr
        h[at["kv_len"]:at["kv_len"] + b] = kv_end
        h[at["kv_begin"]:at["kv_begin"] + b] = kv_begin
        h[at["stream_prefix"]:at["stream_prefix"] + b + 1] = work.prefix
        used = at["kv_indices"] + len(table.indices)
        h[at["kv_indices"]:used] = table.indices
        self._upload.upload(used)
        scale = (self.default_sm_scale() if sm_scale is None else float(sm_scale)) * float(k_scale)
        if self.use_cuda_graph and self._plan is not None:  # launch parameters are baked into a captured graph
            was = (self._plan["page_size"], self._plan["sm_scale"], self._plan["v_scale"], self._plan["q_len"])
            if was != (page_size, scale, float(v_scale), q_len):
                raise checks.fail("plan in CUDA-graph mode",
                                  f"page_size, sm_scale*k_scale, v_scale, q_len as captured {was}",
                                  (page_size, scale, float(v_scale), q_len), "Capture one graph per configuration.")
        self._plan = {"batch": b, "page_size": page_size, "max_page": table.max_page_index,
                      "sm_scale": scale, "v_scale": float(v_scale), "work": work, "q_len": q_len,
                      "kernel": kernel, "ctas": ctas, "any_split": any_split, "stream_items": items_per_request,
                      "merge_launch": merge_launch}
        self._memo.new_plan()

    def _merge_launch_for(self, kernel, work: scheduler.StreamPlan) -> bool:
        """Whether this plan's split items are merged by batch_decode_merge_kernel (see merge_launch)."""
        if self.FAMILY != "decode" or not getattr(kernel, "row_merge", False):
            return False
        if self.use_cuda_graph and self._plan is not None:  # the captured graph holds the launch or not
            return self._plan["merge_launch"]
        if self.merge_in_launch is not None:
            return self.merge_in_launch
        return not self.use_cuda_graph and scheduler.longest_merge_rows(work, kernel.item_rows) > \
            scheduler.MERGE_LAUNCH_ROWS

    @property
    def planned_kernel(self) -> tuple:
        """(DecodeKernel, grid CTAs) that run() launches for the current plan."""
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}: call plan(...) first")
        return self._plan["kernel"], self._plan["ctas"]

    def _launch_plan(self, kv_begin, kv_end, items_per_request: int) -> tuple:
        """(kernel, grid CTAs, stream plan, items per request): a whole-item kernel where this plan has
        about one (near-)equal item per CTA of its grid, or where that kernel takes chunked plans, equal items
        cut into equal chunks of about one a CTA (see whole_items in __init__); else the default kernel."""
        for whole, ctas, tiling in self._pickable_wholes():
            # a whole-item kernel's items may hold more query heads (MQA: head_splits 1)
            per_request = items_per_request // self.kernel.head_splits * whole.head_splits
            items = len(kv_end) * per_request
            if self.use_cuda_graph and self._plan is not None:  # the captured graph launches that kernel
                use = self._plan["kernel"] is whole
            else:  # (the count first: most batches outnumber the grid, and the chunk cap costs ~0.3 us)
                use = 0 < items <= ctas and scheduler.in_whole_item_band(items, ctas, self._whole_max_chunks(tiling))
            if use:
                work = scheduler.plan_whole_items(kv_begin, kv_end, per_request, ctas)
                if self.use_cuda_graph or 0 < scheduler.aligned_chunks(work) <= self._whole_max_chunks(tiling):
                    return whole, ctas, work, per_request
        return self.kernel, self.num_ctas, self._plan_stream(kv_begin, kv_end, items_per_request), items_per_request

    def _pickable_wholes(self) -> tuple:
        """The whole-item launches a plan may pick: none under CUDA graphs unless whole_items=True (see __init__)."""
        return self._wholes if self.whole_items or not self.use_cuda_graph else ()

    def launchable_kernels(self) -> tuple:
        """Every kernel spec a plan of this wrapper may launch (its merge kernels share their modules)."""
        return (self.kernel, *(w.kernel for w in self._pickable_wholes()))

    def load_kernels(self) -> tuple[str, ...]:
        """Build (where the cache lacks them) and load on this wrapper's GPU every kernel its plans may launch;
        returns their module names. Call it at start-up: a plan that first picks another kernel (a whole-item
        one, or MLA's transposed one) then pays no build or module load in a step, and a module load may wait
        for the device's running work (docs/serving.md)."""
        return registry.load_all(self.launchable_kernels(), self.device)

    def _plan_stream(self, kv_begin, kv_end, items_per_request: int) -> scheduler.StreamPlan:
        slack = scheduler.ALIGN_SLACK if self.align_slack is None else self.align_slack
        snap = scheduler.SPAN_SNAP if self.span_snap is None else self.span_snap
        return scheduler.plan_stream(kv_begin, kv_end, items_per_request, self.num_ctas, align_equal_items=True,
                                     align_slack=slack, snap=snap)

    def default_sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.spec.head_dim_qk)

    # -- run -----------------------------------------------------------------------------------------
    def _check_q(self, q: torch.Tensor) -> None:
        s, rows = self.spec, self._plan["batch"] * self._plan["q_len"]
        checks.check_cuda("q", q, self.device)
        checks.check_dtype("q", q, (checks.TORCH_DTYPES[s.q_dtype],))
        checks.check_shape("q", q, (rows, s.num_qo_heads, s.head_dim_qk),
                           "[batch, num_qo_heads, head_dim]" if self._plan["q_len"] == 1 else
                           "[batch * q_len, num_qo_heads, head_dim] (q_len as planned)")
        checks.check_contiguous_last("q", q)
        if q.stride(1) % 8 or q.stride(0) % 8 or q.data_ptr() % 16:
            raise checks.fail("q", "16-byte aligned rows", f"strides {q.stride()}", "Call q.contiguous().")

    def _cache_args(self, kv_cache: KVCache) -> tuple:
        """(K address, V address, page / token / head strides, pages) of a checked cache (plain numbers: RunMemo;
        run() checks the plan's page ids against the pages)."""
        k, v, *strides = paged.split_cache(self.spec, kv_cache, self._plan["page_size"], -1, self.device)
        return (k.data_ptr(), v.data_ptr(), *strides, k.shape[0])

    def _plan_fields(self) -> dict:
        """The params a plan fixes in every stream kernel (decode's and MLA's): the partial states and the buffers
        plan() copied."""
        return {"partial_o": self._partial_o.data_ptr(), "partial_lse": self._partial_lse.data_ptr(),
                **{name: self._dev_ptr(name) for name in PLAN_BUFFERS}}

    def _per_run(self, fields: tuple) -> tuple:
        """A run's params: `fields` and the score modifier's runtime values."""
        mod = self.spec.score_mod
        return fields + (tuple(f.name for f in mod.param_fields()) if mod is not None else ())

    def _params_template(self) -> codegen.ParamsTemplate:
        """The plan's launch parameters (RunMemo.once): all but a run's tensors, strides and modifier values."""
        s = self.spec
        return self._plan["kernel"].params.template(
            self._per_run(RUN_FIELDS), **self._plan_fields(), merge_count=self._merge_count.data_ptr(),
            page_size=self._plan["page_size"], num_qo_heads=s.num_qo_heads, num_kv_heads=self._plan["stream_items"],
            v_scale=self._plan["v_scale"], merge_launch=int(self._plan["merge_launch"]), q_len=self._plan["q_len"],
            **variants.variant_values(s, self._plan["sm_scale"]))

    def check_inputs(self, q: torch.Tensor, kv_cache: KVCache, out: Optional[torch.Tensor] = None,
                     lse: Optional[torch.Tensor] = None) -> tuple:
        """run()'s checks of its arguments against the plan, each once per tensor layout (checks.RunMemo), and
        the plan's page ids against the cache; raises before any launch. Wrappers that launch kernels of their
        own before the decode (Quest's scoring, cascade's levels) call it first. Returns the cache's (K address,
        V address, page / token / head strides, pages)."""
        s, memo = self.spec, self._memo
        b = self._plan["batch"] * self._plan["q_len"]  # query rows
        memo.get("q", (q,), lambda: self._check_q(q), b)
        if s.score_mod is not None:  # (run() reads them again at the launch; Quest scores before it)
            memo.once("mod_device", lambda: s.score_mod.check_device(self.device))
        cache = memo.get("kv", paged.cache_list(kv_cache), lambda: self._cache_args(kv_cache), self._plan["page_size"])
        paged.check_page_bound(self._plan["max_page"], cache[-1])
        self._captured.note(self.use_cuda_graph, cache[-1])
        if out is not None or lse is not None:
            checks.check_output_buffers(out, lse, (b, s.num_qo_heads, s.head_dim_vo), self.out_dtype,
                                        self.device, "[batch, num_qo_heads, head_dim]", "[batch, num_qo_heads]", memo,
                                        aligned=False)  # (store_floats: rows at any alignment)
        return cache

    def run(self, q: torch.Tensor, kv_cache: KVCache, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False):
        """q [B, Hq, D]; kv_cache [P, 2, page, Hkv, D] / [P, 2, Hkv, page, D] or a (K, V) pair.
        (A plan of q_len > 1 tokens a request: q [B * q_len, Hq, D], request b's token t at row b * q_len + t.)

        Returns out [B, Hq, D] (and lse [B, Hq] float32, natural log, if return_lse), as q's rows.
        Under torch.compile the call is one custom op (attnforge.ops).
        """
        checks.check_untracked("BatchDecode.run", ("q", q), ("kv_cache", kv_cache), ("out", out), ("lse", lse))
        if ops.compiling():
            args = [q, *paged.cache_list(kv_cache)]
            return ops.compiled_run(self, self._plan is not None, args, out, lse, return_lse)
        if self._plan is None:
            raise RuntimeError("BatchDecode.run: call plan(...) first (once per batch, outside graph capture).")
        s, memo = self.spec, self._memo
        k, v, stride_page, stride_token, stride_head, _ = self.check_inputs(q, kv_cache, out, lse)
        if out is None or (return_lse and lse is None):
            out, lse = checks.allocate_outputs(out, lse, return_lse, (q.shape[0], s.num_qo_heads, s.head_dim_vo),
                                               self.out_dtype, self.device)
        self._launch_planned(
            memo.once("params", self._params_template), q=q.data_ptr(), k_cache=k, v_cache=v, out=out.data_ptr(),
            lse=0 if lse is None else lse.data_ptr(), q_stride_b=q.stride(0), q_stride_h=q.stride(1),
            out_stride_b=out.stride(0), out_stride_h=out.stride(1), stride_page=stride_page, stride_token=stride_token,
            stride_head=stride_head)
        return (out, lse) if return_lse else out

    def run_narrowed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False) -> tuple:
        """run() for a caller whose q, K and V come back call after call (attention()'s decode route, one call
        signature a wrapper: dense_decode.DecodeCall): the plan's template narrowed by their pointers and strides,
        checked once per plan and tensor set, so a call allocates its rows and sets only out, lse and the
        modifier's values. k, v: the (K, V) pair form. Returns (out, lse or None), rows as run()'s."""
        key = (checks.tensor_key(q), checks.tensor_key(k), checks.tensor_key(v))  # (what the checks read of them)
        s, memo = self.spec, self._memo
        narrowed = memo.once("narrowed templates", dict)  # (a new plan starts them over)
        template = narrowed.get(key)
        if template is None:
            k_ptr, v_ptr, stride_page, stride_token, stride_head, _ = self.check_inputs(q, (k, v))
            if len(narrowed) >= checks.RunMemo.MAX_ENTRIES:
                narrowed.clear()
            template = narrowed[key] = memo.once("params", self._params_template).narrowed(
                q=q.data_ptr(), k_cache=k_ptr, v_cache=v_ptr, q_stride_b=q.stride(0), q_stride_h=q.stride(1),
                out_stride_b=s.num_qo_heads * s.head_dim_vo, out_stride_h=s.head_dim_vo, stride_page=stride_page,
                stride_token=stride_token, stride_head=stride_head)
        out, lse = checks.allocate_outputs(None, None, return_lse, (q.shape[0], s.num_qo_heads, s.head_dim_vo),
                                           self.out_dtype, self.device)  # (contiguous: the strides fixed above)
        self._launch_planned(template, out=out.data_ptr(), lse=0 if lse is None else lse.data_ptr())
        return out, lse

    def _launch_planned(self, template: codegen.ParamsTemplate, **values) -> None:
        """The plan's kernel with `template` filled by `values` and the modifier's values; split items merged by
        their last chunk's CTA, or by a second launch."""
        s, kernel, ctas, memo = self.spec, self._plan["kernel"], self._plan["ctas"], self._memo
        mod_values = s.score_mod.param_values(self.device) if s.score_mod is not None else {}
        params = template.fill(**values, **mod_values)
        lib = memo.once("lib", lambda: registry.get_library(kernel, kernel.module, self.device))
        with on_device(self.device):
            self._upload.order_run()  # (after a plan copied on another stream)
            lib["batch_decode_kernel"].launch((ctas,), (kernel.threads,), params,
                                             smem=kernel.smem_bytes, pdl=self.pdl or self.launch_after_own_kernel)
            if self._plan["merge_launch"]:  # a block a (request, item, query head) row; whole items' exit at once
                rows = self._plan["batch"] * self._plan["stream_items"] * kernel.item_rows
                lib["batch_decode_merge_kernel"].launch((rows,), kernel.row_merge_block, params, pdl=True)

    def _op_out_shape(self, args: list):  # (attnforge::run's fake; MLA's 512-wide rows are its head_dim_vo)
        return ops.rows_out_shape(self.spec, args, self.out_dtype)

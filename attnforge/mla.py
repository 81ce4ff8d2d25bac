"""BatchMLADecode: DeepSeek multi-head latent attention decode over a paged latent cache.

    w = BatchMLADecode(num_qo_heads=16)                       # pipeline and backend: the measured winner
                                                              # (wgmma; mma.sync for fp8 KV or without sm_90a)
    w.plan(kv_indptr, kv_indices, kv_last_page_len, page_size=64, q_len=1)
    out = w.run(q_nope, q_pe, ckv_cache, kpe_cache)            # or run(q_nope, q_pe, kv_cache_576)

Every cached token is 512 latent values (ckv, which is also the value row) plus 64 rope values
(kpe). q_len > 1 (speculative decoding) is causal among the request's draft tokens: token t of
q_len sits at position kv_len - q_len + t. Reuses BatchDecode's planner, buffers and graph mode.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from . import checks, codegen, ops, paged, scheduler, variants
from .decode import BatchDecode
from .jit import registry
from .jit.loader import on_device
from .kernels.mla import MLADecodeKernel, default_backend, rows_per_cta
from .spec import MLA_HEAD_DIM_QK, MLA_HEAD_DIM_VO, AttentionSpec

ROPE_DIM = MLA_HEAD_DIM_QK - MLA_HEAD_DIM_VO
MAX_Q_LEN = 4
# the MLA params a run sets besides its cache's (BatchMLADecode._cache_args); plan() fixes the rest
RUN_FIELDS = ("q_nope", "q_pe", "out", "lse", "q_nope_stride_t", "q_nope_stride_h", "q_pe_stride_t", "q_pe_stride_h",
              "out_stride_t", "out_stride_h")
DEEPSEEK_SM_SCALE = 1.0 / math.sqrt(128 + 64)  # (qk_nope_head_dim + qk_rope_head_dim)^-1/2 in DeepSeek-V2/V3


MERGE_CHUNKS_PER_LANE = 16  # two batches of loads in flight (kMergeBatch = 8) per merging thread group
# With lanes, a row's 512 dims are shared by MERGE_DIM_SPLIT CTAs of 32 x lanes threads (4 dims each),
# so up to 16 lanes fit the merge kernel's __launch_bounds__(512): ~264 chunks of one long request
# take 2-3 round trips per lane, not 9 (4 lanes of 128 threads, one CTA per row, until 2026-11-30). Splits of 8
# and 16 ran 1-7% slower at B1 L131072 (forty-first session).
MERGE_DIM_SPLIT = 4
MAX_MERGE_LANES = 16
# Each warp must hold one lane of one row: merge_lse_states fences its batches with __syncwarp, and lanes of
# one row may take different numbers of batches
assert (MLA_HEAD_DIM_VO // 4 // MERGE_DIM_SPLIT) % 32 == 0, "a merge lane's threads must fill whole warps"


def merge_lanes(work: scheduler.StreamPlan) -> int:
    """Thread groups that split one row's chunks in the merge kernel: 1 unless some request is cut
    into more than MERGE_CHUNKS_PER_LANE chunks (few long requests over every SM), where a single
    group would wait for one memory round trip per 8 chunks, hundreds of them in a row."""
    if work.batch_size == 0:
        return 1
    return lanes_for_chunks(scheduler.longest_item(work) // work.span + 2)  # an item's most CTAs


def graph_merge_lanes(batch: int, items_per_request: int, spans: int) -> int:
    """merge_lanes for a CUDA graph, fixed at capture for every later plan: as for `batch` equal
    requests (spans // (batch x items) chunks an item). A graph of one long request then merges over
    lanes as eager runs do (one lane: h16 B1 L131072 took 93 us in graph mode against 62 eagerly,
    twenty-seventh session); batched graphs keep one lane, and so does a skewed plan replayed in them."""
    return lanes_for_chunks(spans // max(1, batch * items_per_request) + 2)


def merge_kernel_name(blocks: int, num_sms: int) -> str:
    """The merge kernel for a grid of `blocks`: the one-wave kernel (each batch's loads in one round trip, one
    block an SM: templates/mla_decode.cu.jinja says what it won and lost) where they fit one block an SM."""
    return "mla_merge_one_wave_kernel" if blocks <= num_sms else "mla_merge_kernel"


def lanes_for_chunks(chunks: int) -> int:
    if chunks <= MERGE_CHUNKS_PER_LANE:
        return 1
    return min(MAX_MERGE_LANES, 1 << (-(-chunks // MERGE_CHUNKS_PER_LANE) - 1).bit_length())


# Aligned spans may grow by up to this many latent tokens (1152 bytes each at bf16, against decode's
# 512-byte token-heads). Measured on the H200 (fourteenth session, h16, in rotation): spans 62-63 tokens
# longer won 2.9% (B64 L8192) and 3.8% (B128 L4096); 124 longer lost 1.5% (B16 L65536, h8 and h16).
MLA_ALIGN_SLACK = 96
# The 64-row wgmma kernels (normal pipeline, the default from 16 heads) pay far more for a split item:
# each chunk loads 64 query rows (73 KB), writes a 128 KB partial state and has it merged. There aligned
# spans may grow by this fraction of the even span. Measured on the H200 (twenty-sixth session, two
# rounds in rotation): spans 3.1% longer, each holding whole items or one equal chunk of one, won 4-13%
# (h128 B64 L8192 -13%, B128 L4096 -7%, B16 L65536 -4%; h32 / h64 B16 L65536 -7 / -9%); 3.1% was the
# most measured. The 64-row mma.sync kernel (fp8 KV) keeps MLA_ALIGN_SLACK: not measured.
MLA_WIDE_ALIGN_FRACTION = 0.04
# The transposed wgmma kernel aligns within this many tokens (from 16 heads: or MLA_WIDE_ALIGN_FRACTION of
# the span where that is more, as it is on every h16 shape of the suite). At 8 heads (its default) it lets
# B128 L4096 take one whole request a span (126 tokens more) and B64 L8192 one equal half of one, cut on a
# tile boundary (4096 + 4096 tokens: 157 more; under 128 its cut stayed at 4064 + 4128, 64 + 65 tiles),
# while B16 L65536 (which would grow 304) keeps its even split. Measured on the H200: 128 against
# MLA_ALIGN_SLACK (thirty-seventh session, three rounds in rotation): h8 B128 L4096 -6.2%, B64 L8192 -1.8%,
# B16 L65536 and B1 L131072 ties; 200 against 128 (forty-second session, four rounds in one process; every
# value in 157..303 makes the same plans): h8 B64 L8192 -0.5..-1.0%, B128 L4096 / B16 L65536 / B1 L131072
# -0.5..+0.2%. The fraction is not used at 8 heads: at 4% B16 L65536 took 128 equal chunks on 132 SMs and
# lost 0.9%. (No alignment at all, slack 0, lost at h16 too: B16 L65536 +0.9..+1.2%, B64 L8192 +5.2..+5.4%.)
MLA_TRANSPOSED_ALIGN_SLACK = 192
# One long request at 16 heads: the transposed wgmma kernel (its producer warpgroup copying) instead of the
# default normal one. Measured on the H200 (thirty-second session): h16 B1 L131072 2821 against 2688 GB/s
# (record, call 9) and 53.7 against 56.4 us (three rounds in rotation, call 8); as this switch, 53.0-53.9
# against 55.5-56.3 us (thirty-third session, three rounds). With the transposed kernel's early S^T
# (thirty-fifth session) it led batches too where its spans aligned as the normal kernel's: below.
LONG_REQUEST_TRANSPOSED = True
# Batches at 16 heads of one query token a request run that kernel too, eager and in CUDA graphs (a graph's
# batch size and q_len are fixed at capture, so is the choice). Measured on the H200 (thirty-sixth session,
# three rounds in rotation, transposed against normal, both on spans aligned within MLA_WIDE_ALIGN_FRACTION):
# -2.7..-6.8% on the nine batches of call 5, B16..B128 x L2048..L65536 (B64 L8192 -3.0%, B128 L4096 -2.9%,
# B16 L65536 -2.8%, B16 L4096 -6.0%; before the alignment, B2 L16384 -12% and B4 L4096 -25%). A batch of
# several query tokens a request keeps the normal kernel, whose 64-row blocks hold four: at two tokens the
# transposed kernel (a 16-row block a token, each rereading the request's KV) ran 60-77% slower
# (thirty-seventh session, three rounds: B16 L65536 q2 541 against 309 us, B64 L8192 272 against 170).
BATCHES_TRANSPOSED = True
# Aligned chunks' cuts on the kernel's KV tiles (scheduler.plan_stream(align_tile=...)), on the wgmma kernels:
# h16 B64 L8192 was cut into 4064 + 4128 tokens, so half its CTAs ran 65 tiles where B128 L4096's ran 64
# (thirty-eighth session's trace: 64.5 tiles an item, against 64.0). Measured on the H200 against the
# unrounded cuts, three rounds in one process: the transposed kernel (thirty-eighth session) B64 L8192 -1.1%
# (156.3 -> 154.5 us), B16 L65536 -0.2%, B128 L4096 (whole requests: the same plan) +0.3%; the roles kernel
# (thirty-ninth) h64 B64 L8192 -1.3%, h32 B64 L8192 -0.6..-2.6%, h64 B1 L131072 -1.0%, h32 / h64 B16 L65536
# -0.2..-0.6%, h128 B16 L65536 and B1 L131072 0..-1%, no round a loss past +0.1%. The mma.sync kernels
# (fp8 KV) keep unrounded cuts: not measured. None on a wrapper (align_tile): the kernel's tile there,
# else 0; 0: unrounded.
ALIGN_CUTS_TO_TILES = True


class BatchMLADecode(BatchDecode):
    FAMILY = "mla_decode"
    MAX_Q_LEN = MAX_Q_LEN  # (BatchDecode.__init__ checks max_q_len against it)
    # aligned chunks' cuts rounded to this many tokens (scheduler.plan_stream); None: a wgmma kernel's KV
    # tile where ALIGN_CUTS_TO_TILES, else 0 (benchmarks set 0 to compare)
    align_tile: Optional[int] = None

    def __init__(self, spec: Optional[AttentionSpec] = None, workspace: Optional[torch.Tensor] = None, *,
                 use_cuda_graph: bool = False, max_batch_size: int = 256, max_num_pages: int = 1 << 16,
                 max_q_len: int = 1, device: Union[str, torch.device, None] = None, num_stages: Optional[int] = None,
                 tile_kv: Optional[int] = None, backend: Optional[str] = None, schedule: Optional[str] = None,
                 kernel_fields: Optional[dict] = None, ctas_per_sm: Optional[int] = None, pdl: Optional[bool] = None,
                 **spec_kwargs):
        """tile_kv / num_stages override the measured defaults (attnforge.kernels.mla.default_tiling).
        backend="wgmma": the sm_90a warpgroup-MMA kernels (16-bit KV; normal: 64 rows per CTA, transposed:
        up to 32); "mma": mma.sync (any arch, fp8 KV); None: the measured winner for the spec
        (attnforge.kernels.mla.default_backend), or "mma" when tile_kv / num_stages are given.
        schedule: the wgmma normal pipeline's warpgroup schedule (attnforge.kernels.mla.SCHEDULES).
        kernel_fields: attnforge.kernels.mla.MLADecodeKernel fields to set beyond the ones above, for
        ablations of the measured defaults (e.g. {"roles_w0_dims": 256, "roles_q_steps": 0}); validated there.
        Any explicit choice (backend, schedule, kernel_fields) pins the kernel: at 16 heads the plan-by-plan
        switch to the transposed kernel (LONG_REQUEST_TRANSPOSED, BATCHES_TRANSPOSED) is then off; pass
        pipeline="transposed" with backend="wgmma" to set that kernel's fields.
        ctas_per_sm: fewer persistent CTAs than the kernel's occupancy (attnforge.decode.grid_ctas).
        pdl: launch the decode kernel with programmatic dependent launch, as BatchDecode does (its CTAs
        find their first item while the kernel before it finishes, and read queries and cache after it
        completes); False for a plain launch; None: the kernel's measured default
        (MLADecodeKernel.pdl_by_default: plain for h128's roles kernel)."""
        self._kernel_fields = self._checked_kernel_fields(kernel_fields)
        self._backend, self._schedule = backend, schedule
        self._graph_lanes = None  # the merge's lanes in graph mode, fixed at the first plan
        if spec is None:  # (the spec fills MLA's one KV shape: 1 head, 576 / 512)
            spec = AttentionSpec(family="mla_decode", **spec_kwargs)
            spec_kwargs = {}
        super().__init__(spec, workspace, use_cuda_graph=use_cuda_graph, max_batch_size=max_batch_size,
                         max_num_pages=max_num_pages, device=device, num_stages=num_stages, tile_kv=tile_kv,
                         ctas_per_sm=ctas_per_sm, pdl=True if pdl is None else pdl, max_q_len=max_q_len,
                         **spec_kwargs)
        if pdl is None:
            self.pdl = self.kernel.pdl_by_default
        self._default_kernel = self._transposed_kernel = None  # filled at the first plan (_pick_kernel)

    # MLADecodeKernel's fields that have arguments of their own here
    _OWN_KERNEL_ARGS = ("spec", "num_stages", "tile_kv", "backend", "schedule")

    @classmethod
    def _checked_kernel_fields(cls, fields: Optional[dict]) -> dict:
        known = [f.name for f in dataclasses.fields(MLADecodeKernel) if f.name not in cls._OWN_KERNEL_ARGS]
        if fields is not None and not isinstance(fields, dict):
            raise checks.fail("kernel_fields", f"None or a dict of {known}", repr(fields),
                              "Pass e.g. kernel_fields={'roles_w0_dims': 256}.")
        unknown = sorted(set(fields or {}) - set(known))
        if unknown:
            raise checks.fail("kernel_fields", f"keys among {known}", unknown,
                              f"Pass {list(cls._OWN_KERNEL_ARGS[1:])} as BatchMLADecode's own arguments.")
        return dict(fields or {})

    def _make_kernel(self, spec, tile_kv, num_stages, num_warps):
        # a tiling override is for the mma.sync kernel (the wgmma one has a fixed 64 x 2 tiling)
        backend = self._backend
        if backend is None:  # (a falsy 0 or "" is refused by the kernel, not taken as the default)
            backend = "mma" if (tile_kv, num_stages) != (None, None) else default_backend(spec)
        return MLADecodeKernel(spec, num_stages, tile_kv, backend, self._schedule, **self._kernel_fields)

    def _host_only_defaults(self) -> None:
        self._backend, self._schedule, self._kernel_fields, self.max_q_len, self._graph_lanes = None, None, {}, 1, None
        self._default_kernel = self._transposed_kernel = None  # (host_only sets the kernel after: filled at plan())
        self._captured = paged.CapturedPages()

    def _make_transposed_kernel(self) -> Optional[MLADecodeKernel]:
        """The kernel plan() runs one request (LONG_REQUEST_TRANSPOSED), or a batch of one query token each
        (BATCHES_TRANSPOSED), on instead of the default: the transposed wgmma kernel where the default is
        the 64-row normal one at 16 heads, on the same grid, unless the kernel was chosen explicitly
        (backend, schedule, kernel_fields; the wgmma kernels have one tiling, 64 tokens in 2 stages)."""
        k = self._default_kernel
        if not (LONG_REQUEST_TRANSPOSED or BATCHES_TRANSPOSED) or self.spec.num_qo_heads != 16:
            return None
        if (k.backend, k.spec.pipeline) != ("wgmma", "normal"):
            return None
        if self._backend is not None or self._schedule is not None or self._kernel_fields:
            return None
        t = MLADecodeKernel(dataclasses.replace(self.spec, pipeline="transposed"), backend="wgmma")
        return t if t.ctas_per_sm == k.ctas_per_sm and t.rows <= k.rows else None

    def _pick_kernel(self, batch: int, q_len: int) -> None:
        """The kernel for a plan of `batch` requests of `q_len` query tokens: the transposed kernel for
        one request, or for a batch of one token each (BATCHES_TRANSPOSED), else the default. (Under CUDA
        graphs every plan has the captured batch size and q_len, so the captured kernel stays.) Both fit the
        workspace: the default's slots hold 64 rows, the transposed kernel's 16 a row block."""
        default, transposed_kernel = self._kernel_pair()
        transposed = (LONG_REQUEST_TRANSPOSED and batch == 1) or (BATCHES_TRANSPOSED and q_len == 1)
        self.kernel = transposed_kernel if transposed and transposed_kernel is not None else default

    def _kernel_pair(self) -> tuple:
        """(the default kernel, the transposed one or None), made at the first call (the first plan or
        load_kernels), on a constructed or a host_only wrapper alike."""
        if self._default_kernel is None:
            self._default_kernel = self.kernel
            self._transposed_kernel = self._make_transposed_kernel()
        return self._default_kernel, self._transposed_kernel

    def launchable_kernels(self) -> tuple:
        return tuple(k for k in self._kernel_pair() if k is not None)

    def _rows_per_slot(self) -> int:
        return self.kernel.rows

    def _stream_items(self) -> int:  # (sizes the decode merge counters; MLA plans row blocks itself)
        return self.spec.num_kv_heads

    def _workspace_need(self) -> int:
        return self.workspace_bytes(self.spec, self.num_ctas, self.kernel.backend)

    @staticmethod
    def workspace_bytes(spec: AttentionSpec, num_ctas: int, backend: str = "mma") -> int:
        """Two partial (o, lse) slots of one row block per persistent CTA."""
        return 2 * num_ctas * rows_per_cta(spec.num_qo_heads, spec.pipeline, backend) * (MLA_HEAD_DIM_VO + 1) * 4

    def default_sm_scale(self) -> float:
        return DEEPSEEK_SM_SCALE

    def _plan_stream(self, kv_begin, kv_end, row_blocks: int) -> scheduler.StreamPlan:
        """R / S items per request over num_ctas // S spans, S = the row blocks run side by side
        (MLADecodeKernel.side_blocks): CTA c runs side c % S of span c // S
        (templates/mla_decode.cu.jinja), so those row blocks read the same tokens at the same time. Equal
        requests plan spans on item boundaries, as decode does: cut into equal chunks, or several whole
        to a span where they outnumber the CTAs, if that lengthens a span by less than MLA_ALIGN_SLACK
        (the transposed wgmma kernel: MLA_TRANSPOSED_ALIGN_SLACK; the 64-row wgmma kernels and the
        transposed one from 16 heads: MLA_WIDE_ALIGN_FRACTION of the span)."""
        side = self.kernel.side_blocks(row_blocks)
        # the wgmma kernels: MLA_WIDE_ALIGN_FRACTION of the span, for the 64-row blocks and the transposed
        # kernel from 16 heads (h16 B128 L4096 -10%, B64 L8192 -3%; at 8 heads B16 L65536 lost 0.9%: its
        # 128 equal chunks left 4 SMs idle; thirty-sixth session)
        k = self.kernel
        transposed_wgmma = k.backend == "wgmma" and k.spec.pipeline == "transposed"
        wide = self.align_slack is None and k.backend == "wgmma" and (
            k.rows >= 64 or (transposed_wgmma and k.spec.num_qo_heads >= 16))
        slack = self.align_slack if self.align_slack is not None else (
            MLA_TRANSPOSED_ALIGN_SLACK if transposed_wgmma else MLA_ALIGN_SLACK)
        tile = k.tiling[0] if ALIGN_CUTS_TO_TILES and k.backend == "wgmma" else 0
        return scheduler.plan_stream(kv_begin, kv_end, row_blocks // side, self.num_ctas // side,
                                     align_equal_items=True, whole_items_per_span=True, align_slack=slack,
                                     align_fraction=MLA_WIDE_ALIGN_FRACTION if wide else 0.0,
                                     align_tile=tile if self.align_tile is None else self.align_tile)

    def plan(self, kv_indptr=None, kv_indices=None, kv_last_page_len=None, *, page_size: Optional[int] = None,
             q_len: int = 1, seq_lens=None, block_table=None, sm_scale: Optional[float] = None,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """As BatchDecode.plan, plus q_len: query tokens per request (1..max_q_len).
        sm_scale defaults to DeepSeek's 1/sqrt(192)."""
        self._check_q_len(q_len)
        table, page_size = self._page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, seq_lens, block_table)
        previous = self.kernel
        self._pick_kernel(table.batch_size, q_len)
        try:
            self._commit_plan(table, page_size, self.kernel.row_blocks(q_len), q_len, sm_scale, k_scale, v_scale)
        except Exception:
            self.kernel = previous  # a refused plan (a graph's batch size changed) keeps the last plan's kernel
            raise
        if self.use_cuda_graph:  # the launch shape is captured: chosen at the first plan (its batch is fixed)
            if self._graph_lanes is None:
                side = self.kernel.side_blocks(self.kernel.row_blocks(q_len))
                self._graph_lanes = graph_merge_lanes(self._plan["batch"], self.kernel.row_blocks(q_len) // side,
                                                      self.num_ctas // side)
            self._plan["merge_lanes"] = self._graph_lanes
        else:
            self._plan["merge_lanes"] = merge_lanes(self._plan["work"])
        # Outside graphs the merge launches only when some item is split (equal requests often are not:
        # several whole ones a span); a captured graph keeps one launch sequence for every plan.
        self._plan["merge"] = self.use_cuda_graph or self._plan["any_split"]

    def _partial_scale_ptr(self) -> int:
        """Row scales of 16-bit partial states (MLADecodeKernel.partial_16bit), one float per partial row as
        the LSEs: in the upper half of the partial outputs' region, which fp16 rows leave free."""
        return self._partial_o.data_ptr() + self._partial_o.numel() * 2

    def _any_split(self, work) -> bool:  # the merge kernel's early exit (StreamMeta.any_split)
        return scheduler.has_split_items(work)

    # -- run -----------------------------------------------------------------------------------------
    def _check_q(self, name: str, t: torch.Tensor, dim: int) -> None:
        s, rows = self.spec, self._plan["batch"] * self._plan["q_len"]
        checks.check_cuda(name, t, self.device)
        checks.check_dtype(name, t, (checks.TORCH_DTYPES[s.q_dtype],))
        checks.check_shape(name, t, (rows, s.num_qo_heads, dim), "[batch * q_len, num_heads, dim]")
        checks.check_contiguous_last(name, t)
        if t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            raise checks.fail(name, "16-byte aligned rows", f"strides {t.stride()}", f"Call {name}.contiguous().")

    def _split_latent_cache(self, ckv: torch.Tensor, kpe: Optional[torch.Tensor]):
        """(ckv address, kpe address, ckv strides, kpe strides, pages) of a checked latent cache (run() checks the
        plan's page ids against the pages)."""
        s, ps = self.spec, self._plan["page_size"]
        parts = (("kv_cache", ckv, MLA_HEAD_DIM_QK),) if kpe is None else \
            (("ckv_cache", ckv, MLA_HEAD_DIM_VO), ("kpe_cache", kpe, ROPE_DIM))
        for name, t, width in parts:
            checks.check_cuda(name, t, self.device)
            checks.check_dtype(name, t, (checks.TORCH_DTYPES[s.kv_dtype],))
            checks.check_shape(name, t, (None, ps, width), f"[pages, page_size={ps}, {width}]")
            checks.check_contiguous_last(name, t)
            if (t.stride(0) * t.element_size()) % 16 or (t.stride(1) * t.element_size()) % 16 or t.data_ptr() % 16:
                raise checks.fail(name, "16-byte aligned token rows", f"strides {t.stride()}",
                                  f"Call {name}.contiguous().")
        pages = min(t.shape[0] for _, t, _ in parts)
        if kpe is None:  # one [P, page, 576] cache: the rope part starts 512 elements into each row
            return ckv.data_ptr(), ckv.data_ptr() + MLA_HEAD_DIM_VO * ckv.element_size(), ckv.stride()[:2], \
                ckv.stride()[:2], pages
        return ckv.data_ptr(), kpe.data_ptr(), ckv.stride()[:2], kpe.stride()[:2], pages

    def _cache_args(self, ckv: torch.Tensor, kpe: Optional[torch.Tensor]) -> tuple:
        """The params a checked latent cache sets (addresses, strides, TMA maps; plain values: RunMemo), and its
        pages."""
        ckv_ptr, kpe_ptr, ckv_strides, kpe_strides, pages = self._split_latent_cache(ckv, kpe)
        return {"ckv_cache": ckv_ptr, "kpe_cache": kpe_ptr, "ckv_stride_page": ckv_strides[0],
                "ckv_stride_token": ckv_strides[1], "kpe_stride_page": kpe_strides[0],
                "kpe_stride_token": kpe_strides[1],
                **self.kernel.tma_values(*self._latent_views(ckv, kpe), self._plan["page_size"])}, pages

    def _params_template(self, cache_fields: tuple) -> codegen.ParamsTemplate:
        """The plan's launch parameters (RunMemo.once): all but a run's tensors, strides, cache fields and
        modifier values."""
        q_len, k = self._plan["q_len"], self.kernel
        return k.params.template(
            self._per_run(RUN_FIELDS + cache_fields), **self._plan_fields(), partial_scale=self._partial_scale_ptr(),
            page_size=self._plan["page_size"], q_len=q_len, num_row_blocks=k.row_blocks(q_len),
            side_blocks=k.side_blocks(k.row_blocks(q_len)), v_scale=self._plan["v_scale"],
            **variants.variant_values(self.spec, self._plan["sm_scale"]))

    @staticmethod
    def _latent_views(ckv: torch.Tensor, kpe: Optional[torch.Tensor]):
        """(latent [P, page, 512], rope [P, page, 64]): the two caches, or views of the one 576-wide cache."""
        return (ckv, kpe) if kpe is not None else (ckv[..., :MLA_HEAD_DIM_VO], ckv[..., MLA_HEAD_DIM_VO:])

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False):
        """q_nope [B*q_len, H, 512], q_pe [B*q_len, H, 64]; ckv_cache [P, page, 512] with kpe_cache
        [P, page, 64], or one [P, page, 576] cache. Returns out [B*q_len, H, 512] (and lse
        [B*q_len, H] float32, natural log, if return_lse). Under torch.compile: one custom op (attnforge.ops)."""
        checks.check_untracked("BatchMLADecode.run", ("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache),
                               ("kpe_cache", kpe_cache), ("out", out), ("lse", lse))
        if ops.compiling():
            caches = [ckv_cache] + ([] if kpe_cache is None else [kpe_cache])
            return ops.compiled_run(self, self._plan is not None, [q_nope, q_pe, *caches], out, lse, return_lse)
        if self._plan is None:
            raise RuntimeError("BatchMLADecode.run: call plan(...) first (once per batch, outside graph capture).")
        s, b, q_len, memo = self.spec, self._plan["batch"], self._plan["q_len"], self._memo
        memo.get("q", (q_nope, q_pe), lambda: (self._check_q("q_nope", q_nope, MLA_HEAD_DIM_VO),
                                               self._check_q("q_pe", q_pe, ROPE_DIM)), b * q_len)
        cache, pages = memo.get("kv", (ckv_cache, kpe_cache), lambda: self._cache_args(ckv_cache, kpe_cache),
                                self._plan["page_size"])
        paged.check_page_bound(self._plan["max_page"], pages, "the latent cache")
        self._captured.note(self.use_cuda_graph, pages)
        out, lse = checks.output_buffers(out, lse, return_lse, (b * q_len, s.num_qo_heads, MLA_HEAD_DIM_VO),
                                         checks.TORCH_DTYPES[s.out_dtype], self.device,
                                         "[batch * q_len, num_heads, 512]", "[batch * q_len, num_heads]", memo)
        lib = memo.once("lib", lambda: registry.get_library(self.kernel, self.kernel.module, self.device))
        mod_values = s.score_mod.param_values(self.device) if s.score_mod is not None else {}
        params = memo.once("params", lambda: self._params_template(tuple(cache))).fill(
            q_nope=q_nope.data_ptr(), q_pe=q_pe.data_ptr(), out=out.data_ptr(),
            lse=0 if lse is None else lse.data_ptr(),
            q_nope_stride_t=q_nope.stride(0), q_nope_stride_h=q_nope.stride(1), q_pe_stride_t=q_pe.stride(0),
            q_pe_stride_h=q_pe.stride(1), out_stride_t=out.stride(0), out_stride_h=out.stride(1), **cache,
            **mod_values)
        with on_device(self.device):
            self._upload.order_run()  # (after a plan copied on another stream)
            lib["mla_decode_kernel"].launch((self.num_ctas,), (self.kernel.threads,), params,
                                            smem=self.kernel.smem_bytes, pdl=self.pdl)
            if self._plan["merge"]:  # (else every item is whole: the decode kernel wrote out and lse itself)
                self._launch_merge(lib, params)  # (a graph's plans keep its batch and q_len: plan() checks)
        return (out, lse) if return_lse else out

    @staticmethod
    def _op_run_args(args: list) -> tuple:  # (attnforge::run) q_nope, q_pe, ckv[, kpe]
        return (*args[:3], args[3] if len(args) == 4 else None)

    def merge_launch(self) -> tuple[str, tuple, tuple, int]:
        """The planned merge's (kernel, grid, block, dynamic shared memory): a block of two rows, or with lanes
        one row per MERGE_DIM_SPLIT blocks, its chunks split over `lanes` thread groups; the one-wave kernel
        where the grid fits one block an SM (merge_kernel_name)."""
        rows = self._plan["batch"] * self._plan["q_len"] * self.spec.num_qo_heads
        lanes = self._plan["merge_lanes"]
        if lanes == 1:
            grid, block, smem = (-(-rows // 2),), (MLA_HEAD_DIM_VO // 4, 2), 0
        else:
            grid, block = (rows, MERGE_DIM_SPLIT), (MLA_HEAD_DIM_VO // 4 // MERGE_DIM_SPLIT, 1, lanes)
            smem = lanes * (MLA_HEAD_DIM_VO + 4) * 4
        return merge_kernel_name(math.prod(grid), self.num_sms), grid, block, smem

    def _launch_merge(self, lib, params) -> None:
        # the merge waits for the decode kernel's grid in-kernel (PDL): its launch hides under the decode's tail
        name, grid, block, smem = self.merge_launch()
        lib[name].launch(grid, block, params, smem=smem, pdl=True)

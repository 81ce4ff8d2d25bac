"""Batch prefill: plan/run over ragged, dense or paged KV; plus the one-shot `attention` API.

    w = BatchPrefill(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, causal=True)
    w.plan(qo_indptr, kv_indptr)                     # ragged K/V: kv_indptr counts tokens
    out = w.run(q, (k, v))                           # q [Nq, 32, 128], k/v [Nk, 8, 128]
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size=16)   # paged KV
    out = w.run(q, kv_cache)
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from . import blockmask, checks, codegen, ops, paged, scheduler, variants
from .jit import registry
from .jit.upload import HostOnlyUpload, StagedUpload
from .jit.loader import on_device
from .kernels.prefill import PrefillKernel, default_backend, split_dims
from .merge import MergeSpec, merge_states
from .spec import AttentionSpec

RAGGED_PAGE = 1 << 30  # ragged KV is one "page" per request (PagedKV.token_base holds its start)
MIN_UPLOAD_INT32 = 1 << 14  # the first upload buffers' size (64 KB each): most plans never grow them
# graph mode's regions: the fixed-size ones first, so that one copy covers them with the used part of `work`
# (the whole capacity, ~6.3 MB at the defaults, was copied every plan: ~0.25 ms of the stream at ~25 GB/s)
GRAPH_REGIONS = ("num_work", "qo_indptr", "q_offset", "kv_indptr", "kv_len", "kv_offset", "work", "kv_indices",
                 "kv_tile_indptr", "kv_tiles")
# plan()'s int32 arrays in the order it packs them, then the count graph mode reads from the device
PLAN_ARRAYS = ("qo_indptr", "q_offset", "kv_indptr", "kv_indices", "kv_len", "kv_offset", "work", "kv_tile_indptr",
               "kv_tiles", "num_work")


class BatchPrefill:
    """use_cuda_graph=True: plan() writes into buffers sized at construction (max_* capacities), the
    grid covers max_work_items and idle CTAs exit, so a graph captured once replays any later plan
    with the same page size and scale."""

    def __init__(self, spec: Optional[AttentionSpec] = None, *, device=None, use_cuda_graph: bool = False,
                 max_batch_size: int = 256, max_work_items: int = 1 << 16, max_num_pages: int = 1 << 16,
                 max_tiles: int = 1 << 20, backend: Optional[str] = None, num_stages: Optional[int] = None,
                 kv_tile: Optional[int] = None, producer: Optional[bool] = None, pingpong: bool = False,
                 split_kv: bool = True, persistent: Optional[bool] = None, work_order: str = "grouped",
                 tma: Optional[bool] = None, fma_exp_every: Optional[int] = None, m_tiles: Optional[int] = None,
                 fp8_stages: Optional[int] = None, fp8_int_widen: bool = False, k_ahead: Optional[bool] = None,
                 float_out: bool = False, exact_max: bool = False, **spec_kwargs):
        if spec is None:
            spec = AttentionSpec(family="prefill", **spec_kwargs)
        elif spec_kwargs:
            raise TypeError(f"BatchPrefill: pass either a spec or keyword arguments (extra {sorted(spec_kwargs)})")
        checks.check_spec("BatchPrefill", spec, "prefill", "Use the matching wrapper.")
        # backend: "wgmma" (Hopper) or "mma" (portable); None picks the best that applies here.
        # num_stages / kv_tile / producer / pingpong / persistent override the kernel's defaults
        # (kernels/prefill.py); persistent: one CTA per SM walks the work list (None: wherever the
        # kernel has a producer and no ping-pong, where it measured faster); tma: whole K/V tiles
        # copied by the copy engine (None: ragged K/V and pages of 8+ tokens that tile the KV tile,
        # where it measured faster; with fp8 K/V ragged K/V only, at head_dim 128, on a twin kernel that
        # plan() picks; True: wherever the tensors qualify; False: cp.async only). fma_exp_every: every Nth
        # exponential of the softmax on the FMA pipe (None: as measured, by head_dim and whether a
        # function of the score such as soft-cap's tanh shares the SFU; kernels/prefill.py). m_tiles: the
        # mma kernel's m16 row tiles a warp (None: as measured, kernels.prefill.mma_m_tiles). fp8_stages /
        # fp8_int_widen: fp8 K/V on the wgmma kernel, its staging slots and how its producer widens. k_ahead:
        # with values narrower than keys, the producer copies K(t+1) before V(t) (None: on there).
        # split_kv: cut KV ranges longer than a fair share of the GPU into chunks merged by LSE (few
        # query tiles against long KV, e.g. a cascade's shared prefix); never in CUDA-graph mode (the
        # partial buffers would change size between plans) nor with a row epilogue that must see the
        # whole row: an attention sink joins the denominator once, an output transform (raw C++) may
        # not commute with the merge.
        # work_order: the launch order of work items (scheduler.order_prefill_work); "grouped" measured
        # +2-13% over "longest_first" on the H200's contiguous cases (docs/perf-notes.md).
        # exact_max: the wgmma kernel's row max moves with every new maximum instead of lagging up to 2^8, so a
        # peaked row's dominant weight is exactly 1 (the lag measured 1.2-3% faster on the H200; the mma kernel's
        # max is always exact)
        # float_out: rows written as float32 instead of the spec's out_dtype (the split plans' twin kernel), for
        # callers that merge them with other attention states (CascadeDecode's levels)
        for name, value in (("use_cuda_graph", use_cuda_graph), ("pingpong", pingpong), ("split_kv", split_kv),
                            ("fp8_int_widen", fp8_int_widen), ("float_out", float_out),
                            ("exact_max", exact_max)):
            checks.check_flag("BatchPrefill", name, value)
        for name, value in (("producer", producer), ("persistent", persistent), ("tma", tma), ("k_ahead", k_ahead)):
            checks.check_flag("BatchPrefill", name, value, optional=True)
        for name, value in (("max_batch_size", max_batch_size), ("max_work_items", max_work_items),
                            ("max_num_pages", max_num_pages), ("max_tiles", max_tiles)):
            checks.check_count("BatchPrefill", name, value)
        if work_order not in scheduler.WORK_ORDERS:
            raise checks.fail("BatchPrefill(work_order=...)", f"one of {scheduler.WORK_ORDERS}", repr(work_order),
                              "'grouped' keeps each (request, kv head)'s items together for L2 reuse.")
        self.work_order = work_order
        self.spec = spec
        mod = spec.score_mod
        row_epilogue = mod is not None and (mod.sink is not None or any(
            flag in (mod.raw_cpp or "") for flag in ("kHasSink", "kHasOutputTransform")))
        self.split_kv = split_kv and not use_cuda_graph and not row_epilogue
        backend = default_backend(spec) if backend is None else backend  # (a falsy 0 or "" is refused, not the default)
        self.kernel = PrefillKernel(spec, backend, num_stages, kv_tile, producer, pingpong,
                                    persistent, tma, fma_exp_every, m_tiles, fp8_stages, fp8_int_widen, k_ahead,
                                    exact_max=exact_max)
        # the kernel a plan runs, by its KV kind (ragged or paged) and whether it splits KV: self.kernel, or a twin
        # for one kind, or that kernel's twin that writes float32 rows (PrefillKernel.for_partials): a split plan's
        # partial states, or every plan's rows with float_out
        self.float_out = float_out
        self.out_dtype = torch.float32 if float_out else checks.TORCH_DTYPES[spec.out_dtype]  # run()'s rows
        self._kernels = {(ragged, split): self.kernel.for_kv(ragged).for_partials() if split or float_out else
                         self.kernel.for_kv(ragged) for ragged in (False, True) for split in (False, True)}
        self.device = checks.cuda_device(device, "BatchPrefill", host_ok=True)
        self._plan = None
        self._captured = paged.CapturedPages()  # (use_cuda_graph: the captured caches' pages bound each plan)
        self._upload = None  # plan()'s staged uploads outside graph mode (made by the first plan)
        self._num_sms = None
        self._memo = checks.RunMemo()  # run()'s checked inputs and the plan's params template
        ops.handle(self)  # (its name in compiled graphs: attnforge.ops)
        self.use_cuda_graph = use_cuda_graph
        self.capacity = {"batch": max_batch_size, "work": max_work_items, "pages": max_num_pages, "tiles": max_tiles}
        if use_cuda_graph:  # fixed regions (a captured launch keeps their addresses): (name, int32 entries)
            b, w = max_batch_size, max_work_items
            caps = dict(zip(PLAN_ARRAYS, (b + 1, b, b + 1, max(max_num_pages, 1), b, b, 6 * w, w + 1, max(max_tiles, 1),
                                          1)))
            self._regions = [(name, caps[name]) for name in GRAPH_REGIONS]
            self._staged_upload(sum(-(-n // 4) * 4 for _, n in self._regions))

    def plan(self, qo_indptr, kv_indptr=None, kv_indices=None, kv_last_page_len=None, *,
             page_size: Optional[int] = None, seq_lens=None, block_table=None, sm_scale: Optional[float] = None,
             q_offset=None, kv_offset=None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Ragged KV when only kv_indptr is given (it then counts tokens), else a paged KV table: the CSR arrays
        (kv_indptr, kv_indices, kv_last_page_len) or vLLM's form (seq_lens= KV lengths [B], block_table= [B,
        max_pages]), as BatchDecode.plan takes them.
        k_scale / v_scale: the per-tensor scales of an fp8 cache (K = k_scale * stored K, likewise V);
        k_scale folds into sm_scale, v_scale scales each output row (16-bit K/V take v_scale 1 only)."""
        v_scale = self._check_scales(k_scale, v_scale, sm_scale)
        qo = paged.host_int_array("qo_indptr", qo_indptr)
        qo_len = qo[1:] - qo[:-1] if qo.ndim == 1 else None  # (np.diff costs 3x this in Python overhead)
        if qo_len is None or len(qo) < 1 or qo[0] != 0 or np.minimum.reduce(qo_len, initial=0) < 0:
            raise checks.fail("qo_indptr", "a non-decreasing 1-D array [B+1] starting at 0", paged.preview(qo),
                              "Build it as the prefix sum of query lengths.")
        if int(qo[-1]) * self.spec.group_size >= 2**31:  # (before the work items, whose first packed rows are int32:
            # 2^33 tokens asked numpy for 48 GiB of them)
            if qo[-1] >= 2**31:
                raise checks.fail("qo_indptr[-1]", "fewer than 2^31 query tokens in one plan", int(qo[-1]),
                                  "Split the batch into smaller plans (the kernels read these arrays as int32).")
            raise checks.fail("qo_indptr[-1] x group size", f"fewer than 2^31 packed query rows in one plan (tokens "
                              f"x {self.spec.group_size} query heads a KV head)", int(qo[-1]) * self.spec.group_size,
                              "Split the batch into smaller plans (the kernels read these arrays as int32).")
        b = len(qo_len)
        vllm_form = seq_lens is not None or block_table is not None
        if kv_indices is None and not vllm_form:
            if kv_indptr is None:
                raise TypeError("plan: expected kv_indptr (ragged K/V: token offsets), the page table's CSR arrays "
                                "or seq_lens= and block_table=, got none of them. Pass the keys' layout.")
            kvp = paged.host_int_array("kv_indptr", kv_indptr)
            kv_len = kvp[1:] - kvp[:-1] if kvp.shape == (b + 1,) else None
            if kv_len is None or kvp[0] != 0 or np.minimum.reduce(kv_len, initial=0) < 0:
                raise checks.fail("kv_indptr", f"a non-decreasing array [{b + 1}] starting at 0 (token offsets)",
                                  paged.preview(kvp), "For paged KV also pass kv_indices and kv_last_page_len.")
            ragged, indices, page = True, np.zeros(1, dtype=np.int64), RAGGED_PAGE
            kv_off = kvp[:-1] if kv_offset is None else paged.host_int_array("kv_offset", kv_offset)
            max_page = -1
        elif split_dims(self.spec):
            raise checks.fail("plan(kv_indices= or block_table=)", "ragged K/V (no page table) for head_dim_vo "
                              f"{self.spec.head_dim_vo} < head_dim_qk {self.spec.head_dim_qk}", "a page table",
                              "Narrower values run on ragged K/V only: gather the pages into k [tokens, Hkv, "
                              "head_dim_qk] and v [tokens, Hkv, head_dim_vo] (DeepSeek's prefill computes them).")
        else:
            page = page_size if page_size is not None else self.spec.page_size
            if page is None:
                raise checks.fail("plan(page_size=...)", "an int >= 1 for a paged KV cache", None,
                                  "Pass the cache's tokens per page.")
            table = paged.from_either_form(kv_indptr, kv_indices, kv_last_page_len, seq_lens, block_table, page)
            if table.batch_size != b:
                what, n = ("seq_lens", f"{b} entries") if vllm_form else ("kv_indptr", f"{b + 1} entries")
                raise checks.fail(what, f"{n} (same batch as qo_indptr)", table.batch_size + (0 if vllm_form else 1),
                                  "Pass one page range per request.")
            kv_len, ragged, indices, kvp = table.kv_len, False, table.indices, table.indptr
            kv_off, max_page = np.zeros(b, dtype=np.int64), table.max_page_index
            self._captured.check(max_page)
        q_off = qo[:-1] if q_offset is None else paged.host_int_array("q_offset", q_offset)
        tile_q, tile_kv = self.kernel.tile_q, self.kernel.tile_kv
        # Work: one CTA per (request, kv head, tile_q packed query rows); the longest KV range first.
        work, cost = scheduler.prefill_work(qo_len, kv_len, self.spec.group_size, self.spec.num_kv_heads, tile_q,
                                            self.spec.causal)
        tile_indptr = tile_ids = None
        mod = self.spec.score_mod
        if mod is not None and mod.mask_root is not None:  # block-sparse: visit only tiles with a visible pair
            checks.require_gpu(self.device, "BatchPrefill")  # (the mask is evaluated on the wrapper's device)
            tile_indptr, tile_ids = blockmask.tile_lists(mod, self.spec, qo_len, kv_len, work, tile_q, tile_kv,
                                                         self.device)
            cost = blockmask.item_costs(tile_indptr, tile_kv)  # KV tokens: the fixed cost below is in tokens
        split = self._split(work, cost, qo_len, kv_len, tile_indptr is None)
        work, num_slots = split.work, split.num_slots
        if split.chunk:  # the chunks' own lengths now order them
            cost = work[:, 4] - work[:, 3]
        if (len(work) >= scheduler.GROUPED_BY_TILES_MIN and self.work_order == "grouped" and not split.chunk
                and tile_indptr is None):  # prefill_work's items as they came: by tiles
            heads = self.spec.num_kv_heads
            order = scheduler.grouped_order_by_tiles(scheduler.prefill_tiles(qo_len, self.spec.group_size, tile_q),
                                                     cost[::heads], heads)
        else:
            order = scheduler.order_prefill_work(work, cost, self.work_order)
        if self.kernel.persistent:  # CTA b runs positions b, b + grid, ...: balance each round of them
            fixed = scheduler.PREFILL_ITEM_FIXED_COST * tile_q
            order = order[scheduler.balance_persistent_rounds(cost[order] + fixed, self._grid(len(work)))]
        work = np.take(work.astype(np.int32), order, axis=0)  # (take: ~3.5x a fancy index of rows; narrowed first,
        # it moves half the bytes)
        if tile_indptr is not None:  # reorder the lists with their work items
            counts = np.diff(tile_indptr)[order]
            starts = tile_indptr[:-1][order]
            tile_ids = np.concatenate([tile_ids[a:a + n] for a, n in zip(starts, counts)]) if len(order) else tile_ids
            tile_indptr = np.concatenate([[0], np.cumsum(counts)])
        parts = [qo, q_off, kvp, indices, kv_len, kv_off, work.ravel()]
        if tile_indptr is not None:
            parts += [tile_indptr, tile_ids if len(tile_ids) else np.zeros(1, dtype=np.int64)]
        flat = np.concatenate(parts)  # (int64: every part is an integer array; one range check, not one a part)
        if work.size < 8192:  # (a short plan: one pass costs less than finding the work items' extent)
            largest = int(np.abs(flat).max())
        else:  # skip the work items, six values an item: int32 already, each a request, head, row or KV bound of the
            # arrays checked here (a long plan's ~100K values: ~30 us)
            head = len(qo) + len(q_off) + len(kvp) + len(indices) + len(kv_len) + len(kv_off)
            largest = int(np.abs(flat[:head]).max())
            if tile_indptr is not None:
                largest = max(largest, int(np.abs(flat[head + work.size:]).max()))
        if largest >= 2**31:
            raise checks.fail("plan: offsets, lengths and page ids", "values that fit in int32 (< 2^31)", largest,
                              "Split the batch into smaller plans (the kernels read these arrays as int32).")
        d = self.spec.head_dim_qk
        scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * float(k_scale)
        if self.use_cuda_graph:
            ptrs, host, dev = self._fill_graph_buffers(parts, tile_indptr is not None, len(work), int(page), scale,
                                                       ragged, v_scale)
        else:
            upload = self._staged_upload(len(flat))
            host = upload.stage([(0, flat)])[:len(flat)]  # (waits for that buffer's copy of two plans ago)
            dev = upload.dev
            ptrs, at = dict.fromkeys(PLAN_ARRAYS, 0), dev.data_ptr()  # (absent arrays: null)
            for name, part in zip(PLAN_ARRAYS, parts):
                ptrs[name], at = at, at + 4 * len(part)
        self._plan = {"batch": b, "total_q": int(qo[-1]), "ragged": ragged, "kv_tokens": int(kv_len.sum()),
                      "page_size": int(page), "max_page": max_page, "kv_len": kv_len, "num_work": len(work),
                      "dev": dev, "host": host, "ptrs": ptrs, "sm_scale": scale, "v_scale": v_scale,
                      "num_slots": num_slots, "kernel": self._kernels[ragged, num_slots > 1],
                      "grid": self._grid(len(work))}
        self._memo.new_plan()

    def _staged_upload(self, num_int32: int) -> StagedUpload:
        """The plan's upload buffers, grown (doubling) when a plan outgrows them; a CPU device plans
        host-only (tests, host-cost timing): its 'device' buffer is host memory."""
        upload = self._upload
        if upload is None or upload.dev.numel() < num_int32:
            size = max(num_int32, 2 * upload.dev.numel() if upload is not None else MIN_UPLOAD_INT32)
            if upload is not None:
                upload.drain()  # its pinned buffers go back to torch's allocator: no copy may still read them
            cpu = self.device.type == "cpu"
            checks.require_gpu(self.device, "BatchPrefill")
            upload = self._upload = HostOnlyUpload(size) if cpu else StagedUpload(size, self.device)
        return upload

    def _grid(self, num_work: int) -> int:
        """CTAs to launch: one per item, or (persistent) one per resident slot; graph mode sizes for
        the capacity and the kernel reads the planned count from device memory."""
        if self.kernel.persistent:
            slots = self._sms() * self.kernel.ctas_per_sm
            return slots if self.use_cuda_graph else max(1, min(num_work, slots))
        return self.capacity["work"] if self.use_cuda_graph else num_work

    def _split(self, work, cost, qo_len, kv_len, splittable: bool) -> scheduler.PrefillSplit:
        """Work items [N, 6] with their KV chunk and partial slot (scheduler.split_prefill_work)."""
        s, k = self.spec, self.kernel
        if not (self.split_kv and splittable):
            return scheduler.unsplit_prefill_work(work)
        if s.window_left >= 0:  # the first KV token the item's first row may see
            req = work[:, 0]
            kv_lo = np.maximum(0, kv_len[req] - qo_len[req] + work[:, 2] // s.group_size - s.window_left)
        else:
            kv_lo = None  # (every range from 0)
            # prefill_work's items: each tile's heads in turn, the same range (short plans: the test over every item
            # costs no more)
            if len(work) >= scheduler.GROUPED_BY_TILES_MIN and scheduler.prefill_items_fit_one_share(
                    cost[::s.num_kv_heads], s.num_kv_heads, k.tile_q, k.tile_kv, self._sms() * k.ctas_per_sm):
                return scheduler.unsplit_prefill_work(work)
        return scheduler.split_prefill_work(work, cost, kv_lo, k.tile_q, k.tile_kv, self._sms() * k.ctas_per_sm)

    def launchable_kernels(self) -> tuple:
        """Every kernel spec a plan of this wrapper may launch: the kernel for paged and for ragged K/V (one, or a
        twin: PrefillKernel.for_kv) and, where plans split KV, their float32-partials twins and the merge of the
        partial states."""
        kernels = tuple(dict.fromkeys(k for (_, split), k in self._kernels.items() if self.split_kv or not split))
        return kernels + ((MergeSpec(torch.float32, self.out_dtype),) if self.split_kv else ())

    def load_kernels(self) -> tuple[str, ...]:
        """Build (where the cache lacks them) and load on this wrapper's GPU every kernel its plans may launch;
        returns their module names (BatchDecode.load_kernels: call it at start-up)."""
        return registry.load_all(self.launchable_kernels(), self.device)

    def _sms(self) -> int:
        """The device's SM count, asked once (up to three times a plan otherwise; not at construction,
        which a machine without a GPU runs too)."""
        if self._num_sms is None:
            checks.require_gpu(self.device, "BatchPrefill")
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._num_sms

    def _check_scales(self, k_scale, v_scale, sm_scale=None) -> float:
        """The plan's v_scale, after checking the scales (checks.check_plan_scales); v_scale 1 for 16-bit K/V
        (only the fp8 kernel carries it: scale V itself, or pass sm_scale for K)."""
        checks.check_plan_scales(sm_scale, k_scale, v_scale)
        if not self.kernel.fp8_kv and v_scale != 1.0:
            raise checks.fail("plan(v_scale=...)", f"1.0 for {self.spec.kv_dtype} K/V", v_scale,
                              "Scales belong to an fp8 cache (kv_dtype='fp8_e4m3'); scale V itself here.")
        return float(v_scale)

    def _fill_graph_buffers(self, parts, has_tiles: bool, num_work: int, page: int, scale: float, ragged: bool,
                            v_scale: float):
        """Write the plan into the fixed regions (graph mode) of a staged buffer and copy what it filled."""
        first = getattr(self, "_graph_fixed", None)
        fixed = (page, scale, ragged, has_tiles, v_scale)
        if first is not None and first != fixed:
            raise checks.fail("plan in CUDA-graph mode",
                              f"page_size, sm_scale*k_scale, KV kind, mask and v_scale as captured {first}",
                              fixed, "Capture one graph per configuration (these are baked into the launch).")
        # what the plan needs against each capacity (every region then fits: they are sized from these)
        needs = {"batch": (len(parts[0]) - 1, "requests", "max_batch_size"),
                 "work": (num_work, "work items", "max_work_items"),
                 "pages": (0 if ragged else len(parts[3]), "page ids", "max_num_pages"),
                 "tiles": (len(parts[8]) if has_tiles else 0, "KV tiles (block mask)", "max_tiles")}
        for key, (need, what, arg) in needs.items():
            if need > self.capacity[key]:
                raise checks.fail(f"plan in CUDA-graph mode: {what}", f"at most {arg}={self.capacity[key]}", need,
                                  f"Construct BatchPrefill with a larger {arg} (the buffers a graph captures are "
                                  "sized at construction).")
        self._graph_fixed = fixed
        values = dict(zip(PLAN_ARRAYS, parts))
        values["num_work"] = np.array([num_work])
        upload, ptrs, pieces, off = self._upload, {}, [], 0
        for name, n in self._regions:
            v = values.get(name)
            if v is not None:
                pieces.append((off, v))
            ptrs[name] = upload.dev.data_ptr() + 4 * off if v is not None else 0
            off += -(-n // 4) * 4
        if not has_tiles:
            ptrs["kv_tile_indptr"] = ptrs["kv_tiles"] = 0
        host = upload.stage(pieces)  # (waits for that buffer's copy of two plans ago; copies only what it filled)
        return ptrs, host[:off], upload.dev

    # -- run -----------------------------------------------------------------------------------------
    def _q_fields(self, q: torch.Tensor) -> dict:
        """q's params after its checks (strides, TMA map; plain values: RunMemo)."""
        s, pl = self.spec, self._plan
        checks.check_cuda("q", q, self.device)
        checks.check_dtype("q", q, (checks.TORCH_DTYPES[s.q_dtype],))
        if self.use_cuda_graph:  # captured buffers are sized for the largest plan; extra rows are untouched
            checks.check_shape("q", q, (None, s.num_qo_heads, s.head_dim_qk), "[rows >= total_q, Hq, D]")
            if q.shape[0] < pl["total_q"]:
                raise checks.fail("q.shape[0]", f"at least the planned {pl['total_q']} query rows", q.shape[0],
                                  "Size the captured query buffer for the largest plan.")
        else:
            checks.check_shape("q", q, (pl["total_q"], s.num_qo_heads, s.head_dim_qk), "[total_q, Hq, D]")
        checks.check_contiguous_last("q", q)
        checks.check_aligned_rows("q", q)
        return {"q_stride_n": q.stride(0), "q_stride_h": q.stride(1), **pl["kernel"].q_tma_values(q)}

    def _kv_args(self, kv) -> tuple:
        """(K/V params, pages) after the checks: addresses, strides, TMA maps (plain values: RunMemo); run()
        checks a paged plan's page ids against the pages."""
        k, v, stride_page, stride_token, stride_head = self._kv(kv)
        for name, t in (("k", k), ("v", v)):
            checks.check_aligned_rows(name, t)
        pl = self._plan
        v_strides = {"v_stride_token": v.stride(0), "v_stride_head": v.stride(1)} if split_dims(self.spec) else {}
        return {"k_cache": k.data_ptr(), "v_cache": v.data_ptr(), "stride_page": stride_page,
                "stride_token": stride_token, "stride_head": stride_head, **v_strides,
                **pl["kernel"].kv_tma_values(k, v, pl["page_size"], pl["ragged"])}, k.shape[0]

    def _kv(self, kv):
        """-> k, v, stride_page, stride_token, stride_head, after checking them against the plan (a paged
        plan's page ids excepted)."""
        s, pl = self.spec, self._plan
        if not pl["ragged"]:
            return paged.split_cache(s, kv, pl["page_size"], -1, self.device)
        if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
            raise checks.fail("kv", "a (k, v) pair of ragged [tokens, Hkv, D] tensors (planned without kv_indices)",
                              type(kv).__name__, "Or plan with a page table for a paged cache.")
        k, v = kv
        for name, t, d in (("k", k, s.head_dim_qk), ("v", v, s.head_dim_vo)):
            checks.check_cuda(name, t, self.device)
            checks.check_dtype(name, t, (checks.TORCH_DTYPES[s.kv_dtype],))
            checks.check_shape(name, t, (None, s.num_kv_heads, d), "[tokens, Hkv, D]" if not split_dims(s) else
                               f"[tokens, Hkv, {'head_dim_qk' if name == 'k' else 'head_dim_vo'}]")
            checks.check_contiguous_last(name, t)
        if k.shape[0] != v.shape[0] or (not split_dims(s) and k.stride() != v.stride()):
            raise checks.fail("kv", "k and v with equal token counts" + ("" if split_dims(s) else " and strides"),
                              f"{tuple(k.shape)} {k.stride()} vs {tuple(v.shape)} {v.stride()}", "Allocate them alike.")
        if k.shape[0] < pl["kv_tokens"]:
            raise checks.fail("k.shape[0]", f"at least kv_indptr[-1]={pl['kv_tokens']} tokens", k.shape[0],
                              "Pass the whole ragged K/V.")
        return k, v, 0, k.stride(0), k.stride(1)

    def _check_out(self, out: torch.Tensor, shape) -> None:
        checks.check_out(out, tuple(shape), self.out_dtype, self.device, "like q")

    def _dense_fields(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
        """attention()'s contiguous q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D or Dv] as params: one page a request (plain
        values: RunMemo; shapes, dtypes and devices were checked by the caller)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            checks.check_aligned_rows(name, t)
        pl = self._plan
        v_strides = {"v_stride_token": v.stride(2), "v_stride_head": v.stride(1)} if split_dims(self.spec) else {}
        return {"q_stride_n": q.stride(2), "q_stride_h": q.stride(1), "k_cache": k.data_ptr(), "v_cache": v.data_ptr(),
                "stride_page": 0, "stride_token": k.stride(2), "stride_head": k.stride(1), **v_strides,
                **pl["kernel"].q_tma_values(q), **pl["kernel"].kv_tma_values(k, v, pl["page_size"], pl["ragged"])}

    def run(self, q: torch.Tensor, kv, out: Optional[torch.Tensor] = None, return_lse: bool = False):
        """q [total_q, Hq, D] (ragged); kv a ragged (k, v) pair or a paged cache. Returns out [total_q, Hq, Dv]
        (and lse [total_q, Hq] float32, natural log, with return_lse). Under torch.compile: one custom op
        (attnforge.ops). Inputs are checked once per address, shape, strides and dtype under the plan
        (checks.RunMemo)."""
        checks.check_untracked("BatchPrefill.run", ("q", q), ("kv", kv), ("out", out))
        if ops.compiling():
            return ops.compiled_run(self, self._plan is not None, [q, *paged.cache_list(kv)], out, None, return_lse)
        if self._plan is None:
            raise RuntimeError("BatchPrefill.run: call plan(...) first")
        s, pl, memo = self.spec, self._plan, self._memo
        q_fields = memo.get("q", (q,), lambda: self._q_fields(q), pl["total_q"], pl["ragged"])
        kv_fields, pages = memo.get("kv", paged.cache_list(kv), lambda: self._kv_args(kv), pl["ragged"],
                                    pl["page_size"], pl["kv_tokens"])
        if not pl["ragged"]:
            paged.check_page_bound(pl["max_page"], pages)
            self._captured.note(self.use_cuda_graph, pages)
        out_shape = (q.shape[0], s.num_qo_heads, s.head_dim_vo)
        if out is None:
            out = torch.empty(out_shape, dtype=self.out_dtype, device=self.device)
        else:
            memo.get("out", (out,), lambda: self._check_out(out, out_shape), out_shape)
        fields = {**q_fields, **kv_fields}
        slots = pl["num_slots"]
        if slots > 1:  # split KV: partial states [rows, slots, Hq, D] (unwritten slots keep LSE -inf), merged
            n, h, d = out_shape
            part = torch.empty((n, slots, h, d), dtype=torch.float32, device=self.device)  # (rounded once, merged)
            part_lse = torch.full((n, slots, h), -math.inf, dtype=torch.float32, device=self.device)
            self._launch(q, part, part_lse, dict(**fields, out_stride_n=slots * h * d, out_stride_h=d,
                                                 out_stride_slot=h * d, lse_stride_n=slots * h, lse_stride_h=1,
                                                 lse_stride_slot=h))
            merged, lse = merge_states(part, part_lse, out=out if out.is_contiguous() else None, out_dtype=out.dtype)
            if merged is not out:
                out.copy_(merged)
            return (out, lse) if return_lse else out
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device) if return_lse else None
        self._launch(q, out, lse, dict(**fields, out_stride_n=out.stride(0), out_stride_h=out.stride(1),
                                       out_stride_slot=0, lse_stride_n=s.num_qo_heads, lse_stride_h=1,
                                       lse_stride_slot=0))
        return (out, lse) if return_lse else out

    def _op_out_shape(self, args: list):  # (attnforge::run's fake)
        return ops.rows_out_shape(self.spec, args, self.out_dtype)

    def _params_template(self) -> codegen.ParamsTemplate:
        """The plan's launch parameters (RunMemo.once): all but a run's tensors, strides, TMA maps and modifier
        values."""
        pl = self._plan
        kernel = pl["kernel"]  # self.kernel, or its twin for this plan's KV kind (PrefillKernel.for_kv)
        fixed = dict(**pl["ptrs"], page_size=pl["page_size"], ragged=int(pl["ragged"]), work_count=pl["num_work"],
                     **variants.variant_values(self.spec, pl["sm_scale"]),
                     **({"v_scale": pl["v_scale"]} if kernel.fp8_kv else {}))
        return kernel.params.template([f.name for f in kernel.params.fields if f.name not in fixed], **fixed)

    def _launch(self, q, out, lse, fields: dict) -> None:
        """Launch the plan's kernel on q, out, lse and `fields` (the K/V's and the strides' params)."""
        self._launch_filled(self._memo.once("params", self._params_template), q=q.data_ptr(), out=out.data_ptr(),
                            lse=0 if lse is None else lse.data_ptr(), **fields)

    def _dense_template(self, q, k, v, strides: dict, addresses: tuple) -> codegen.ParamsTemplate:
        """The plan's template narrowed by attention()'s q, k, v (their pointers, strides and TMA maps) and by
        the output's strides: a model's repeated calls then set only out, lse and modifier values (~10 us of
        Python less a call than a fill of every per-run field). addresses: q's, k's and v's data pointers, which
        key them here: this wrapper is one call signature's (dense.DenseCall), whose shapes, strides and dtypes
        are fixed, as are the output's strides under one plan."""
        per_plan = self._memo.once("dense templates", dict)  # (a new plan's template starts them over)
        template = per_plan.get(addresses)
        if template is None:
            if len(per_plan) >= checks.RunMemo.MAX_ENTRIES:
                per_plan.clear()
            template = per_plan[addresses] = self._memo.once("params", self._params_template).narrowed(
                q=q.data_ptr(), **self._memo.get("dense", (q, k, v), lambda: self._dense_fields(q, k, v)),
                **strides)
        return template

    def _launch_filled(self, template: codegen.ParamsTemplate, **values) -> None:
        """Launch the plan's kernel with `template` filled by `values` and the modifier's values."""
        s, pl, memo = self.spec, self._plan, self._memo
        kernel = pl["kernel"]
        mod_values = s.score_mod.param_values(self.device) if s.score_mod is not None else {}
        params = template.fill(**values, **mod_values)
        lib = memo.once("lib", lambda: registry.get_library(kernel, kernel.module, self.device))
        with on_device(self.device):
            self._upload.order_run()  # (after a plan copied on another stream)
            lib[kernel.kernel_name].launch((pl["grid"],), (kernel.threads,), params, smem=kernel.smem_bytes)


def single_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   sm_scale: Optional[float] = None, return_lse: bool = False, k_scale: float = 1.0,
                   v_scale: float = 1.0, **spec_kwargs):
    """One request: q [Lq, Hq, D]; k [Lk, Hkv, D], v [Lk, Hkv, Dv] of q's dtype (Dv = D, or narrower: see
    spec.PREFILL_QK_VO_DIMS), or fp8 e4m3 with the cache's per-tensor k_scale / v_scale (the K/V dtype is k's).
    Returns out [Lq, Hq, Dv], and lse [Lq, Hq] with return_lse."""
    checks.check_untracked("single_prefill", ("q", q), ("k", k), ("v", v))
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise checks.fail(f"single_prefill {name}", "a 3-D tensor [tokens, heads, head_dim]",
                              getattr(t, "shape", type(t).__name__), "Batches go through BatchPrefill.")
    for name, t in named:
        checks.check_cuda(name, t, q.device)
    spec = AttentionSpec(family="prefill", num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim_qk=q.shape[2],
                         head_dim_vo=v.shape[2], q_dtype=q.dtype, kv_dtype=spec_kwargs.pop("kv_dtype", k.dtype),
                         causal=causal, **spec_kwargs)
    w = _cached_wrapper(spec, q.device)
    w.plan([0, q.shape[0]], [0, k.shape[0]], sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    return w.run(q, (k, v), return_lse=return_lse)


_WRAPPERS: dict = {}
MAX_WRAPPERS = 64  # single_prefill's wrappers kept (a model has a few specs); past it the table starts over


def _cached_wrapper(spec: AttentionSpec, device, make=None):
    """The wrapper single_prefill (and single_decode: make(spec, device) builds its own) keeps for spec."""
    # specs compare a score modifier by its expression: its identity keys its captured tensors' wrapper (the
    # wrapper holds the modifier, so its id is not reused while the entry lives). Bounded: a caller that builds
    # a modifier a call would otherwise keep every wrapper, its buffers and its modifier's tensors for good.
    key = (spec, str(device), id(spec.score_mod))  # (the spec's family tells decode's wrappers from prefill's)
    w = _WRAPPERS.get(key)
    if w is None:
        if len(_WRAPPERS) >= MAX_WRAPPERS:
            _WRAPPERS.clear()  # (an upload's pinned buffers are held until its copies are done: jit/upload.py)
        w = _WRAPPERS[key] = BatchPrefill(spec, device=device) if make is None else make(spec, device)
    return w

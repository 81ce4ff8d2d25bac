"""Shared test helpers: random paged caches, the tolerance rule, host programs over the headers."""
from __future__ import annotations

import gc
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from attnforge import AttentionSpec, reference
from attnforge.checks import TORCH_DTYPES


def make_paged_case(spec: AttentionSpec, lengths, page_size: int, seed: int = 0, extra_pages: int = 3):
    """Random q and a paged cache with shuffled pages; returns q, cache, (indptr, indices, last), per-request kv."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-L // page_size) for L in lengths]
    total_pages = sum(pages_per) + extra_pages
    perm = torch.randperm(total_pages, generator=g).numpy()
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    indices = perm[: indptr[-1]].astype(np.int32)
    last = np.array([L - (n - 1) * page_size if n else 0 for L, n in zip(lengths, pages_per)], dtype=np.int32)
    hkv, d = spec.num_kv_heads, spec.head_dim_qk
    shape = (total_pages, 2, page_size, hkv, d) if spec.kv_layout == "NHD" else (total_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, generator=g)
    if spec.kv_dtype == "fp8_e4m3":
        cache = (cache * 2).to(torch.float8_e4m3fn)
    cache = cache.to(TORCH_DTYPES[spec.kv_dtype]).cuda()
    q = torch.randn(len(lengths), spec.num_qo_heads, d, generator=g).to(TORCH_DTYPES[spec.q_dtype]).cuda()
    per_request = reference.gather_paged(cache[:, 0].float(), cache[:, 1].float(), spec.kv_layout, indptr,
                                         indices, last, page_size)
    return q, cache, (indptr, indices, last), per_request


def csr_table(lengths, page_size: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host CSR page-table arrays (indptr, indices, last_page_len) for KV lengths, the page ids shuffled."""
    pages = [-(-n // page_size) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.random.default_rng(len(lengths)).permutation(indptr[-1]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(lengths, pages)], dtype=np.int32)
    return indptr, indices, last


def decode_in_a_fresh_process(device: str) -> tuple[int, float]:
    """A new Python process whose first CUDA work is building a BatchDecode on `device` (no context exists yet),
    then a plan and a run: (torch's current device after it, max abs error against the float64 reference)."""
    script = f"""
import numpy as np, torch, attnforge
from attnforge import reference
w = attnforge.BatchDecode(attnforge.AttentionSpec(), device={device!r})  # the process's first CUDA work
lengths, page = [3, 700], 16
n = [-(-L // page) for L in lengths]
indptr = np.cumsum([0] + n)
indices = np.random.default_rng(0).permutation(indptr[-1])
last = np.array([L - (p - 1) * page for L, p in zip(lengths, n)])
w.plan(indptr, indices, last, page_size=page)
cache = torch.randn(indptr[-1], 2, page, 8, 128).bfloat16()
q = torch.randn(2, 32, 128).bfloat16()
out = w.run(q.to({device!r}), cache.to({device!r}))
per_req = reference.gather_paged(cache[:, 0].double(), cache[:, 1].double(), "NHD", indptr, indices, last, page)
ref = torch.cat([reference.attention(q[b:b + 1].double(), k, v, batch_index=b)[0] for b, (k, v) in enumerate(per_req)])
print(torch.cuda.current_device(), (out.cpu().double() - ref).abs().max().item())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    current, err = done.stdout.split()[-2:]
    return int(current), float(err)


def unheld_slots(num_pages: int, indptr, indices, last, page_size: int) -> torch.Tensor:
    """[pages, page_size] bool: True where no request holds the slot (pages past the table, tokens past
    a last page's length)."""
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b in range(len(indptr) - 1):
        pages = indptr[b + 1] - indptr[b]
        for j in range(pages):
            used[int(indices[indptr[b] + j]), :(last[b] if j == pages - 1 else page_size)] = True
    return ~used


def poison_unused_slots(cache, indptr, indices, last, page_size, layout):
    """NaN in every slot of a paged K/V cache [P, 2, ...] that no request holds: a copy that reads beyond
    a request's tokens into a computed tile (or a masked score meeting such a V row) then shows up as NaN,
    as it would on an engine's uninitialised cache memory."""
    unheld = unheld_slots(cache.shape[0], indptr, indices, last, page_size).to(cache.device)
    fp8 = cache.element_size() == 1  # torch fills no fp8 tensor by mask: write e4m3's NaN bytes (0x7F)
    for kv in (0, 1):
        view = cache[:, kv] if layout == "NHD" else cache[:, kv].transpose(1, 2)  # [P, page, Hkv, D]
        if fp8:
            view.view(torch.uint8)[unheld] = 0x7F
        else:
            view[unheld] = math.nan


def random_page_table(rng, batch: int, page_size: int, num_pages: int, max_len: int, long_len=None):
    """Random lengths in [0, max_len) (one request in [long_len[0], long_len[1]) when given), each
    request's pages drawn without repetition from num_pages. Returns (lengths, indptr, indices, last)."""
    lengths = rng.integers(0, max_len, size=batch)
    if long_len is not None:
        lengths[rng.integers(batch)] = int(rng.integers(*long_len))
    n = -(-lengths // page_size)
    indptr = np.concatenate([[0], np.cumsum(n)])
    indices = rng.permutation(num_pages)[: indptr[-1]]
    last = np.where(n > 0, lengths - (n - 1) * page_size, 0)
    return lengths, indptr, indices, last


def decode_reference(spec: AttentionSpec, q, per_request, sm_scale=None, v_scale=1.0, dtype=torch.float64):
    outs, lses = [], []
    for b, (k, v) in enumerate(per_request):
        o, lse = reference.attention(q[b:b + 1].to(dtype), k.to(dtype), v.to(dtype) * v_scale,
                                     sm_scale=sm_scale, window_left=spec.window_left,
                                     logits_soft_cap=spec.logits_soft_cap, batch_index=b, dtype=dtype)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def decode_expected(spec: AttentionSpec, q, per_request):
    """(float64 reference, torch's low-precision result in q's dtype) of a decode on the CPU, at the default scale:
    what assert_attention_close takes, whichever device q and the per-request K/V are on."""
    per_request = [(k.cpu(), v.cpu()) for k, v in per_request]
    scale = 1 / math.sqrt(spec.head_dim_qk)
    ref, ref_lse = decode_reference(spec, q.cpu(), per_request, sm_scale=scale)
    low, _ = decode_reference(spec, q.cpu().float(), [(k.to(q.dtype).float(), v.to(q.dtype).float())
                                                      for k, v in per_request], sm_scale=scale, dtype=torch.float32)
    return ref, ref_lse, low.to(q.dtype)


def assert_attention_close(out, ref64, low_ref, what="", dominant_weight_error=0.0):
    """FlashAttention's rule: our error at most 2x that of torch in low precision, plus a small atol;
    and the relative error in the bf16 band of METHOD.md. dominant_weight_error: what rounding weights or
    partial rows to 16 bits may add where torch's float32 yardstick rounds neither (weight_rounding_allowance)."""
    out = out.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten or NaN output)"
    err = (out - ref64).abs().max().item()
    base = (low_ref.double() - ref64).abs().max().item()
    bound = 2 * base + 2e-3 + dominant_weight_error
    assert err <= bound, f"{what}: max err {err:.3e} vs torch low-precision {base:.3e} (bound {bound:.3e})"
    denom = ref64.norm().item()
    if denom > 0:
        assert (out - ref64).norm().item() / denom < 1e-2, f"{what}: relative error too large"


def weight_rounding_allowance(p_dtype: torch.dtype, max_abs_v: float) -> float:
    """What rounding weights or partial rows to 16 bits may add to an output: each moves within one unit
    roundoff of itself (2^-8 in bf16, 2^-11 in fp16) and the weights sum to one, so the output moves at most
    that times max |V|. torch's float32 yardstick rounds neither, so the max-error rule needs this term where
    the rounding shows:
    - a kernel whose row max lags (MLADecodeKernel.rescale_slack > 0) weights a peaked row's dominant value
      by 2^f, not exactly 1 (tests/test_fuzz_gpu.py: h64 bf16 read 2.45x torch's max error where the eager
      kernels read 1.00x);
    - partial states stored in the output type, then merged. No path does so now: a prefill plan that splits
      KV did until its partials became float32 (seed 917, five slots, d256 fp8 K/V at twice randn's scale,
      read 2.8x, one output rounded to its other neighbour), and a cascade's levels until they wrote float32
      rows (float_out). tests/test_helpers.py still proves the bound for it."""
    return (2.0 ** -8 if p_dtype == torch.bfloat16 else 2.0 ** -11) * max_abs_v


def assert_lse_close(lse, ref_lse, what=""):
    lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), f"{what}: -inf pattern differs"
    if (~inf).any():
        err = (lse[~inf] - ref_lse[~inf]).abs().max().item()
        assert err < 2e-3, f"{what}: max lse err {err:.3e} (bound 2e-3)"


def poison(shape, dtype, device="cuda"):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def chain_on_own_outputs(run, q, use_cuda_graph: bool, calls: int = 3) -> list:
    """run(q_in, out) `calls` times in a row, each call's queries the previous call's output (a PDL launch
    must not read them before that call completes): eagerly, or captured once in a CUDA graph and
    replayed onto poisoned outputs. Returns the outputs."""
    outs = [poison(q.shape, q.dtype) for _ in range(calls)]

    def chain():
        src = q
        for o in outs:
            run(src, o)
            src = o
    if use_cuda_graph:
        chain()  # warm-up (JIT) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        for o in outs:
            o.copy_(poison(q.shape, q.dtype))
        graph.replay()
    else:
        chain()
    torch.cuda.synchronize()
    return outs


def replays_after_replans(run, replan, refresh, rounds: int):
    """The CUDA-graph protocol every wrapper's test checks: plan, run once outside capture (build and
    load), capture `run`, then per round re-plan, refresh inputs and poison outputs (`refresh`), replay
    and synchronise. Yields (round, what replan returned) for the caller's checks."""
    replan()
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for i in range(rounds):
        planned = replan()
        refresh()
        graph.replay()
        torch.cuda.synchronize()
        yield i, planned


def queued_plans_match_dense(quest, spec: AttentionSpec, cache, q, tables, page_size: int) -> None:
    """Quest plans and runs of each (indptr, indices, last) table queued back to back, no synchronisation
    between them (plan() must never wait for the GPU nor reuse a staging buffer still being copied), then
    each full-budget output compared with a dense BatchDecode of its own table."""
    from attnforge import BatchDecode
    from conftest import rel_error
    outs = []
    for indptr, indices, last in tables:
        quest.plan(indptr, indices, last)
        outs.append(quest.run(q[:len(last)], cache))
    for i, ((indptr, indices, last), out) in enumerate(zip(tables, outs)):
        dense = BatchDecode(spec)
        dense.plan(indptr, indices, last, page_size=page_size)
        assert rel_error(out, dense.run(q[:len(last)], cache)) < 1e-2, f"plan {i}"


def int4_query_codes(q, index):
    """The int4 path's query side in torch, in the kernel's float32 steps exactly: per (request, KV head)
    the group's positive and negative sums times the channel scales, as int8 codes with a step of
    (largest |sum|) / 127 each. Returns [(codes [B, Hkv, D] int8, step [B, Hkv, 1]) for P, then N]."""
    b, hq, d = q.shape
    hkv = index.summary_shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    table = index.channel_scale_table(q.device)  # [rows, D]: row (request * Hkv + head) % rows
    scale = table[torch.arange(b * hkv, device=q.device).view(b, hkv) % table.shape[0]]
    out = []
    for sign in (1, -1):
        part = torch.zeros_like(qg[:, :, 0])
        for g in range(qg.shape[2]):  # summed in the kernel's order (a reduction may pair them up)
            part = part + (qg[:, :, g].clamp(min=0) if sign > 0 else qg[:, :, g].clamp(max=0))
        part = part * scale
        top = part.abs().amax(-1, keepdim=True)
        # a tensor divisor: torch on CUDA divides by a Python number as a product by its reciprocal,
        # a bit off the kernel's IEEE quotient, and a code then rounds the other way (4 in 13 million)
        step = top / torch.full_like(top, 127.0)
        step = torch.where(step > 0, step, torch.ones_like(step))
        out.append((torch.round(part * (1 / step)).to(torch.int8), step))  # by the step's reciprocal
    return out


def int4_kernel_scores(q, index, indptr, indices):
    """The int4 path's arithmetic in torch: codes times P and N rounded to int8 steps of (largest |sum|
    of the request and KV head) / 127, summed over written (page, head)s."""
    from attnforge.sparse.summaries import int4_codes
    b = q.shape[0]
    sums = [codes.float() * step for codes, step in int4_query_codes(q, index)]
    counts = (indptr[1:] - indptr[:-1]).long()
    request = torch.repeat_interleave(torch.arange(b, device=q.device), counts)
    pages = indices.long()
    lo, hi = int4_codes(index.kmin[pages]), int4_codes(index.kmax[pages])  # [n, Hkv, D]
    written = (lo[..., :1] <= hi[..., :1]).float()
    return ((hi * sums[0][request] + lo * sums[1][request]) * written).sum(dim=(1, 2))


def summary_format(index_dtype, keys):
    """QuestIndex's dtype and scale for a test's format; "fp8-channels": fp8 with a scale per KV head
    and dim (the float query sums then take the scales row by row)."""
    from attnforge.sparse import channel_scales
    if index_dtype == "fp8-channels":
        return {"dtype": torch.float8_e4m3fn, "scale": channel_scales(keys)}
    if index_dtype == "int4":
        return {"dtype": "int4", "scale": channel_scales(keys, "int4")}
    return {"dtype": index_dtype, "scale": 0.02 if index_dtype == torch.float8_e4m3fn else 1.0}


def run_host_program(source: str, directory: Path) -> str:
    """Build a host C++ program over the attnforge headers (their AF_HOST_DEVICE functions) with nvcc
    in `directory` and run it: its standard output."""
    from attnforge import codegen
    (directory / "t.cu").write_text(source)
    subprocess.run(["nvcc", "-std=c++20", f"-I{codegen.include_dir()}", "-o", str(directory / "t"),
                    str(directory / "t.cu")], check=True, capture_output=True)
    return subprocess.run([str(directory / "t")], check=True, capture_output=True, text=True).stdout


def ptxas_log_of_async_wgmmas(module, entry: str, directory: Path) -> str:
    """Compile a kernel module for sm_90a with ptxas's report and check that ptxas kept every wgmma
    asynchronous: it says so quietly (info C7514 / C7515 / C7518: serialised; C7517: waits injected) when
    code between an issue and its wait branches or touches accumulators (C7518: a branch ptxas cannot tell
    is warp-uniform), and C7511 when it serialises them for want of registers (forty-third session: an
    m64n32 wgmma per quarter of an m64n128 accumulator, two or more of them). Returns the entry's part of
    the log."""
    from attnforge import codegen
    (directory / "k.cu").write_text(module.source)
    out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
                          f"-I{codegen.include_dir()}", "-Xptxas=-v", "-o", str(directory / "k.cubin"),
                          str(directory / "k.cu")], capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    marker = f"Compiling entry function '{entry}'"
    assert marker in log, log[-2000:]
    for code in ("C7511", "C7514", "C7515", "C7517", "C7518"):
        lines = "\n".join(x for x in log.splitlines() if code in x)
        assert code not in log, f"{module.name}: ptxas {code}:\n{lines}"
    return log.split(marker)[1]


def count_calls(monkeypatch, owner, name: str) -> dict:
    """Wrap owner.name (a function or method) so that calls["n"] counts its calls for the test's duration."""
    calls, real = {"n": 0}, getattr(owner, name)

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counting)
    return calls


class LaunchRecorder:
    """Stands in for a loaded library: launches records (kernel name, grid, params) instead of launching."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, name):
        rec = self

        class Kernel:
            def launch(self, grid, block, params, smem=0, stream=None, pdl=False):
                rec.launches.append((name, grid, params))
        return Kernel()

    def last(self, w):
        """The params of the last launch of w's planned kernel (a merge may launch after it)."""
        return next(p for name, _, p in reversed(self.launches) if name == w._plan["kernel"].kernel_name)


def stub_host_prefill(monkeypatch, encode) -> LaunchRecorder:
    """stub_launches, and what a BatchPrefill on device "cpu" asks of a GPU: its SM count (132), pinned memory
    and the TMA encoder (encode(tensor, box) -> a map's 128 bytes)."""
    import types
    from attnforge.jit import tma
    rec = stub_launches(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(tma, "encode", encode)
    return rec


def stub_launches(monkeypatch) -> LaunchRecorder:
    """Run wrappers' run() without a GPU: every library is a LaunchRecorder, device checks and guards pass."""
    import contextlib
    from attnforge import checks
    from attnforge.jit import registry
    rec = LaunchRecorder()
    monkeypatch.setattr(registry, "get_library", lambda *a, **k: rec)
    monkeypatch.setattr(checks, "check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return rec


def python_tensors(which) -> list:
    """(storage bytes, tensor) of each tensor the collector tracks for which which(tensor) holds: those Python
    objects hold (torch's count of live CUDA bytes also has what C++ holds: a graph's pool, a shared storage)."""
    return [(obj.untyped_storage().nbytes(), obj) for obj in gc.get_objects()
            if issubclass(type(obj), torch.Tensor) and which(obj)]  # (type: isinstance warns on deprecated objects)


def largest_holders(seen: list, min_bytes: int = 64 << 20) -> str:
    """For the largest of python_tensors() (from min_bytes): the types of what refers to it, and of what refers
    to those (conftest's memory log, after each GPU test). A frame off the running stack is named by its function
    and line (a stored traceback keeps one, or C code: compute-sanitizer's host backtraces); the running stack's
    own frames are skipped."""
    if not seen:
        return ""
    nbytes, tensor = max(seen, key=lambda x: x[0])
    if nbytes < min_bytes:
        return ""
    ours = {id(seen), *(id(pair) for pair in seen)}  # (this function's own references are not holders)
    frame = inspect.currentframe()
    while frame is not None:
        ours.add(id(frame))
        frame = frame.f_back

    def name(obj) -> str:
        if inspect.isframe(obj):
            return f"frame {obj.f_code.co_name}@{os.path.basename(obj.f_code.co_filename)}:{obj.f_lineno}"
        return type(obj).__name__

    here = [r for r in gc.get_referrers(tensor) if id(r) not in ours][:4]
    ours.add(id(here))
    names = []
    for r in here:
        up = [name(u) for u in gc.get_referrers(r) if id(u) not in ours][:4]
        names.append(f"{name(r)} <- {'/'.join(up) or '?'}")
    return (f"; largest {nbytes >> 20} MiB {list(tensor.shape)}, {sys.getrefcount(tensor) - 3} references, held by "
            f"{', '.join(names) or 'no Python object'}")


def log_test_memory(path: str, test_id: str) -> None:
    """One line of the memory log (ATTNFORGE_TEST_MEMLOG, tests/conftest.py) after a test: the CUDA bytes torch
    counts live and reserved once cycles are collected, the CUDA tensors Python holds and what holds the largest;
    then the cached blocks go back (this process shares the card with others)."""
    gc.collect()  # (tensors held only by reference cycles are not a leak)
    live, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    seen = python_tensors(lambda t: t.is_cuda)
    with open(path, "a") as log:
        log.write(f"{live >> 20} MiB live, {reserved >> 20} MiB reserved, {len(seen)} CUDA tensors Python holds "
                  f"({sum(nbytes for nbytes, _ in seen) >> 20} MiB{largest_holders(seen, min_bytes=0)}): {test_id}\n")
    torch.cuda.empty_cache()


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is scripts, not a package)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

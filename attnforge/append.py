"""Write new tokens into a paged KV cache in one launch (templates/append_kv.cu.jinja).

Three entry points over one kernel:
  append_paged_kv_cache      K and V of tokens at (request, position) through a CSR page table
  append_paged_mla_kv_cache  MLA's latent ckv [N, 512] and rope kpe [N, 64], into a pair or one 576-wide cache
  append_kv_by_slots         K and V by flat slot ids (page * page_size + offset; < 0 skips the token), as
                             vLLM's slot_mapping
A 16-bit source into an fp8 e4m3 cache is quantized on the way: code = value / scale, rounded to nearest
and saturated to +-448 (decode and prefill read it back with plan(k_scale=..., v_scale=...)).

Indices live on the GPU, so nothing is synchronised and every call is graph-capturable; tokens whose
indices fall outside the page table or the cache are never written. check_indices=True counts them in
the kernel and raises naming the first (this synchronises). Under torch.compile the calls trace as the
torch formulation in attnforge.reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import checks, intdiv, ops, reference
from .codegen import ParamField, ParamsLayout
from .jit import JitModule, registry
from .jit.loader import on_device
from .spec import MLA_HEAD_DIM_QK, MLA_HEAD_DIM_VO

UNIT = 8  # elements a thread moves (the kernel's kUnit): rows and strides come in multiples of it
THREADS = 256
MAX_CTAS = 8192  # a grid-stride loop beyond: enough CTAs to fill an H200 many times over
# append_kv_kernel_wide: this many units of a token a thread, their loads in flight behind one page lookup
# (5 CTAs an SM, 5120 units in flight, against one unit a thread's 6 CTAs and 1536). Taken from
# WIDE_FROM_UNITS_PER_SM units an SM up, where one unit a thread needs more than one wave of its CTAs: suite
# `append_sizes` on the H200 put the switch between 131K and 262K units (GQA 8x128: 512 tokens 3.8 us both,
# 1024 tokens 5.1 against the wide kernel's 4.5; 8192 tokens 25.2 against 20.5). A decode step keeps one unit a
# thread, whose many small CTAs spread over more SMs (B64 GQA: 3.0 us against 3.3).
UNITS_PER_THREAD = 4
WIDE_FROM_UNITS_PER_SM = 1536
_SRC_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_INDEX_DTYPES = (torch.int32, torch.int64)

APPEND_PARAMS = ParamsLayout("AppendParams", [
    *(ParamField(n, "const void*", "ptr") for n in ("src0", "src1", "batch_indices", "positions", "kv_indices",
                                                   "kv_indptr", "slot_mapping")),
    ParamField("dst0", "void*", "ptr"), ParamField("dst1", "void*", "ptr"), ParamField("error", "int*", "ptr"),
    *(ParamField(n, "int64_t", "i64") for n in (
        "src0_stride_n", "src0_stride_h", "src1_stride_n", "src1_stride_h", "dst0_stride_page", "dst0_stride_token",
        "dst0_stride_head", "dst1_stride_page", "dst1_stride_token", "dst1_stride_head", "num_slots", "num_pages")),
    ParamField("scale0", "float", "f32"), ParamField("scale1", "float", "f32"),
    *(ParamField(n, "int32_t", "i32") for n in ("num_tokens", "num_heads", "chunks0", "chunks1", "page_size",
                                                 "batch_size")),
    ParamField("index_wide", "uint32_t", "u32"),
    # bit 2 * dst + stream: that stream's rows (source when dst = 0, cache when 1) hold their heads back to back
    ParamField("dense_rows", "uint32_t", "u32"),
    # (mul, shift) of fast_div by chunks0, chunks1, page_size and the threads a token of each kernel
    *(ParamField(f"{n}_{k}", "uint32_t", "u32") for n in ("chunks0", "chunks1", "page", "per_token1", "per_token_wide")
      for k in ("mul", "shift")),
])


@dataclass(frozen=True)
class AppendSpec:
    """The append kernel is specialised on the source and cache element types only."""

    src_dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.src_dtype not in _SRC_DTYPES:
            raise checks.fail("AppendSpec.src_dtype", " or ".join(map(str, _SRC_DTYPES)), self.src_dtype,
                              "Cast the new tokens to one of them.")
        if self.cache_dtype not in (self.src_dtype, torch.float8_e4m3fn):
            raise checks.fail("cache dtype", f"{self.src_dtype} (the tokens' dtype) or torch.float8_e4m3fn",
                              self.cache_dtype, "Cast the new tokens to the cache's dtype.")

    @property
    def quantizes(self) -> bool:
        return self.cache_dtype != self.src_dtype

    @property
    def name(self) -> str:
        return f"append_kv_{checks.CPP_TYPES[self.src_dtype]}_to_{checks.CPP_TYPES[self.cache_dtype]}"

    def module(self) -> JitModule:
        return JitModule(self.name, "append_kv.cu.jinja",
                         {"src_dtype": checks.CPP_TYPES[self.src_dtype],
                          "cache_dtype": checks.CPP_TYPES[self.cache_dtype], "params_struct": APPEND_PARAMS.cpp(),
                          "units_per_thread": UNITS_PER_THREAD},
                         ("append_kv_kernel", "append_kv_kernel_wide"))


@dataclass(frozen=True)
class Stream:
    """One matrix the kernel writes: new rows src [N, H, D] into cache rows dst (a view [P, page, H, D] in
    any stride order: what a page, a token and a head step in elements)."""

    name: str
    src: torch.Tensor
    dst: torch.Tensor
    dst_strides: tuple  # (page, token, head) in elements
    scale: float


def _check_rows(name: str, t: torch.Tensor, strides) -> None:
    """The kernel moves 8 elements at a time: unit strides within a row, the rest multiples of 8, and an
    8-element aligned start."""
    unit_bytes = UNIT * t.element_size()
    if t.stride(-1) != 1 or any(s % UNIT for s in strides) or t.data_ptr() % unit_bytes:
        raise checks.fail(name, f"rows of contiguous elements whose other strides are multiples of {UNIT} and whose "
                          f"start is {unit_bytes}-byte aligned", f"strides {tuple(t.stride())}, data_ptr % "
                          f"{unit_bytes} = {t.data_ptr() % unit_bytes}", f"Pass {name}.contiguous() (or a cache "
                          "allocated whole).")


def _check_scale(name: str, scale, quantizes: bool) -> float:
    if not (checks.finite_float32(scale) and scale > 0):  # (past float32's range the kernel would get inf)
        raise checks.fail(name, "a finite float > 0", repr(scale), "Pass the scale decode will read the cache with.")
    if not quantizes and scale != 1.0:
        raise checks.fail(name, "1.0 (a scale applies only when 16-bit tokens are quantized into an fp8 cache)", scale,
                          "Drop it, or append into a torch.float8_e4m3fn cache.")
    return float(scale)


def _check_index(name: str, t, n: Optional[int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise checks.fail(name, "a torch.Tensor", type(t).__name__, "Pass a GPU index tensor.")
    checks.check_dtype(name, t, _INDEX_DTYPES)
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"[{n}] (one per new token)" if n is not None else "a 1-D tensor"
        raise checks.fail(f"{name}.shape", want, list(t.shape), "Pass a flat index tensor.")


def _stream(name: str, src: torch.Tensor, dst: torch.Tensor, strides, scale, scale_name: str) -> Stream:
    if not isinstance(src, torch.Tensor):
        raise checks.fail(name, "a torch.Tensor", type(src).__name__, "Pass the new tokens as a tensor.")
    checks.check_dtype(name, src, _SRC_DTYPES)
    if dst.dtype not in (src.dtype, torch.float8_e4m3fn):
        raise checks.fail(f"{name} cache dtype", f"{src.dtype} (the tokens' dtype) or torch.float8_e4m3fn", dst.dtype,
                          f"Cast {name} to the cache's dtype.")
    spec = AppendSpec(src.dtype, dst.dtype)
    if dst.shape[-1] % UNIT:
        raise checks.fail(f"{name} head dim", f"a multiple of {UNIT}", dst.shape[-1], "Pad the head dimension.")
    _check_rows(name, src, src.stride()[:-1])
    _check_rows(f"{name} cache", dst, strides)
    return Stream(name, src, dst, tuple(strides), _check_scale(scale_name, scale, spec.quantizes))


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


# An eager call whose arguments repeat (an engine appends into the same cache from the same buffers every layer of
# every step) launches the params its first call packed, its checks not run again: what a launch depends on is
# each tensor's address, shape, strides, dtype and device and the plain arguments, which key the table.
_LAUNCHES: dict = {}
MAX_LAUNCHES = 1024  # signatures kept (a model's layers times its buffers); past it the table starts over


def _call_key(entry: str, tensors: tuple, *values):
    """The signature of a call (None, not memoised, when an argument is not a tensor: the checks name it).
    Values keep their type, so scale=True does not find the entry of scale=1.0 (the check refuses bools)."""
    key = [entry, *((type(x), x) for x in values)]
    for t in tensors:
        if isinstance(t, (tuple, list)):  # a (K, V) cache pair
            if len(t) != 2 or not all(isinstance(x, torch.Tensor) for x in t):
                return None
            key += ["pair", *((x.data_ptr(), x.shape, x.stride(), x.dtype, x.device) for x in t)]
        elif t is None or isinstance(t, torch.Tensor):
            key.append(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(key)


def _launch_memoised(key) -> bool:
    """Launch the params of an earlier call with this signature; False when there was none."""
    if key is None or key not in _LAUNCHES:
        return False
    hit = _LAUNCHES[key]
    if hit is not None:  # (None: a call of no tokens, nothing to launch)
        kernel, grid, params, device = hit
        with on_device(device):
            kernel.launch(grid, (THREADS,), params)
    return True


def _launch(streams: list, num_heads: int, page_size: int, num_pages: int, *, batch_indices=None, positions=None,
            kv_indices=None, kv_indptr=None, slot_mapping=None, check_indices: bool = False, key=None) -> None:
    """Device checks, then one launch; with check_indices, the kernel's count of skipped tokens is read back.
    key: the call's signature, under which its launch is kept (none with check_indices: its buffer is per call)."""
    a, b = streams
    device = a.src.device
    for s in streams:
        checks.check_cuda(s.name, s.src, device if s is not a else None)
        checks.check_cuda(f"{s.name} cache", s.dst, device)
    if b.src.dtype != a.src.dtype or b.dst.dtype != a.dst.dtype:
        raise checks.fail(f"{b.name}.dtype", f"{a.src.dtype} into {a.dst.dtype} (as {a.name})",
                          f"{b.src.dtype} into {b.dst.dtype}", "Use one dtype for both.")
    indices = {"batch_indices": batch_indices, "positions": positions, "kv_indices": kv_indices,
               "kv_indptr": kv_indptr, "slot_mapping": slot_mapping}
    wide_bit = {"batch_indices": 0, "slot_mapping": 0, "positions": 1, "kv_indices": 2, "kv_indptr": 3}
    wide = 0
    for name, t in indices.items():
        if t is not None:
            checks.check_cuda(name, t, device)
            wide |= (t.dtype == torch.int64) << wide_bit[name]
    n = a.src.shape[0]
    unit_count = num_heads * (a.src.shape[-1] + b.src.shape[-1]) // UNIT  # 8-element units a token
    units = n * unit_count
    if units >= 2 ** 31:  # (the kernel divides 32-bit unit indices)
        raise checks.fail("new tokens", "fewer than 2^31 8-element units in one call", n, "Append in several calls.")
    spec = AppendSpec(a.src.dtype, a.dst.dtype)
    lib = registry.get_library(spec, spec.module, device)
    error = torch.tensor([0, 2 ** 31 - 1], dtype=torch.int32, device=device) if check_indices else None
    # what the kernels divide by (fast_div): each stream's units a row, the page size, and the threads a token of
    # each kernel (the wide kernel's threads a token are its kPer = UNITS_PER_THREAD units' count, rounded up)
    divisors = {"chunks0": a.src.shape[-1] // UNIT, "chunks1": b.src.shape[-1] // UNIT, "page": page_size,
                "per_token1": unit_count, "per_token_wide": -(-unit_count // UNITS_PER_THREAD)}
    dense = 0
    for i, st in enumerate(streams):  # heads back to back: a unit's offset in the row is its index times 8
        width = st.src.shape[-1]
        dense |= (num_heads == 1 or st.src.stride(1) == width) << i
        dense |= (num_heads == 1 or st.dst_strides[2] == width) << (2 + i)
    fast_divs = {f"{name}_{k}": x for name, d in divisors.items() for k, x in zip(("mul", "shift"), intdiv.divisor(d))}
    params = APPEND_PARAMS.pack(
        dense_rows=dense, **fast_divs,
        src0=a.src.data_ptr(), src1=b.src.data_ptr(), dst0=a.dst.data_ptr(), dst1=b.dst.data_ptr(),
        **{name: _ptr(t) for name, t in indices.items()}, error=_ptr(error),
        src0_stride_n=a.src.stride(0), src0_stride_h=a.src.stride(1), src1_stride_n=b.src.stride(0),
        src1_stride_h=b.src.stride(1), **{f"dst{i}_stride_{k}": s.dst_strides[j] for i, s in enumerate(streams)
                                          for j, k in enumerate(("page", "token", "head"))},
        num_slots=0 if kv_indices is None else kv_indices.shape[0], num_pages=num_pages, scale0=a.scale,
        scale1=b.scale, num_tokens=n, num_heads=num_heads, chunks0=divisors["chunks0"],
        chunks1=divisors["chunks1"], page_size=page_size,
        batch_size=0 if kv_indptr is None else kv_indptr.shape[0] - 1, index_wide=wide)
    launch = _kernel_and_grid(lib, units, device) + (params, device) if units else None
    if key is not None and not check_indices:
        if len(_LAUNCHES) >= MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = launch
    if launch is not None:
        with on_device(device):
            launch[0].launch(launch[1], (THREADS,), params)
    if error is not None:
        skipped, first = error.tolist()
        if skipped:
            where = (f"slot_mapping[{first}] = {slot_mapping[first].item()}" if slot_mapping is not None else
                     f"batch_indices[{first}] = {batch_indices[first].item()}, positions[{first}] = "
                     f"{positions[first].item()}")
            raise checks.fail("append indices", f"every token inside the page table and the cache ({num_pages} "
                              f"pages of {page_size})", f"{skipped} token(s) outside, first token {first}: {where}",
                              "Those tokens were not written; fix the indices (or the page table) and append them.")


_SMS: dict = {}  # device -> its SM count, asked once


def _kernel_and_grid(lib, units: int, device: torch.device) -> tuple:
    """(kernel, grid) for `units` 8-element units: the wide kernel from WIDE_FROM_UNITS_PER_SM units an SM,
    else one unit a thread."""
    if units >= WIDE_FROM_UNITS_PER_SM:  # (fewer reach the threshold on any device: no need to ask its SMs)
        if device not in _SMS:
            _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        if units >= WIDE_FROM_UNITS_PER_SM * _SMS[device]:
            return lib["append_kv_kernel_wide"], (min(MAX_CTAS, -(-units // (THREADS * UNITS_PER_THREAD))),)
    return lib["append_kv_kernel"], (min(MAX_CTAS, -(-units // THREADS)),)


def _kv_views(kv_cache, kv_layout: str):
    """(K view, V view, (page, token, head) strides, page_size, heads, head_dim) of a paged cache."""
    if kv_layout not in ("NHD", "HND"):
        raise checks.fail("kv_layout", "'NHD' or 'HND'", repr(kv_layout), "Pass the cache's layout.")
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise checks.fail("kv_cache.shape", "[P, 2, page, Hkv, D] (NHD) or [P, 2, Hkv, page, D] (HND)",
                              list(kv_cache.shape), "Or pass a (K, V) pair.")
        kc, vc = kv_cache[:, 0], kv_cache[:, 1]
    else:
        kc, vc = kv_cache
        if kc.dim() != 4 or kc.shape != vc.shape:
            raise checks.fail("kv_cache", "a (K, V) pair of equal 4-D shapes", [list(kc.shape), list(vc.shape)],
                              "Pass [P, page, Hkv, D] (NHD) or [P, Hkv, page, D] (HND) tensors.")
        if kc.dtype != vc.dtype:
            raise checks.fail("kv_cache[1].dtype", f"{kc.dtype} (as K's)", vc.dtype, "Use one dtype for K and V.")
    token_dim, head_dim_axis = (1, 2) if kv_layout == "NHD" else (2, 1)
    def strides(c):
        return c.stride(0), c.stride(token_dim), c.stride(head_dim_axis)
    return kc, vc, strides(kc), strides(vc), kc.shape[token_dim], kc.shape[head_dim_axis], kc.shape[3]


def _kv_streams(k, v, kv_cache, kv_layout: str, k_scale, v_scale):
    """(the K and V streams, heads, page size, pages) of a paged K/V append, its tokens and cache checked."""
    kc, vc, k_strides, v_strides, page, hkv, d = _kv_views(kv_cache, kv_layout)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise checks.fail(name, "a torch.Tensor", type(t).__name__, "Pass the new tokens as a tensor.")
        checks.check_shape(name, t, (k.shape[0], hkv, d), f"[tokens, {hkv}, {d}] matching the cache")
    return ([_stream("k", k, kc, k_strides, k_scale, "k_scale"), _stream("v", v, vc, v_strides, v_scale, "v_scale")],
            hkv, page, kc.shape[0])


def _check_csr(batch_indices, positions, kv_indices, kv_indptr, n: int) -> None:
    _check_index("batch_indices", batch_indices, n)
    _check_index("positions", positions, n)
    _check_index("kv_indices", kv_indices, None)
    _check_index("kv_indptr", kv_indptr, None)
    if kv_indptr.shape[0] < 1:
        raise checks.fail("kv_indptr.shape", "[batch + 1]", list(kv_indptr.shape), "Pass the page table's CSR offsets.")


def append_paged_kv_cache(k: torch.Tensor, v: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
                          kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, kv_layout: str = "NHD", *,
                          k_scale: float = 1.0, v_scale: float = 1.0, check_indices: bool = False) -> None:
    """Write new tokens into their pages: token i of k/v [N, Hkv, D] belongs to request
    batch_indices[i] at position positions[i]; its page is kv_indices[kv_indptr[b] + pos // page].

    kv_cache is [P, 2, page, Hkv, D] (NHD) / [P, 2, Hkv, page, D] (HND) or a (K, V) pair. Index tensors are
    int32 or int64 on the GPU. An fp8 e4m3 cache takes 16-bit tokens quantized by k_scale / v_scale."""
    checks.check_untracked("append_paged_kv_cache", ("k", k), ("v", v), ("kv_cache", kv_cache))
    if ops.compiling():
        return reference.append_paged_kv(k, v, batch_indices, positions, kv_cache, kv_indices, kv_indptr, kv_layout,
                                         k_scale, v_scale)
    key = None if check_indices else _call_key("paged", (k, v, batch_indices, positions, kv_cache, kv_indices,
                                                                        kv_indptr), kv_layout, k_scale, v_scale)
    if _launch_memoised(key):
        return
    streams, hkv, page, num_pages = _kv_streams(k, v, kv_cache, kv_layout, k_scale, v_scale)
    _check_csr(batch_indices, positions, kv_indices, kv_indptr, k.shape[0])
    _launch(streams, hkv, page, num_pages, batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
            kv_indptr=kv_indptr, check_indices=check_indices, key=key)


def append_kv_by_slots(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_cache,
                       kv_layout: str = "NHD", *, k_scale: float = 1.0, v_scale: float = 1.0,
                       check_indices: bool = False) -> None:
    """Write token i of k/v [N, Hkv, D] at cache slot slot_mapping[i] = page * page_size + offset (int32 or
    int64 on the GPU); a negative slot skips the token (padding), as vLLM's slot_mapping. Caches and scales
    as append_paged_kv_cache."""
    checks.check_untracked("append_kv_by_slots", ("k", k), ("v", v), ("kv_cache", kv_cache))
    if ops.compiling():
        return reference.append_kv_slots(k, v, slot_mapping, kv_cache, kv_layout, k_scale, v_scale)
    key = None if check_indices else _call_key("slots", (k, v, slot_mapping, kv_cache), kv_layout, k_scale, v_scale)
    if _launch_memoised(key):
        return
    streams, hkv, page, num_pages = _kv_streams(k, v, kv_cache, kv_layout, k_scale, v_scale)
    _check_index("slot_mapping", slot_mapping, k.shape[0])
    _launch(streams, hkv, page, num_pages, slot_mapping=slot_mapping, check_indices=check_indices, key=key)


def append_paged_mla_kv_cache(ckv: torch.Tensor, kpe: torch.Tensor, batch_indices: torch.Tensor,
                              positions: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: Optional[torch.Tensor],
                              kv_indices: torch.Tensor, kv_indptr: torch.Tensor, *, kv_scale: float = 1.0,
                              check_indices: bool = False) -> None:
    """MLA's new tokens: ckv [N, 512] and kpe [N, 64] into ckv_cache [P, page, 512] and kpe_cache
    [P, page, 64], or, with kpe_cache None, one [P, page, 576] cache (latent, then rope), the caches
    BatchMLADecode.run reads. Indices as append_paged_kv_cache; an fp8 cache takes 16-bit tokens quantized
    by kv_scale (plan with k_scale = v_scale = kv_scale)."""
    checks.check_untracked("append_paged_mla_kv_cache", ("ckv", ckv), ("kpe", kpe), ("ckv_cache", ckv_cache),
                           ("kpe_cache", kpe_cache))
    if ops.compiling():
        return reference.append_paged_mla(ckv, kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices,
                                          kv_indptr, kv_scale)
    key = None if check_indices else _call_key("mla", (ckv, kpe, batch_indices, positions, ckv_cache, kpe_cache,
                                                        kv_indices, kv_indptr), kv_scale)
    if _launch_memoised(key):
        return
    latent, rope = MLA_HEAD_DIM_VO, MLA_HEAD_DIM_QK - MLA_HEAD_DIM_VO
    if not isinstance(ckv_cache, torch.Tensor) or ckv_cache.dim() != 3:
        raise checks.fail("ckv_cache", "a [P, page, 512] tensor (or [P, page, 576] with kpe_cache=None)",
                          getattr(ckv_cache, "shape", type(ckv_cache).__name__), "Pass the MLA cache.")
    if kpe_cache is None:
        checks.check_shape("ckv_cache", ckv_cache, (None, None, latent + rope), "one cache of latent + rope rows")
        ckv_dst, kpe_dst = ckv_cache[..., :latent], ckv_cache[..., latent:]
    else:
        checks.check_shape("ckv_cache", ckv_cache, (None, None, latent), "[P, page, 512]")
        checks.check_shape("kpe_cache", kpe_cache, (ckv_cache.shape[0], ckv_cache.shape[1], rope),
                           f"[P, page, {rope}] matching ckv_cache")
        ckv_dst, kpe_dst = ckv_cache, kpe_cache
    if kpe_dst.dtype != ckv_dst.dtype:
        raise checks.fail("kpe_cache.dtype", f"{ckv_dst.dtype} (as ckv_cache's)", kpe_dst.dtype, "Use one dtype.")
    for name, t, width in (("ckv", ckv, latent), ("kpe", kpe, rope)):
        if not isinstance(t, torch.Tensor):
            raise checks.fail(name, "a torch.Tensor", type(t).__name__, "Pass the new tokens as a tensor.")
        checks.check_shape(name, t, (ckv.shape[0], width), f"[tokens, {width}]")
    _check_csr(batch_indices, positions, kv_indices, kv_indptr, ckv.shape[0])
    # (one head: a token's row is its single "head", the cache's head stride unused)
    streams = [_stream(name, src.unsqueeze(1), dst.unsqueeze(2), (dst.stride(0), dst.stride(1), 0), kv_scale,
                       "kv_scale")
               for name, src, dst in (("ckv", ckv, ckv_dst), ("kpe", kpe, kpe_dst))]
    _launch(streams, 1, ckv_cache.shape[1], ckv_cache.shape[0], batch_indices=batch_indices, positions=positions,
            kv_indices=kv_indices, kv_indptr=kv_indptr, check_indices=check_indices, key=key)

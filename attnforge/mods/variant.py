"""ScoreMod: traced score_mod / mask_mod (or a raw C++ snippet) as one attnforge variant.

The compiled code depends only on the expression (`cache_key`); captured tensors and 0-d tensor
scalars are kernel parameters packed at every launch, so new values never trigger a rebuild.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .. import checks
from ..codegen import ParamField
from . import affine, graph, scaled
from .library_args import check_table
from .trace import ModTraceError, scalar_value, trace

MAX_TENSORS, MAX_SCALARS = 8, 8

# Helpers shared by generated code on the device and in the g++ host test.
CPP_PRELUDE = r"""
#ifndef AF_MOD_PRELUDE
#define AF_MOD_PRELUDE
#ifdef __CUDACC__
#define AF_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define AF_HD inline
#endif
// Integer modifier arithmetic is 32-bit, as in FlexAttention's kernels (positions, heads and batch
// indices fit; 64-bit temporaries for every score cost registers, and spills, in the prefill loop).
typedef int af_int;
AF_HD af_int af_floordiv(af_int a, af_int b) { af_int q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
AF_HD af_int af_mod(af_int a, af_int b) { af_int r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
#ifdef __CUDA_ARCH__  // SFU approximations on the device: errors far below bf16/fp16 score rounding
#define AF_PICK(device_fn, host_fn) device_fn
AF_HD float af_tanh_approx(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
AF_HD float af_sqrt_approx(float x) { float y; asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
// rounded products and sums that nvcc never fuses into an FMA (it fuses a * b + c by default): for the
// arithmetic under a comparison, floor or integer cast, where one rounding more or less moves the result
AF_HD float af_mul_rn(float a, float b) { return __fmul_rn(a, b); }
AF_HD float af_add_rn(float a, float b) { return __fadd_rn(a, b); }
AF_HD float af_sub_rn(float a, float b) { return __fsub_rn(a, b); }
#else
#define AF_PICK(device_fn, host_fn) host_fn
// (the host test builds with contraction on, as nvcc compiles: a volatile result is rounded and never fused)
inline float af_mul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float af_add_rn(float a, float b) { volatile float r = a + b; return r; }
inline float af_sub_rn(float a, float b) { volatile float r = a - b; return r; }
#endif
AF_HD float af_exp(float x) { return AF_PICK(__expf, expf)(x); }
AF_HD float af_log(float x) { return AF_PICK(__logf, logf)(x); }
AF_HD float af_exp2(float x) { return exp2f(x); }
AF_HD float af_log2(float x) { return AF_PICK(__log2f, log2f)(x); }
AF_HD float af_sin(float x) { return AF_PICK(__sinf, sinf)(x); }
AF_HD float af_cos(float x) { return AF_PICK(__cosf, cosf)(x); }
AF_HD float af_tanh(float x) { return AF_PICK(af_tanh_approx, tanhf)(x); }
AF_HD float af_sqrt(float x) { return AF_PICK(af_sqrt_approx, sqrtf)(x); }
// IEEE division (and sqrt) compile to a multi-instruction sequence with a slow-path call per score;
// the device takes the 2-ulp forms, the host (the g++ test against torch) the exact ones
AF_HD float af_div_exact(float a, float b) { return a / b; }
AF_HD float af_div(float a, float b) { return AF_PICK(__fdividef, af_div_exact)(a, b); }
// Float // and % as torch and Python compute them, from the exact remainder fmodf: floor(a / b) differs where
// the rounded quotient reaches a multiple the exact one does not (2.1f // 0.7f is 2, floorf(2.1f / 0.7f) 3)
AF_HD float af_mod(float a, float b) {
  const float r = fmodf(a, b);
  return (r != 0.f && ((r < 0.f) != (b < 0.f))) ? r + b : r;
}
AF_HD float af_floordiv(float a, float b) {
  if (b == 0.f) return af_div_exact(a, b);
  const float r = fmodf(a, b);
  float q = af_div_exact(a - r, b);  // an integer up to rounding
  if (r != 0.f && ((r < 0.f) != (b < 0.f))) q -= 1.f;
  if (q == 0.f) return copysignf(0.f, af_div_exact(a, b));
  const float f = floorf(q);
  return q - f > 0.5f ? f + 1.f : f;
}
// an integer power, wrapping on overflow as the rest of the 32-bit arithmetic does
AF_HD af_int af_ipow(af_int a, af_int n) {
  unsigned r = 1u, x = unsigned(a);
  for (; n > 0; n >>= 1, x *= x) if (n & 1) r *= x;
  return af_int(r);
}
AF_HD float af_sigmoid(float x) { return af_div(1.f, 1.f + af_exp(-x)); }
AF_HD float af_rsqrt(float x) { return AF_PICK(rsqrtf, 1.f / sqrtf)(x); }
// torch.div(rounding_mode="trunc") and torch.fmod: C's quotient and remainder (toward zero)
AF_HD af_int af_truncdiv(af_int a, af_int b) { return a / b; }
AF_HD float af_truncdiv(float a, float b) { return truncf(af_div_exact(a, b)); }
AF_HD af_int af_fmod(af_int a, af_int b) { return a % b; }
AF_HD float af_fmod(float a, float b) { return fmodf(a, b); }
AF_HD af_int af_sign(af_int x) { return (x > 0) - (x < 0); }
AF_HD float af_sign(float x) { return float((x > 0.f) - (x < 0.f)); }  // (NaN -> 0, as torch)
AF_HD bool af_sign(bool x) { return x; }
AF_HD af_int af_abs(af_int x) { return x < 0 ? -x : x; }
AF_HD float af_abs(float x) { return fabsf(x); }
AF_HD af_int af_min(af_int a, af_int b) { return a < b ? a : b; }
AF_HD af_int af_max(af_int a, af_int b) { return a > b ? a : b; }
AF_HD float af_min(float a, float b) { return fminf(a, b); }
AF_HD float af_max(float a, float b) { return fmaxf(a, b); }
AF_HD float af_pow(float a, float b) { return powf(a, b); }
AF_HD af_int af_index(af_int i, af_int size) { i = i < 0 ? i + size : i; return i < 0 ? 0 : (i >= size ? size - 1 : i); }
#endif
"""


@dataclass(eq=False)
class ScoreMod:
    """A compiled-modifier description. Equality and hashing follow `cache_key` only."""

    score_root: Optional[tuple]
    mask_root: Optional[tuple]
    tensors: list = field(default_factory=list)
    scalars: list = field(default_factory=list)
    slots: dict = field(default_factory=dict)
    raw_cpp: Optional[str] = None  # escape hatch: a C++ body for the variant struct
    name: str = "mod"
    sink: Optional[torch.Tensor] = None  # attention sink logits [Hq] (added to the softmax denominator)
    scalar_sources: list = field(default_factory=list)  # the 0-d tensors the scalars were read from (traced mods)

    @property
    def is_identity(self) -> bool:
        """Nothing to apply (a traced mask that is always True, as Flex's noop_mask): the plain kernel serves."""
        return self.score_root is None and self.mask_root is None and self.sink is None and self.raw_cpp is None

    @property
    def cache_key(self) -> str:
        parts = [graph.canonical(self.score_root), graph.canonical(self.mask_root),
                 repr(sorted((k, s.kind, s.ndim, s.dtype) for k, s in self.slots.items())), str(len(self.scalars)),
                 self.raw_cpp or "", "sink" if self.sink is not None else ""]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()

    def __eq__(self, other):
        return isinstance(other, ScoreMod) and other.cache_key == self.cache_key

    def __hash__(self):
        return hash(self.cache_key)

    @property
    def cpp_struct_name(self) -> str:
        return f"AfMod_{self.cache_key[:12]}"

    @property
    def scaled_core(self) -> Optional[tuple[float, float, str]]:
        """(in, out, F) when the score modifier is out * F(in * score) (attnforge/mods/scaled.py), else None."""
        return scaled.scaled_core(self.score_root)

    @property
    def kv_slope_root(self) -> Optional[tuple]:
        """B when the score modifier is score + A + B * kv_idx (attnforge/mods/affine.py), else None."""
        return affine.kv_slope(self.score_root, self.slots)

    # -- C++ --------------------------------------------------------------------------------
    def host_functions(self) -> str:
        """Plain C++ (compiles with g++ and nvcc): the mod bodies over an accessor `a`."""
        out = [CPP_PRELUDE]
        if self.score_root is not None:
            body = graph.emit_cpp(self.score_root, self.slots, "f")
            out.append(f"template <class A> AF_HD float {self.cpp_struct_name}_score(float score, af_int b, "
                       f"af_int h, af_int q_idx, af_int kv_idx, const A& a) {{\n{body}\n}}")
        if self.kv_slope_root is not None:
            body = graph.emit_cpp(self.kv_slope_root, self.slots, "f")
            out.append(f"template <class A> AF_HD float {self.cpp_struct_name}_kv_slope(af_int b, af_int h, "
                       f"af_int q_idx, const A& a) {{\n{body}\n}}")
        if self.scaled_core is not None:
            out.append(f"AF_HD float {self.cpp_struct_name}_core(float x) {{ return "
                       f"{graph.FLOAT_FUNCS[self.scaled_core[2]][1]}(x); }}")
        if self.mask_root is not None:
            body = graph.emit_cpp(self.mask_root, self.slots, "b")
            out.append(f"template <class A> AF_HD bool {self.cpp_struct_name}_mask(af_int b, af_int h, "
                       f"af_int q_idx, af_int kv_idx, const A& a) {{\n{body}\n}}")
        return "\n".join(out)

    @property
    def cpp_decl(self) -> str:
        n = self.cpp_struct_name
        reads = {"f32": "float({ptr}[off])", "f16": "__half2float({ptr}[off])",
                 "bf16": "__bfloat162float({ptr}[off])"}  # (integer and bool elements: af_int(...), below)
        ctypes_ = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "i32": "int", "i64": "long long",
                   "i16": "short", "i8": "signed char", "u8": "unsigned char", "b8": "unsigned char"}
        loads = {"f": [], "i": []}
        for k, s in sorted(self.slots.items()):  # typed at compile time: the dtype is in the cache key
            dims = ", ".join(f"p.mod_t{k}_size{d}" for d in range(s.ndim))
            ptr = f"static_cast<const {ctypes_[s.dtype]}*>(p.mod_t{k})"
            loads["f" if s.kind == "f" else "i"].append(
                f"    if (k == {k}) {{ const long long sz[{s.ndim}] = {{{dims}}}; long long off = 0;\n"
                f"      for (int d = 0; d < {s.ndim}; ++d) off = off * sz[d] + af_index(idx.begin()[d], sz[d]);\n"
                f"      return {reads.get(s.dtype, 'af_int({ptr}[off])').format(ptr=ptr)}; }}")
        scalars = "\n".join(f"    if (k == {k}) return p.mod_s{k};" for k in range(len(self.scalars)))
        accessor = f"""
template <class P>
struct {n}_Access {{
  const P& p;
  AF_HD float load_f(int k, std::initializer_list<af_int> idx) const {{
{chr(10).join(loads["f"])}
    return 0.f;
  }}
  AF_HD af_int load_i(int k, std::initializer_list<af_int> idx) const {{
{chr(10).join(loads["i"])}
    return 0;
  }}
  AF_HD float scalar(int k) const {{
{scalars}
    return 0.f;
  }}
}};
"""
        methods = []
        if self.score_root is not None:
            methods.append(f"""  static constexpr bool kHasLogitsTransform = true;
  template <class P> AF_DEVICE float logits_transform(const P& p, float s, const attnforge::LogitsIndex& i) const {{
    return {n}_score(s, i.batch, i.qo_head, i.qo_pos(), i.kv, {n}_Access<P>{{p}});
  }}""")
        if self.kv_slope_root is not None:
            methods.append(f"""  static constexpr bool kAffineKV = true;
  template <class P> AF_DEVICE float affine_kv_slope(const P& p, const attnforge::LogitsIndex& i) const {{
    return {n}_kv_slope(i.batch, i.qo_head, i.qo_pos(), {n}_Access<P>{{p}});
  }}""")
        if self.scaled_core is not None:
            scale_in, scale_out, _ = self.scaled_core
            methods.append(f"""  static constexpr bool kScaledCore = true;
  template <class P> AF_DEVICE float core_in_scale(const P&) const {{ return {scale_in!r}f; }}
  template <class P> AF_DEVICE float core_out_scale(const P&) const {{ return {scale_out!r}f; }}
  template <class P> AF_DEVICE float logits_core(const P&, float x) const {{ return {n}_core(x); }}""")
        if self.mask_root is not None:
            methods.append(f"""  static constexpr bool kHasMask = true;
  template <class P> AF_DEVICE bool logits_mask(const P& p, const attnforge::LogitsIndex& i) const {{
    return {n}_mask(i.batch, i.qo_head, i.qo_pos(), i.kv, {n}_Access<P>{{p}});
  }}""")
        if self.sink is not None:
            methods.append("""  static constexpr bool kHasSink = true;
  template <class P> AF_DEVICE float sink_logit(const P& p, uint32_t qo_head) const {
    return static_cast<const float*>(p.mod_sink)[qo_head];
  }""")
        if self.raw_cpp:
            methods.append(self.raw_cpp)
        struct = f"struct {n} : attnforge::IdentityVariant {{\n" + "\n".join(methods) + "\n};"
        return "#include <initializer_list>\n" + self.host_functions() + accessor + struct

    # -- runtime parameters ------------------------------------------------------------------
    def param_fields(self) -> list[ParamField]:
        fields = []
        for k, s in sorted(self.slots.items()):
            fields += [ParamField(f"mod_t{k}", "const void*", "ptr"), ParamField(f"mod_t{k}_dtype", "int32_t", "i32")]
            fields += [ParamField(f"mod_t{k}_size{d}", "int32_t", "i32") for d in range(s.ndim)]
        fields += [ParamField(f"mod_s{k}", "float", "f32") for k in range(len(self.scalars))]
        if self.sink is not None:
            fields.append(ParamField("mod_sink", "const void*", "ptr"))
        return fields

    def check_device(self, device: torch.device) -> None:
        """Every tensor the kernels read by address (captured tensors, sink logits) on `device`."""
        for k, t in enumerate(self.tensors):
            if t.device != device:
                raise ValueError(f"score_mod captured tensor #{k}: expected a tensor on {device}, got {t.device}. "
                                 f"Create it on the GPU (or call .to('{device}')) before building the mod.")
        if self.sink is not None and self.sink.device != device:
            raise ValueError(f"attention sink logits: expected a tensor on {device}, got {self.sink.device}. "
                             f"Create them on the GPU (or call .to('{device}')) before building the mod.")

    def param_values(self, device: torch.device) -> dict:
        self.check_device(device)
        vals = {}
        for k, t in enumerate(self.tensors):
            if not t.is_contiguous():
                raise ValueError(f"score_mod captured tensor #{k}: expected a contiguous tensor. Pass t.contiguous().")
            if graph.DTYPE_NAMES.get(t.dtype) != self.slots[k].dtype:
                raise ValueError(f"score_mod captured tensor #{k}: compiled for {self.slots[k].dtype}, now {t.dtype}. "
                                 "Keep the tensor's dtype or build the modifier again.")
            vals[f"mod_t{k}"] = t.data_ptr()
            vals[f"mod_t{k}_dtype"] = list(graph.DTYPE_NAMES).index(t.dtype)
            for d in range(t.dim()):
                vals[f"mod_t{k}_size{d}"] = t.shape[d]
        for k, v in enumerate(self.scalars):
            vals[f"mod_s{k}"] = float(v)
        if self.sink is not None:
            vals["mod_sink"] = self.sink.data_ptr()
        return vals

    def refresh_scalars(self) -> None:
        """Read the scalars from their 0-d tensors again: attention() does at each call, so a tensor written in
        place counts from the next call on (a CUDA tensor's read synchronises). A ScoreMod given to a wrapper
        keeps the values read when it was built: build another for other values (the same kernel serves it)."""
        for k, t in enumerate(self.scalar_sources):
            self.scalars[k] = scalar_value(t)

    # -- reference ------------------------------------------------------------------------------
    def torch_score(self, score, b, h, q_idx, kv_idx):
        if self.score_root is None:
            return score
        env = {"score": score.float(), "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        return graph.evaluate(self.score_root, env, self.tensors, self.scalars).to(score.dtype)

    def torch_mask(self, b, h, q_idx, kv_idx):
        if self.mask_root is None:
            return torch.ones((), dtype=torch.bool)
        return graph.evaluate(self.mask_root, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx},
                              self.tensors, self.scalars).bool()


def compile_mod(score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None, *,
                sink: Optional[torch.Tensor] = None, name: Optional[str] = None) -> ScoreMod:
    """Trace Python modifiers into a ScoreMod (the value AttentionSpec.score_mod takes)."""
    if score_mod is None and mask_mod is None and sink is None:
        raise ValueError("compile_mod: pass a score_mod, a mask_mod or a sink")
    if sink is not None:
        check_table("compile_mod", "sink", sink, 1, "[num_qo_heads] (one logit per query head)")
    tensors, scalars, slots, sources = [], [], {}, []
    roots = {}
    for kind, fn in (("score", score_mod), ("mask", mask_mod)):
        if fn is None:
            roots[kind] = None
            continue
        root, tracer = trace(fn, kind)
        # renumber this function's tensors and scalars after the previous function's
        t_off, s_off = len(tensors), len(scalars)
        root = _shift(root, t_off, s_off)
        for k, t in enumerate(tracer.tensors):
            tensors.append(t)
            s = tracer.slots[k]
            slots[k + t_off] = graph.TensorSlot(k + t_off, s.kind, s.ndim, s.dtype)
        scalars += tracer.scalars
        sources += tracer.scalar_sources
        roots[kind] = None if kind == "mask" and root == ("const", True, "b") else root  # (noop_mask: no mask)
    if len(tensors) > MAX_TENSORS or len(scalars) > MAX_SCALARS:
        raise ModTraceError(f"modifiers capture {len(tensors)} tensors and {len(scalars)} scalars; at most "
                            f"{MAX_TENSORS} and {MAX_SCALARS} are supported")
    label = name or "_".join(getattr(f, "__name__", "mod") for f in (score_mod, mask_mod) if f is not None) or "sink"
    return ScoreMod(roots["score"], roots["mask"], tensors, scalars, slots, name=label,
                    sink=None if sink is None else sink.float().contiguous(), scalar_sources=sources)


def raw_mod(cpp_body: str, tensors: Sequence[torch.Tensor] = (), scalars: Sequence[float] = (),
            name: str = "raw") -> ScoreMod:
    """Escape hatch: C++ methods for the variant struct (see attnforge/variant.cuh), with extra
    parameters p.mod_t<k> (const void*, plus p.mod_t<k>_dtype / _size<d>) and p.mod_s<k> (float)."""
    tensors, scalars = list(tensors), list(scalars)
    _check_raw_inputs(tensors, scalars)
    slots = {k: graph.TensorSlot(k, graph.slot_kind(t), t.dim(), graph.DTYPE_NAMES[t.dtype])
             for k, t in enumerate(tensors)}
    return ScoreMod(None, None, tensors, [float(s) for s in scalars], slots, raw_cpp=cpp_body, name=name)


def _check_raw_inputs(tensors, scalars) -> None:
    """raw_mod's extra parameters, checked as a traced modifier's are: a KeyError or an AttributeError would not
    say which argument is wrong, nor what would do."""
    if len(tensors) > MAX_TENSORS or len(scalars) > MAX_SCALARS:
        raise checks.fail("raw_mod", f"at most {MAX_TENSORS} tensors and {MAX_SCALARS} scalars",
                          f"{len(tensors)} and {len(scalars)}", "Pack tables into one tensor (a stacked table).")
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dtype not in graph.DTYPE_NAMES:
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise checks.fail(f"raw_mod(tensors[{k}])", "a torch.Tensor of dtype "
                              + ", ".join(str(d).replace("torch.", "") for d in graph.DTYPE_NAMES), got,
                              "Convert it (e.g. t.float() or t.int()); p.mod_t<k>_dtype tells the C++ which.")
    for k, v in enumerate(scalars):
        if not isinstance(v, (str, bytes)):  # (float() would parse a string)
            try:
                float(v)  # (a number, or a one-element tensor as before)
                continue
            except (TypeError, ValueError, RuntimeError):
                pass
        raise checks.fail(f"raw_mod(scalars[{k}])", "a number (passed as float32)", repr(v),
                          "Pass a Python int or float.")


def _shift(node, t_off, s_off):
    if not isinstance(node, tuple):
        return node
    if node[0] == "load":
        return ("load", node[1] + t_off, *[_shift(a, t_off, s_off) for a in node[2:]])
    if node[0] == "scalar":
        return ("scalar", node[1] + s_off, *node[2:])
    if node[0] in ("input", "const"):
        return node
    if node[0] == "cast":
        return ("cast", node[1], _shift(node[2], t_off, s_off))
    return (node[0], *[_shift(a, t_off, s_off) for a in node[1:]])

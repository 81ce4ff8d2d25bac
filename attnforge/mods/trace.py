"""Symbolic tracing of FlexAttention-style modifiers (no torch.compile).

    score_mod(score, b, h, q_idx, kv_idx) -> score      mask_mod(b, h, q_idx, kv_idx) -> bool

The function is called once with `Sym` proxies; arithmetic, comparisons, torch.where, min/max,
abs, exp, log, tanh, sigmoid, integer, bitwise and logical ops and indexing into captured tensors are
recorded into an expression graph (attnforge.mods.graph), typed as torch types them. Anything
data-dependent on traced values (an `if`, a loop, int()/float() of a traced value), an unknown
function, or an operation torch refuses on its operands' types raises ModTraceError naming the
construct and the line of the user's source where it happened.
"""
from __future__ import annotations

import inspect
import math
import threading
import traceback
from typing import Callable

import numpy as np
import torch

from .. import checks
from . import graph
from . import torch_names as names


class ModTraceError(TypeError):
    pass


class ModTraceAttributeError(ModTraceError, AttributeError):
    """A tensor attribute a traced value does not have: an AttributeError too, so hasattr() and getattr(x, name,
    default) answer as for any object instead of failing."""


def _user_line() -> str:
    """The innermost frame outside attnforge and torch: where the user's code did it."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if "attnforge/mods/" not in f and "/torch/" not in f and "<frozen" not in f:
            return f"{f}:{frame.lineno}: {frame.line}"
    return "<unknown>"


class Tracer:
    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.scalars: list[float] = []
        self.slots: dict[int, graph.TensorSlot] = {}
        self.scalar_sources: list[torch.Tensor] = []

    def tensor_slot(self, t: torch.Tensor) -> int:
        for i, known in enumerate(self.tensors):
            if known is t:
                return i
        if t.dtype not in graph.DTYPE_NAMES or t.dim() == 0 or t.dim() > 4:
            raise ModTraceError(f"captured tensor of dtype {t.dtype} and rank {t.dim()} cannot be indexed by a "
                                f"modifier; use a float32/float16/bfloat16, int64/int32/int16/int8/uint8 or bool "
                                f"tensor of rank 1..4 "
                                f"(at {_user_line()})")
        if t.dtype == torch.int64 and t.numel() and t.device.type != "meta" and \
                not isinstance(t, torch._subclasses.FakeTensor):
            lo, hi = int(t.min()), int(t.max())  # (once, when traced: the kernel reads int64 values as 32-bit)
            if lo < -2 ** 31 or hi >= 2 ** 31:
                raise ModTraceError(f"a captured int64 tensor holds values in [{lo}, {hi}], outside 32 bits; modifier "
                                    f"integers are 32-bit on the device, so they would wrap. Remap the values (e.g. "
                                    f"torch.unique(t, return_inverse=True)[1]) (at {_user_line()})")
        self.tensors.append(t)
        kind = graph.slot_kind(t)
        self.slots[len(self.tensors) - 1] = graph.TensorSlot(len(self.tensors) - 1, kind, t.dim(),
                                                             graph.DTYPE_NAMES[t.dtype])
        return len(self.tensors) - 1

    def scalar_slot(self, t: torch.Tensor) -> int:
        for i, known in enumerate(self.scalar_sources):
            if known is t:
                return i
        self.scalar_sources.append(t)
        self.scalars.append(scalar_value(t))
        return len(self.scalars) - 1


SCALAR_KINDS = {torch.float32: "f", torch.float16: "f", torch.bfloat16: "f", torch.float64: "f", torch.bool: "b",
                torch.int8: "i", torch.uint8: "i", torch.int16: "i", torch.int32: "i", torch.int64: "i"}
EXACT_INT_SCALAR = 2 ** 24  # integers a float32 parameter carries exactly


def scalar_value(t: torch.Tensor) -> float:
    """A 0-d tensor's value as the kernel's float32 parameter; an integer one must survive the trip."""
    v = t.item()
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= EXACT_INT_SCALAR:
        raise ModTraceError(f"a captured 0-d integer tensor holds {v}; runtime scalars travel as float32 and "
                            f"integers must stay below 2^24 in magnitude. Capture it in a 1-element tensor "
                            f"indexed with [0] instead (loaded as an integer).")
    return float(v)


_TRACER: list[Tracer] = []
_TRACE_LOCK = threading.Lock()


def _lift(x) -> tuple:
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, np.generic) and x.ndim == 0:  # a numpy scalar: its Python value
        x = x.item()
    if isinstance(x, bool):
        return ("const", bool(x), "b")
    if isinstance(x, int):
        return ("const", _int32(x), "i")
    if isinstance(x, float):
        if not math.isfinite(x):
            return ("const", x, "f")
        return ("const", float(x), "f")
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype in SCALAR_KINDS:
        # a 0-d tensor is a runtime scalar: changing its value never triggers a rebuild. It keeps its type
        # (an integer one is passed as a float32, exact below 2^24, and converted back in the kernel)
        kind = SCALAR_KINDS[x.dtype]
        return ("scalar", _TRACER[-1].scalar_slot(x)) + ((kind,) if kind != "f" else ())
    raise ModTraceError(f"value of type {type(x).__name__} cannot take part in a modifier expression "
                        f"(at {_user_line()})")


def _typed(node: tuple) -> "Sym":
    """Sym(node) once its operands' types are ones torch accepts for the op (the reference evaluates the
    graph in torch, and the C++ must agree with it)."""
    slots = _TRACER[-1].slots
    types = [graph.node_type(a, slots) for a in node[1:]]
    why = graph.type_error(node[0], types)
    if why is None and node[0] == "pow" and graph.result_type("pow", types) != "f":
        exponent = node[2]
        if not (exponent[0] == "const" and int(exponent[1]) >= 0):
            why = ("an integer power needs a constant exponent >= 0 (torch refuses negative ones); for a float "
                   "power convert the base with .to(torch.float32) or write a float exponent")
    if why is not None:
        raise ModTraceError(f"{why} (at {_user_line()})")
    return Sym(node)


def _binary(op):
    def f(self, other):
        return _typed((op, self.node, _lift(other)))

    def r(self, other):
        return _typed((op, _lift(other), self.node))
    return f, r


def _as_bool(node: tuple) -> tuple:
    """node as a boolean (nonzero), for torch.logical_*: casts only what is not boolean already."""
    return node if graph.node_type(node, _TRACER[-1].slots) == "b" else ("cast", "b", node)


class Sym:
    """A traced scalar expression (per score element)."""

    __slots__ = ("node",)

    def __init__(self, node: tuple):
        self.node = node

    __add__, __radd__ = _binary("add")
    __sub__, __rsub__ = _binary("sub")
    __mul__, __rmul__ = _binary("mul")
    __truediv__, __rtruediv__ = _binary("truediv")
    __floordiv__, __rfloordiv__ = _binary("floordiv")
    __mod__, __rmod__ = _binary("mod")
    __pow__, __rpow__ = _binary("pow")
    __lt__ = _binary("lt")[0]
    __le__ = _binary("le")[0]
    __gt__ = _binary("gt")[0]
    __ge__ = _binary("ge")[0]
    __eq__ = _binary("eq")[0]  # type: ignore[assignment]
    __ne__ = _binary("ne")[0]  # type: ignore[assignment]
    __and__, __rand__ = _binary("and")
    __or__, __ror__ = _binary("or")
    __xor__, __rxor__ = _binary("xor")
    __lshift__, __rlshift__ = _binary("lshift")
    __rshift__, __rrshift__ = _binary("rshift")

    def __neg__(self):
        return _typed(("neg", self.node))

    def __abs__(self):
        return _typed(("abs", self.node))

    def __invert__(self):
        return _typed(("not", self.node))

    __hash__ = None  # type: ignore[assignment]

    def _refuse(self, what: str, fix: str = "Use torch.where(cond, a, b) instead of `if`, and express loops "
                                             "over values with tensor indexing."):
        raise ModTraceError(f"{what} on a traced value is data-dependent and cannot be compiled "
                            f"(at {_user_line()}). {fix}")

    def __bool__(self):
        self._refuse("`if`/`and`/`or`/`not` (truth value)")

    def __iter__(self):
        self._refuse("iteration")

    def __index__(self):
        self._refuse("use as a Python index or range()")

    def __int__(self):
        self._refuse("int()", "Cast with .to(torch.int32), or round with torch.div(a, b, rounding_mode='floor').")

    def __float__(self):  # (what Python's math functions call on their argument)
        self._refuse("float() (or a math.* function, which calls it)",
                     "Call the torch function (torch.tanh, torch.exp, ...), and cast with .to(torch.float32).")

    def __len__(self):
        self._refuse("len()")

    def to(self, *args, **kwargs):
        """.to(dtype), .to(other), .to(device) (a no-op) and their keyword forms."""
        target = kwargs.get("dtype", next((a for a in args if isinstance(a, (torch.dtype, Sym))), None))
        if target is None:
            return self
        kind = target.kind if isinstance(target, Sym) else _dtype_kind(target)
        return Sym(("cast", kind, self.node)) if kind != self.kind else self

    @property
    def kind(self) -> str:
        return graph.node_type(self.node, _TRACER[-1].slots)

    # the tensor attributes FlexAttention's helpers read (and_masks: b.new_ones((), dtype=torch.bool))
    dtype = property(lambda self: names.KIND_DTYPES[self.kind])
    device = property(lambda self: torch.device("cpu"))
    shape = property(lambda self: torch.Size([]))
    ndim = 0

    def dim(self):
        return 0

    def size(self, *dim):
        if dim:
            raise ModTraceError(f"size({dim[0]}) of a traced value: it is 0-d, one value per score (at {_user_line()})")
        return torch.Size([])

    def numel(self):
        return 1

    def new_ones(self, *size, dtype=None, **kwargs):
        return self.new_full(kwargs.get("size", size[0] if len(size) == 1 else size), 1, dtype=dtype)

    def new_zeros(self, *size, dtype=None, **kwargs):
        return self.new_full(kwargs.get("size", size[0] if len(size) == 1 else size), 0, dtype=dtype)

    def new_full(self, size, fill_value, dtype=None, **_):
        """A constant of the given (0-d) size: (), [] or torch.Size([]) (device and the like are ignored)."""
        size = (size,) if isinstance(size, int) else tuple(size)
        if size != ():
            raise ModTraceError(f"new_*(size={size}) in a modifier: values are per score, only size () "
                                f"is supported (at {_user_line()})")
        return Sym(_constant(fill_value, _dtype_kind(dtype) if dtype is not None else self.kind))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in names.METHOD_ALIASES:
            return lambda *args, **kwargs: names.METHOD_ALIASES[name](self, *args, **kwargs)
        if name in names.CAST_METHODS:
            return lambda: self.to(names.CAST_METHODS[name])
        raise ModTraceAttributeError(f"tensor method or attribute .{name} is not supported in modifiers (at "
                                     f"{_user_line()}); see docs/mods.md for what is")

    def __repr__(self):
        return f"Sym({graph.canonical(self.node)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return _dispatch(func, args, kwargs)


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        raise ModTraceError(f"a cast to {dtype} in a modifier: its arithmetic is float32 and would not round as "
                            f"torch does; leave the value in float32 (at {_user_line()})")
    return "f" if dtype.is_floating_point else ("b" if dtype == torch.bool else "i")


def _constant(value, kind: str) -> tuple:
    return ("const", bool(value), "b") if kind == "b" else (
        ("const", _int32(int(value)), "i") if kind == "i" else ("const", float(value), "f"))


def _int32(v: int) -> int:
    """An integer constant as the device holds it: modifier integers are 32-bit (af_int), so one past 32 bits
    would wrap in the kernel while the torch reference computes in int64 (q - kv <= 10**12 masked every key)."""
    if not -2 ** 31 <= v < 2 ** 31:
        raise ModTraceError(f"the integer constant {v} is outside 32 bits; modifier integers are 32-bit on the device "
                            f"(as in FlexAttention's kernels), so it would wrap. Use a float constant (e.g. "
                            f"{float(v):g}), or one within 32 bits: a window past any sequence is no window "
                            f"(at {_user_line()})")
    return v


def _dispatch(func, args, kwargs):
    if func is torch.where:
        cond, a, b = (list(args) + [kwargs.get("input"), kwargs.get("other")])[:3]
        return Sym(("where", _lift(cond), _lift(a), _lift(b)))
    if func in names.FUNC_NAMES and not kwargs:
        return Sym((names.FUNC_NAMES[func], _lift(args[0])))
    if func in names.UNARY_FUNCS and len(args) == 1 and not kwargs:
        return _typed((names.UNARY_FUNCS[func], _lift(args[0])))
    if func is torch.square and len(args) == 1 and not kwargs:
        x = _lift(args[0])
        return _typed(("mul", x, x))
    if func is torch.div and len(args) == 2 and set(kwargs) <= {"rounding_mode"}:
        op = {None: "truediv", "floor": "floordiv", "trunc": "truncdiv"}[kwargs.get("rounding_mode")]
        return _typed((op, _lift(args[0]), _lift(args[1])))
    if func in names.LIKE_FUNCS or func is torch.full_like:
        like = args[0] if isinstance(args[0], Sym) else Sym(_lift(args[0]))
        value = names.LIKE_FUNCS.get(func, args[1] if len(args) > 1 else kwargs.get("fill_value"))
        dtype = kwargs.get("dtype")
        return Sym(_constant(value, _dtype_kind(dtype) if dtype is not None else like.kind))
    if func in names.BINARY_FUNCS and len(args) == 2 and not kwargs:
        return _typed((names.BINARY_FUNCS[func], _lift(args[0]), _lift(args[1])))
    if func in names.LOGICAL_FUNCS and len(args) == 2 and not kwargs:
        return Sym((names.LOGICAL_FUNCS[func], _as_bool(_lift(args[0])), _as_bool(_lift(args[1]))))
    if func in (torch.abs, torch.Tensor.abs, torch.Tensor.__abs__):
        return _typed(("abs", _lift(args[0])))
    if func in (torch.logical_not, torch.Tensor.logical_not):
        return Sym(("not", _as_bool(_lift(args[0]))))
    if func in (torch.bitwise_not, torch.Tensor.bitwise_not):
        return _typed(("not", _lift(args[0])))
    if func is torch.Tensor.__getitem__:
        tensor, index = args
        return _index(tensor, index)
    if func in (torch.clamp, torch.Tensor.clamp, torch.clip):
        x = _lift(args[0])
        lo, hi = (list(args[1:]) + [kwargs.get("min"), kwargs.get("max")])[:2]
        if lo is not None:
            x = ("maximum", x, _lift(lo))
        if hi is not None:
            x = ("minimum", x, _lift(hi))
        return Sym(x)
    raise ModTraceError(f"torch function {_torch_name(func)} is not supported in modifiers (at {_user_line()}). "
                        "Supported: arithmetic, comparisons, bitwise and logical operations, torch.where, min/max, "
                        "abs, clamp, div, fmod, floor/ceil/round/trunc, sign, exp, exp2, expm1, log, log2, log1p, "
                        "sqrt, rsqrt, sin, cos, tanh, sigmoid, *_like constants, and indexing captured tensors (see "
                        "docs/mods.md).")


def _torch_name(func) -> str:
    """How the user wrote a torch function: torch.erf, not its qualname _VariableFunctionsClass.erf."""
    name = getattr(func, "__name__", repr(func))
    for prefix, home in (("torch.", torch), ("torch.nn.functional.", torch.nn.functional), ("Tensor.", torch.Tensor)):
        if getattr(home, name, None) is func:
            return prefix + name
    return getattr(func, "__qualname__", name)


def _index(tensor: torch.Tensor, index) -> Sym:
    if not isinstance(tensor, torch.Tensor):
        raise ModTraceError(f"only captured torch tensors can be indexed by traced values (at {_user_line()})")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != tensor.dim():
        raise ModTraceError(f"a captured tensor of rank {tensor.dim()} must be indexed with {tensor.dim()} indices, "
                            f"got {len(idx)} (at {_user_line()}); slicing is not supported")
    nodes = []
    for i in idx:
        if isinstance(i, slice) or i is None or i is Ellipsis:
            raise ModTraceError(f"slices, None and ... are not supported when indexing in a modifier "
                                f"(at {_user_line()})")
        nodes.append(_lift(i))
    return Sym(("load", _TRACER[-1].tensor_slot(tensor), *nodes))


def _builtin_min_max(name):
    import builtins
    orig = getattr(builtins, name)

    def patched(*args, **kwargs):
        if len(args) == 2 and any(isinstance(a, Sym) for a in args) and not kwargs:
            return Sym(("minimum" if name == "min" else "maximum", _lift(args[0]), _lift(args[1])))
        return orig(*args, **kwargs)
    return orig, patched


def trace(fn: Callable, kind: str):
    """kind: 'score' (5 arguments) or 'mask' (4). Returns (root node, tracer)."""
    if not callable(fn):  # (inspect.signature's own error names no argument)
        raise ModTraceError(f"a {kind}_mod must be a Python function, got {checks.describe(fn)}; pass a "
                            f"lambda or a def taking ({'score, ' if kind == 'score' else ''}b, h, q_idx, kv_idx)")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    want = 5 if kind == "score" else 4
    if len(params) != want:
        sig = "score_mod(score, b, h, q_idx, kv_idx)" if kind == "score" else "mask_mod(b, h, q_idx, kv_idx)"
        raise ModTraceError(f"{getattr(fn, '__name__', fn)!s} takes {len(params)} positional arguments; a {kind}_mod "
                            f"must be {sig}")
    names = ["score", "b", "h", "q_idx", "kv_idx"][5 - want:]
    tracer = Tracer()
    import builtins
    saved = {}
    _TRACE_LOCK.acquire()  # builtins.min/max are swapped while tracing: one trace at a time
    _TRACER.append(tracer)
    try:
        for name in ("min", "max"):  # Python's min/max on traced values become minimum/maximum
            saved[name], patched = _builtin_min_max(name)
            setattr(builtins, name, patched)
        out = fn(*[Sym(("input", n)) for n in names])
        root = _lift(out)  # (with the tracer: a returned 0-d tensor becomes one of its scalars)
    finally:
        for name, orig in saved.items():
            setattr(builtins, name, orig)
        _TRACER.pop()
        _TRACE_LOCK.release()
    t = graph.node_type(root, tracer.slots)
    if kind == "mask" and t != "b":
        raise ModTraceError(f"mask_mod {getattr(fn, '__name__', fn)} must return a boolean expression, got a "
                            f"{'float' if t == 'f' else 'integer'} one")
    return root, tracer



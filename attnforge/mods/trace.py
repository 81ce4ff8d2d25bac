"""Symbolic tracing of FlexAttention-style modifiers (no torch.compile).

    score_mod(score, b, h, q_idx, kv_idx) -> score      mask_mod(b, h, q_idx, kv_idx) -> bool

The function is called once with `Sym` proxies; arithmetic, comparisons, torch.where, min/max,
abs, exp, log, tanh, sigmoid, integer ops and indexing into captured tensors are recorded into an
expression graph (attnforge.mods.graph). Anything data-dependent on traced values (an `if`, a
loop, int()/float() of a traced value) or an unknown function raises ModTraceError naming the
construct and the line of the user's source where it happened.
"""
from __future__ import annotations

import inspect
import math
import threading
import traceback
from typing import Callable

import torch

from . import graph


class ModTraceError(TypeError):
    pass


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
                                f"modifier; use a float32/float16/bfloat16/int32/int64 tensor of rank 1..4 "
                                f"(at {_user_line()})")
        self.tensors.append(t)
        kind = "f" if t.is_floating_point() else "i"
        self.slots[len(self.tensors) - 1] = graph.TensorSlot(len(self.tensors) - 1, kind, t.dim(),
                                                             graph.DTYPE_NAMES[t.dtype])
        return len(self.tensors) - 1

    def scalar_slot(self, t: torch.Tensor) -> int:
        for i, known in enumerate(self.scalar_sources):
            if known is t:
                return i
        self.scalar_sources.append(t)
        self.scalars.append(float(t.item()))
        return len(self.scalars) - 1


_TRACER: list[Tracer] = []
_TRACE_LOCK = threading.Lock()


def _lift(x) -> tuple:
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, bool):
        return ("const", bool(x), "b")
    if isinstance(x, int):
        return ("const", int(x), "i")
    if isinstance(x, float):
        if not math.isfinite(x):
            return ("const", x, "f")
        return ("const", float(x), "f")
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        # a 0-d tensor is a runtime scalar: changing its value never triggers a rebuild
        return ("scalar", _TRACER[-1].scalar_slot(x))
    raise ModTraceError(f"value of type {type(x).__name__} cannot take part in a modifier expression "
                        f"(at {_user_line()})")


def _binary(op):
    def f(self, other):
        return Sym((op, self.node, _lift(other)))

    def r(self, other):
        return Sym((op, _lift(other), self.node))
    return f, r


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

    def __neg__(self):
        return Sym(("neg", self.node))

    def __abs__(self):
        return Sym(("abs", self.node))

    def __invert__(self):
        return Sym(("not", self.node))

    __hash__ = None  # type: ignore[assignment]

    def _refuse(self, what: str):
        raise ModTraceError(f"{what} on a traced value is data-dependent and cannot be compiled "
                            f"(at {_user_line()}). Use torch.where(cond, a, b) instead of `if`, and "
                            "express loops over values with tensor indexing.")

    def __bool__(self):
        self._refuse("`if`/`and`/`or`/`not` (truth value)")

    def __iter__(self):
        self._refuse("iteration")

    def __index__(self):
        self._refuse("use as a Python index or range()")

    def __int__(self):
        self._refuse("int()")

    def __float__(self):
        self._refuse("float()")

    def __len__(self):
        self._refuse("len()")

    def to(self, dtype):
        kind = "f" if dtype.is_floating_point else ("b" if dtype == torch.bool else "i")
        return Sym(("cast", kind, self.node))

    def float(self):
        return self.to(torch.float32)

    def __repr__(self):
        return f"Sym({graph.canonical(self.node)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return _dispatch(func, args, kwargs)


_FUNC_NAMES = {torch.exp: "exp", torch.log: "log", torch.tanh: "tanh", torch.sqrt: "sqrt", torch.sigmoid: "sigmoid",
               torch.sin: "sin", torch.cos: "cos", torch.log2: "log2", torch.exp2: "exp2",
               torch.Tensor.exp: "exp", torch.Tensor.log: "log", torch.Tensor.tanh: "tanh",
               torch.Tensor.sigmoid: "sigmoid", torch.Tensor.sqrt: "sqrt"}
_BINARY_FUNCS = {torch.minimum: "minimum", torch.maximum: "maximum", torch.min: "minimum", torch.max: "maximum",
                 torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.eq: "eq", torch.ne: "ne",
                 torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge",
                 torch.logical_and: "and", torch.logical_or: "or", torch.pow: "pow", torch.remainder: "mod"}


def _dispatch(func, args, kwargs):
    if func is torch.where:
        cond, a, b = (list(args) + [kwargs.get("input"), kwargs.get("other")])[:3]
        return Sym(("where", _lift(cond), _lift(a), _lift(b)))
    if func in _FUNC_NAMES and not kwargs:
        return Sym((_FUNC_NAMES[func], _lift(args[0])))
    if func in _BINARY_FUNCS and len(args) == 2 and not kwargs:
        return Sym((_BINARY_FUNCS[func], _lift(args[0]), _lift(args[1])))
    if func in (torch.abs, torch.Tensor.abs, torch.Tensor.__abs__):
        return Sym(("abs", _lift(args[0])))
    if func in (torch.logical_not, torch.Tensor.logical_not):
        return Sym(("not", _lift(args[0])))
    if func is torch.Tensor.__getitem__:
        tensor, index = args
        return _index(tensor, index)
    if func in (torch.clamp, torch.Tensor.clamp):
        x = _lift(args[0])
        lo, hi = (list(args[1:]) + [kwargs.get("min"), kwargs.get("max")])[:2]
        if lo is not None:
            x = ("maximum", x, _lift(lo))
        if hi is not None:
            x = ("minimum", x, _lift(hi))
        return Sym(x)
    name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    raise ModTraceError(f"torch function {name} is not supported in modifiers (at {_user_line()}). Supported: "
                        "arithmetic, comparisons, torch.where, min/max, abs, clamp, exp, exp2, log, log2, sqrt, sin, cos, "
                        "tanh, sigmoid, and indexing captured tensors (see docs/mods.md).")


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
    finally:
        for name, orig in saved.items():
            setattr(builtins, name, orig)
        _TRACER.pop()
        _TRACE_LOCK.release()
    root = _lift(out)
    t = graph.node_type(root, tracer.slots)
    if kind == "mask" and t != "b":
        raise ModTraceError(f"mask_mod {getattr(fn, '__name__', fn)} must return a boolean expression, got a "
                            f"{'float' if t == 'f' else 'integer'} one")
    return root, tracer



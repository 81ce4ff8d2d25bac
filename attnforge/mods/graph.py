"""The expression graph of a traced modifier: evaluation in torch and emission as C++.

Nodes are immutable tuples (op, args...) so equal expressions are equal values and the cache key
is their canonical text. Types: "f" (float32), "i" (int64), "b" (bool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

FLOAT_FUNCS = {  # name -> (torch evaluation, C++ spelling: fast intrinsics on the device, libm on the host)
    "exp": (torch.exp, "af_exp"), "log": (torch.log, "af_log"), "tanh": (torch.tanh, "af_tanh"),
    "sqrt": (torch.sqrt, "af_sqrt"), "sin": (torch.sin, "af_sin"), "cos": (torch.cos, "af_cos"),
    "sigmoid": (torch.sigmoid, "af_sigmoid"), "log2": (torch.log2, "af_log2"), "exp2": (torch.exp2, "af_exp2"),
    "log1p": (torch.log1p, "log1pf"), "expm1": (torch.expm1, "expm1f"), "rsqrt": (torch.rsqrt, "af_rsqrt"),
}
BINARY = {  # op -> (torch evaluation, C++ template with {a} {b})
    "add": (torch.add, "({a} + {b})"), "sub": (torch.sub, "({a} - {b})"), "mul": (torch.mul, "({a} * {b})"),
    "truediv": (torch.true_divide, "af_div(float({a}), float({b}))"),  # emitted by _emit_division
    "floordiv": (lambda a, b: torch.div(a, b, rounding_mode="floor"), "af_floordiv({a}, {b})"),
    "mod": (torch.remainder, "af_mod({a}, {b})"),
    "lt": (torch.lt, "({a} < {b})"), "le": (torch.le, "({a} <= {b})"), "gt": (torch.gt, "({a} > {b})"),
    "ge": (torch.ge, "({a} >= {b})"), "eq": (torch.eq, "({a} == {b})"), "ne": (torch.ne, "({a} != {b})"),
    "minimum": (torch.minimum, "af_min({a}, {b})"), "maximum": (torch.maximum, "af_max({a}, {b})"),
    "pow": (torch.pow, "af_pow({a}, {b})"),
    "truncdiv": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), "af_truncdiv({a}, {b})"),
    "fmod": (torch.fmod, "af_fmod({a}, {b})"),
    # & | ^ << >> as in torch: logical on two booleans, bitwise on integers (a boolean counts as 0 / 1)
    "and": (torch.bitwise_and, "({a} & {b})"), "or": (torch.bitwise_or, "({a} | {b})"),
    "xor": (torch.bitwise_xor, "({a} ^ {b})"),
    "lshift": (torch.bitwise_left_shift, "({a} << {b})"), "rshift": (torch.bitwise_right_shift, "({a} >> {b})"),
}
BOOL_FORMS = {"and": "({a} && {b})", "or": "({a} || {b})", "xor": "({a} != {b})",  # two booleans give a boolean:
              "add": "({a} || {b})", "mul": "({a} && {b})", "maximum": "({a} || {b})",  # torch's True + True is True
              "minimum": "({a} && {b})"}
UNARY = {"neg": (torch.neg, "(-{a})"), "abs": (torch.abs, "af_abs({a})"), "not": (torch.bitwise_not, "(~{a})"),
         "sign": (torch.sign, "af_sign({a})")}
ROUNDING = {"floor": (torch.floor, "floorf"), "ceil": (torch.ceil, "ceilf"), "round": (torch.round, "rintf"),
            "trunc": (torch.trunc, "truncf")}  # (integers pass through unchanged; rintf rounds half to even)
COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
INTEGER_ONLY = {"and", "or", "xor", "not", "lshift", "rshift"}  # refused on floats, as torch refuses them
INPUT_TYPES = {"score": "f", "b": "i", "h": "i", "q_idx": "i", "kv_idx": "i"}


def contains(node, leaves: tuple) -> bool:
    """Whether any of `leaves` (e.g. ("input", "score")) occurs in the graph below `node`."""
    if not isinstance(node, tuple):
        return False
    return node in leaves or any(contains(a, leaves) for a in node[1:])


def reads_runtime_values(node) -> bool:
    """Whether the graph below `node` reads a captured tensor ("load") or a runtime scalar ("scalar"): a value the
    kernel knows only at run time (ALiBi's slopes table), not a constant the compiler folds."""
    if not isinstance(node, tuple) or not node:
        return False
    return node[0] in ("load", "scalar") or any(reads_runtime_values(a) for a in node[1:])


def applies_function_to_score(node) -> bool:
    """Whether a float function (FLOAT_FUNCS: tanh, exp, ...) takes the score in its argument somewhere
    below `node`: per score, an SFU op beside the softmax's exponential."""
    if not isinstance(node, tuple) or not node:
        return False
    if node[0] in FLOAT_FUNCS and contains(node[1], (("input", "score"),)):
        return True
    return any(applies_function_to_score(a) for a in node[1:])


def result_type(op: str, types: list[str]) -> str:
    """torch's promotion (bool < int64 < float32) for the graph's ops."""
    if op in COMPARE:
        return "b"
    if op in FLOAT_FUNCS or op == "truediv":
        return "f"
    if op in ("lshift", "rshift"):
        return "i"
    return "f" if "f" in types else ("i" if "i" in types else "b")


def type_error(op: str, types: list[str]) -> Optional[str]:
    """Why torch refuses `op` on operands of these types (None when it accepts them): the reference
    evaluates the graph in torch, so the tracer refuses what torch would."""
    if op in INTEGER_ONLY and "f" in types:
        return f"`{_SPELLING[op]}` is bitwise on integers and logical on booleans; torch refuses it on a float"
    if op in ("sub", "neg") and "b" in types:
        return "torch refuses `-` on a boolean; use `^` or `~` for booleans, or convert with .to(torch.int32)"
    if op in ("abs", "floordiv", "mod", "pow", "truncdiv", "fmod", *ROUNDING) and all(t == "b" for t in types):
        return f"torch refuses `{_SPELLING[op]}` on booleans; convert with .to(torch.int32) or .to(torch.float32)"
    return None


_SPELLING = {"and": "&", "or": "|", "xor": "^", "not": "~", "lshift": "<<", "rshift": ">>", "sub": "-", "neg": "-",
             "abs": "abs", "floordiv": "//", "mod": "%", "pow": "**", "truncdiv": "div(rounding_mode='trunc')",
             "fmod": "fmod", **{op: op for op in ROUNDING}}


# captured tensors' element types; the position is the runtime code raw C++ reads in p.mod_t<k>_dtype
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32",
               torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8"}


def slot_kind(t: torch.Tensor) -> str:
    """The graph type a load from this captured tensor has: a bool tensor's elements are booleans (as in torch,
    `keep[kv_idx]` can be a mask_mod's result), every other integer dtype's are integers."""
    return "f" if t.is_floating_point() else ("b" if t.dtype == torch.bool else "i")


@dataclass(frozen=True)
class TensorSlot:
    """A captured tensor: its position, element type and rank (values are runtime parameters)."""
    index: int
    kind: str  # "f", "i" or "b" (slot_kind)
    ndim: int
    dtype: str = "f32"  # one of DTYPE_NAMES' values: loads are typed at compile time


def node_type(node: tuple, slots: dict[int, TensorSlot]) -> str:
    op = node[0]
    if op == "input":
        return INPUT_TYPES[node[1]]
    if op == "const":
        return node[2]
    if op == "scalar":  # ("scalar", k) a float; ("scalar", k, kind) an integer or boolean one
        return node[2] if len(node) > 2 else "f"
    if op == "load":
        return slots[node[1]].kind
    if op == "where":
        t = {node_type(node[2], slots), node_type(node[3], slots)}
        return "f" if "f" in t else ("i" if "i" in t else "b")
    if op == "cast":
        return node[1]
    return result_type(op, [node_type(a, slots) for a in node[1:]])


def evaluate(node: tuple, env: dict[str, torch.Tensor], tensors: list[torch.Tensor], scalars: list[float]):
    """Evaluate in torch with broadcasting (the reference path)."""
    op = node[0]
    ev = lambda n: evaluate(n, env, tensors, scalars)  # noqa: E731
    if op == "input":
        return env[node[1]]
    if op == "const":
        return torch.tensor(node[1], dtype=torch.float32 if node[2] == "f" else
                            (torch.bool if node[2] == "b" else torch.int64))
    if op == "scalar":
        v, kind = scalars[node[1]], node_type(node, {})
        return torch.tensor({"f": float(v), "i": int(v), "b": v != 0}[kind])
    if op == "load":
        t = tensors[node[1]]
        idx = [_wrap_clamp(ev(i).to(torch.int64), t.shape[d]) for d, i in enumerate(node[2:])]
        idx = torch.broadcast_tensors(*idx)
        out = t[tuple(i.to(t.device) for i in idx)]
        return out.float() if out.is_floating_point() else (out if out.dtype == torch.bool else out.to(torch.int64))
    if op == "where":
        return torch.where(ev(node[1]).bool(), ev(node[2]), ev(node[3]))
    if op == "cast":
        v = ev(node[2])
        return v.float() if node[1] == "f" else (v.bool() if node[1] == "b" else v.to(torch.int64))
    args = [ev(a) for a in node[1:]]
    dev = next((a.device for a in args if a.dim() > 0), args[0].device)
    args = [a.to(dev) for a in args]
    if op in FLOAT_FUNCS:
        return FLOAT_FUNCS[op][0](args[0].float())
    if op in UNARY:
        return UNARY[op][0](args[0])
    if op in ROUNDING:
        return ROUNDING[op][0](args[0])
    if op == "truediv":
        return torch.true_divide(args[0].float(), args[1])
    if op == "pow" and (args[0].is_floating_point() or args[1].is_floating_point()):
        return torch.pow(args[0].float(), args[1].float())
    return BINARY[op][0](*args)


def _wrap_clamp(i: torch.Tensor, size: int) -> torch.Tensor:
    """Python-style negative indices, then clamped into range: never an out-of-bounds read."""
    return torch.where(i < 0, i + size, i).clamp(0, size - 1)


_CPP_TYPE = {"f": "float", "i": "af_int", "b": "bool"}  # af_int: 32-bit (attnforge/mods/variant.py)


DISCONTINUOUS = COMPARE | {"floordiv", "mod", "truncdiv", "fmod", "sign", *ROUNDING}  # and casts to int or bool:
# one rounding more or less can move their result
_ROUNDED = {"add": "af_add_rn", "sub": "af_sub_rn", "mul": "af_mul_rn"}


def rounded_arithmetic(root: tuple, slots: dict[int, TensorSlot]) -> set:
    """The float +, -, * nodes below a discontinuous operation. The device must round each of them as torch
    does: nvcc's fusion of a * b + c into one FMA skips a rounding, and `kv * 0.1 - q * 0.1 <= 0` then drops
    keys on the diagonal that the reference (and the block mask) keeps."""
    marked, below, visited = set(), set(), set()

    def mark_below(node):
        if not isinstance(node, tuple) or node in below:
            return
        below.add(node)
        if node[0] in _ROUNDED and node_type(node, slots) == "f":
            marked.add(node)
        for a in node[1:]:
            mark_below(a)

    def find(node):
        if not isinstance(node, tuple) or node in visited:
            return
        visited.add(node)
        if node[0] in DISCONTINUOUS or (node[0] == "cast" and node[1] != "f"):
            for a in node[1:]:
                mark_below(a)
        for a in node[1:]:
            find(a)
    find(root)
    return marked


def emit_cpp(root: tuple, slots: dict[int, TensorSlot], ret: str) -> str:
    """One C++ statement per node (shared sub-expressions are emitted once), ending in a return."""
    names: dict[tuple, str] = {}
    lines: list[str] = []
    rounded = rounded_arithmetic(root, slots)

    def visit(node: tuple) -> str:
        if node in names:
            return names[node]
        op = node[0]
        if op == "input":
            return node[1]
        if op == "const":
            v, t = node[1], node[2]
            return ("true" if v else "false") if t == "b" else (_float_literal(v) if t == "f" else f"af_int({int(v)})")
        if op == "scalar":  # (a float32 parameter; an integer one is exact below 2^24)
            forms = {"f": "a.scalar({})", "i": "af_int(a.scalar({}))", "b": "(a.scalar({}) != 0.f)"}
            expr = forms[node_type(node, slots)].format(node[1])
        elif op == "load":
            slot = slots[node[1]]
            idx = ", ".join(visit(i) for i in node[2:])
            fn = "load_f" if slot.kind == "f" else "load_i"  # (a bool element is loaded as an integer, 0 or 1)
            expr = f"a.{fn}({node[1]}, {{{idx}}})" if slot.kind != "b" else f"(a.load_i({node[1]}, {{{idx}}}) != 0)"
        elif op == "where":
            t = node_type(node, slots)
            expr = f"({visit(node[1])} ? {_cpp_cast(visit(node[2]), t)} : {_cpp_cast(visit(node[3]), t)})"
        elif op == "cast":
            expr = _cpp_cast(visit(node[2]), node[1])
        elif op in FLOAT_FUNCS:
            expr = f"{FLOAT_FUNCS[op][1]}(float({visit(node[1])}))"
        elif op == "not":  # logical on a boolean, bitwise on an integer
            a = visit(node[1])
            expr = f"(!{a})" if node_type(node[1], slots) == "b" else f"(~af_int({a}))"
        elif op in ROUNDING:  # (an integer is its own floor)
            a = visit(node[1])
            expr = f"{ROUNDING[op][1]}({a})" if node_type(node[1], slots) == "f" else a
        elif op in UNARY:
            a = visit(node[1])
            expr = UNARY[op][1].format(a=f"({a})" if a.startswith("-") else a)  # (-(-1.5f), not --1.5f)
        elif op == "truediv":
            expr = _emit_division(visit(node[1]), visit(node[2]), node[2])
        else:
            a, b = visit(node[1]), visit(node[2])
            t = node_type(node, slots)
            if op in COMPARE:  # C++ promotes as torch does: bool -> int -> float
                expr = BINARY[op][1].format(a=a, b=b)
            elif t == "b":
                expr = BOOL_FORMS[op].format(a=a, b=b)
            elif op == "pow" and t == "i":  # a non-negative constant exponent (the tracer checks)
                expr = f"af_ipow(af_int({a}), af_int({b}))"
            elif node in rounded:
                expr = f"{_ROUNDED[op]}(float({a}), float({b}))"
            else:  # both operands in the result's type: one overload of af_min / af_floordiv / ... applies
                if (node_type(node[1], slots), node_type(node[2], slots)) != (t, t):
                    a, b = _cpp_cast(a, t), _cpp_cast(b, t)
                expr = BINARY[op][1].format(a=a, b=b)
        name = f"v{len(names)}"
        names[node] = name
        lines.append(f"const {_CPP_TYPE[node_type(node, slots)]} {name} = {expr};")
        return name

    result = visit(root)
    lines.append(f"return {_cpp_cast(result, ret)};")
    return "\n".join(lines)


def _emit_division(a: str, b: str, divisor: tuple) -> str:
    """IEEE float division is a ~10-instruction sequence with a slow path; a modifier's quotient feeds a
    score rounded to bf16/fp16 anyway. A constant divisor becomes a multiply by its float32 reciprocal
    (one FMUL, no SFU: soft-cap's tanh already shares the SFU with the softmax's exp2), a runtime one
    af_div (device: __fdividef, 2 ulp). Both differ from a / b by at most a few float32 ulp."""
    if divisor[0] == "const" and divisor[2] != "b" and float(divisor[1]) != 0.0:
        inv = float(np.float32(1.0 / float(divisor[1])))
        if np.isfinite(inv) and inv != 0.0:
            return f"(float({a}) * {inv!r}f)"
    return f"af_div(float({a}), float({b}))"


def _float_literal(v: float) -> str:
    """A float32 constant in C++ for nvcc and g++ alike: `-inf` (torch.where(mask, score, -inf), the usual way
    to mask in a score_mod) and NaN have no literal."""
    if v != v:
        return '__builtin_nanf("")'
    if v in (float("inf"), float("-inf")):
        return f"({'-' if v < 0 else ''}__builtin_huge_valf())"
    return f"{float(v)!r}f"


def _cpp_cast(expr: str, t: str) -> str:
    return f"{_CPP_TYPE[t]}({expr})"


def canonical(node: Any) -> str:
    return repr(node)

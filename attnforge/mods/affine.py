"""Score modifiers of the form score + bias, the bias affine in the key position:
score + A(b, h, q_idx) + B(b, h, q_idx) * kv_idx (ALiBi, or any bias linear in distance).

A kernel that knows B evaluates the modifier once per row and KV tile (the Hopper prefill: at the
tile's first column of the thread, score 0, with the modifier's own integer arithmetic) or once per
item (decode: at the query's position), then steps by B per column: one FMA a score instead of
positions, an integer-to-float conversion and the body per score. Instructions per score are what
a modifier costs in the prefill (ALiBi on the H200: +21% with the body per score, +11% stepped).
"""
from __future__ import annotations

from typing import Optional

from . import graph

_SCORE, _KV = ("input", "score"), ("input", "kv_idx")
_ZERO = ("const", 0, "i")
_ONE = ("const", 1, "i")


def kv_slope(root: Optional[tuple], slots: dict) -> Optional[tuple]:
    """The graph of B when `root` is score + A + B * kv_idx (A and B free of score and kv_idx), else
    None. The coefficient of score must be exactly 1; kv_idx may enter only through +, -, negation,
    float casts and products with kv-free factors. `slots`: the mod's captured tensors (their types)."""
    if root is None:
        return None
    form = _form(root, {}, slots)
    return form[2] if form is not None and form[0] == "score" else None


def _form(node: tuple, memo: dict, slots: dict) -> Optional[tuple]:
    """("free", node) | ("kv", A, B): A + B kv | ("score", A, B): score + A + B kv | None."""
    if node in memo:
        return memo[node]
    memo[node] = out = _classify(node, memo, slots)
    return out


def _op(op: str, x: tuple, y: tuple, slots: dict) -> tuple:
    """(op, x, y), folding the 0 and 1 the decomposition introduces (the generated slope stays short).
    A boolean factor is made an integer first: in the source it was multiplied by a number, and the
    sum or difference of two booleans means something else in torch (True + True is True)."""
    x, y = (("cast", "i", v) if graph.node_type(v, slots) == "b" else v for v in (x, y))
    if op in ("add", "sub") and y == _ZERO:
        return x
    if op == "add" and x == _ZERO:
        return y
    if op == "sub" and x == _ZERO:
        return ("neg", y)
    if op == "mul" and _ZERO in (x, y):
        return _ZERO
    if op == "mul" and _ONE in (x, y):
        return y if x == _ONE else x
    return (op, x, y)


def _parts(form: tuple) -> tuple[tuple, tuple]:
    return (form[1], _ZERO) if form[0] == "free" else (form[1], form[2])


def _classify(node: tuple, memo: dict, slots: dict) -> Optional[tuple]:
    if not graph.contains(node, (_SCORE, _KV)):
        return ("free", node)
    if node == _KV:
        return ("kv", _ZERO, _ONE)
    if node == _SCORE:
        return ("score", _ZERO, _ZERO)
    op = node[0]
    if op == "cast":  # to float keeps the value (positions and biases stay far below 2^24)
        inner = _form(node[2], memo, slots)
        return inner if node[1] == "f" and inner is not None and inner[0] != "free" else None
    if op == "neg":
        inner = _form(node[1], memo, slots)
        if inner is None or inner[0] != "kv":
            return None  # -score: the coefficient of score would be -1
        return ("kv", _op("sub", _ZERO, inner[1], slots), _op("sub", _ZERO, inner[2], slots))
    if op in ("add", "sub"):
        x, y = _form(node[1], memo, slots), _form(node[2], memo, slots)
        if x is None or y is None or (x[0] == "score" and y[0] == "score") or (op == "sub" and y[0] == "score"):
            return None
        (ax, bx), (ay, by) = _parts(x), _parts(y)
        kind = "score" if "score" in (x[0], y[0]) else "kv"
        return (kind, _op(op, ax, ay, slots), _op(op, bx, by, slots))
    if op == "mul":
        x, y = _form(node[1], memo, slots), _form(node[2], memo, slots)
        if x is None or y is None:
            return None
        if x[0] == "free":
            x, y = y, x
        if x[0] != "kv" or y[0] != "free":
            return None  # kv * kv, or a scaled score
        return ("kv", _op("mul", x[1], y[1], slots), _op("mul", x[2], y[1], slots))
    return None

"""Score modifiers of the form out * F(in * score), out > 0 and in constants, F a float function
(soft-capping: cap * tanh(score / cap)).

A kernel that knows the form folds `in` into sm_scale and `out` into the log2 e of the exponent:
the row max of F(in * s) times out is the transform's row max (out > 0), so per score only the
multiply feeding F and F itself remain (two FMULs fewer than the body per score).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .graph import FLOAT_FUNCS

_SCORE = ("input", "score")


def _const(node) -> Optional[float]:
    return float(node[1]) if isinstance(node, tuple) and node[0] == "const" and node[2] != "b" else None


def _split_product(node: tuple) -> tuple[Optional[float], tuple]:
    """(c, rest) when node is c * rest or rest * c with a numeric constant c, else (None, node)."""
    if node[0] == "mul":
        for k, other in ((1, 2), (2, 1)):
            c = _const(node[k])
            if c is not None:
                return c, node[other]
    return None, node


def _in_scale(x: tuple) -> Optional[float]:
    """The float32 factor f with x == score * f as emitted C++ computes it (graph._emit_division's
    reciprocal for a constant divisor), or None."""
    if x == _SCORE:
        return 1.0
    if x[0] == "cast" and x[1] == "f":
        return _in_scale(x[2])
    c, rest = _split_product(x)
    if c is not None and _in_scale(rest) == 1.0:  # (the score itself, or a float cast of it)
        return float(np.float32(c))
    if x[0] == "truediv" and _in_scale(x[1]) == 1.0 and (d := _const(x[2])) is not None and d != 0.0:
        inv = float(np.float32(1.0 / d))
        return inv if np.isfinite(inv) and inv != 0.0 else None
    return None


def scaled_core(root: Optional[tuple]) -> Optional[tuple[float, float, str]]:
    """(in, out, F) when `root` is out * F(in * score) with constants out > 0 and in, F a float
    function; else None."""
    if root is None:
        return None
    out, core = _split_product(root)
    if out is None:
        out = 1.0
    if not (np.isfinite(out) and out > 0) or core[0] not in FLOAT_FUNCS:
        return None
    scale = _in_scale(core[1])
    return None if scale is None else (scale, float(np.float32(out)), core[0])

"""The mod library's argument checks: each factory says what it expected, what it got and how to fix it, before
tracing (a number where a table belongs would otherwise fail inside the trace as "not subscriptable")."""
from __future__ import annotations

import math
import numbers

import torch

from .. import checks
from .trace import ModTraceError


def check_table(who: str, name: str, t, dims: int, layout: str, integer: bool = False) -> None:
    """A captured table: a tensor of `dims` dimensions, real (integer where it holds ids or lengths). Its dtype's
    support is the tracer's to check (it names the dtypes a modifier can read)."""
    kind = "an integer" if integer else "a real"
    ok = (isinstance(t, torch.Tensor) and t.dim() == dims and t.dtype != torch.bool and not t.is_complex()
          and not (integer and t.is_floating_point()))
    if not ok:
        raise ModTraceError(f"{who}({name}=...): expected {kind} tensor {layout}, got {checks.describe(t)}. Pass a "
                            f"tensor on the device the kernel runs on; its values are read at each launch.")


def compiled_int(who: str, name: str, n) -> int:
    """An int >= 0 compiled into the modifier (checks.check_count: not a bool, a float or a string), as a Python
    int for the tracer."""
    checks.check_count(who, name, n, least=0, fix="It is compiled into the kernel (another value builds another "
                                                   "kernel): pass a Python int.")
    return int(n)


def check_cap(who: str, cap):
    """A soft-cap: a finite number > 0 (compiled in), or a 0-d real tensor (a runtime value, read at each launch)."""
    if isinstance(cap, torch.Tensor):
        if cap.dim() != 0 or cap.dtype == torch.bool or cap.is_complex():
            raise ModTraceError(f"{who}(cap=...): expected a number > 0 or a 0-d real tensor, got "
                                f"{checks.describe(cap)}. A runtime cap is one value: torch.tensor(50.0).")
        return cap
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (math.isfinite(cap) and cap > 0):
        raise ModTraceError(f"{who}(cap=...): expected a finite number > 0 (cap * tanh(score / cap)), got "
                            f"{checks.describe(cap)}. Gemma-2 uses 50.0; to turn capping off, leave the modifier out.")
    return float(cap)

"""The bad-input fuzz: a valid call of each public API, and mutations of one of its arguments at a time.

A mutation is one of three kinds:
  REFUSE  breaks a rule the API states (a dtype, a shape, an alignment, a page id, a range, a type): the call must
          raise a ValueError or TypeError that says what was expected and what it got, before any kernel launch;
  SAME    keeps every value and changes only the container (a list for an array, int64 for int32, a strided numpy
          view): the call must accept it and compute bitwise what the valid call computes;
  EITHER  keeps the values in a form an API may refuse (rows padded in memory, a list for a pair): a refusal as
          clear as REFUSE's, or the valid call's result.
A call is a dict of named arguments; `Api.invoke(env, args)` plans and runs it. tests/test_input_fuzz.py runs every
mutation of the APIs marked cpu on the CPU with the launches stubbed (plan() and run()'s checks are host code), and
tests/test_input_fuzz_gpu.py on a GPU, where each accepted call's output is compared with the valid call's."""
from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

REFUSE, SAME, EITHER = "refuse", "same", "either"


class Mutation(NamedTuple):
    arg: str  # the argument's key in the call's dict
    name: str  # what was done to it
    kind: str  # REFUSE, SAME or EITHER
    change: Callable[[Any], Any]  # the valid value -> the mutated one

    @property
    def id(self) -> str:
        return f"{self.arg}:{self.name}"


def _set(a: np.ndarray, i: int, value) -> np.ndarray:
    b = a.astype(np.int64).copy()
    b[i] = value
    return b


def index_array(arg: str, a: np.ndarray, gpu: bool, bad_value: int | None = -1) -> list[Mutation]:
    """A host int array of plan(): refused as floats, strings, 2-D, scalars, None, a CUDA tensor, one entry short
    or long, or with `bad_value` (a value the array may not hold) at its last entry; the same values as a list,
    int64, uint32, int16 where they fit, a CPU tensor, or a strided numpy view."""
    a = np.asarray(a)
    out = [Mutation(arg, "float", REFUSE, lambda x: np.asarray(x, np.float64)),
           Mutation(arg, "strings", REFUSE, lambda x: np.asarray([str(v) for v in x])),
           Mutation(arg, "2d", REFUSE, lambda x: np.asarray(x)[None, :]),
           Mutation(arg, "scalar", REFUSE, lambda x: np.asarray(x)[0]),
           Mutation(arg, "none", REFUSE, lambda x: None),
           Mutation(arg, "one-short", REFUSE, lambda x: np.asarray(x)[:-1]),
           Mutation(arg, "one-long", REFUSE, lambda x: np.append(x, np.asarray(x)[-1:])),
           Mutation(arg, "list", SAME, lambda x: np.asarray(x).tolist()),
           Mutation(arg, "int64", SAME, lambda x: np.asarray(x, np.int64)),
           Mutation(arg, "uint32", SAME, lambda x: np.asarray(x).astype(np.uint32)),
           Mutation(arg, "cpu-tensor", SAME, lambda x: torch.from_numpy(np.array(x, np.int32))),
           Mutation(arg, "strided", SAME, lambda x: np.repeat(np.asarray(x, np.int32), 2)[::2])]
    if a.size and np.abs(a).max() < 2**15:
        out.append(Mutation(arg, "int16", SAME, lambda x: np.asarray(x).astype(np.int16)))
    if bad_value is not None:
        out.append(Mutation(arg, f"last={bad_value}", REFUSE, lambda x: _set(np.asarray(x), -1, bad_value)))
    out.append(Mutation(arg, "last=2^31", REFUSE, lambda x: _set(np.asarray(x), -1, 2**31)))
    out.append(Mutation(arg, "last=2^32", REFUSE, lambda x: _set(np.asarray(x), -1, 2**32)))
    if gpu:
        out.append(Mutation(arg, "cuda-tensor", REFUSE, lambda x: torch.tensor(np.asarray(x), device="cuda")))
    return out


def _padded(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t's values in rows `extra` elements longer in memory (a view of the first columns)."""
    buf = torch.zeros(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=t.device)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]]


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values at an address one element past a 16-byte boundary."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def _other_dtype(t: torch.Tensor) -> torch.dtype:
    for d in (torch.float16, torch.bfloat16):
        if d != t.dtype:
            return d
    raise AssertionError


WRITTEN = ("out", "lse")  # the arguments a call writes (its output buffers)


def tensor(arg: str, t: torch.Tensor, gpu: bool, rows: bool = True, padded: str = EITHER) -> list[Mutation]:
    """A device tensor of run(): refused in another dtype, with one more dimension, one element short on the last
    (head) dimension, one row short (rows=True: its first dimension is counted by the plan), with a strided last
    dimension, at a misaligned address, with rows 1 element apart in memory past their end, tracked by autograd
    (a floating tensor), with every row at the first one's address (an output: WRITTEN), or on the CPU (gpu);
    padded rows 16-byte aligned are `padded`'s kind (an API may take row strides or refuse them)."""
    out = [Mutation(arg, "dtype", REFUSE, lambda x: x.to(_other_dtype(x))),
           Mutation(arg, "float32", REFUSE, lambda x: x.float()),
           Mutation(arg, "int32", REFUSE, lambda x: x.to(torch.int32)),
           Mutation(arg, "extra-dim", REFUSE, lambda x: x[None]),
           Mutation(arg, "narrow-last", REFUSE, lambda x: x[..., :-8].contiguous()),
           Mutation(arg, "strided-last", REFUSE, lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)),
           Mutation(arg, "misaligned", REFUSE, misaligned),
           Mutation(arg, "odd-row-stride", REFUSE, lambda x: _padded(x, 1)),
           Mutation(arg, "padded-rows", padded, lambda x: _padded(x, 8)),
           Mutation(arg, "copy", SAME, lambda x: x.clone())]
    if rows:
        out.append(Mutation(arg, "one-row-short", REFUSE, lambda x: x[:-1]))
    if t.dtype.is_floating_point:  # (grad mode is on in the tests: autograd would track it, and get no gradient)
        out.append(Mutation(arg, "requires-grad", REFUSE, lambda x: x.detach().clone().requires_grad_()))
    if arg in WRITTEN:  # (one row's memory for every row: CTAs storing other rows there would race)
        out.append(Mutation(arg, "overlapping-rows", REFUSE, lambda x: x[:1].expand_as(x)))
    if gpu:
        out.append(Mutation(arg, "cpu", REFUSE, lambda x: x.cpu()))
    return out


def retag(mutations: list, kind: str, *names: str) -> list:
    """The mutations named `names` as `kind` (an API that copies its inputs contiguous takes strided ones), the
    others as they are; kind None drops them (an API that also takes other dtypes or widths)."""
    return [m._replace(kind=kind) if m.name in names else m for m in mutations
            if kind is not None or m.name not in names]


def decode_out(arg: str, t: torch.Tensor, gpu: bool) -> list:
    """A decode kernel's out: its rows leave as one 8- or 16-byte store where the address allows, else a store an
    element, so rows at any offset or stride may be taken (tests/test_decode_gpu.py checks them bitwise)."""
    return retag(tensor(arg, t, gpu), EITHER, "misaligned", "odd-row-stride")


def scale(arg: str, refuse_zero: bool = True) -> list[Mutation]:
    """A float argument: refused as NaN, an infinity, a string or (refuse_zero) 0 and negative; the same value
    as a numpy float64 is SAME."""
    out = [Mutation(arg, "nan", REFUSE, lambda x: float("nan")), Mutation(arg, "inf", REFUSE, lambda x: float("inf")),
           Mutation(arg, "string", REFUSE, lambda x: str(x)), Mutation(arg, "np-float", SAME, lambda x: np.float64(x))]
    if refuse_zero:
        out += [Mutation(arg, "zero", REFUSE, lambda x: 0.0), Mutation(arg, "negative", REFUSE, lambda x: -abs(x))]
    return out


def page_size(arg: str = "page_size") -> list[Mutation]:
    """Tokens a page: refused as 0, -1, a float, a bool or a string; a numpy int is SAME."""
    bad = {"0": lambda x: 0, "-1": lambda x: -1, "float": float, "bool": lambda x: True, "string": str}
    return [Mutation(arg, name, REFUSE, f) for name, f in bad.items()] + \
        [Mutation(arg, "np-int", SAME, lambda x: np.int64(x))]


CLEAR = re.compile(r"expected .+, got ", re.S)


def clear_refusal(err: BaseException) -> str | None:
    """None if err is the refusal the fuzz asks for (a ValueError or TypeError saying expected and got, as
    checks.fail words it), else what is wrong with it."""
    if not isinstance(err, (ValueError, TypeError)):
        return f"{type(err).__name__} (expected a ValueError or TypeError): {err}"
    if not CLEAR.search(str(err)):
        return f"{type(err).__name__} without 'expected ..., got ...': {err}"
    return None


def outputs_equal(a, b) -> bool:
    """Bitwise equality of two results (a tensor, or a tuple of them; None where the API returns nothing)."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(outputs_equal(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = (lambda t: t.cpu().view(torch.uint8)) if a.dtype.is_floating_point else (lambda t: t.cpu())
    return torch.equal(bits(a), bits(b))  # (bitwise: NaN equals NaN, -0 differs from 0)

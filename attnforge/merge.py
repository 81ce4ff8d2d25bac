"""merge_state / merge_states: combine partial attention outputs by their LSE.

LSEs are natural-log everywhere in attnforge (as torch SDPA and FlexAttention return them):
    out = sum_i exp(s_i - S) * v_i,  S = log(sum_i exp(s_i)).
Rows whose LSE is -inf on every side give zeros and -inf, never NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import checks, ops
from .codegen import ParamField, ParamsLayout
from .jit import JitModule, registry
from .jit.loader import on_device

MERGE_PARAMS = ParamsLayout("MergeParams", [
    ParamField("v_a", "const void*", "ptr"), ParamField("lse_a", "const void*", "ptr"),
    ParamField("v_b", "const void*", "ptr"), ParamField("lse_b", "const void*", "ptr"),
    ParamField("out", "void*", "ptr"), ParamField("out_lse", "void*", "ptr"),
    ParamField("num_rows", "int32_t", "i32"), ParamField("num_states", "int32_t", "i32"),
    ParamField("num_heads", "int32_t", "i32"), ParamField("head_dim", "int32_t", "i32"),
])
_V_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_THREADS = 128


@dataclass(frozen=True)
class MergeSpec:
    """The merge kernel is specialised on the element types only."""

    dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"merge_states_{checks.CPP_TYPES[self.dtype]}_out{checks.CPP_TYPES[self.out_dtype]}"

    def module(self) -> JitModule:
        return JitModule(self.name, "merge_states.cu.jinja",
                         {"dtype": checks.CPP_TYPES[self.dtype], "out_dtype": checks.CPP_TYPES[self.out_dtype],
                          "params_struct": MERGE_PARAMS.cpp()},
                         ("merge_states_kernel", "merge_state_pair_kernel"))


def _launch_geometry(rows: int, head_dim: int, dtype: torch.dtype):
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    if head_dim % vec or head_dim // vec > _THREADS:
        raise checks.fail("head_dim", f"a multiple of {vec} and at most {_THREADS * vec} for {dtype}",
                          head_dim, "Pad the head dimension.")
    tx = head_dim // vec
    ty = max(1, _THREADS // tx)
    return ((rows + ty - 1) // ty,), (tx, ty)


def _run(kernel: str, v_a, s_a, v_b, s_b, num_states, out, out_lse):
    n, h, d = out.shape
    spec = MergeSpec(v_a.dtype, out.dtype)
    lib = registry.get_library(spec, spec.module, v_a.device)
    grid, block = _launch_geometry(n * h, d, v_a.dtype)
    params = MERGE_PARAMS.pack(
        v_a=v_a.data_ptr(), lse_a=s_a.data_ptr(), v_b=0 if v_b is None else v_b.data_ptr(),
        lse_b=0 if s_b is None else s_b.data_ptr(), out=out.data_ptr(), out_lse=out_lse.data_ptr(),
        num_rows=n * h, num_states=num_states, num_heads=h, head_dim=d)
    with on_device(v_a.device):
        lib[kernel].launch(grid, block, params)


def check_merge_out(out: torch.Tensor, device, shape) -> None:
    """A caller's merged output: on the inputs' device, of the shape, a merge's dtype, contiguous (stored an element
    at a time, so at any alignment)."""
    checks.check_cuda("out", out, device)
    checks.check_shape("out", out, shape, "merged output")
    checks.check_dtype("out", out, (torch.bfloat16, torch.float16, torch.float32))
    if not out.is_contiguous():
        raise checks.fail("out", "a contiguous tensor", f"strides {out.stride()}", "Pass out.contiguous().")


def _prepare_out(out, like: torch.Tensor, shape, out_dtype):
    if out_dtype is not None and out_dtype not in _V_DTYPES:  # (an int dtype reached the kernel cache's names)
        raise checks.fail("out_dtype", f"None (the inputs' dtype) or one of {_V_DTYPES}", out_dtype,
                          "Merge into bf16, fp16 or fp32.")
    if out is None:
        return torch.empty(shape, dtype=out_dtype or like.dtype, device=like.device)
    check_merge_out(out, like.device, shape)
    if out_dtype is not None and out.dtype != out_dtype:
        raise checks.fail("out_dtype", f"out's dtype {out.dtype} (or None) when out is given", out_dtype,
                          "Pass out_dtype or out, not two different dtypes.")
    return out


def merge_states(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None):
    """Merge S partial states: v [N, S, H, D], s [N, S, H] (float32, natural-log LSE).

    Returns (out [N, H, D], lse [N, H] float32).
    """
    checks.check_untracked("merge_states", ("v", v), ("s", s), ("out", out))
    if ops.compiling():
        return ops.compiled_merge(ops.merge_states_op, (v, s), out, out_dtype)
    checks.check_cuda("v", v)
    checks.check_cuda("s", s, v.device)
    checks.check_dtype("v", v, _V_DTYPES)
    checks.check_dtype("s", s, (torch.float32,))
    if v.dim() != 4:
        raise checks.fail("v.shape", "[N, S, H, D]", list(v.shape), "Stack the partial outputs on dim 1.")
    n, ns, h, d = v.shape
    checks.check_shape("s", s, (n, ns, h), "[N, S, H] LSE of each partial output")
    if ns == 0:
        raise checks.fail("v.shape[1]", "at least one state to merge", 0, "Pass S >= 1.")
    out = _prepare_out(out, v, (n, h, d), out_dtype)
    lse = torch.empty((n, h), dtype=torch.float32, device=v.device)
    if n * h:
        _run("merge_states_kernel", checks.dense_copy(v), s.contiguous(), None, None, ns, out, lse)
    return out, lse


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """Merge two states: v_* [N, H, D], s_* [N, H] float32 natural-log LSE. Returns (out, lse)."""
    checks.check_untracked("merge_state", ("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b), ("out", out))
    if ops.compiling():
        return ops.compiled_merge(ops.merge_state_op, (v_a, s_a, v_b, s_b), out, out_dtype)
    for name, t in (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b)):
        checks.check_cuda(name, t, v_a.device if name != "v_a" else None)
    checks.check_dtype("v_a", v_a, _V_DTYPES)
    if v_b.dtype != v_a.dtype:
        raise checks.fail("v_b.dtype", f"{v_a.dtype} (same as v_a)", v_b.dtype, "Cast one side.")
    if v_a.dim() != 3:
        raise checks.fail("v_a.shape", "[N, H, D]", list(v_a.shape), "Pass one state per row and head.")
    n, h, d = v_a.shape
    checks.check_shape("v_b", v_b, (n, h, d), "same as v_a")
    for name, t in (("s_a", s_a), ("s_b", s_b)):
        checks.check_dtype(name, t, (torch.float32,))
        checks.check_shape(name, t, (n, h), "[N, H] natural-log LSE")
    out = _prepare_out(out, v_a, (n, h, d), out_dtype)
    lse = torch.empty((n, h), dtype=torch.float32, device=v_a.device)
    if n * h:
        _run("merge_state_pair_kernel", checks.dense_copy(v_a), s_a.contiguous(), checks.dense_copy(v_b),
             s_b.contiguous(), 2, out, lse)
    return out, lse

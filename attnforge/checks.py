"""Input checks shared by the wrappers: every failure says expected / got / how to fix."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Sequence

import torch

from .spec import FLOAT32_MAX

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp32": torch.float32}
CPP_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float",
             torch.float8_e4m3fn: "fp8e4m3"}


def fail(what: str, expected: str, got, fix: str) -> ValueError:
    return ValueError(f"{what}: expected {expected}, got {got}. {fix}")


def describe(x) -> str:
    """A value as an error message shows it: a tensor by dtype and shape (its repr spans lines), else type and
    value, cut short."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"{type(x).__name__} {x!r:.40}"


def check_spec(who: str, spec, family: str, fix: str) -> None:
    """A wrapper's spec is an AttentionSpec of the family it runs (a raw int or string would otherwise fail on an
    attribute read deep inside, naming nothing)."""
    from .spec import AttentionSpec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"{who}(spec=...): expected an AttentionSpec(family={family!r}, ...), got "
                        f"{describe(spec)}. Build one with attnforge.AttentionSpec(family="
                        f"{family!r}, num_qo_heads=..., num_kv_heads=..., ...).")
    if spec.family != family:
        raise fail(f"{who} spec.family", repr(family), repr(spec.family), fix)


def check_plan_scales(sm_scale, k_scale, v_scale) -> None:
    """plan()'s scales, before any work: sm_scale None (1 / sqrt(head_dim)) or a finite float; k_scale and v_scale
    (an fp8 cache's per-tensor dequantisation scales, 1.0 for none) finite and > 0. A NaN, an infinity or a
    sign flip would otherwise reach every score of every request, silently."""
    if sm_scale is None and type(k_scale) is float and type(v_scale) is float and k_scale == v_scale == 1.0:
        return  # the usual call, the defaults (plan() is on the step's path)
    if sm_scale is not None and not finite_float32(sm_scale):
        raise fail("plan(sm_scale=...)", "None (1 / sqrt(head_dim)) or a finite float", repr(sm_scale),
                   "Pass the softmax scale as a float.")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (finite_float32(x) and x > 0):
            raise fail(f"plan({name}=...)", "a finite float > 0", repr(x),
                       "Pass the cache's per-tensor dequantisation scale (1.0 for none).")


def check_flag(who: str, name: str, value, optional: bool = False, fix: Optional[str] = None) -> None:
    """A constructor's switch: a bool (or None, the default's pick, where `optional`). A truthy string such as
    "no" would otherwise turn the option on."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise fail(f"{who}({name}=...)", "None, True or False" if optional else "True or False", repr(value),
                   fix or f"Pass a bool{' (None for the default)' if optional else ''}.")


def check_count(who: str, name: str, value, least: int = 1, fix: str = "Pass the largest count you will plan.") -> None:
    """A constructor's capacity or size: an int >= least (not a bool, a float or a string)."""
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least):
        raise fail(f"{who}({name}=...)", f"an int >= {least}", repr(value), fix)


def finite_float32(x) -> bool:
    """A real number (not a bool) that float32, the kernels' scale type, holds as a finite value."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and abs(x) <= FLOAT32_MAX


def cuda_device(device=None, who: str = "attnforge", host_ok: bool = False) -> torch.device:
    """The device a wrapper runs on: `device` as given (a torch.device, "cuda:1"), with "cuda" and None meaning
    the current CUDA device by its index, so that tensors on cuda:0 pass check_cuda's same-device test against a
    wrapper built with device="cuda". `who` names the wrapper. With `host_ok` (BatchPrefill, which allocates
    nothing at construction outside graph mode, and a VirtualKVCache on a stand-in driver) "cpu" or an explicit
    "cuda:N" also serve on a machine without a GPU, for host-side checks and tests; the other wrappers allocate
    on the GPU at construction. A missing GPU, or an index past the GPUs torch sees, is named here, before
    torch's own errors (an AssertionError from a CPU build of torch, or an invalid device ordinal at the first
    allocation)."""
    d = torch.device("cuda") if device is None else torch.device(device)
    if d.type != "cuda":
        if not host_ok:
            raise fail(f"{who}(device=...)", "a CUDA device ('cuda' or 'cuda:N')", repr(str(d)),
                       f"{who} allocates its buffers on the GPU at construction: pass device='cuda' or "
                       "'cuda:N'.")
        return d
    available = torch.cuda.is_available()
    if not available and (d.index is None or not host_ok):
        raise no_gpu(who)
    if d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if available and d.index >= torch.cuda.device_count():
        raise fail(f"{who}(device=...)", f"cuda:0 to cuda:{torch.cuda.device_count() - 1}",
                   repr(str(d)), "Name a GPU this process sees (CUDA_VISIBLE_DEVICES renumbers them from 0).")
    return d


def no_gpu(who: str) -> RuntimeError:
    """The error for a wrapper that needs a GPU on a machine whose torch sees none (raised before torch's own
    `AssertionError: Torch not compiled with CUDA enabled`)."""
    build = f"a CPU build of torch {torch.__version__}" if torch.version.cuda is None else \
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return RuntimeError(f"{who}: expected a CUDA GPU, got {build}. Install a CUDA build of torch or run on a "
                        "machine with a GPU; kernels build without one (python -m attnforge build).")


def require_gpu(device: torch.device, who: str) -> None:
    """For a wrapper built host-only on a named "cuda:N" (cuda_device's host_ok): its first GPU step (an SM count,
    a mask evaluated on the device, an upload) says the GPU is missing instead of torch's AssertionError."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise no_gpu(who)


def check_untracked(who: str, *named) -> None:
    """attnforge's kernels compute the forward pass only and write through raw pointers, so autograd records
    nothing of a call: an input it tracks would get no gradient, silently. Refused while grad mode is on; under
    torch.inference_mode() or torch.no_grad(), where engines run, the check is one flag read. named: (name,
    value) pairs, a value a tensor, a (K, V) pair or None."""
    if torch.is_grad_enabled():  # (attribute reads only: on a run's path in grad mode, half a generic loop's time;
        # plain loops, no generator expression, for dynamo, which traces this before a compiled call's custom op)
        for name, value in named:
            if isinstance(value, (tuple, list)):
                for i, t in enumerate(value):
                    if getattr(t, "requires_grad", False):
                        raise _tracked(who, f"{name}[{i}]")
            elif getattr(value, "requires_grad", False):
                raise _tracked(who, name)


def _tracked(who: str, name: str) -> ValueError:
    return fail(f"{who}: {name}", "a tensor autograd does not track (attnforge has no backward pass)",
                f"{name}.requires_grad=True with grad mode on",
                f"Call it under torch.inference_mode() or torch.no_grad(), or pass {name}.detach(); to train "
                "through attention, use torch SDPA or FlexAttention.")


def check_cuda(name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(name, "a torch.Tensor", type(t).__name__, "Pass a CUDA tensor.")
    if not t.is_cuda:
        raise fail(name, "a CUDA tensor", f"device {t.device}", f"Move it with {name}.cuda().")
    if device is not None and t.device != device:
        raise fail(name, f"a tensor on {device}", f"device {t.device}", "Put all inputs on one GPU.")


def workspace_floats(workspace: torch.Tensor, need: int, who: str) -> torch.Tensor:
    """A caller's workspace (any dtype, on the wrapper's GPU: check_cuda first) as `need` bytes of float32 values:
    contiguous, since the wrapper carves it by byte offsets, at a 16-byte aligned address, since the kernels store
    partial states as 16-byte vectors (a slice at another offset would fault at the first split request:
    a misaligned address), and large enough."""
    size = workspace.numel() * workspace.element_size()
    if not workspace.is_contiguous() or workspace.data_ptr() % 16:
        raise fail(f"{who}(workspace=...)", "a contiguous tensor at a 16-byte aligned address (the kernels store "
                   "partial states as 16-byte vectors)", f"data_ptr % 16 = {workspace.data_ptr() % 16}, strides "
                   f"{tuple(workspace.stride())} for shape {list(workspace.shape)}",
                   "Allocate it with torch.empty(n, dtype=torch.uint8, device=...), or share one buffer by slicing "
                   "it at multiples of 16 bytes.")
    if size < need:
        raise fail(f"{who}(workspace=...)", f"at least {need} bytes", size,
                   f"Allocate {who}.workspace_bytes(...)={need} bytes or let the wrapper allocate.")
    return workspace.reshape(-1).view(torch.uint8)[:need].view(torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise fail(f"{name}.dtype", " or ".join(str(a) for a in allowed), t.dtype,
                   f"Cast with {name}.to({allowed[0]}) or build a spec for this dtype.")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], meaning: str) -> None:
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise fail(f"{name}.shape", f"{shown} ({meaning})", list(t.shape), "Reshape or fix the spec.")


def check_contiguous_last(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise fail(f"{name}.stride(-1)", "1 (unit stride along the head dimension)", t.stride(-1),
                   f"Call {name}.contiguous().")


def check_aligned_rows(name: str, t: torch.Tensor) -> None:
    """16-byte aligned start and rows: the kernels copy and store rows in 16-byte vectors."""
    step = 16 // t.element_size()
    if t.data_ptr() % 16 or any(st % step for st in t.stride()[:-1]):
        fix = (f"Pass {name}.clone() (a view at an offset that is not 16-byte aligned)" if t.is_contiguous() else
               f"Call {name}.contiguous() (or allocate it unpadded)")
        raise fail(name, f"16-byte aligned rows (data_ptr % 16 == 0, strides other than the last multiples of "
                   f"{step} elements)", f"data_ptr % 16 = {t.data_ptr() % 16}, strides {tuple(t.stride())}", f"{fix}.")


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """t itself where it is contiguous and 16-byte aligned, else a contiguous copy (of a view at an offset too):
    for the calls that take any layout (attention(), the merges) over kernels that read 16-byte vectors."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_out(out: torch.Tensor, shape, dtype: torch.dtype, device, meaning: str, aligned: bool = True) -> None:
    """A given output buffer: its device, dtype, shape, unit stride along the head dimension and, where the kernel
    stores its rows as 16-byte vectors (aligned), 16-byte aligned rows (decode stores at any alignment)."""
    check_cuda("out", out, device)
    check_dtype("out", out, (dtype,))
    check_shape("out", out, shape, meaning)
    check_contiguous_last("out", out)
    if overlaps_itself(out):  # (an expanded view: CTAs would store different rows to one address, a race)
        raise fail("out", "a tensor whose elements never share an address (no expanded or interleaved strides)",
                   f"strides {tuple(out.stride())} for shape {list(out.shape)}",
                   "Pass a buffer from torch.empty, or out.contiguous().")
    if aligned:
        check_aligned_rows("out", out)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of t may share an address (torch refuses such tensors as in-place outputs): its
    dimensions of more than one element by stride, each stride past the extent of the smaller ones together.
    Conservative: an interleaved layout whose addresses happen to be distinct (strides 2 and 3) also answers yes."""
    extent = 1  # (addresses spanned, in elements, by the dimensions taken so far)
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False


def output_buffers(out, lse, return_lse: bool, shape, dtype: torch.dtype, device, meaning: str, lse_meaning: str,
                   memo: Optional["RunMemo"] = None):
    """The (out, lse) a wrapper writes: checked where given (check_output_buffers), else allocated (lse only if
    asked for)."""
    check_output_buffers(out, lse, shape, dtype, device, meaning, lse_meaning, memo)
    return allocate_outputs(out, lse, return_lse, shape, dtype, device)


def check_output_buffers(out, lse, shape, dtype: torch.dtype, device, meaning: str, lse_meaning: str,
                         memo: Optional["RunMemo"] = None, aligned: bool = True) -> None:
    """A caller's out (check_out) and lse (float32 [shape[0], shape[1]], contiguous), where given; with a memo,
    once per buffer layout."""
    if out is not None:
        if memo is None:
            check_out(out, shape, dtype, device, meaning, aligned)
        else:
            memo.get("out", (out,), lambda: check_out(out, shape, dtype, device, meaning, aligned), shape)
    if lse is not None:
        if memo is None:
            _check_lse(lse, shape, device, lse_meaning)
        else:
            memo.get("lse", (lse,), lambda: _check_lse(lse, shape, device, lse_meaning), shape)


def allocate_outputs(out, lse, return_lse: bool, shape, dtype: torch.dtype, device) -> tuple:
    """(out, lse): the caller's, or new ones (lse only if asked for)."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    if return_lse and lse is None:
        lse = torch.empty(tuple(shape[:2]), dtype=torch.float32, device=device)
    return out, lse


def _check_lse(lse, shape, device, meaning: str) -> None:
    check_cuda("lse", lse, device)
    check_dtype("lse", lse, (torch.float32,))
    check_shape("lse", lse, tuple(shape[:2]), meaning)
    if not lse.is_contiguous():
        raise fail("lse", "a contiguous tensor", lse.stride(), "Pass lse.contiguous().")


def tensor_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """All that the run checks read of a tensor: its address, shape, strides, dtype and device. Tensors with
    equal keys pass or fail every check alike, whatever their contents."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class RunMemo:
    """A wrapper's run() inputs as checked, with what was derived from them (pointers, strides), and what
    each plan derives once (a params template).

    On the GPU hosts a run's checks and its packing took as much host time as the launch. An engine plans
    once a step and calls run() once per layer, with that layer's cache and usually the same buffers: after
    the first step each call pays only for the keys (~1 us a tensor). An input's key holds what its checks
    read of it (tensor_key) and of the plan (`depends`, e.g. the batch size and page size); up to MAX_ENTRIES
    inputs are kept (a model's layers' caches). Derived values are plain numbers, never tensors: a memo must
    not keep a freed cache alive."""

    MAX_ENTRIES = 1024

    def __init__(self):
        self._inputs: dict = {}
        self._plan: dict = {}

    def new_plan(self) -> None:
        """Forget what the last plan derived (once()); checked inputs stay, keyed by what they depend on."""
        self._plan = {}

    def get(self, role: str, tensors: Sequence, derive: Callable[[], Any], *depends):
        """derive() (which checks the tensors and raises on bad input) once for each new set of keys."""
        key = [role, depends]
        for t in tensors:
            if t is not None and not isinstance(t, torch.Tensor):
                return derive()  # not a tensor: derive() raises the error that says so
            key.append(tensor_key(t))
        key = tuple(key)
        try:
            return self._inputs[key]
        except KeyError:
            pass
        value = derive()
        if len(self._inputs) >= self.MAX_ENTRIES:  # (an engine's inputs repeat: a full table is unusual)
            self._inputs.clear()
        self._inputs[key] = value
        return value

    def once(self, role: str, make: Callable[[], Any]):
        """make()'s value, made at the first call under the current plan (what depends on the plan alone)."""
        try:
            return self._plan[role]
        except KeyError:
            pass  # (make() runs outside the handler: its errors, a failed load say, are not chained to a KeyError)
        value = self._plan[role] = make()
        return value

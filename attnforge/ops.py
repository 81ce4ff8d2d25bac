"""torch.compile support: attnforge's GPU calls as torch custom ops (namespace `attnforge`).

Dynamo cannot trace a kernel launched through cuda-python. So each public call that launches one
(`attention`, `merge_state`, `merge_states`, and the `run` of BatchDecode, BatchMLADecode, BatchPrefill and
the Quest wrappers) switches to a custom op while dynamo traces it (`torch.compiler.is_compiling()`). The op
has a fake implementation that gives the output shapes from the input shapes, so a model that calls attnforge
compiles as one graph (`fullgraph=True`) with one opaque node per call. Eager calls never pass through these
ops.

An op reaches its wrapper, or a compiled score modifier, through a handle (a string such as "BatchDecode#3")
that the graph holds as a constant: an int could turn symbolic under dynamic shapes. plan() stays outside the
compiled function, as in eager use: it reads host arrays, and its results reach the compiled call through the
wrapper's device buffers. The handle table holds weak references: a wrapper must outlive the compiled
functions that call it.
"""
import itertools
import weakref
from typing import Optional

import torch

_NEXT_HANDLE = itertools.count(1)
_OBJECTS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_HANDLE_ATTR = "_attnforge_op_handle"


def handle(obj) -> str:
    """The name a compiled graph gives `obj` (a wrapper or a ScoreMod); the same for its lifetime. The
    wrappers take theirs when built: dynamo (torch 2.11) traces neither the weak table's insert nor a call
    that takes the wrapper as a constant, but it reads a str attribute."""
    h = obj.__dict__.get(_HANDLE_ATTR)
    if h is None:
        h = f"{type(obj).__name__}#{next(_NEXT_HANDLE)}"
        setattr(obj, _HANDLE_ATTR, h)
        _OBJECTS[h] = obj
    return h


def lookup(h: str):
    obj = _OBJECTS.get(h)
    if obj is None:
        raise RuntimeError(f"attnforge op handle {h}: the wrapper or score modifier it names was freed. Keep it "
                           "alive for as long as the compiled function that calls it.")
    return obj


def compiling() -> bool:
    return torch.compiler.is_compiling()


def _no_lse(like: torch.Tensor) -> torch.Tensor:
    # custom ops return a fixed number of tensors: an unrequested LSE is an empty one
    return like.new_empty((0,), dtype=torch.float32)


# --- the wrappers' run ---------------------------------------------------------------------------------

@torch.library.custom_op("attnforge::run", mutates_args=())
def run_op(wrapper: str, args: list[torch.Tensor], return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A planned wrapper's run on its tensor arguments, flattened: q, then the cache or the K and V of a pair."""
    w = lookup(wrapper)
    split = getattr(w, "_op_run_args", _q_and_kv)  # the run's positional arguments from the flat list
    got = w.run(*split(args), return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    return out, (lse if return_lse else _no_lse(out))


def _q_and_kv(args: list) -> tuple:
    """run(q, kv)'s arguments: kv a cache alone, or a (K, V) pair (paged.cache_list flattened them)."""
    return args[0], (args[1] if len(args) == 2 else tuple(args[1:]))


def rows_out_shape(spec, args: list, dtype: Optional[torch.dtype] = None):
    """(shape, dtype) of a run's output: a row of num_qo_heads x head_dim_vo per query row (args[0]'s rows), of
    `dtype` (None: the spec's out_dtype)."""
    from .checks import TORCH_DTYPES
    return (args[0].shape[0], spec.num_qo_heads, spec.head_dim_vo), dtype or TORCH_DTYPES[spec.out_dtype]


@run_op.register_fake
def _run_fake(wrapper, args, return_lse):
    shape, dtype = lookup(wrapper)._op_out_shape(args)
    out = args[0].new_empty(shape, dtype=dtype)
    return out, (args[0].new_empty(tuple(shape[:2]), dtype=torch.float32) if return_lse else _no_lse(out))


def compiled_run(wrapper, planned: bool, args: list, out: Optional[torch.Tensor], lse: Optional[torch.Tensor],
                 return_lse: bool):
    """What a wrapper's run returns under torch.compile; caller-given out / lse are filled by a copy."""
    if not planned:  # raised while the graph is made, not when it first runs
        raise RuntimeError(f"{type(wrapper).__name__}.run: call plan(...) first, outside the compiled function "
                           "(it reads host arrays); the compiled run then follows each new plan.")
    o, l_ = run_op(getattr(wrapper, _HANDLE_ATTR), args, return_lse or lse is not None)
    if out is not None:
        o = out.copy_(o)
    if lse is not None:
        l_ = lse.copy_(l_)
    return (o, l_) if return_lse else o


# --- attention(), the SDPA/Flex-layout one-shot call ------------------------------------------------------

# attention() plans at each call (host arrays copied to a wrapper shared by every call of its spec), which a
# CUDA graph cannot replay: inductor's graphs (mode="reduce-overhead") leave the op outside
# (no `from __future__ import annotations` in this file: older torch reads the ops' annotations as objects; and
# no tags argument where the tag is missing, as torch 2.4's custom_op takes none)
_GRAPH_UNSAFE = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("attnforge::attention", mutates_args=(), **_GRAPH_UNSAFE)
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: str, scale: Optional[float],
                 enable_gqa: bool, return_lse: bool, is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from .dense import attention_with_mod
    out, lse = attention_with_mod(q, k, v, lookup(mod) if mod else None, scale, enable_gqa, return_lse,
                                  causal=is_causal)
    return out, (lse if return_lse else _no_lse(out))


@attention_op.register_fake
def _attention_fake(q, k, v, mod, scale, enable_gqa, return_lse, is_causal=False):
    from .dense import check_attention_args
    check_attention_args(q, k, v, enable_gqa)  # bad shapes fail while the graph is made
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # (V's width: it may be narrower than q's)
    return out, (q.new_empty(tuple(q.shape[:3]), dtype=torch.float32) if return_lse else _no_lse(out))


@torch._dynamo.assume_constant_result
def mod_handle(score_mod, mask_mod) -> str:
    """Traced as a constant: builds (or reuses) the C++ modifier of the Python functions when the graph is
    made, so the compiled graph holds its handle ("": none) and not the tracing."""
    if score_mod is None and mask_mod is None:
        return ""
    from .dense import compiled_mod
    mod = compiled_mod(score_mod, mask_mod, for_graph=True)
    if mod.is_identity:
        return ""
    for k, t in enumerate(mod.tensors):
        if isinstance(t, torch._subclasses.FakeTensor):
            raise ValueError(f"score_mod captured tensor #{k}: under torch.compile a modifier may capture only "
                             "tensors that live outside the compiled function (globals, a module's buffers read "
                             "before compiling); got one the graph traces (an input of the compiled function, or "
                             "a tensor made inside it). Build the tensor outside.")
    return handle(mod)


# --- merge_state / merge_states ----------------------------------------------------------------------------

@torch.library.custom_op("attnforge::merge_state", mutates_args=())
def merge_state_op(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                   out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    from .merge import merge_state
    return merge_state(v_a, s_a, v_b, s_b, out_dtype=out_dtype)


@merge_state_op.register_fake
def _merge_state_fake(v_a, s_a, v_b, s_b, out_dtype):
    n, h, d = v_a.shape
    return v_a.new_empty((n, h, d), dtype=out_dtype or v_a.dtype), v_a.new_empty((n, h), dtype=torch.float32)


@torch.library.custom_op("attnforge::merge_states", mutates_args=())
def merge_states_op(v: torch.Tensor, s: torch.Tensor,
                    out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    from .merge import merge_states
    return merge_states(v, s, out_dtype=out_dtype)


@merge_states_op.register_fake
def _merge_states_fake(v, s, out_dtype):
    n, _, h, d = v.shape
    return v.new_empty((n, h, d), dtype=out_dtype or v.dtype), v.new_empty((n, h), dtype=torch.float32)


def compiled_merge(op, tensors: tuple, out: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]):
    merged, lse = op(*tensors, out_dtype if out is None else out.dtype)
    return (out.copy_(merged) if out is not None else merged), lse

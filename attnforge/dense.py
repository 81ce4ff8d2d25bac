"""attention(): the one-shot call in SDPA / FlexAttention layout, on the prefill kernels.

    out = attnforge.attention(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False)

q [B, Hq, Lq, D] and k, v [B, Hkv, Lk, D] are a ragged batch whose request r starts r*H*L rows of D in.
Models call it once per layer with the same shapes, so each call signature (the layouts of q, k and v,
enable_gqa and the modifier) keeps a `DenseCall`: its spec's own wrapper, planned once and planned again only
when the scale changes or, with a mask_mod, when the tensors and scalars the mask reads hold other values.
Each call then pays for its tensors' keys, one launch and (with a mask_mod) one comparison of the mask's
inputs, not for the spec, the plan and the block-sparse tile lists (2.2 ms at 128 tokens on the H200 host).
With a FlexAttention block_mask instead, the plan follows the BlockMask object, as Flex's block lists do: no
comparison and no synchronisation while the same BlockMask comes back; a new one plans again.
With ATTNFORGE_ATTENTION_DECODE=1, calls of one query a request, or of up to 8 causal ones, run on the decode
kernels instead (attnforge/dense_decode.py: K/V read in place, whatever their strides).
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numpy as np
import torch

from . import checks, dense_decode, flex_args, ops
from .attn_mask import as_modifiers as attn_mask_modifiers
from .merge import merge_states
from .prefill import BatchPrefill
from .spec import PREFILL_QK_VO_DIMS, AttentionSpec

_MODS: dict = {}  # eager calls' modifiers, bounded: a call that defines its modifier anew builds one a call
MAX_MODS = 64
_GRAPH_MODS: dict = {}  # kept for good: compiled graphs name their modifiers by weak handles (attnforge.ops)
_CALLS: dict = {}
MAX_CALLS = 64  # call signatures kept (a model has a few); past it the table starts over


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod=None, mask_mod=None,
              scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
              kernel_options=None, *, block_mask=None, is_causal: bool = False,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, return_aux=None):
    """SDPA/FlexAttention layout: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] -> out [B, Hq, Lq, Dv]
    (and lse [B, Hq, Lq], natural log); Dv = D, or narrower (spec.PREFILL_QK_VO_DIMS, e.g. 192/128).
    score_mod / mask_mod follow FlexAttention's signatures; q_idx is the query's position aligned to the end of
    the keys (Flex's q_idx when Lq == Lk). block_mask: a FlexAttention BlockMask, taken for its mask_mod (a
    Flex call carries over unchanged; attnforge makes its own tile lists when it plans, at the first call with
    that BlockMask object: build a new one when the mask's inputs change, as for Flex).
    is_causal: SDPA's, for Lq == Lk (query i sees keys 0..i): the prefill kernels' own causal tiles, no mask to
    plan from (with a score_mod or mask_mod, they apply within it).
    attn_mask: SDPA's, broadcastable to [B, Hq, Lq, Lk] (row i: query i); bool (True: the key takes part, and-ed
    with mask_mod; fully masked tiles are skipped) or float (added to the scaled score after score_mod; -inf
    masks). A row with every key masked gives zeros and lse -inf (SDPA's math backend gives NaN there).
    dropout_p: SDPA's, taken so a model's call carries over; only 0.0 (attnforge is forward-only, for inference).
    Flex's positional order carries over too (a BlockMask fifth is taken as block_mask), and its kernel_options
    (Triton tuning knobs: taken, and ignored) and return_aux=AuxRequest(lse=True) (returns (out, AuxOutput)).
    Under torch.compile the call is one custom op (attnforge.ops), its modifier built when the graph is.
    ATTNFORGE_ATTENTION_DECODE=1 runs calls of one query a request, and causal ones of up to 8, on the decode
    kernels (attnforge/dense_decode.py)."""
    checks.check_untracked("attention", ("q", q), ("k", k), ("v", v), ("attn_mask", attn_mask))
    check_no_dropout(dropout_p)
    mask_mod, block_mask = flex_args.positional_block_mask(mask_mod, block_mask)
    flex_args.check_modifier_functions(score_mod, mask_mod)
    flex_args.check_kernel_options(kernel_options)
    for name, flag in (("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        checks.check_flag("attention", name, flag)  # (a truthy "no" would turn it on)
    want_lse = flex_args.lse_wanted(return_lse, return_aux)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        check_attention_args(q, k, v, enable_gqa)  # (raises, naming the argument, before a shape is read below)
    mask_mod = flex_args.block_mask_function(mask_mod, block_mask, q, k)
    check_causal(is_causal, q, k)
    adapter = None if attn_mask is None else sdpa_mask(attn_mask, q, k, score_mod, mask_mod, block_mask, is_causal)
    if adapter is not None:
        score_mod, mask_mod = adapter.score_mod, adapter.mask_mod
    if ops.compiling():
        out, lse = ops.attention_op(q, k, v, ops.mod_handle(score_mod, mask_mod), scale, enable_gqa, want_lse,
                                    is_causal)
        return flex_outputs(out, lse, return_lse, return_aux)
    mod = compiled_mod(score_mod, mask_mod) if score_mod is not None or mask_mod is not None else None
    if mod is not None and mod.is_identity:
        mod = None
    out, lse = attention_with_mod(q, k, v, mod, scale, enable_gqa, want_lse,
                                  block_mask=block_mask if mod is not None else None, causal=is_causal)
    if adapter is not None:
        adapter.read_by_launch()
    return flex_outputs(out, lse, return_lse, return_aux)


def flex_outputs(out, lse, return_lse, return_aux):
    """SDPA's out, (out, lse) for return_lse, or Flex's (out, AuxOutput) for return_aux."""
    if return_aux is not None:
        return out, flex_args.aux_output(lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


def check_no_dropout(dropout_p) -> None:
    """SDPA's dropout_p: attnforge computes inference's attention, which has none."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise checks.fail("attention(dropout_p=...)", "0.0 (attnforge is forward-only: inference has no dropout)",
                          repr(dropout_p), "Pass dropout_p=(p if module.training else 0.0), or drop the argument.")


def check_causal(is_causal, q, k) -> None:
    """is_causal is SDPA's flag for as many queries as keys. With Lq != Lk SDPA's causal mask is aligned to the
    top left and FlashAttention's (and attnforge's q_idx) to the bottom right: refused rather than guessed."""
    if not isinstance(is_causal, bool):
        raise checks.fail("attention(is_causal=...)", "a bool", repr(is_causal), "Pass True or False, as to SDPA.")
    lq, lk = q.shape[-2], k.shape[-2]  # (4-d tensors: attention() checked them)
    if is_causal and lq != lk:
        top_left = f"q_idx - {lk - lq}" if lk > lq else f"q_idx + {lq - lk}"  # (query i's q_idx is Lk - Lq + i)
        raise checks.fail("attention(is_causal=True)", "as many queries as keys", f"Lq={lq} and Lk={lk}",
                          f"SDPA aligns its causal mask to the top left there, FlashAttention to the bottom right. "
                          f"For the bottom right pass mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx "
                          f"(attnforge's q_idx is aligned to the end of the keys); for the top left, "
                          f"mask_mod=lambda b, h, q_idx, kv_idx: {top_left} >= kv_idx")


def sdpa_mask(attn_mask, q: torch.Tensor, k: torch.Tensor, score_mod, mask_mod, block_mask, is_causal):
    """The MaskAdapter whose modifiers apply SDPA's attn_mask after score_mod and mask_mod (attnforge/attn_mask.py),
    filled with this call's mask."""
    for given, what in ((is_causal, "is_causal=True"), (block_mask is not None, "a block_mask")):
        if given:
            raise checks.fail("attention(attn_mask=...)", "one mask", f"an attn_mask and {what}",
                              "Fold one into the other (SDPA refuses attn_mask with is_causal too), e.g. the causal "
                              "rule as mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx beside the attn_mask.")
    if ops.compiling():
        raise checks.fail("attention(attn_mask=...)", "an eager call", "a call under torch.compile",
                          "Capture the mask in a mask_mod (lambda b, h, q_idx, kv_idx: keep[b, kv_idx]) or a "
                          "score_mod, which compiled graphs take.")
    return attn_mask_modifiers(attn_mask, tuple(q.shape), k.shape[-2], score_mod, mask_mod, q.device,
                               _mod_key)  # (q and k are 4-d here: attention() checked)


def compiled_mod(score_mod, mask_mod, for_graph: bool = False):
    """The C++ modifier of FlexAttention-style functions, built once per (function, captured objects).
    for_graph: a compiled graph will name it by its handle, so it is kept for good; eager calls' modifiers are
    kept in a bounded table (each entry holds its function and the tensors it captured)."""
    from .mods import compile_mod
    key = (_mod_key(score_mod), _mod_key(mask_mod))
    mod = _GRAPH_MODS.get(key)
    if mod is None:
        mod = _MODS.get(key)
    if mod is None:
        mod = compile_mod(score_mod=score_mod, mask_mod=mask_mod)
        if not for_graph:
            if len(_MODS) >= MAX_MODS:
                _MODS.clear()
            _MODS[key] = mod
    if for_graph:
        _GRAPH_MODS[key] = mod
    return mod


def _mod_key(fn):
    """What a built modifier depends on: the function, the objects in its closure and the tensors its globals
    name now (a global rebound to a new tensor needs a new build: the old one holds the old tensor)."""
    if fn is None:
        return None
    cells = tuple(id(c.cell_contents) for c in (fn.__closure__ or ()))
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    scope = getattr(fn, "__globals__", {})
    tensors = tuple(id(scope[n]) for n in names if isinstance(scope.get(n), torch.Tensor))
    return (fn, cells, tensors)


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    """attention()'s checks of devices, shapes and dtypes (no pointer: they also run on fake tensors)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_cuda(name, t, q.device if name != "q" else None)
        if t.dim() != 4:
            raise checks.fail(f"{name}.shape", "[B, H, L, D]", list(t.shape), "Use SDPA's layout.")
    bq, hq, lq, d = q.shape
    bk, hkv, lk, dk = k.shape
    dv = v.shape[3]
    if (bk, dk) != (bq, d) or v.shape[:3] != k.shape[:3] or (dv != d and (d, dv) not in PREFILL_QK_VO_DIMS):
        raise checks.fail("k/v shape", f"[{bq}, Hkv, Lk, {d}] each (v may be narrower: (D, Dv) in "
                          f"{PREFILL_QK_VO_DIMS})", f"{list(k.shape)}, {list(v.shape)}",
                          "Match batch, heads, lengths and head_dim; v must have k's shape but its last dim.")
    if hq != hkv and not enable_gqa:
        raise checks.fail("num heads", f"q heads == k heads ({hkv})", hq, "Pass enable_gqa=True for GQA/MQA.")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise checks.fail("k/v dtype", f"{q.dtype} (q's)", f"{k.dtype}/{v.dtype}", "Cast them to one dtype.")


class DenseCall:
    """One call signature's wrapper (its own: its plan is this signature's) and what its plan was made for."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod, causal: bool = False):
        hq, d = q.shape[1], q.shape[3]
        self.mod = mod  # (held: the signature keys the modifier by identity)
        self.contiguous = all(t.is_contiguous() for t in (q, k, v))
        spec = AttentionSpec(family="prefill", num_qo_heads=hq, num_kv_heads=k.shape[1], head_dim_qk=d,
                             head_dim_vo=v.shape[3], q_dtype=q.dtype, score_mod=mod, causal=causal)
        self.wrapper = BatchPrefill(spec, device=q.device)
        self.planned = False  # whether the wrapper's plan is this call's (a failed plan leaves none to reuse)
        self.scale: Optional[float] = None
        self.mask_inputs: Optional[MaskInputs] = None  # the mask's tensors and scalars as planned
        self.block_mask = None  # a weak reference to the BlockMask planned for (it keys the plan, not values)

    def plan(self, bq: int, hq: int, hkv: int, lq: int, lk: int, scale, block_mask=None) -> None:
        """Plan unless the last plan was for this scale and mask (the shapes are the signature's): the same
        BlockMask object where one is given, else the same values of the mask's inputs."""
        mask = self.mod is not None and self.mod.mask_root is not None
        if self.planned and scale == self.scale and (not mask or self._same_mask(block_mask)):
            return
        self.planned = False
        by_values = mask and block_mask is None
        self.mask_inputs = MaskInputs(self.mod) if by_values else None  # snapshot before the plan reads them
        self.block_mask = weakref.ref(block_mask) if mask and block_mask is not None else None
        self.wrapper.plan(np.arange(bq + 1) * lq, np.arange(bq + 1) * lk, sm_scale=scale,
                          q_offset=np.arange(bq) * hq * lq, kv_offset=np.arange(bq) * hkv * lk)
        self.scale, self.planned = scale, True

    def _same_mask(self, block_mask) -> bool:
        if block_mask is not None:  # (a weak reference: a dead one is None, never the object given)
            return self.block_mask is not None and self.block_mask() is block_mask
        return self.mask_inputs is not None and self.mask_inputs.same()


class MaskInputs:
    """The tensors and scalars a modifier's mask reads, copied when a plan's block-sparse tile lists were made
    from them. same() compares the current values (one device comparison, a synchronisation, per tensor): a
    write by any path, a kernel's or another library's included, makes the next call plan again."""

    def __init__(self, mod):
        tensors, scalars = set(), set()
        _inputs_of(mod.mask_root, tensors, scalars)
        self._mod = mod
        self._tensors = [(t, t.clone()) for t in (mod.tensors[i] for i in sorted(tensors))]
        self._scalars = [(i, mod.scalars[i]) for i in sorted(scalars)]  # (floats: refresh_scalars keeps them so)

    def same(self) -> bool:
        return all(self._mod.scalars[i] == value for i, value in self._scalars) and \
            all(now.shape == was.shape and torch.equal(now, was) for now, was in self._tensors)


def _inputs_of(node, tensors: set, scalars: set) -> None:
    """The captured tensor and scalar slots an expression graph reads."""
    if not isinstance(node, tuple):
        return
    if node[0] == "load":
        tensors.add(node[1])
    elif node[0] == "scalar":
        scalars.add(node[1])
    for arg in node[1:]:
        _inputs_of(arg, tensors, scalars)


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod, enable_gqa: bool, causal: bool) -> tuple:
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, enable_gqa, id(mod), causal)


def dense_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod, enable_gqa: bool,
               causal: bool = False):
    """The DenseCall of these tensors' layouts, made (after the checks) at the signature's first call; a
    dense_decode.DecodeCall where ATTNFORGE_ATTENTION_DECODE asks for it and the call fits (dense_decode.fits)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        check_attention_args(q, k, v, enable_gqa)  # (raises, naming the argument)
    decode = dense_decode.wanted(q)  # (in the signature: the knob may change between calls)
    sig = _signature(q, k, v, mod, enable_gqa, causal) + (decode,)
    call = _CALLS.get(sig)  # (a call holds its modifier, so the id in its signature is not reused meanwhile)
    if call is None:
        check_attention_args(q, k, v, enable_gqa)
        decode = decode and dense_decode.fits(q, k, v, mod, causal)
        call = dense_decode.DecodeCall(q, k, v, mod) if decode else DenseCall(q, k, v, mod, causal)
        if len(_CALLS) >= MAX_CALLS:
            _CALLS.clear()
        _CALLS[sig] = call
    return call


def attention_with_mod(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod, scale: Optional[float],
                       enable_gqa: bool, return_lse: bool = True, block_mask=None, causal: bool = False):
    """attention() with its modifier already built (a ScoreMod or None). Returns (out, lse or None).
    block_mask: the FlexAttention BlockMask the mask came from, which keys the plan (DenseCall.plan).
    causal: attention()'s is_causal, checked (check_causal)."""
    if mod is not None and mod.scalar_sources:
        mod.refresh_scalars()  # (a captured 0-d tensor written in place since the last call)
    call = dense_call(q, k, v, mod, enable_gqa, causal)
    if isinstance(call, dense_decode.DecodeCall):
        return call.run(q, k, v, scale, return_lse)
    addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if not call.contiguous or (addresses[0] | addresses[1] | addresses[2]) % 16:  # (the usual case is neither)
        q, k, v = (checks.dense_copy(t) for t in (q, k, v))  # any layout, as SDPA takes
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    bq, hq, lq, _ = q.shape
    hkv, lk, d = k.shape[1], k.shape[2], v.shape[3]  # (d: the output's, V's width)
    call.plan(bq, hq, hkv, lq, lk, scale, block_mask)
    w = call.wrapper
    out = q.new_empty((bq, hq, lq, d))
    slots = w._plan["num_slots"]
    if slots > 1:  # split KV (few query tiles, long keys): partials [B, H, Lq, slots, D], merged by LSE
        part = torch.empty((bq, hq, lq, slots, d), dtype=torch.float32, device=q.device)  # (a split plan: float rows)
        part_lse = torch.full((bq, hq, lq, slots), -math.inf, dtype=torch.float32, device=q.device)
        template = w._dense_template(q, k, v, dict(out_stride_n=slots * d, out_stride_h=lq * slots * d,
                                                   out_stride_slot=d, lse_stride_n=slots, lse_stride_h=lq * slots,
                                                   lse_stride_slot=1), addresses)
        w._launch_filled(template, out=part.data_ptr(), lse=part_lse.data_ptr())
        rows = bq * hq * lq
        _, lse = merge_states(part.view(rows, slots, 1, d), part_lse.view(rows, slots, 1), out=out.view(rows, 1, d))
        return out, (lse.view(bq, hq, lq) if return_lse else None)
    lse = torch.empty((bq, hq, lq), dtype=torch.float32, device=q.device) if return_lse else None
    template = w._dense_template(q, k, v, dict(out_stride_n=d, out_stride_h=lq * d, out_stride_slot=0,
                                               lse_stride_n=1, lse_stride_h=lq, lse_stride_slot=0), addresses)
    w._launch_filled(template, out=out.data_ptr(), lse=0 if lse is None else lse.data_ptr())
    return out, lse

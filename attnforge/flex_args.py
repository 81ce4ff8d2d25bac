"""attention()'s FlexAttention arguments: a `flex_attention(...)` call must carry over to `attnforge.attention(...)`
unchanged, positional arguments and Flex's newer keywords included, or be refused with a clear error.

Flex's order is (query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options); ours puts
mask_mod where Flex puts block_mask, so a BlockMask arriving there is taken as the block_mask it is."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from . import checks


def is_block_mask(x) -> bool:
    """A FlexAttention BlockMask, by what attention() reads of it, its mask_mod (no import of torch's flex module
    needed; a mask_mod function has no such attribute)."""
    return callable(getattr(x, "mask_mod", None))


def positional_block_mask(mask_mod, block_mask):
    """(mask_mod, block_mask) with a BlockMask passed in mask_mod's place (Flex's fifth argument) moved to
    block_mask, where attention() reads it."""
    if not is_block_mask(mask_mod):
        return mask_mod, block_mask
    if block_mask is not None:
        raise checks.fail("attention(mask_mod=..., block_mask=...)", "one mask", "a BlockMask in each",
                          "Pass the BlockMask once, as block_mask= (or as the fifth argument, Flex's place).")
    return None, mask_mod


def block_mask_function(mask_mod, block_mask, q: torch.Tensor, k: torch.Tensor):
    """The mask_mod a call asks for: its own, or its FlexAttention BlockMask's (checked against q and k)."""
    if block_mask is None:
        return mask_mod
    if mask_mod is not None:
        raise checks.fail("attention(mask_mod=..., block_mask=...)", "one of the two", "both a mask_mod and a "
                          "block_mask", "Pass one: a block_mask stands for the mask_mod it was built from.")
    if not is_block_mask(block_mask):
        raise TypeError(f"attention: block_mask must be a FlexAttention BlockMask (create_block_mask(mask_mod, "
                        f"B, H, Q_LEN, KV_LEN)), got {type(block_mask).__name__}")
    if q.shape[-2] != k.shape[-2]:  # (a BlockMask holds Flex's positions; taking its function would move them)
        raise ValueError(f"attention: a block_mask needs as many queries as keys, got {q.shape[-2]} and "
                         f"{k.shape[-2]}: FlexAttention's q_idx starts at 0 while attnforge aligns queries to the "
                         f"end of the keys, so the same mask_mod would mask other pairs. Pass mask_mod= written "
                         f"for end-aligned positions (q_idx = {k.shape[-2] - q.shape[-2]} + the query's row)")
    built_for = tuple(getattr(block_mask, "seq_lengths", ()))
    if built_for and built_for != (q.shape[-2], k.shape[-2]):
        raise ValueError(f"attention: the block_mask was built for (Q_LEN, KV_LEN) = {built_for}, but q holds "
                         f"{q.shape[-2]} queries and k {k.shape[-2]} keys; build it with create_block_mask(mask_mod, "
                         f"B, H, {q.shape[-2]}, {k.shape[-2]})")
    return block_mask.mask_mod


def check_modifier_functions(score_mod, mask_mod) -> None:
    """score_mod and mask_mod are functions (or None), checked before they are keyed or traced."""
    for name, fn, signature in (("score_mod", score_mod, "score_mod(score, b, h, q_idx, kv_idx)"),
                                ("mask_mod", mask_mod, "mask_mod(b, h, q_idx, kv_idx)")):
        if fn is not None and not callable(fn):
            sdpa = (" A tensor there may be SDPA's attn_mask, fourth in SDPA's order: pass it as attn_mask=."
                    if isinstance(fn, torch.Tensor) else "")
            raise TypeError(f"attention({name}=...): expected None or a function {signature}, got "
                            f"{checks.describe(fn)}. Pass a Python function (a lambda or a def) as "
                            f"for FlexAttention, or None.{sdpa}")


def check_kernel_options(kernel_options) -> None:
    """Flex's kernel_options are its Triton kernel's tuning knobs (tile sizes, warps, stages, backend). attnforge
    picks its own tiles per spec, so they are taken, so a Flex call carries over, and change nothing."""
    if kernel_options is None:
        return
    if not isinstance(kernel_options, Mapping) or not all(isinstance(key, str) for key in kernel_options):
        raise checks.fail("attention(kernel_options=...)", "None or a dict of FlexAttention's options by name",
                          checks.describe(kernel_options),
                          "Pass a dict such as {'BLOCK_M': 64} (attnforge ignores them: it picks its own tiles), "
                          "or drop the argument.")


def lse_wanted(return_lse, return_aux) -> bool:
    """Whether the call needs the LSE: return_lse=True, or Flex's return_aux=AuxRequest(lse=True). Flex refuses
    both at once; so does attention(). max_scores (each row's largest score) is not kept by attnforge's kernels."""
    if return_aux is None:
        return return_lse
    if return_lse:
        raise checks.fail("attention(return_lse=True, return_aux=...)", "one of the two", "both",
                          "Pass return_aux=AuxRequest(lse=True) alone, as FlexAttention requires, or return_lse "
                          "alone.")
    lse, max_scores = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
    if not isinstance(lse, bool) or not isinstance(max_scores, bool):
        raise checks.fail("attention(return_aux=...)", "None or FlexAttention's AuxRequest(lse=..., max_scores=...)",
                          checks.describe(return_aux),
                          "Pass torch.nn.attention.flex_attention.AuxRequest(lse=True).")
    if max_scores:
        raise checks.fail("attention(return_aux=AuxRequest(max_scores=True))", "max_scores=False",
                          "max_scores=True", "attnforge's kernels keep each row's LSE, not its largest score: ask "
                          "for AuxRequest(lse=True) (the LSE bounds the largest score from above).")
    return lse


def aux_output(lse):
    """Flex's AuxOutput holding the LSE (or None), for a call that passed return_aux."""
    from torch.nn.attention.flex_attention import AuxOutput  # (torch 2.9+; return_aux came with it)
    return AuxOutput(lse=lse, max_scores=None)

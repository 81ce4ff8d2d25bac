import numbers
from typing import Union

import torch

from .library_args import compiled_int, check_table
from .variant import ScoreMod, compile_mod


def prefix_lm(prefix_len: Union[torch.Tensor, int]) -> ScoreMod:
    """Prefix-LM: the first prefix_len[b] tokens are seen by every query; later ones causally. prefix_len: an
    integer tensor [B] (read at each launch), or one int for every request (compiled in)."""
    if isinstance(prefix_len, numbers.Integral) and not isinstance(prefix_len, bool):
        prefix = compiled_int("prefix_lm", "prefix_len", prefix_len)

        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix)
    else:
        check_table("prefix_lm", "prefix_len", prefix_len, 1, "[B] (each request's prefix length) or an int",
                    integer=True)

        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])
    return compile_mod(mask_mod=prefix_lm_mask, name="prefix_lm")


def reference(q_pos, kv_idx, prefix: int):
    return (kv_idx[None, :] <= q_pos[:, None]) | (kv_idx[None, :] < prefix)

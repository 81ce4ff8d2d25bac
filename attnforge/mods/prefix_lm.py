import torch

from .variant import ScoreMod, compile_mod


def prefix_lm(prefix_len: torch.Tensor) -> ScoreMod:
    """Prefix-LM: the first prefix_len[b] tokens are seen by every query; later ones causally."""
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])
    return compile_mod(mask_mod=prefix_lm_mask, name="prefix_lm")


def reference(q_pos, kv_idx, prefix: int):
    return (kv_idx[None, :] <= q_pos[:, None]) | (kv_idx[None, :] < prefix)

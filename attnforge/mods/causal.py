import torch

from .variant import ScoreMod, compile_mod


def causal() -> ScoreMod:
    """Causal mask: a query sees keys at or before its own position."""
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return compile_mod(mask_mod=causal_mask, name="causal")


def reference(q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Dense keep-mask [Lq, Lk] for query positions q_pos [Lq] and keys kv_idx [Lk]."""
    return q_pos[:, None] >= kv_idx[None, :]

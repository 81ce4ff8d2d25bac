import torch

from .library_args import compiled_int
from .variant import ScoreMod, compile_mod


def sliding_window(window: int) -> ScoreMod:
    """Causal sliding window: a query sees itself and the `window` keys before it."""
    window = compiled_int("sliding_window", "window", window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return compile_mod(mask_mod=sliding_window_mask, name=f"sliding_window{window}")


def reference(q_pos: torch.Tensor, kv_idx: torch.Tensor, window: int) -> torch.Tensor:
    d = q_pos[:, None] - kv_idx[None, :]
    return (d >= 0) & (d <= window)

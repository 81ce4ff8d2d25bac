import torch

from .library_args import check_table
from .variant import ScoreMod, compile_mod


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: score + slopes[h] * (kv_idx - q_idx); slopes [num_qo_heads] (see `default_slopes`)."""
    check_table("alibi", "slopes", slopes, 1, "[num_qo_heads] (see attnforge.mods.alibi.default_slopes)")

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return compile_mod(score_mod=alibi_score, name="alibi")


def default_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper: 2^(-8 i / n) for i = 1..n."""
    return torch.pow(2.0, -8.0 * torch.arange(1, num_heads + 1, device=device) / num_heads)


def reference(score, h, q_pos, kv_idx, slopes):
    return score + slopes[h][:, None, None] * (kv_idx[None, None, :] - q_pos[None, :, None])

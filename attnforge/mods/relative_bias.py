import torch

from .. import checks
from .library_args import compiled_int, check_table
from .variant import ScoreMod, compile_mod


def relative_position_bias(table: torch.Tensor, max_distance: int) -> ScoreMod:
    """T5-style learned bias: score + table[h, clamp(kv_idx - q_idx, -max, max) + max];
    table [num_qo_heads, 2 * max_distance + 1]."""
    max_distance = compiled_int("relative_position_bias", "max_distance", max_distance)
    check_table("relative_position_bias", "table", table, 2, f"[num_qo_heads, {2 * max_distance + 1}]")
    if table.shape[1] != 2 * max_distance + 1:  # (a narrower table would be read past its rows' ends)
        raise checks.fail("relative_position_bias(table=...)", f"a table [num_qo_heads, {2 * max_distance + 1}] "
                          f"(one column per offset -{max_distance}..{max_distance})", f"shape {list(table.shape)}",
                          "Give the table 2 * max_distance + 1 columns, or pass the max_distance it was trained with.")

    def relative_bias_score(score, b, h, q_idx, kv_idx):
        rel = torch.clamp(kv_idx - q_idx, -max_distance, max_distance)
        return score + table[h, rel + max_distance]
    return compile_mod(score_mod=relative_bias_score, name="relative_bias")


def reference(score, h, q_pos, kv_idx, table, max_distance):
    rel = (kv_idx[None, :] - q_pos[:, None]).clamp(-max_distance, max_distance) + max_distance
    return score + table[h][:, rel]

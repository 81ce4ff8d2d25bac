import torch

from .library_args import check_table
from .variant import ScoreMod, compile_mod


def attention_sink(sink_logits: torch.Tensor, score_mod=None, mask_mod=None) -> ScoreMod:
    """Attention sinks (gpt-oss style): a learned per-head logit sink[h] that joins the softmax
    denominator but contributes no value: out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j))."""
    check_table("attention_sink", "sink_logits", sink_logits, 1, "[num_qo_heads]")
    return compile_mod(score_mod=score_mod, mask_mod=mask_mod, sink=sink_logits, name="attention_sink")


def reference(lse: torch.Tensor, sink: torch.Tensor):
    """The row scale e^(lse - lse') and the new LSE, for rows [.., H] with per-head sink [H]."""
    total = torch.logaddexp(lse, sink)
    return torch.exp(lse - total), total

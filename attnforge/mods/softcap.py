import torch

from .variant import ScoreMod, compile_mod


def softcap(cap) -> ScoreMod:
    """Gemma-2 logit soft-capping: cap * tanh(score / cap). Pass a 0-d tensor for a runtime cap."""
    cap_value = cap if isinstance(cap, torch.Tensor) else float(cap)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap_value * torch.tanh(score / cap_value)
    return compile_mod(score_mod=softcap_score, name="softcap")


def reference(score: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(score / cap)

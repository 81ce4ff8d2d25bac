import torch

from .library_args import check_cap
from .variant import ScoreMod, compile_mod


def softcap(cap) -> ScoreMod:
    """Gemma-2 logit soft-capping: cap * tanh(score / cap). Pass a 0-d tensor for a runtime cap.

    On the GPU tanh is tanh.approx.f32 (relative error about 2^-11, the instruction FlashInfer's
    soft-cap uses too), so a logit l carries up to about |l| * 2^-11 of error: at cap 50 with logits
    near 20 that is ~0.01, above bf16's own rounding of the output (docs/perf-notes.md, twenty-third
    session). Where that matters, write the core with exp and a division, which the device evaluates
    to ~2^-21: `cap * (1 - 2 / (torch.exp(2 * score / cap) + 1))` (not folded into the exponent, so
    slower in prefill)."""
    cap_value = check_cap("softcap", cap)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap_value * torch.tanh(score / cap_value)
    return compile_mod(score_mod=softcap_score, name="softcap")


def reference(score: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(score / cap)

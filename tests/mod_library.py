"""One instance of every library modifier, with its captured tensors on `device` (shared by tests)."""
import torch

import attnforge.mods as m

HQ = 32


def library(device="cuda"):
    g = torch.Generator().manual_seed(0)
    from attnforge.mods.alibi import default_slopes
    return {
        "causal": m.causal(), "sliding_window": m.sliding_window(100), "softcap": m.softcap(5.0),
        "alibi": m.alibi(default_slopes(HQ, device)),
        "relative_bias": m.relative_position_bias(torch.randn(HQ, 65, generator=g).to(device), 32),
        "document_mask": m.document_mask(torch.randint(0, 4, (4, 3000), generator=g).sort(dim=1).values.to(device)),
        "prefix_lm": m.prefix_lm(torch.tensor([0, 5, 700, 10], device=device)),
        "attention_sink": m.attention_sink(torch.randn(HQ, generator=g).to(device) + 3),
    }

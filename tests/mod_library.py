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
        "every_operation": every_operation(device),
    }


def every_operation(device="cuda"):
    """A score_mod of every operation the tracer knows beyond the library's, with torch's meanings: bitwise & | ^ ~ <<
    >> on integers, True + True is True, logical_xor on nonzero-ness, float // and % of positions, fmod,
    truncating division, round / ceil / sign, an integer power, int32 / int16 / int8 / uint8 tables, a bool
    table in the branch condition, rsqrt / log1p / expm1, and -inf for some keys. Discontinuities take positions
    only: a score's last ulp differs between the kernel's MMA and the reference, and must not move a floor or a
    branch."""
    table = torch.tensor([3, -2, 7, 1], dtype=torch.int32, device=device)
    i16 = torch.tensor([-3000, 1200, 9, -1], dtype=torch.int16, device=device)  # (narrow elements, signs kept)
    i8 = torch.tensor([-100, 5, 77], dtype=torch.int8, device=device)
    u8 = torch.tensor([200, 3], dtype=torch.uint8, device=device)
    allowed = torch.tensor([True, False, True, True, False], device=device)

    def every_op(score, b, h, q_idx, kv_idx):
        i = ((kv_idx & 7) | (h << 2)) ^ (~q_idx >> 1)
        pos = (kv_idx * 0.5) // 0.7 + kv_idx % 2.5 + (q_idx - kv_idx) // 3 + (kv_idx % 5) ** 2 + \
            torch.fmod(kv_idx * 0.5, 0.7) + torch.div(q_idx - kv_idx, 3, rounding_mode="trunc") + \
            torch.round(kv_idx * 0.25) + torch.ceil(kv_idx * 0.3) + torch.sign(q_idx - kv_idx - 7)
        smooth = torch.rsqrt(abs(score) + 1.0) + torch.log1p(abs(score)) + torch.expm1(score.clamp(-2.0, 2.0))
        flags = (kv_idx > q_idx) + (h > 1)
        keep = (torch.logical_xor(i > 3, kv_idx & 1) | ~(h == 2)) & allowed[(kv_idx + h) % 5]
        narrow = i16[q_idx % 4] + i8[kv_idx % 3] + u8[h % 2]
        out = torch.where(keep, score + 0.002 * pos + flags + 0.001 * narrow,
                          score * 0.5 + table[i % 4] * 0.1 + 0.05 * smooth)
        return torch.where(kv_idx % 97 == 5, float("-inf"), out)  # (masking in a score_mod, as Flex users do)
    return m.compile_mod(score_mod=every_op)

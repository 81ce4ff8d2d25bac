"""Score modifiers: FlexAttention-style Python functions traced into the C++ variant hooks.

    mod = attnforge.mods.compile_mod(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    spec = AttentionSpec(..., score_mod=mod)

q_idx is the query's position in its request's keys (queries aligned to the end of the keys);
it equals FlexAttention's q_idx when q_len == kv_len. Python numbers are compiled in; captured
tensors (indexable) and 0-d tensors (scalars) are runtime parameters.
One factory per file below, each with its own dense torch reference.
"""
from .alibi import alibi  # noqa: F401
from .attention_sink import attention_sink  # noqa: F401
from .causal import causal  # noqa: F401
from .document_mask import document_mask  # noqa: F401
from .prefix_lm import prefix_lm  # noqa: F401
from .relative_bias import relative_position_bias  # noqa: F401
from .sliding_window import sliding_window  # noqa: F401
from .softcap import softcap  # noqa: F401
from .trace import ModTraceError  # noqa: F401
from .variant import ScoreMod, compile_mod, raw_mod  # noqa: F401

LIBRARY = ("causal", "sliding_window", "softcap", "alibi", "relative_position_bias", "document_mask",
           "prefix_lm", "attention_sink")

import torch

from ..checks import describe
from .library_args import check_table
from .trace import ModTraceError
from .variant import ScoreMod, compile_mod


def document_mask(doc_ids: torch.Tensor, causal: bool = True) -> ScoreMod:
    """Packed sequences: attend only within the same document. doc_ids [B, max_len] (int) gives
    each token's document; with causal=True also only to earlier tokens."""
    check_table("document_mask", "doc_ids", doc_ids, 2, "[B, max_len] (each token's document)", integer=True)
    if not isinstance(causal, bool):
        raise ModTraceError(f"document_mask(causal=...): expected a bool, got {describe(causal)}. Pass True to "
                            f"also mask later tokens, False for the whole document.")

    def document_mask_fn(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return (same & (q_idx >= kv_idx)) if causal else same
    return compile_mod(mask_mod=document_mask_fn, name="document_causal" if causal else "document")


def reference(doc_ids_row: torch.Tensor, q_pos, kv_idx, causal=True):
    same = doc_ids_row[q_pos][:, None] == doc_ids_row[kv_idx][None, :]
    return same & (q_pos[:, None] >= kv_idx[None, :]) if causal else same

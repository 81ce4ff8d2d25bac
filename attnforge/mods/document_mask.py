import torch

from .variant import ScoreMod, compile_mod


def document_mask(doc_ids: torch.Tensor, causal: bool = True) -> ScoreMod:
    """Packed sequences: attend only within the same document. doc_ids [B, max_len] (int) gives
    each token's document; with causal=True also only to earlier tokens."""
    if doc_ids.dim() != 2 or doc_ids.is_floating_point():
        raise ValueError(f"document_mask: expected integer doc_ids [B, max_len], got {doc_ids.dtype} "
                         f"{list(doc_ids.shape)}")

    def document_mask_fn(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return (same & (q_idx >= kv_idx)) if causal else same
    return compile_mod(mask_mod=document_mask_fn, name="document_causal" if causal else "document")


def reference(doc_ids_row: torch.Tensor, q_pos, kv_idx, causal=True):
    same = doc_ids_row[q_pos][:, None] == doc_ids_row[kv_idx][None, :]
    return same & (q_pos[:, None] >= kv_idx[None, :]) if causal else same

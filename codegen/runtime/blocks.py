"""What the generated layers (`derive/layers/*.py` block specs) share beyond the generated ops:
splitting and merging attention heads, and attention itself. Their argument checks are
checks.py's, as every generated API's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_heads(packed, parts, num_heads):
    """(batch, seq, parts * num_heads * head_dim) -> `parts` views (batch, num_heads, seq,
    head_dim)."""
    batch, seq, width = packed.shape
    head_dim = width // (parts * num_heads)
    return packed.view(batch, seq, parts, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(context):
    """(batch, num_heads, seq, head_dim) -> (batch, seq, num_heads * head_dim)."""
    batch, num_heads, seq, head_dim = context.shape
    return context.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)


def attention(query, key, value, mask, *, scale, causal, dropout_p):
    """torch's scaled_dot_product_attention. torch takes is_causal only without an attn_mask, so
    a causal call given a mask folds the causal mask into it."""
    if causal and mask is not None:
        seq_q, seq_k = query.shape[-2], key.shape[-2]
        keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device).tril(seq_k - seq_q)
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        causal = False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale
    )

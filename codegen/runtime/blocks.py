"""What the generated layers (`derive/layers/*.py` block specs) share: splitting and merging
attention heads, attention itself, and the constructor's argument checks."""

from __future__ import annotations

import numbers

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


def check_hidden_states(function, name, tensor, hidden_size):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if not tensor.is_floating_point():
        raise TypeError(
            f"{function}(): argument '{name}' must have a floating dtype, got {tensor.dtype}"
        )
    if tensor.dim() != 3 or tensor.shape[-1] != hidden_size:
        raise ValueError(
            f"{function}(): argument '{name}' must have shape (batch, seq, "
            f"hidden_size={hidden_size}), "
            f"got {list(tensor.shape)}"
        )


def check_attention_mask(function, name, mask, hidden_states, num_heads):
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor or None, got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool and mask.dtype != hidden_states.dtype:
        raise TypeError(
            f"{function}(): argument '{name}' must be bool (True = attend) or have the dtype of "
            f"'hidden_states' ({hidden_states.dtype}; added to the scores), got {mask.dtype}"
        )
    batch, seq = hidden_states.shape[:2]
    scores = torch.Size((batch, num_heads, seq, seq))
    try:
        fits = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, scores) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{function}(): argument '{name}' must broadcast to the attention scores (batch, "
            "num_heads, "
            f"seq, seq) = {list(scores)}, got shape {list(mask.shape)}"
        )


def check_size(function, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{function}(): argument '{name}' must be an int, got {type(value).__name__}"
        )
    if value <= 0:
        raise ValueError(f"{function}(): argument '{name}' must be > 0, got {value}")
    return int(value)


def check_real(function, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{function}(): argument '{name}' must be a real number, got {type(value).__name__}"
        )
    return float(value)


def check_probability(function, name, value):
    value = check_real(function, name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{function}(): argument '{name}' must be in [0, 1), got {value}")
    return value


def check_positive(function, name, value):
    value = check_real(function, name, value)
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{function}(): argument '{name}' must be finite and > 0, got {value}")
    return value


def check_flag(function, name, value):
    if not isinstance(value, bool):
        raise TypeError(
            f"{function}(): argument '{name}' must be a bool, got {type(value).__name__}"
        )
    return value


def check_choice(function, name, value, choices):
    if value not in choices:
        raise ValueError(
            f"{function}(): argument '{name}' must be one of {', '.join(map(repr, choices))}, got "
            f"{value!r}"
        )
    return value

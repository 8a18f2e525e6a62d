"""Multi-head self-attention from a packed (batch, seq, 3 * hidden) projection, as both layers
compute it: torch's scaled_dot_product_attention, or probabilities materialised by the generated
masked softmax (DeepSpeed's layout), optionally recomputed in the backward."""

from __future__ import annotations

from derive.blocks import (
    ATTENTION,
    MATMUL,
    MERGE_HEADS,
    SPLIT_HEADS,
    TRAINING,
    TRANSPOSE,
    Attr,
    BlockSpec,
    Select,
    Value,
    op,
)

MASKED_SOFTMAX = op("masked_softmax", "masked_softmax")

ATTENTION_KINDS = ("materialized", "sdpa")
ATTENTION_DOC = (
    '"materialized": scores, then the generated masked softmax (scale, mask, a causal layer\'s '
    'causal mask and dropout fused; it keeps only its output), then probs @ value, as DeepSpeed '
    'computes it; "sdpa": torch.nn.functional.scaled_dot_product_attention (flash / '
    'memory-efficient kernels on the GPU; nothing of size seq x seq is kept)')
CHECKPOINT_DOC = (
    "recompute the masked softmax (with its dropout) and probs @ value in the backward, so "
    "neither the probabilities nor the dropped probabilities are kept, only the scores "
    '(DeepSpeed\'s attn_dropout_checkpoint); needs attention="materialized"')


def self_attention(block: BlockSpec, qkv: Value, mask: Value, *, causal: bool, heads: Attr,
                   scale: Attr, dropout: Attr, attention: Attr, recompute: Attr) -> Value:
    """(batch, seq, hidden) context of the heads; `attention` picks the kind, `recompute` the
    checkpoint of the materialised probabilities."""
    block.require(recompute & attention.equals("sdpa"),
                  "attn_dropout_checkpoint needs attention='materialized' (sdpa keeps no "
                  "probabilities to recompute)")
    query, key, value = block.call(SPLIT_HEADS, qkv, 3, heads, out=("query", "key", "value"))
    with block.branch() as branch:
        with branch.when(attention.equals("sdpa")):
            block.call(ATTENTION, query, key, value, mask, scale=scale, causal=causal,
                       dropout_p=Select(TRAINING, dropout, 0.0), out="context")
        with branch.otherwise():
            key_t = block.call(TRANSPOSE, key, -2, -1, out="key_t")
            scores = block.call(MATMUL, query, key_t, out="scores")
            with block.checkpoint("_attention_probs", recompute,
                                  "softmax(scale * scores + mask), dropped, times the values."):
                probs = block.call(MASKED_SOFTMAX, scores, mask, scale=scale, causal=causal,
                                   dropout_p=dropout, training=TRAINING, out="probs")
                block.call(MATMUL, probs, value, out="context")
    return block.call(MERGE_HEADS, Value("context"), out="merged")

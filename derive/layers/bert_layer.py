"""BERT transformer layer, as DeepSpeed's BertTransformerLayer (DeepSpeedTransformerLayer).

Post-LN by default (BERT): attention, bias + dropout + residual, LayerNorm; GELU feed-forward,
bias + dropout + residual, LayerNorm. With `pre_layer_norm=True` (DeepSpeed's pre-LN variant)
the stream is normalized before attention and before the feed-forward, the residual adds stay on
the un-normalized stream and there is no final LayerNorm (the model adds one). Parameter names,
shapes and order are DeepSpeed's, so its state_dict loads as it is.
"""

from __future__ import annotations

from derive.blocks import (
    CHECK_HIDDEN,
    CHECK_MASK,
    LINEAR,
    TRAINING,
    BlockSpec,
    Select,
    op,
)
from derive.layers._attention import ATTENTION_DOC, ATTENTION_KINDS, CHECKPOINT_DOC, self_attention

LAYER_NORM = op("layernorm", "layer_norm")
ADD_LAYER_NORM = op("add_layernorm", "add_layer_norm")
BIAS_DROPOUT_ADD = op("bias_dropout_add", "bias_dropout_add")
GELU = op("gelu", "gelu")


def block() -> BlockSpec:
    b = BlockSpec("bert_layer", "BertLayer", doc=__doc__)
    hidden = b.size("hidden_size", "width of the hidden states")
    heads = b.size("num_heads", "attention heads; must divide hidden_size")
    inter = b.size("intermediate_size", "width of the feed-forward layer")
    attn_dropout = b.probability("attn_dropout_ratio", 0.1,
                                 "dropout on the attention probabilities")
    dropout = b.probability("hidden_dropout_ratio", 0.1,
                            "dropout on the attention output and the feed-forward output")
    eps = b.positive("layer_norm_eps", 1e-12, "LayerNorm epsilon")
    init_std = b.positive("initializer_range", 0.02,
                          "standard deviation of the GEMM weights at init (biases 0, norms 1)")
    pre_ln = b.flag("pre_layer_norm", False,
                    "pre-LN (normalize before attention and feed-forward) instead of post-LN")
    attention = b.choice("attention", "materialized", ATTENTION_KINDS, ATTENTION_DOC)
    gelu_checkpoint = b.flag(
        "gelu_checkpoint", False,
        "recompute bias + GELU and the second GEMM in the backward: the GELU output "
        "(batch x seq x intermediate_size) is not kept")
    attn_checkpoint = b.flag("attn_dropout_checkpoint", False, CHECKPOINT_DOC)
    invertible = b.flag(
        "normalize_invertible", False,
        'every LayerNorm keeps its output instead of its input (memory="invertible"): the '
        "output is kept by the next GEMM anyway")

    b.require((hidden % heads).greater(0), "num_heads must divide hidden_size")
    head_dim = b.derive("head_dim", hidden // heads, "width of one head")
    scale = b.derive("scale", head_dim ** -0.5, "1 / sqrt(head_dim), applied to the scores")
    memory = b.derive("norm_memory", Select(invertible, "invertible", "default"),
                      "memory mode of every LayerNorm")

    qkv_w = b.param("attn_qkvw", (3 * hidden, hidden), "normal",
                    "query, key and value projections, stacked", std=init_std)
    qkv_b = b.param("attn_qkvb", (3 * hidden,), "zeros", "their biases")
    out_w = b.param("attn_ow", (hidden, hidden), "normal", "attention output projection",
                    std=init_std)
    out_b = b.param("attn_ob", (hidden,), "zeros", "its bias")
    attn_norm_w = b.param("attn_nw", (hidden,), "ones",
                          "LayerNorm after attention (post-LN) / before the feed-forward (pre-LN)")
    attn_norm_b = b.param("attn_nb", (hidden,), "zeros", "its bias")
    inter_w = b.param("inter_w", (inter, hidden), "normal", "feed-forward, first GEMM",
                      std=init_std)
    inter_b = b.param("inter_b", (inter,), "zeros", "its bias (fused into the GELU)")
    output_w = b.param("output_w", (hidden, inter), "normal", "feed-forward, second GEMM",
                       std=init_std)
    output_b = b.param("output_b", (hidden,), "zeros", "its bias")
    norm_w = b.param("norm_w", (hidden,), "ones",
                     "final LayerNorm (post-LN) / LayerNorm before attention (pre-LN)")
    norm_b = b.param("norm_b", (hidden,), "zeros", "its bias")

    x = b.input("hidden_states", "(batch, seq, hidden_size)")
    mask = b.input("attention_mask",
                   "None, or broadcastable to (batch, num_heads, seq, seq): additive (floating, "
                   "e.g. 0 / -10000 as BERT's extended mask) or bool (True = attend)",
                   optional=True)
    b.check(CHECK_HIDDEN, x, hidden)
    b.check(CHECK_MASK, mask, x, heads)
    shape = (hidden,)
    dropping = TRAINING & dropout.greater(0)

    with b.branch() as branch:
        with branch.when(pre_ln):
            normed = b.call(LAYER_NORM, x, shape, norm_w, norm_b, eps, memory=memory,
                            out="attn_input")
            b.call(LINEAR, normed, qkv_w, qkv_b, out="qkv")
        with branch.otherwise():
            b.call(LINEAR, x, qkv_w, qkv_b, out="qkv")
    merged = self_attention(b, b.value("qkv"), mask, causal=False, heads=heads, scale=scale,
                            dropout=attn_dropout, attention=attention, recompute=attn_checkpoint)
    attn_out = b.call(LINEAR, merged, out_w, out="attn_out")

    # residual + bias (+ dropout) + LayerNorm: one fused kernel each way when nothing is dropped
    with b.branch() as branch:
        with branch.when(dropping):
            residual = b.call(BIAS_DROPOUT_ADD, attn_out, x, bias=out_b, p=dropout,
                              training=TRAINING, out="attn_residual")
            b.call(LAYER_NORM, residual, shape, attn_norm_w, attn_norm_b, eps, memory=memory,
                   out="ffn_input")
        with branch.when(pre_ln):
            b.call(ADD_LAYER_NORM, attn_out, x, shape, attn_norm_w, attn_norm_b, eps,
                   input_bias=out_b, prenorm=True, memory=memory,
                   out=("ffn_input", "attn_residual"))
        with branch.otherwise():
            b.call(ADD_LAYER_NORM, attn_out, x, shape, attn_norm_w, attn_norm_b, eps,
                   input_bias=out_b, memory=memory, out="ffn_input")

    ff1 = b.call(LINEAR, b.value("ffn_input"), inter_w, out="ff1")
    with b.checkpoint("_ffn_activation", gelu_checkpoint,
                      "bias + GELU, then the second feed-forward GEMM."):
        activation = b.call(GELU, ff1, bias=inter_b, out="activation")
        ff2 = b.call(LINEAR, activation, output_w, out="ff2")

    with b.branch() as branch:
        with branch.when(pre_ln):
            b.call(BIAS_DROPOUT_ADD, ff2, b.value("attn_residual"), bias=output_b, p=dropout,
                   training=TRAINING, out="output")
        with branch.when(dropping):
            residual = b.call(BIAS_DROPOUT_ADD, ff2, b.value("ffn_input"), bias=output_b,
                              p=dropout, training=TRAINING, out="ffn_residual")
            b.call(LAYER_NORM, residual, shape, norm_w, norm_b, eps, memory=memory,
                   out="output")
        with branch.otherwise():
            b.call(ADD_LAYER_NORM, ff2, b.value("ffn_input"), shape, norm_w, norm_b, eps,
                   input_bias=output_b, memory=memory, out="output")
    b.output(b.value("output"), "(batch, seq, hidden_size)")
    return b

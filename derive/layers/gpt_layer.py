"""GPT-style transformer layer, as GPT-2's block (transformers' GPT2Block).

Pre-LN: LayerNorm, causal self-attention, bias + dropout + residual; LayerNorm, bias + GELU
(tanh approximation) feed-forward, bias + dropout + residual. No final LayerNorm (the model adds
one). Parameters are GPT2Block's, under names of their own: `ln_1_*` and `ln_2_*` are its
`ln_1.*` and `ln_2.*`, `attn_qkv_*` its `attn.c_attn.*`, `attn_proj_*` its `attn.c_proj.*`,
`mlp_fc_*` its `mlp.c_fc.*` and `mlp_proj_*` its `mlp.c_proj.*`. The GEMM weights are in
torch.nn.Linear layout (out_features, in_features): GPT-2's Conv1D weights load transposed.
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
GELU_TANH = op("gelu_tanh", "gelu_tanh")


def block() -> BlockSpec:
    b = BlockSpec("gpt_layer", "GPTLayer", doc=__doc__)
    hidden = b.size("hidden_size", "width of the hidden states (GPT-2's n_embd)")
    heads = b.size("num_heads", "attention heads; must divide hidden_size")
    inter = b.size("intermediate_size", "width of the feed-forward layer (4 * hidden_size)")
    attn_dropout = b.probability("attn_dropout_ratio", 0.1,
                                 "dropout on the attention probabilities (attn_pdrop)")
    dropout = b.probability("hidden_dropout_ratio", 0.1,
                            "dropout on the attention and feed-forward outputs (resid_pdrop)")
    eps = b.positive("layer_norm_eps", 1e-5, "LayerNorm epsilon")
    init_std = b.positive("initializer_range", 0.02,
                          "standard deviation of the GEMM weights at init (biases 0, norms 1)")
    attention = b.choice("attention", "sdpa", ATTENTION_KINDS, ATTENTION_DOC)
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

    ln_1_w = b.param("ln_1_weight", (hidden,), "ones", "LayerNorm before attention (ln_1.weight)")
    ln_1_b = b.param("ln_1_bias", (hidden,), "zeros", "its bias (ln_1.bias)")
    qkv_w = b.param("attn_qkv_weight", (3 * hidden, hidden), "normal",
                    "query, key and value projections, stacked (attn.c_attn.weight, transposed)",
                    std=init_std)
    qkv_b = b.param("attn_qkv_bias", (3 * hidden,), "zeros", "their biases (attn.c_attn.bias)")
    proj_w = b.param("attn_proj_weight", (hidden, hidden), "normal",
                     "attention output projection (attn.c_proj.weight, transposed)", std=init_std)
    proj_b = b.param("attn_proj_bias", (hidden,), "zeros", "its bias (attn.c_proj.bias)")
    ln_2_w = b.param("ln_2_weight", (hidden,), "ones",
                     "LayerNorm before the feed-forward (ln_2.weight)")
    ln_2_b = b.param("ln_2_bias", (hidden,), "zeros", "its bias (ln_2.bias)")
    fc_w = b.param("mlp_fc_weight", (inter, hidden), "normal",
                   "feed-forward, first GEMM (mlp.c_fc.weight, transposed)", std=init_std)
    fc_b = b.param("mlp_fc_bias", (inter,), "zeros",
                   "its bias (mlp.c_fc.bias), fused into the GELU")
    mlp_proj_w = b.param("mlp_proj_weight", (hidden, inter), "normal",
                         "feed-forward, second GEMM (mlp.c_proj.weight, transposed)", std=init_std)
    mlp_proj_b = b.param("mlp_proj_bias", (hidden,), "zeros", "its bias (mlp.c_proj.bias)")

    x = b.input("hidden_states", "(batch, seq, hidden_size)")
    mask = b.input("attention_mask",
                   "None, or broadcastable to (batch, num_heads, seq, seq): additive (floating) "
                   "or bool (True = attend); applied on top of the causal mask", optional=True)
    b.check(CHECK_HIDDEN, x, hidden)
    b.check(CHECK_MASK, mask, x, heads)
    shape = (hidden,)

    normed = b.call(LAYER_NORM, x, shape, ln_1_w, ln_1_b, eps, memory=memory, out="attn_input")
    qkv = b.call(LINEAR, normed, qkv_w, qkv_b, out="qkv")
    merged = self_attention(b, qkv, mask, causal=True, heads=heads, scale=scale,
                            dropout=attn_dropout, attention=attention, recompute=attn_checkpoint)
    attn_out = b.call(LINEAR, merged, proj_w, out="attn_out")

    # residual + bias (+ dropout) + LayerNorm: one fused kernel each way when nothing is dropped
    with b.branch() as branch:
        with branch.when(TRAINING & dropout.greater(0)):
            residual = b.call(BIAS_DROPOUT_ADD, attn_out, x, bias=proj_b, p=dropout,
                              training=TRAINING, out="attn_residual")
            b.call(LAYER_NORM, residual, shape, ln_2_w, ln_2_b, eps, memory=memory,
                   out="ffn_input")
        with branch.otherwise():
            b.call(ADD_LAYER_NORM, attn_out, x, shape, ln_2_w, ln_2_b, eps, input_bias=proj_b,
                   prenorm=True, memory=memory, out=("ffn_input", "attn_residual"))

    ff1 = b.call(LINEAR, b.value("ffn_input"), fc_w, out="ff1")
    with b.checkpoint("_ffn_activation", gelu_checkpoint,
                      "bias + GELU (tanh), then the second feed-forward GEMM."):
        activation = b.call(GELU_TANH, ff1, bias=fc_b, out="activation")
        ff2 = b.call(LINEAR, activation, mlp_proj_w, out="ff2")
    output = b.call(BIAS_DROPOUT_ADD, ff2, b.value("attn_residual"), bias=mlp_proj_b, p=dropout,
                    training=TRAINING, out="output")
    b.output(output, "(batch, seq, hidden_size)")
    return b

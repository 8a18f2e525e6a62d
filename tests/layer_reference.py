"""Plain-PyTorch reference layers: the BERT and GPT layers in torch ops only (F.linear, matmul,
softmax, F.dropout, F.layer_norm, F.gelu), with autograd doing every backward. They hold the
same parameters, under the same names, as generated.bert_layer.BertLayer and
generated.gpt_layer.GPTLayer; `ReferenceLayer.like(layer)` copies one (independent leaves).

Used by tests/test_layers.py and benchmarks/layers_memory.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: role -> parameter name, per generated layer class
NAMES = {
    "BertLayer": {
        "qkv_w": "attn_qkvw", "qkv_b": "attn_qkvb", "out_w": "attn_ow", "out_b": "attn_ob",
        "ffn_norm_w": "attn_nw", "ffn_norm_b": "attn_nb", "fc_w": "inter_w", "fc_b": "inter_b",
        "proj_w": "output_w", "proj_b": "output_b", "norm_w": "norm_w", "norm_b": "norm_b",
    },
    "GPTLayer": {
        "qkv_w": "attn_qkv_weight", "qkv_b": "attn_qkv_bias", "out_w": "attn_proj_weight",
        "out_b": "attn_proj_bias", "ffn_norm_w": "ln_2_weight", "ffn_norm_b": "ln_2_bias",
        "fc_w": "mlp_fc_weight", "fc_b": "mlp_fc_bias", "proj_w": "mlp_proj_weight",
        "proj_b": "mlp_proj_bias", "norm_w": "ln_1_weight", "norm_b": "ln_1_bias",
    },
}


class ReferenceLayer(torch.nn.Module):
    """DeepSpeed's BERT layer (post- or pre-LN) or a GPT-2 block, in plain torch ops.

    Pre-LN: `norm_*` normalizes the input, `ffn_norm_*` the attention residual, and there is no
    final norm. Post-LN: `ffn_norm_*` follows attention, `norm_*` is the final norm.
    """

    def __init__(self, kind: str, params: dict[str, torch.nn.Parameter], *, num_heads: int,
                 eps: float, pre_layer_norm: bool, causal: bool, approximate: str,
                 attn_dropout: float, hidden_dropout: float):
        super().__init__()
        self.kind = kind
        for name, param in params.items():
            self.register_parameter(name, param)
        self.num_heads, self.eps = num_heads, eps
        self.pre_layer_norm, self.causal, self.approximate = pre_layer_norm, causal, approximate
        self.attn_dropout, self.hidden_dropout = attn_dropout, hidden_dropout

    @classmethod
    def like(cls, layer: torch.nn.Module) -> ReferenceLayer:
        """A reference holding copies of `layer`'s parameters and its options."""
        kind = type(layer).__name__
        params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in layer.named_parameters()}
        gpt = kind == "GPTLayer"
        reference = cls(kind, params, num_heads=layer.num_heads, eps=layer.layer_norm_eps,
                        pre_layer_norm=gpt or layer.pre_layer_norm, causal=gpt,
                        approximate="tanh" if gpt else "none",
                        attn_dropout=layer.attn_dropout_ratio,
                        hidden_dropout=layer.hidden_dropout_ratio)
        return reference.train(layer.training)

    def p(self, role: str) -> torch.Tensor:
        return getattr(self, NAMES[self.kind][role])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.norm
        attn_input = norm(x, "norm") if self.pre_layer_norm else x
        attn = F.linear(self.attention(F.linear(attn_input, self.p("qkv_w"), self.p("qkv_b")),
                                       mask), self.p("out_w"), self.p("out_b"))
        residual = x + F.dropout(attn, self.hidden_dropout, self.training)
        ffn_input = norm(residual, "ffn_norm")
        ffn = F.linear(F.gelu(F.linear(ffn_input, self.p("fc_w"), self.p("fc_b")),
                              approximate=self.approximate), self.p("proj_w"), self.p("proj_b"))
        ffn = F.dropout(ffn, self.hidden_dropout, self.training)
        if self.pre_layer_norm:
            return residual + ffn
        return norm(ffn_input + ffn, "norm")

    def norm(self, t: torch.Tensor, role: str) -> torch.Tensor:
        return F.layer_norm(t, t.shape[-1:], self.p(f"{role}_w"), self.p(f"{role}_b"), self.eps)

    def attention(self, qkv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, width = qkv.shape
        head_dim = width // (3 * self.num_heads)
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) * head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
                else scores + mask
        if self.causal:
            keep = torch.ones(seq, seq, dtype=torch.bool, device=qkv.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1), self.attn_dropout, self.training)
        return torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq, width // 3)

"""Rotary position embedding (RoPE): y = x * cos + rotate_half(x) * sin.

rotate_half(x) is (-x2, x1) for the halves x1 = x[..., :N/2], x2 = x[..., N/2:] (Hugging
Face's): at column j, the partner column's value (j + N/2) mod N, negated in the first half.
`cos` and `sin` have the row's width and broadcast over the leading dims (the heads), read in
place through their strides. Only the tables are saved: the VJP is linear in the upstream
gradient and never reads x (saving x would hold every layer's q and k until the backward).
The backward rotates the upstream gradient the other way, dx = dy * cos - rotate_half(dy * sin)
read through the same pairing: the engine derives it from the partner read
(docs/spec_language.md).
"""

import sympy

from derive.api import PositionEmbeddingAPI, Replaces
from derive.spec import N, OpSpec


def spec() -> OpSpec:
    op = OpSpec("rotary", doc=__doc__)
    x = op.input("x")
    cos = op.input("cos", grad=False, broadcast=True)
    sin = op.input("sin", grad=False, broadcast=True)
    j = op.column_index("j")
    x_partner = op.partner("x_rotated", x, pairing="half")
    sign = sympy.Piecewise((-1, j < N / 2), (1, True))
    op.output(op.element("y", x * cos + sign * x_partner * sin))
    op.save(cos, sin)
    op.api = PositionEmbeddingAPI(
        function="rotary", module="Rotary",
        torch_function="input * cos + rotate_half(input) * sin",
        inputs=("input", "cos", "sin"),
        embed="apply_rotary_pos_emb", embedded=("q", "k"),
        # torch's expression: never run until a crossover is measured for this op
        # (codegen/runtime/dispatch.py; no "dispatch" entry: the kernels at every size)
        reference="input * cos + torch.cat((-input[..., input.shape[-1] // 2:], "
                  "input[..., :input.shape[-1] // 2]), dim=-1) * sin",
        # the attention modules of LLaMA, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3 (whose forward
        # calls its modeling module's apply_rotary_pos_emb)
        replaces=(Replaces("*Attention", kind="rotary"),))
    return op

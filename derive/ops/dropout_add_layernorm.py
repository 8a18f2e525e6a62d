"""Dropout + (bias +) residual add + LayerNorm: s = dropout(x + input_bias, p) + residual;
y = LayerNorm(s).

flash-attn's dropout_add_layer_norm, and BERT's `LayerNorm(dropout(dense(h)) + input)` in one
kernel each way. The keep mask comes from the call's seed and each element's index, as
bias_dropout_add's (Philox, u >= p keeps an element, scaled by 1/(1 - p)): the same seed gives
the same mask as bias_dropout_add's for the same shape. Nothing of it is saved: the backward
regenerates it. With prenorm the residual stream s is returned too, and its gradient is added
into dresidual and, through the mask, into dx inside the same backward kernel.

add_layer_norm(dropout_p=...) runs these kernels whenever dropout is on (p > 0 in training),
its own, without a random draw, otherwise.
"""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("dropout_add_layernorm", doc=__doc__)
    x = op.input("x")
    residual = op.input("residual", absent=0)
    input_bias = op.column_param("input_bias", absent=0)
    weight = op.column_param("weight", absent=1)
    bias = op.column_param("bias", absent=0)
    eps = op.scalar("eps", positive=True)
    p = op.scalar("dropout_p")
    u = op.random("u")
    keep = op.element("keep", sympy.Piecewise((1, u >= p), (0, True)))
    # a product, as torch's dropout: a dropped NaN stays NaN
    dropped = op.element("dropped", (x + input_bias) * keep / (1 - p))
    residual_out = op.element("residual_out", dropped + residual)
    mean = op.row_mean("mean", residual_out)
    var = op.row_mean("var", (residual_out - mean) ** 2)
    rstd = op.row("rstd", 1 / sympy.sqrt(var + eps), positive=True)
    x_hat = op.element("x_hat", (residual_out - mean) * rstd)
    y = op.element("y", x_hat * weight + bias)
    op.output(y, residual_out)
    op.save(residual_out, mean, rstd, doc="Keeps the sum and both statistics.")
    op.save(residual_out, rstd, mode="recompute_mean",
            doc="The backward recomputes the row mean from the saved sum.")
    op.save(y, rstd, mode="invertible",
            doc="Keeps the output instead of the sum; x_hat = (y - bias) / weight, guarded.")
    op.api = NormalizedShapeAPI(
        function="dropout_add_layer_norm", module="DropoutAddLayerNorm",
        torch_function="torch.nn.functional.layer_norm(torch.nn.functional.dropout(input + "
                       "input_bias, dropout_p, training) + residual, ...)",
        torch_module="torch.nn.LayerNorm",
        params=(Param("weight", "ones"), Param("bias", "zeros", flag="bias")), eps=1e-5,
        residual="residual", call_params=("input_bias",),
        options=(Option("dropout_p", 0.0, check="probability"),), dropout="dropout_p",
        # torch's dropout draws another mask than a seeded one: with dropout off or no seed
        reference="dispatch.normalized(torch.nn.functional.layer_norm, dispatch.added("
                  "torch.nn.functional.dropout(input if input_bias is None else "
                  "input + input_bias, dropout_p, training), residual), normalized_shape, "
                  "weight, bias, eps, prenorm=prenorm)",
        reference_when="not residual_in_fp32 and "
                       "dispatch.same_dtype(input, residual, input_bias, weight, bias)")
    return op

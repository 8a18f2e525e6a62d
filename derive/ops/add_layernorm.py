"""Fused (bias +) residual add + LayerNorm: s = x + input_bias + residual; y = LayerNorm(s).

DeepSpeed's fused bias + residual + LayerNorm and flash-attn's prenorm add. With prenorm the
residual stream s is returned too, and its gradient is added into dx inside the same backward
kernel (the engine sees s as a second output with its own upstream gradient).
"""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("add_layernorm", doc=__doc__)
    x = op.input("x")
    residual = op.input("residual", absent=0)
    input_bias = op.column_param("input_bias", absent=0)
    weight = op.column_param("weight", absent=1)
    bias = op.column_param("bias", absent=0)
    eps = op.scalar("eps", positive=True)
    residual_out = op.element("residual_out", x + input_bias + residual)
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
        function="add_layer_norm", module="AddLayerNorm",
        torch_function="torch.nn.functional.layer_norm(input + input_bias + residual, ...)",
        torch_module="torch.nn.LayerNorm",
        params=(Param("weight", "ones"), Param("bias", "zeros", flag="bias")), eps=1e-5,
        residual="residual", call_params=("input_bias",),
        # dropout on input + input_bias: computed by the kernels of dropout_add_layernorm when
        # on, so that these, without it, draw no random values
        options=(Option("dropout_p", 0.0, check="probability"),), dropout="dropout_p",
        dropout_op="dropout_add_layernorm",
        # the add before a norm inside a transformer layer, with the norm's own parameters
        replaces=(Replaces("*", kind="residual"),),
        reference="dispatch.normalized(torch.nn.functional.layer_norm, "
                  "dispatch.added(input, input_bias, residual), normalized_shape, weight, bias, "
                  "eps, prenorm=prenorm)",
        # torch's sum is rounded to the inputs' dtype, not kept in fp32
        reference_when="not residual_in_fp32 and "
                       "dispatch.same_dtype(input, residual, input_bias, weight, bias)")
    return op

"""LayerNorm: y = (x - mean) * rstd * (weight_offset + weight) + bias over the last dims of the
input.

weight_offset = 0 is torch.nn.LayerNorm; weight_offset = 1 is the (1 + weight) scale of
LayerNorms that store the weight as an offset from one (VideoPrism's, Moonshine's). The offset
belongs to the weight: without a weight, the scale is 1 whatever the offset.
"""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("layernorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    bias = op.column_param("bias", absent=0)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    mean = op.row_mean("mean", x)
    var = op.row_mean("var", (x - mean) ** 2)
    rstd = op.row("rstd", 1 / sympy.sqrt(var + eps), positive=True)
    x_hat = op.element("x_hat", (x - mean) * rstd)
    y = op.element("y", x_hat * (weight_offset + weight) + bias)
    op.output(y)
    op.save(x, mean, rstd, doc="The fastest backward: only x_hat is recomputed.")
    op.save(x, rstd, mode="recompute_mean",
            doc="DeepSpeed's useMean=false: the backward recomputes the row mean from x.")
    op.save(y, rstd, mode="invertible",
            doc="DeepSpeed's normalize_invertible, Apex's memory_efficient: keeps the output, "
                "which the next layer keeps anyway, instead of the input; x_hat is recovered as "
                "(y - bias) / (weight_offset + weight) with the divisor clamped below (see "
                "INVERSION_GUARD).")
    op.api = NormalizedShapeAPI(
        function="layer_norm", module="LayerNorm",
        torch_function="torch.nn.functional.layer_norm", torch_module="torch.nn.LayerNorm",
        params=(Param("weight", "ones", offset="weight_offset"),
                Param("bias", "zeros", flag="bias")), eps=1e-5,
        options=(Option("weight_offset", 0.0),),
        reference="torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)",
        reference_when="weight_offset == 0 and dispatch.same_dtype(input, weight, bias)",
        # HF: nn.LayerNorm's kin, and the (1 + weight) scale of VideoPrism's and Moonshine's
        # (the probe tells which)
        replaces=(Replaces("*LayerNorm", tries=(("weight_offset", (0.0, 1.0)),)),))
    return op

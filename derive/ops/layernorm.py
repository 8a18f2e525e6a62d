"""LayerNorm: y = (x - mean) * rstd * weight + bias over the last dims of the input."""

import sympy

from derive.api import NormalizedShapeAPI, Param, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("layernorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    bias = op.column_param("bias", absent=0)
    eps = op.scalar("eps", positive=True)
    mean = op.row_mean("mean", x)
    var = op.row_mean("var", (x - mean) ** 2)
    rstd = op.row("rstd", 1 / sympy.sqrt(var + eps), positive=True)
    x_hat = op.element("x_hat", (x - mean) * rstd)
    y = op.element("y", x_hat * weight + bias)
    op.output(y)
    op.save(x, mean, rstd, doc="The fastest backward: only x_hat is recomputed.")
    op.save(x, rstd, mode="recompute_mean",
            doc="DeepSpeed's useMean=false: the backward recomputes the row mean from x.")
    op.save(y, rstd, mode="invertible",
            doc="DeepSpeed's normalize_invertible, Apex's memory_efficient: keeps the output, "
                "which the next layer keeps anyway, instead of the input; x_hat is recovered as "
                "(y - bias) / weight with |weight| clamped below (see INVERSION_GUARD).")
    op.api = NormalizedShapeAPI(
        function="layer_norm", module="LayerNorm",
        torch_function="torch.nn.functional.layer_norm", torch_module="torch.nn.LayerNorm",
        params=(Param("weight", "ones"), Param("bias", "zeros", flag="bias")), eps=1e-5,
        reference="torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)",
        reference_when="dispatch.same_dtype(input, weight, bias)",
        replaces=(Replaces("*LayerNorm"),))
    return op

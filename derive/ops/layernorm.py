"""LayerNorm: y = (x - mean) * rstd * weight + bias over the last dims of the input."""

import sympy

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
    op.output(op.element("y", x_hat * weight + bias))
    op.save(x, mean, rstd)
    return op

"""RMSNorm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x**2) + eps)."""

import sympy

from derive.api import NormalizedShapeAPI, Param
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("rmsnorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    mean_square = op.row_mean("mean_square", x**2)
    rstd = op.row("rstd", 1 / sympy.sqrt(mean_square + eps), positive=True)
    x_hat = op.element("x_hat", x * rstd)
    op.output(op.element("y", x_hat * weight))
    op.save(x, rstd)
    op.api = NormalizedShapeAPI(
        function="rms_norm", module="RMSNorm",
        torch_function="torch.nn.functional.rms_norm", torch_module="torch.nn.RMSNorm",
        params=(Param("weight", "ones"),), eps=None)
    return op

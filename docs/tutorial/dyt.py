"""DyT (Dynamic Tanh, Zhu et al. 2025): y = weight * tanh(alpha * x) + bias."""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("dyt", doc=__doc__)
    x = op.input("x")
    alpha = op.scalar_param("alpha")
    weight = op.column_param("weight", absent=1)
    bias = op.column_param("bias", absent=0)
    t = op.element("t", sympy.tanh(alpha * x))
    op.output(op.element("y", weight * t + bias))
    op.save(x)
    op.api = NormalizedShapeAPI(
        function="dyt", module="DyT", torch_function="weight * torch.tanh(alpha * input) + bias",
        torch_module="DyT", params=(Param("alpha", "alpha_init", scalar=True),
                                    Param("weight", "ones"), Param("bias", "zeros", flag="bias")),
        eps=None, options=(Option("alpha_init", 0.5, module_only=True),))
    return op

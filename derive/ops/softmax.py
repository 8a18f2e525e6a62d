"""Softmax: p = exp(x - max(x)) / sum(exp(x - max(x))) along one dim."""

import sympy

from derive.api import DimAPI
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("softmax", doc=__doc__)
    x = op.input("x")
    row_max = op.row_max("row_max", x)
    e = op.element("e", sympy.exp(x - row_max), positive=True)
    denominator = op.row_sum("denominator", e, positive=True)
    p = op.element("p", e / denominator, positive=True)
    op.output(p)
    op.save(p)
    op.api = DimAPI(function="softmax", module="Softmax", torch_function="torch.softmax",
                    reference="torch.softmax(input, dim, dtype=dtype)")
    return op

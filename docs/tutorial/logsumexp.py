"""Log-sum-exp of each row: y = log(sum_j exp(x_j)), one value per row, as torch.logsumexp.

The row max only stabilises the exponentials (the engine proves y does not depend on it); the
backward recomputes the softmax exp(x - row_max) / total from the saved input and the two row
statistics. On a row holding +inf, y and the row's gradient are NaN, where torch.logsumexp
returns +inf: every op stabilised by a row max shifts by that max, +inf included (a row of -inf
by 0), as torch.softmax and torch.nn.functional.cross_entropy shift, which are NaN throughout
such a row; exp(inf - inf) is NaN.
"""

import sympy

from derive.api import ReductionAPI
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("logsumexp", doc=__doc__)
    x = op.input("x")
    row_max = op.row_max("row_max", x)
    total = op.row_sum("total", sympy.exp(x - row_max), positive=True)
    op.output(op.row("y", sympy.log(total) + row_max))
    op.save(x, row_max, total)
    op.api = ReductionAPI(function="logsumexp", module="LogSumExp",
                          torch_function="torch.logsumexp")
    return op

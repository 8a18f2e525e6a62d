"""Cross-entropy of logits over a large vocabulary, one loss per row:
loss = valid * (logsumexp(x) - (1 - smoothing) * x[target] - smoothing * mean(x)),
valid = 0 where target == ignore_index.

The row max is a stabiliser of logsumexp (the engine proves the loss does not depend on it);
the softmax is never stored: the backward recomputes exp(x - row_max) / denominator from the
saved logits and two row statistics, and the gradient is the textbook
dloss * valid * (softmax - (1 - smoothing) * onehot - smoothing / N).
"""

import sympy

from derive.api import Option, RowLossAPI
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("cross_entropy", doc=__doc__)
    x = op.input("x")
    target = op.row_input("target", integer=True)
    ignore_index = op.scalar("ignore_index")
    smoothing = op.scalar("label_smoothing")
    key = op.column_index("key")
    row_max = op.row_max("row_max", x)
    e = op.element("e", sympy.exp(x - row_max), positive=True)
    denominator = op.row_sum("denominator", e, positive=True)
    target_logit = op.row_sum("target_logit", sympy.Piecewise((x, sympy.Eq(key, target)),
                                                              (0, True)))
    logit_mean = op.row_mean("logit_mean", x)
    valid = op.row("valid", sympy.Piecewise((0, sympy.Eq(target, ignore_index)), (1, True)))
    loss = op.row("loss", valid * (sympy.log(denominator) + row_max
                                   - (1 - smoothing) * target_logit - smoothing * logit_mean))
    op.output(loss)
    op.save(x, target, row_max, denominator)
    op.api = RowLossAPI(
        function="cross_entropy", module="CrossEntropyLoss",
        torch_function="torch.nn.functional.cross_entropy",
        target="target", ignore="ignore_index",
        options=(Option("ignore_index", -100, check="integer"),
                 Option("label_smoothing", 0.0, check="unit")))
    return op

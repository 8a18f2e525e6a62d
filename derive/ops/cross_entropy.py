"""Cross-entropy of logits over a large vocabulary, one loss per row:
loss = logsumexp(x) - x[target] + smoothing * mean(x[target] - x), and 0 where
target == ignore_index (torch's (1 - smoothing) * nll + smoothing * mean(-log_softmax(x))).

The row max is a stabiliser of logsumexp (the engine proves the loss does not depend on it);
the softmax is never stored: the backward recomputes exp(x - row_max) / denominator from the
saved logits and two row statistics, and the gradient is the textbook
dloss * (softmax - (1 - smoothing) * onehot - smoothing / N) on rows that are not ignored.
"""

import sympy

from derive.api import Option, Replaces, RowLossAPI
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
    # the smoothing term, mean_j(lse - x_j) = (lse - x[target]) + mean_j(x[target] - x_j), is
    # taken from the logits' gaps to the target, each exact, where a mean of the logits
    # themselves would round at their scale (logits 1e4 + N(0, 1): three digits of an O(1) loss)
    target_gap = op.row_mean("target_gap", target_logit - x)
    # smoothing = 0 drops the term (a -inf logit is allowed, as in torch); an ignored row is
    # selected away, not multiplied by 0, so NaN logits there give a loss of 0, as in torch
    smoothed = op.row("smoothed", sympy.Piecewise((0, sympy.Eq(smoothing, 0)),
                                                  (smoothing * target_gap, True)))
    loss = op.row("loss", sympy.Piecewise(
        (0, sympy.Eq(target, ignore_index)),
        (sympy.log(denominator) + row_max - target_logit + smoothed, True)))
    op.output(loss)
    op.save(x, target, row_max, denominator)
    op.api = RowLossAPI(
        function="cross_entropy", module="CrossEntropyLoss",
        torch_function="torch.nn.functional.cross_entropy",
        target="target", ignore="ignore_index",
        options=(Option("ignore_index", -100, check="integer"),
                 Option("label_smoothing", 0.0, check="unit")),
        # the loss of Hugging Face causal-LM models (GPT-2's is *LMHeadModel)
        replaces=(Replaces("*ForCausalLM", kind="loss"), Replaces("*LMHeadModel", kind="loss")))
    return op

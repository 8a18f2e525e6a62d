"""Scaled masked softmax of attention scores, with dropout on the probabilities:
y = dropout(softmax(scale * x + mask)), keys after `q + window` masked out.

DeepSpeed's attention softmax. `mask` is additive and broadcasts over the leading dims
(batch, heads, queries) without being expanded in memory; `window` = 0 is a causal mask
(key k attends query q when k <= q, as torch's is_causal), +inf none. The row max is proven
a stabiliser, so a fully masked row takes it as 0: every e is 0, the guarded reciprocal of
the zero denominator gives p = 0 and the row's gradient is 0. Only the probabilities p (before
dropout) are saved; the dropout mask is regenerated from the seed.
"""

import sympy

from derive.algebra import GuardedReciprocal
from derive.api import ElementwiseAPI, Option, Switch
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("masked_softmax", doc=__doc__)
    x = op.input("x")
    mask = op.input("attention_mask", absent=0, grad=False, broadcast=True)
    scale = op.scalar("scale")
    window = op.scalar("window")
    dropout_p = op.scalar("dropout_p")
    key = op.column_index("key")
    query = op.row_index("query")
    u = op.random("u")
    z = op.element("z", sympy.Piecewise((scale * x + mask, key <= query + window),
                                        (-sympy.oo, True)))
    row_max = op.row_max("row_max", z)
    e = op.element("e", sympy.exp(z - row_max), positive=True)
    denominator = op.row_sum("denominator", e, positive=True)
    p = op.element("p", e * GuardedReciprocal(denominator), positive=True)
    keep = op.element("keep", sympy.Piecewise((1, u >= dropout_p), (0, True)))
    y = op.element("y", p * keep / (1 - dropout_p))
    op.output(y)
    op.save(p)
    op.api = ElementwiseAPI(
        function="masked_softmax", module="MaskedSoftmax",
        torch_function="torch.nn.functional.dropout(torch.softmax(scale * input + mask, -1), "
                       "dropout_p, training)",
        inputs=("input", "mask"),
        options=(Option("scale", 1.0), Option("dropout_p", 0.0, check="probability")),
        switches=(Switch("causal", "window", on=0.0, off=float("inf")),),
        dropout="dropout_p", additive_masks=("mask",))
    return op

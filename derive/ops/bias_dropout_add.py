"""bias + dropout + residual add: y = residual + dropout(x + bias, p).

DeepSpeed's and Megatron's fused bias-dropout-add. The keep mask comes from the call's seed and
each element's index (Philox, u >= p keeps an element, scaled by 1/(1 - p)); nothing is saved:
the backward regenerates the same mask. p = 0 keeps every element and scales by exactly 1.
"""

import sympy

from derive.api import ElementwiseAPI, Option
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("bias_dropout_add", doc=__doc__)
    x = op.input("x")
    residual = op.input("residual", absent=0)
    bias = op.column_param("bias", absent=0)
    p = op.scalar("p")
    u = op.random("u")
    z = op.element("z", x + bias)
    keep = op.element("keep", sympy.Piecewise((1, u >= p), (0, True)))
    kept = op.element("kept", z * keep / (1 - p))  # a product, as torch: a dropped NaN stays NaN
    op.output(op.element("y", residual + kept))
    op.save()
    op.api = ElementwiseAPI(
        function="bias_dropout_add", module="BiasDropoutAdd",
        torch_function="residual + torch.nn.functional.dropout(input + bias, p, training)",
        call_params=("bias",), inputs=("input", "residual"),
        # torch's dropout draws another mask than a seeded one: with dropout off or no seed
        reference="dispatch.added(torch.nn.functional.dropout("
                  "input if bias is None else input + bias, p, training), residual)",
        options=(Option("p", 0.1, check="probability"),), dropout="p")
    return op

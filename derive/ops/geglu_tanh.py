"""GeGLU with the tanh GELU: y = gelu_tanh(gate) * up, gelu_tanh(z) = z * (1 + tanh(sqrt(2 / pi)
* (z + 0.044715 z^3))) / 2 (Gemma's MLP activation, T5 v1.1's gelu_new). Only the inputs are
saved; the activation is recomputed in the backward."""

import sympy

from derive.api import ElementwiseAPI, Replaces
from derive.ops.gelu_tanh import tanh_argument
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("geglu_tanh", doc=__doc__)
    gate = op.input("gate")
    up = op.input("up")
    t = op.element("t", sympy.tanh(tanh_argument(gate)))
    activation = op.element("activation", gate * (1 + t) / 2)
    op.output(op.element("y", activation * up))
    op.save(gate, up)
    op.api = ElementwiseAPI(function="geglu_tanh", module="GeGLUTanh",
                            torch_function='torch.nn.functional.gelu(gate, approximate="tanh") '
                                           "* up",
                            inputs=("gate", "up"),
                            reference='torch.nn.functional.gelu(gate, approximate="tanh") * up',
                            # Gemma's MLPs, T5's gated dense layers with gelu_new: the probe
                            # tells the tanh GELU from the exact one
                            replaces=(Replaces("*", kind="mlp"),))
    return op

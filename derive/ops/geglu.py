"""GeGLU: y = gelu(gate) * up with the exact (erf) GELU; approximate="tanh" computes it with the
tanh GELU (geglu_tanh's kernels). Only the inputs are saved; the activation is recomputed in the
backward."""

import sympy

from derive.api import ElementwiseAPI, Replaces, Variant
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("geglu", doc=__doc__)
    gate = op.input("gate")
    up = op.input("up")
    activation = op.element("activation", gate * (1 + sympy.erf(gate / sympy.sqrt(2))) / 2)
    op.output(op.element("y", activation * up))
    op.save(gate, up)
    op.api = ElementwiseAPI(function="geglu", module="GeGLU",
                            torch_function="torch.nn.functional.gelu(gate) * up",
                            inputs=("gate", "up"),
                            reference="torch.nn.functional.gelu(gate) * up",
                            # torch's gelu(approximate="tanh") is the tanh GELU: geglu_tanh's op
                            variant=Variant("approximate", (("none", None),
                                                            ("tanh", "geglu_tanh"))),
                            # an MLP down(gelu(gate(x)) * up(x)) with the exact GELU; the probe
                            # turns down the tanh GELU (geglu_tanh's rule takes that)
                            replaces=(Replaces("*", kind="mlp"),))
    return op

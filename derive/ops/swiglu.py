"""SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up (LLaMA's MLP activation).

Only the two inputs are saved; the activation is recomputed in the backward. The sigmoid is
written through e = exp(-gate) so the engine's pivot turns its derivative into s * (1 - s),
finite for any gate (never exp(-gate) / (1 + exp(-gate))**2, which is inf / inf far left).
"""

import sympy

from derive.api import ElementwiseAPI, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("swiglu", doc=__doc__)
    gate = op.input("gate")
    up = op.input("up")
    e = op.element("e", sympy.exp(-gate), positive=True)
    s = op.element("s", 1 / (1 + e), positive=True)
    op.output(op.element("y", gate * s * up))
    op.save(gate, up)
    op.api = ElementwiseAPI(function="swiglu", module="SwiGLU",
                            torch_function="torch.nn.functional.silu(gate) * up",
                            inputs=("gate", "up"),
                            reference="torch.nn.functional.silu(gate) * up",
                            # LLaMA's, Mistral's, Qwen's MLP: down(silu(gate(x)) * up(x))
                            replaces=(Replaces("*", kind="mlp"),))
    return op

"""SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up (LLaMA's MLP activation).

`gate_multiplier` and `down_multiplier` scale the gate before the activation and the result
(Falcon-H1's MLP: up * silu(gate * gate_multiplier), its down projection's output times
down_multiplier, which a bias-free projection lets in here); 1 by default, where they change
nothing. Only the two inputs are saved; the activation is recomputed in the backward. The
sigmoid is written through e = exp(-gate_scaled) so the engine's pivot turns its derivative into
s * (1 - s), finite for any gate (never exp(-g) / (1 + exp(-g))**2, which is inf / inf far left).
"""

import sympy

from derive.api import ElementwiseAPI, Option, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("swiglu", doc=__doc__)
    gate = op.input("gate")
    up = op.input("up")
    gate_multiplier = op.scalar("gate_multiplier")
    down_multiplier = op.scalar("down_multiplier")
    # named to sort before s and up: with multipliers of 1, the products round as before
    gate_scaled = op.element("gate_scaled", gate_multiplier * gate)
    e = op.element("e", sympy.exp(-gate_scaled), positive=True)
    s = op.element("s", 1 / (1 + e), positive=True)
    op.output(op.element("y", gate_scaled * s * up * down_multiplier))
    op.save(gate, up)
    op.api = ElementwiseAPI(function="swiglu", module="SwiGLU",
                            torch_function="torch.nn.functional.silu(gate) * up",
                            inputs=("gate", "up"),
                            options=(Option("gate_multiplier", 1.0,
                                            doc="scales the gate before the activation: "
                                                "silu(gate * gate_multiplier) * up."),
                                     Option("down_multiplier", 1.0,
                                            doc="scales the result (Falcon-H1's multiplier "
                                                "of its down projection's output).")),
                            reference="torch.nn.functional.silu(gate) * up",
                            reference_when="gate_multiplier == 1 and down_multiplier == 1",
                            # LLaMA's, Mistral's, Qwen's MLP: down(silu(gate(x)) * up(x))
                            replaces=(Replaces("*", kind="mlp"),))
    return op

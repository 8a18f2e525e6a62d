"""bias + GELU, exact: y = z * (1 + erf(z / sqrt(2))) / 2 with z = x + bias.

The bias of the preceding linear layer is fused in; its gradient is a column reduction. Only the
input is saved: the activation is recomputed in the backward (DeepSpeed's gelu_checkpoint).
"""

import sympy

from derive.api import ElementwiseAPI, Replaces, Variant
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("gelu", doc=__doc__)
    x = op.input("x")
    bias = op.column_param("bias", absent=0)
    z = op.element("z", x + bias)
    op.output(op.element("y", z * (1 + sympy.erf(z / sympy.sqrt(2))) / 2))
    op.save(x)
    op.api = ElementwiseAPI(
        function="gelu", module="GELU", torch_function="torch.nn.functional.gelu(input + bias)",
        call_params=("bias",),
        reference="torch.nn.functional.gelu(input if bias is None else input + bias)",
        # torch's approximate="tanh" is the tanh approximation's op (its own kernels)
        variant=Variant("approximate", (("none", None), ("tanh", "gelu_tanh"))),
        # torch's GELU and HF's GELU activations; the probe tells the exact one from the others
        replaces=(Replaces("*GELU*"),))
    return op

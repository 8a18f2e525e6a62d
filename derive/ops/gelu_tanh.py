"""bias + GELU, tanh approximation: y = z * (1 + tanh(sqrt(2 / pi) * (z + 0.044715 z^3))) / 2,
z = x + bias (GPT-2's NewGELUActivation, torch's approximate="tanh", DeepSpeed's bias_gelu).
"""

import sympy

from derive.api import ElementwiseAPI, Replaces
from derive.spec import OpSpec


def tanh_argument(z):
    """What the tanh approximation takes: sqrt(2 / pi) * (z + 0.044715 z^3), as torch's."""
    return sympy.sqrt(2 / sympy.pi) * (z + sympy.Rational(44715, 10**6) * z**3)


def spec() -> OpSpec:
    op = OpSpec("gelu_tanh", doc=__doc__)
    x = op.input("x")
    bias = op.column_param("bias", absent=0)
    z = op.element("z", x + bias)
    t = op.element("t", sympy.tanh(tanh_argument(z)))
    op.output(op.element("y", z * (1 + t) / 2))
    op.save(x)
    op.api = ElementwiseAPI(
        function="gelu_tanh", module="GELUTanh",
        torch_function='torch.nn.functional.gelu(input + bias, approximate="tanh")',
        call_params=("bias",),
        reference='torch.nn.functional.gelu(input if bias is None else input + bias, '
                  'approximate="tanh")',
        # torch's GELU(approximate="tanh"), HF's GELUTanh, NewGELUActivation, ...: the probe
        # tells them from the exact GELU
        replaces=(Replaces("*GELU*"),))
    return op

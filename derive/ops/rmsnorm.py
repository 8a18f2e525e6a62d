"""RMSNorm: y = x * rstd * (weight_offset + weight), rstd = 1 / sqrt(mean(x**2) + eps).

weight_offset = 0 is torch.nn.RMSNorm; weight_offset = 1 is Gemma's (1 + weight) scale. The
offset belongs to the weight: without a weight, y = x_hat whatever the offset.
"""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param, Replaces
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("rmsnorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    mean_square = op.row_mean("mean_square", x**2)
    rstd = op.row("rstd", 1 / sympy.sqrt(mean_square + eps), positive=True)
    x_hat = op.element("x_hat", x * rstd)
    y = op.element("y", x_hat * (weight_offset + weight))
    op.output(y)
    op.save(x, rstd, doc="Keeps the input and the row statistic.")
    op.save(y, rstd, mode="invertible",
            doc="Keeps the output instead of the input; x_hat is recovered as "
                "y / (weight_offset + weight) with the divisor clamped below.")
    op.api = NormalizedShapeAPI(
        function="rms_norm", module="RMSNorm",
        torch_function="torch.nn.functional.rms_norm", torch_module="torch.nn.RMSNorm",
        params=(Param("weight", "ones", offset="weight_offset"),), eps=None,
        options=(Option("weight_offset", 0.0),),
        # Liger's in_place: dx written into dy's memory where that is safe
        in_place=True,
        # torch's rms_norm scales by the weight alone: (offset + weight) rounded to a 16-bit
        # weight's dtype would not be the kernels' fp32 scale
        reference="torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)",
        reference_when="weight_offset == 0",
        # HF: LlamaRMSNorm, ... and the (1 + weight) scale of Gemma's and others (the probe
        # tells which); T5's and its kin's *LayerNorm are RMS norms
        replaces=(Replaces("*RMSNorm", tries=(("weight_offset", (0.0, 1.0)),)),
                  Replaces("*LayerNorm", tries=(("weight_offset", (0.0, 1.0)),))))
    return op

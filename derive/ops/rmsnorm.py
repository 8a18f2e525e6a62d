"""RMSNorm: y = x * rstd * (weight_offset + weight), rstd = 1 / sqrt(mean(x**2) + eps).

weight_offset = 0 is torch.nn.RMSNorm; weight_offset = 1 is Gemma's (1 + weight) scale. The
offset belongs to the weight: without a weight, y = x_hat whatever the offset.

A row holding +inf or -inf has mean(x**2) = inf, so rstd = 0: its finite elements give 0 and
its infinite ones NaN (inf * 0), on every path and device, as torch's rms_norm on the CPU; torch's
CUDA rms_norm makes such a row NaN throughout.
"""

import sympy

from derive.api import Choice, NormalizedShapeAPI, Option, Param, Replaces
from derive.spec import OpSpec, Rounded

#: casting_mode: where a 16-bit input's values are rounded (the RMS norms' shared option)
CASTING_MODE = Choice(
    "casting_mode", ("round_normalized",), (("gemma", (0.0,)), ("llama", (1.0,))), doc=(
        "where a float16 or bfloat16 input's values are rounded, as Liger-Kernel's "
        "LigerRMSNorm. \"gemma\" (as torch's rms_norm and Hugging Face's GemmaRMSNorm): "
        "everything in float32, the output rounded once to the input's dtype. \"llama\" (as "
        "Hugging Face's LlamaRMSNorm, `weight * hidden.to(input_dtype)`): the normalized "
        "x * rstd rounded to the input's dtype before the weight (weight_offset + weight, in "
        "float32) multiplies it, the product rounded again; its gradient passes the rounding "
        "unchanged, as torch's autograd passes a cast. Both are the same for float32 and "
        "float64 input. Liger-Kernel's \"none\" (every step in the input's dtype) is not "
        "taken."))


def scaled(op: OpSpec, x_hat: sympy.Symbol) -> sympy.Expr:
    """What the weight multiplies: x_hat, or with casting_mode="llama" (Hugging Face's
    LlamaRMSNorm) x_hat rounded to the input's dtype first. Off ("gemma", the default) the
    kernels never round it: they are those of the spec without the option."""
    llama = op.scalar("round_normalized", absent=0)
    return sympy.Piecewise((x_hat, sympy.Eq(llama, 0)), (Rounded(x_hat), True))


def spec() -> OpSpec:
    op = OpSpec("rmsnorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    mean_square = op.row_mean("mean_square", x**2)
    rstd = op.row("rstd", 1 / sympy.sqrt(mean_square + eps), positive=True)
    x_hat = op.element("x_hat", x * rstd)
    y = op.element("y", scaled(op, x_hat) * (weight_offset + weight))
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
        choices=(CASTING_MODE,),
        # Liger's in_place: dx written into dy's memory where that is safe
        in_place=True,
        # torch's rms_norm scales by the weight alone: (offset + weight) rounded to a 16-bit
        # weight's dtype would not be the kernels' fp32 scale
        reference="torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)",
        reference_when='weight_offset == 0 and casting_mode == "gemma"',
        # HF: LlamaRMSNorm, ... and the (1 + weight) scale of Gemma's and others (the probe
        # tells which); T5's and its kin's *LayerNorm are RMS norms
        # (the probe keeps the casting mode that rounds as the module does: "llama" for a
        # 16-bit LlamaRMSNorm)
        replaces=(Replaces("*RMSNorm", tries=(("weight_offset", (0.0, 1.0)),
                                              ("casting_mode", ("gemma", "llama")))),
                  Replaces("*LayerNorm", tries=(("weight_offset", (0.0, 1.0)),
                                                ("casting_mode", ("gemma", "llama"))))))
    return op

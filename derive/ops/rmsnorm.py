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
    "casting_mode", ("round_normalized", "round_steps"),
    (("gemma", (0.0, 0.0)), ("llama", (1.0, 0.0)), ("none", (1.0, 1.0))), doc=(
        "where a float16 or bfloat16 input's values are rounded, as Liger-Kernel's "
        "LigerRMSNorm. \"gemma\" (as torch's rms_norm and Hugging Face's GemmaRMSNorm): "
        "everything in float32, the output rounded once to the input's dtype. \"llama\" (as "
        "Hugging Face's LlamaRMSNorm, `weight * hidden.to(input_dtype)`): the normalized "
        "x * rstd rounded to the input's dtype before the weight (weight_offset + weight, in "
        "float32) multiplies it, the product rounded again. \"none\" (Liger-Kernel's: no cast, "
        "every step in the input's dtype, as torch's ops compute an RMS norm written out on a "
        "16-bit tensor): each square, the mean square, mean square + eps, rstd, x * rstd and "
        "weight_offset + weight rounded to the input's dtype, the mean summed in float32. The "
        "gradient passes each rounding unchanged, as torch's autograd passes a cast, each "
        "derivative evaluated at the rounded statistics the forward saved. All three are the "
        "same for float32 and float64 input."))


def casting(op: OpSpec) -> tuple[sympy.Symbol, sympy.Symbol]:
    """CASTING_MODE's switches: (x_hat rounded before the weight, every step rounded). Off
    ("gemma", the default) the kernels never round: they are those of the spec without the
    option."""
    return op.scalar("round_normalized", absent=0), op.scalar("round_steps", absent=0)


def rounded_if(switch: sympy.Symbol, expr: sympy.Expr) -> sympy.Expr:
    """expr, rounded to the input's dtype where `switch` is on."""
    return sympy.Piecewise((expr, sympy.Eq(switch, 0)), (Rounded(expr), True))


def normalized(op: OpSpec, s: sympy.Symbol, eps: sympy.Symbol, weight_offset: sympy.Symbol,
               weight: sympy.Symbol) -> tuple[sympy.Symbol, sympy.Symbol]:
    """(rstd, y) of the RMS norm of `s` under CASTING_MODE: y = x_hat * (weight_offset +
    weight), x_hat = s * rstd, rstd = 1 / sqrt(mean(s**2) + eps), with the roundings the
    casting mode asks for ("llama": x_hat; "none": every step)."""
    llama, steps = casting(op)
    mean_square = op.row_mean("mean_square", rounded_if(steps, s**2))
    rstd = op.row("rstd", rounded_if(steps, 1 / sympy.sqrt(
        rounded_if(steps, rounded_if(steps, mean_square) + eps))), positive=True)
    x_hat = op.element("x_hat", s * rstd)
    y = op.element("y", rounded_if(llama, x_hat)
                   * rounded_if(steps, weight_offset + weight))
    return rstd, y


def spec() -> OpSpec:
    op = OpSpec("rmsnorm", doc=__doc__)
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    rstd, y = normalized(op, x, eps, weight_offset, weight)
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

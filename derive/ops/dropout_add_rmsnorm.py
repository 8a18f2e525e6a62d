"""Dropout + (bias +) residual add + RMSNorm: s = dropout(x + input_bias, p) + residual;
y = RMSNorm(s).

Phi-3's `post_attention_layernorm(resid_attn_dropout(attn) + residual)` in one kernel each way.
The keep mask comes from the call's seed and each element's index, as bias_dropout_add's
(Philox, u >= p keeps an element, scaled by 1/(1 - p)): the same seed gives the same mask as
bias_dropout_add's for the same shape. Nothing of it is saved: the backward regenerates it. The
prenorm residual stream s can be returned (kept in fp32 if asked); its gradient is added into
dresidual and, through the mask, into dx inside the same backward kernel.

add_rms_norm(dropout_p=...) runs these kernels whenever dropout is on (p > 0 in training), its
own, without a random draw, otherwise.
"""

import sympy

from derive.api import NormalizedShapeAPI, Option, Param
from derive.ops.rmsnorm import CASTING_MODE, normalized
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("dropout_add_rmsnorm", doc=__doc__)
    x = op.input("x")
    residual = op.input("residual", absent=0)
    input_bias = op.column_param("input_bias", absent=0)
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    p = op.scalar("dropout_p")
    u = op.random("u")
    keep = op.element("keep", sympy.Piecewise((1, u >= p), (0, True)))
    # a product, as torch's dropout: a dropped NaN stays NaN
    dropped = op.element("dropped", (x + input_bias) * keep / (1 - p))
    residual_out = op.element("residual_out", dropped + residual)
    rstd, y = normalized(op, residual_out, eps, weight_offset, weight)
    op.output(y, residual_out)
    op.save(residual_out, rstd, doc="Keeps the sum and the row statistic.")
    op.save(y, rstd, mode="invertible",
            doc="Keeps the output instead of the sum; x_hat = y / (weight_offset + weight).")
    op.api = NormalizedShapeAPI(
        function="dropout_add_rms_norm", module="DropoutAddRMSNorm",
        torch_function="torch.nn.functional.rms_norm(torch.nn.functional.dropout(input + "
                       "input_bias, dropout_p, training) + residual, ...)",
        torch_module="torch.nn.RMSNorm",
        params=(Param("weight", "ones", offset="weight_offset"),), eps=None,
        options=(Option("weight_offset", 0.0), Option("dropout_p", 0.0, check="probability")),
        choices=(CASTING_MODE,),
        residual="residual", call_params=("input_bias",), dropout="dropout_p",
        in_place=True,
        # torch's dropout draws another mask than a seeded one: with dropout off or no seed
        reference="dispatch.normalized(torch.nn.functional.rms_norm, dispatch.added("
                  "torch.nn.functional.dropout(input if input_bias is None else "
                  "input + input_bias, dropout_p, training), residual), normalized_shape, "
                  "weight, eps, prenorm=prenorm)",
        reference_when='not residual_in_fp32 and weight_offset == 0 and casting_mode == "gemma"')
    return op

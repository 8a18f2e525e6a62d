"""Fused (bias +) residual add + RMSNorm: s = x + input_bias + residual; y = RMSNorm(s).

The prenorm residual stream s can be returned (kept in fp32 if asked); its gradient is added
into dx inside the same backward kernel.
"""


from derive.api import NormalizedShapeAPI, Option, Param, Replaces
from derive.ops.rmsnorm import CASTING_MODE, normalized
from derive.spec import OpSpec


def spec() -> OpSpec:
    op = OpSpec("add_rmsnorm", doc=__doc__)
    x = op.input("x")
    residual = op.input("residual", absent=0)
    input_bias = op.column_param("input_bias", absent=0)
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps", positive=True)
    weight_offset = op.scalar("weight_offset")
    residual_out = op.element("residual_out", x + input_bias + residual)
    rstd, y = normalized(op, residual_out, eps, weight_offset, weight)
    op.output(y, residual_out)
    op.save(residual_out, rstd, doc="Keeps the sum and the row statistic.")
    op.save(y, rstd, mode="invertible",
            doc="Keeps the output instead of the sum; x_hat = y / (weight_offset + weight).")
    op.api = NormalizedShapeAPI(
        function="add_rms_norm", module="AddRMSNorm",
        torch_function="torch.nn.functional.rms_norm(input + input_bias + residual, ...)",
        torch_module="torch.nn.RMSNorm",
        params=(Param("weight", "ones", offset="weight_offset"),), eps=None,
        options=(Option("weight_offset", 0.0), Option("dropout_p", 0.0, check="probability")),
        choices=(CASTING_MODE,),
        residual="residual", call_params=("input_bias",),
        # dropout on input + input_bias: computed by the kernels of dropout_add_rmsnorm when
        # on, so that these, without it, draw no random values
        dropout="dropout_p", dropout_op="dropout_add_rmsnorm",
        # the add before a norm inside a transformer layer, with the norm's own parameters
        replaces=(Replaces("*", kind="residual"),),
        # Liger's in_place: dx written into dy's memory where that is safe
        in_place=True,
        reference="dispatch.normalized(torch.nn.functional.rms_norm, "
                  "dispatch.added(input, input_bias, residual), normalized_shape, weight, eps, "
                  "prenorm=prenorm)",
        # torch's sum is rounded to the inputs' dtype, not kept in fp32; its rms_norm scales by
        # the weight alone
        reference_when='not residual_in_fp32 and weight_offset == 0 and casting_mode == "gemma"')
    return op

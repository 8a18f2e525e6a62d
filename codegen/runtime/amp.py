"""torch's autocast policies, as the generated ops follow them.

Under `torch.autocast`, torch runs some ops in float32 whatever the dtype of their inputs: it
casts their floating inputs other than float64 to float32 (ATen's "fp32" policy: layer_norm,
rms_norm, nll_loss, ...), or passes `dtype=torch.float32` (its "fp32_set_opt_dtype" policy:
softmax, log_softmax). Which ops, depends on the device type. A generated op whose torch
counterpart (`torch_function` of its spec's API) calls such an op does what torch's autocast
does to that call, once, here: `policy` names the op its counterpart calls, `float32` says
whether autocast makes it float32 now, `to_float32` casts as torch's autocast casts.

Other ops (gelu, silu, the products and sums around them) have no policy: their inputs'
dtypes decide, with autocast on or off, as torch's.
"""

from __future__ import annotations

import re

import torch

#: the torch functions (by their name in `torch` or `torch.nn.functional`) whose results
#: autocast makes float32, per device type: ATen's autocast lists (autocast_mode.h's
#: AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE for CUDA and the other accelerators,
#: autocast_mode.cpp's own list for the CPU, where norms and softmax keep a 16-bit dtype).
#: cross_entropy is listed where the ops it is made of are (log_softmax, nll_loss on CUDA) or
#: itself (the CPU): its loss is float32, computed from the logits in float32.
FLOAT32 = {
    "cuda": frozenset({"layer_norm", "group_norm", "rms_norm", "softmax", "log_softmax",
                       "cross_entropy", "nll_loss", "logsumexp"}),
    "cpu": frozenset({"cross_entropy", "nll_loss"}),
}
#: the dtypes autocast casts for an op it runs in float32 (never float64)
CAST = frozenset({torch.float16, torch.bfloat16, torch.float32})

_CALLS = re.compile(r"\btorch\.(?:nn\.functional\.)?(\w+)")


def policy(torch_function: str) -> str | None:
    """The first torch function that `torch_function` (an API's counterpart, such as
    "torch.nn.functional.layer_norm(input + residual, ...)") calls and that autocast runs in
    float32 on some device type; None where it calls none."""
    listed = frozenset().union(*FLOAT32.values())
    for name in _CALLS.findall(torch_function):
        if name in listed:
            return name
    return None


def float32(op: str, tensor: torch.Tensor) -> bool:
    """Whether torch's autocast, as it is set now, runs `op` (a name `policy` gave) in float32
    for `tensor`, the call's first input: autocast is on for its device type, lists `op`, and
    casts the tensor's dtype."""
    if not torch._C._is_any_autocast_enabled():  # the common call, at once (host time)
        return False
    device_type = tensor.device.type
    # (no autocast at all for some device types: the meta device's)
    if not (torch._C._is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return False
    # the other accelerators share CUDA's lists in ATen
    return tensor.dtype in CAST and op in FLOAT32.get(device_type, FLOAT32["cuda"])


def to_float32(*tensors):
    """The tensors as torch's autocast passes them to an op it runs in float32: the floating
    ones other than float64 in float32, the others (None, float64, integer) as they are."""
    return tuple(tensor.float() if tensor is not None and tensor.dtype in CAST else tensor
                 for tensor in tensors)


def restored(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in `dtype`, where one is given: a result autocast leaves in the dtype of the
    inputs it did not cast (a fused op's sum before its norm)."""
    return tensor if dtype is None else tensor.to(dtype)

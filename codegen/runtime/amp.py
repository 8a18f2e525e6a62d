"""torch's autocast policies, as the generated ops follow them.

Under `torch.autocast`, torch runs some ops in float32 whatever the dtype of their inputs: it
casts their floating inputs other than float64 to float32 (ATen's "fp32" policy: layer_norm,
rms_norm, nll_loss, ...), or passes `dtype=torch.float32` (its "fp32_set_opt_dtype" policy:
softmax, log_softmax). Which ops, depends on the device type. A generated op whose torch
counterpart (`torch_function` of its spec's API) calls such an op does what torch's autocast
does to that call, once, here (`derive` finds the op the counterpart calls in `FLOAT32`):
`float32` says whether autocast makes it float32 now, `to_float32` casts as torch's autocast
casts.

Other ops (gelu, silu, the products and sums around them) have no policy: their inputs'
dtypes decide, with autocast on or off, as torch's.
"""

from __future__ import annotations

import contextlib

import torch

#: the torch functions (by their name in `torch` or `torch.nn.functional`) whose results
#: autocast makes float32, per device type: ATen's autocast lists (its "fp32" and
#: "fp32_set_opt_dtype" ones for CUDA and the other accelerators, its own list for the CPU,
#: where norms and softmax keep a 16-bit dtype).
#: cross_entropy is listed where the ops it is made of are (log_softmax, nll_loss on CUDA) or
#: itself (the CPU): its loss is float32, computed from the logits in float32.
FLOAT32 = {
    "cuda": frozenset({"layer_norm", "group_norm", "rms_norm", "softmax", "log_softmax",
                       "cross_entropy", "nll_loss", "logsumexp"}),
    "cpu": frozenset({"cross_entropy", "nll_loss"}),
}
#: the dtypes autocast casts for an op it runs in float32 (never float64)
CAST = frozenset({torch.float16, torch.bfloat16, torch.float32})


def float32(op: str, tensor: torch.Tensor) -> bool:
    """Whether torch's autocast, as it is set now, runs `op` (a name of `FLOAT32`) in float32
    for `tensor`, the call's first input: autocast is on for its device type, lists `op`, and
    casts the tensor's dtype."""
    if not torch._C._is_any_autocast_enabled():  # the common call, at once (host time)
        return False
    device_type = tensor.device.type
    if not enabled(device_type):
        return False
    # the other accelerators share CUDA's lists in ATen
    return tensor.dtype in CAST and op in FLOAT32.get(device_type, FLOAT32["cuda"])


def enabled(device_type: str) -> bool:
    """Whether autocast is on for the device type (never for one torch has no autocast for:
    the meta device, whose tensors torch.is_autocast_enabled refuses)."""
    return (torch._C._is_any_autocast_enabled() and torch._C._is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type))


def disabled(device_type: str):
    """A context within which autocast is off for the device type (nothing to turn off for
    one torch has no autocast for)."""
    if not torch._C._is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def to_float32(*tensors):
    """The tensors as torch's autocast passes them to an op it runs in float32: the floating
    ones other than float64 in float32, the others (None, float64, integer) as they are."""
    return tuple(tensor.float() if tensor is not None and tensor.dtype in CAST else tensor
                 for tensor in tensors)


def restored(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in `dtype`, where one is given: a result autocast leaves in the dtype of the
    inputs it did not cast (a fused op's sum before its norm)."""
    return tensor if dtype is None else tensor.to(dtype)

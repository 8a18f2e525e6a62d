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
#: ATen's autocast lists make float32 on some device type (its "fp32" and "fp32_set_opt_dtype"
#: lists for CUDA and the other accelerators, its own for the CPU, where norms and softmax keep
#: a 16-bit dtype): `derive` finds in these the op a generated op's counterpart calls. Which
#: of them a device runs in float32 changes between torch versions (rms_norm is on CUDA's list
#: in some), so `listed` asks the installed torch; these sets say what ATen's lists held when
#: written. cross_entropy is listed where the ops it is made of are (log_softmax, nll_loss on
#: CUDA) or itself (the CPU): its loss is float32, computed from the logits in float32.
FLOAT32 = {
    "cuda": frozenset({"layer_norm", "group_norm", "rms_norm", "softmax", "log_softmax",
                       "cross_entropy", "nll_loss", "logsumexp"}),
    "cpu": frozenset({"cross_entropy", "nll_loss"}),
}
#: the dtypes autocast casts for an op it runs in float32 (never float64)
CAST = frozenset({torch.float16, torch.bfloat16, torch.float32})

#: a call of each op of FLOAT32 on a tiny tensor, whose result's dtype tells what autocast does
_PROBES = {
    "layer_norm": lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]),
    "group_norm": lambda t: torch.nn.functional.group_norm(t, 1),
    "rms_norm": lambda t: torch.nn.functional.rms_norm(t, t.shape[-1:]),
    "softmax": lambda t: torch.softmax(t, -1),
    "log_softmax": lambda t: torch.log_softmax(t, -1),
    "logsumexp": lambda t: torch.logsumexp(t, -1),
    "cross_entropy": lambda t: torch.nn.functional.cross_entropy(t, _targets(t)),
    "nll_loss": lambda t: torch.nn.functional.nll_loss(t, _targets(t)),
}
#: (op, device type, autocast dtype) -> whether the installed torch's autocast runs op in float32
_LISTED: dict[tuple[str, str, torch.dtype], bool] = {}


def _targets(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape[:1], dtype=torch.long, device=t.device)


def listed(op: str, device: torch.device) -> bool:
    """Whether the installed torch's autocast, on now for `device`'s type, runs `op` (a name of
    FLOAT32) in float32: asked of torch once per op, device type and autocast dtype, by a call
    on a tiny tensor. While torch.compile traces, the call is traced too, on fake tensors whose
    dtype autocast decides as it does eagerly, so a compiled call answers as an eager one."""
    device_type = device.type
    key = (op, device_type, torch.get_autocast_dtype(device_type))
    seen = _LISTED.get(key)
    if seen is not None:
        return seen
    probe = torch.ones((2, 4), dtype=key[2], device=device)
    with torch.no_grad():
        seen = _LISTED[key] = _PROBES[op](probe).dtype == torch.float32
    return seen


def float32(op: str, tensor: torch.Tensor) -> bool:
    """Whether torch's autocast, as it is set now, runs `op` (a name of `FLOAT32`) in float32
    for `tensor`, the call's first input: autocast is on for its device type, lists `op`, and
    casts the tensor's dtype."""
    if not torch._C._is_any_autocast_enabled():  # the common call, at once (host time)
        return False
    device_type = tensor.device.type
    if not enabled(device_type):
        return False
    return tensor.dtype in CAST and listed(op, tensor.device)


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

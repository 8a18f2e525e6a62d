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
#: autocast makes float32, per device type (the other accelerators share CUDA's lists in
#: ATen), as `listed` takes them where it cannot ask the installed torch: ATen's autocast lists
#: (its "fp32" and "fp32_set_opt_dtype" ones for CUDA and the other accelerators, its own
#: list for the CPU,
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

#: a call of each op of FLOAT32 on a tiny tensor: the lists change between torch versions
#: (rms_norm is on CUDA's in some), so the installed torch is asked once per op and device type
#: (`listed`), FLOAT32 answering only where it cannot be asked (while torch.compile traces)
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
    """Whether the installed torch's autocast, on now for `device`'s type, runs `op` in float32:
    asked of torch once (a call on a tiny tensor of the autocast dtype), FLOAT32 while
    torch.compile traces."""
    device_type = device.type
    key = (op, device_type, torch.get_autocast_dtype(device_type))
    seen = _LISTED.get(key)
    if seen is not None:
        return seen
    if torch.compiler.is_compiling() or op not in _PROBES:
        return op in FLOAT32.get(device_type, FLOAT32["cuda"])
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

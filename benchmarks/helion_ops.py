"""Helion peers: a Helion forward kernel per op, its backward derived by Helion itself
(``helion.experimental.backward``), wrapped in a ``torch.autograd.Function``.

Imports helion at import time: ``benchmarks.providers`` and ``benchmarks.transformer_ops``
import this module lazily, so without helion only the ``helion`` provider is unavailable.
Tested against torch on the CPU under ``TRITON_INTERPRET=1`` by ``tests/test_bench_helion.py``.

Ops (torch's signatures, so ``OpSpec.bind`` calls them like ``F.rms_norm``):
``rms_norm``, ``layer_norm``, ``softmax`` (last dim), ``swiglu`` (silu(gate) * up) and
``geglu`` (exact gelu(gate) * up). Each forward loads whole rows of a tile of rows (the
GLUs: 2-D tiles), computes in fp32 and stores in the input's dtype; it saves nothing but its
inputs, as ``helion.experimental.backward`` recomputes what it needs from them.

Autotuning: ``EFFORT`` (``VJPFORGE_HELION_EFFORT``, default ``"quick"``, Helion's lighter
search; ``"none"`` takes Helion's default config, ``"full"`` its full search) is the forward
kernels' ``autotune_effort`` and the derived backward's (``autotune=EFFORT != "none"``). Each
kernel is tuned once per shape and dtype (Helion specialises on shapes), on its first call.

Backward: the first backward of a shape goes through ``helion.experimental.backward``, which
differentiates the forward's graph, writes the backward Helion kernel and tunes it. Later
backwards call that generated kernel directly (``DIRECT_BACKWARD``), because the public
function also allocates ``zeros_like`` of every input and adds the kernel's gradient to it and
re-validates the forward graph on every call: two activation-sized writes and a read more per
input than the derived kernel. ``VJPFORGE_HELION_BACKWARD=api`` times the public function on
every call instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import helion
import helion.experimental
import helion.language as hl
import torch

EFFORT: str = os.environ.get("VJPFORGE_HELION_EFFORT", "quick")
if EFFORT not in ("none", "quick", "full"):
    raise ValueError(f"VJPFORGE_HELION_EFFORT={EFFORT!r}: one of none, quick, full")
DIRECT_BACKWARD: bool = os.environ.get("VJPFORGE_HELION_BACKWARD", "direct") != "api"

Tensor = torch.Tensor


# ------------------------------------------------------------------ forward kernels
@helion.kernel(autotune_effort=EFFORT)
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    m, _n = x.size()
    y = torch.empty_like(x)
    for tile in hl.tile(m):
        xt = x[tile, :].to(torch.float32)
        rstd = torch.rsqrt(torch.mean(xt * xt, dim=-1, keepdim=True) + eps)
        y[tile, :] = (xt * rstd * weight[:].to(torch.float32)).to(y.dtype)
    return y


@helion.kernel(autotune_effort=EFFORT)
def layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    m, _n = x.size()
    y = torch.empty_like(x)
    for tile in hl.tile(m):
        xt = x[tile, :].to(torch.float32)
        mean = torch.mean(xt, dim=-1, keepdim=True)
        centred = xt - mean
        var = torch.mean(centred * centred, dim=-1, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        out = centred * rstd * weight[:].to(torch.float32) + bias[:].to(torch.float32)
        y[tile, :] = out.to(y.dtype)
    return y


@helion.kernel(autotune_effort=EFFORT)
def softmax_fwd(x: Tensor) -> Tensor:
    m, _n = x.size()
    y = torch.empty_like(x)
    for tile in hl.tile(m):
        xt = x[tile, :].to(torch.float32)
        row_max = torch.amax(xt, dim=-1, keepdim=True)
        e = torch.exp(xt - row_max)
        y[tile, :] = (e / torch.sum(e, dim=-1, keepdim=True)).to(y.dtype)
    return y


@helion.kernel(autotune_effort=EFFORT)
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    y = torch.empty_like(gate)
    for tile in hl.tile(gate.size()):
        g = gate[tile].to(torch.float32)
        y[tile] = (g * torch.sigmoid(g) * up[tile].to(torch.float32)).to(y.dtype)
    return y


@helion.kernel(autotune_effort=EFFORT)
def geglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    y = torch.empty_like(gate)
    for tile in hl.tile(gate.size()):
        g = gate[tile].to(torch.float32)
        gelu = 0.5 * g * (1.0 + torch.erf(g * 0.7071067811865476))
        y[tile] = (gelu * up[tile].to(torch.float32)).to(y.dtype)
    return y


KERNELS: dict[str, Any] = {
    "rmsnorm": rms_norm_fwd,
    "layernorm": layer_norm_fwd,
    "softmax": softmax_fwd,
    "swiglu": swiglu_fwd,
    "geglu": geglu_fwd,
}


# ------------------------------------------------------------------ derived backward
_direct: dict[int, Callable[..., Any] | None] = {}
"""id(forward BoundKernel) -> its derived backward kernel, or None where the public
function must run (its gradients need reshaping or summing over derived inputs)."""


def _derived_kernel(kernel: Any, tensors: Sequence[Tensor], scalars: Sequence[Any]) -> Any:
    """The backward kernel ``helion.experimental.backward`` made for this shape, if it maps
    one-to-one onto the forward's tensor inputs (else None)."""
    bound = kernel.bind((*tensors, *scalars))
    entries = list(getattr(bound, "_backward_compiled_cache", {}).values())
    if len(entries) != 1:
        return None
    bwd_fn, _src, _bound, _ndims, is_scan_hop, _inits, mappings, names, _hf, _shapes = entries[0]
    if is_scan_hop or [m.tensor_name for m in mappings] != list(names) or len(names) != len(
        tensors
    ):
        return None
    return bwd_fn


def derived_backward(
    kernel: Any, dy: Tensor, tensors: Sequence[Tensor], scalars: Sequence[Any] = ()
) -> tuple[Tensor, ...]:
    """Gradients of ``kernel(*tensors, *scalars)`` for every tensor input, by Helion."""
    dy = dy.contiguous()
    key = id(kernel.bind((*tensors, *scalars))) if DIRECT_BACKWARD else None
    direct = _direct.get(key) if key is not None else None
    if direct is not None:
        grads = direct(dy, *tensors)
    else:
        # Helion differentiates with torch's autograd: grad mode must be on, and an
        # autograd.Function's backward runs with it off
        with torch.enable_grad():
            grads = helion.experimental.backward(
                kernel,
                dy,
                *tensors,
                *scalars,
                autotune=EFFORT != "none",
                autotune_effort=EFFORT,
            )
        if key is not None:
            _direct[key] = _derived_kernel(kernel, tensors, scalars)
    return grads if isinstance(grads, tuple) else (grads,)


class _HelionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kernel: Any, scalars: tuple[Any, ...], *tensors: Tensor) -> Tensor:
        tensors = tuple(t.contiguous() for t in tensors)
        ctx.kernel, ctx.scalars = kernel, scalars
        ctx.save_for_backward(*tensors)
        return kernel(*tensors, *scalars)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        grads = derived_backward(ctx.kernel, dy, ctx.saved_tensors, ctx.scalars)
        return (None, None, *grads)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _apply(kernel: Any, scalars: tuple[Any, ...], x: Tensor, *params: Tensor) -> Tensor:
    return _HelionOp.apply(kernel, scalars, _rows(x), *params).reshape(x.shape)


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor, eps: float = 1e-6
) -> Tensor:
    assert tuple(normalized_shape) == (x.shape[-1],)
    return _apply(rms_norm_fwd, (eps,), x, weight)


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-5,
) -> Tensor:
    assert tuple(normalized_shape) == (x.shape[-1],)
    return _apply(layer_norm_fwd, (eps,), x, weight, bias)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    assert dim in (-1, x.dim() - 1)
    return _apply(softmax_fwd, (), x)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return _HelionOp.apply(swiglu_fwd, (), _rows(gate), _rows(up)).reshape(gate.shape)


def geglu(gate: Tensor, up: Tensor) -> Tensor:
    return _HelionOp.apply(geglu_fwd, (), _rows(gate), _rows(up)).reshape(gate.shape)


# ------------------------------------------------------------------ reductions, for the docs
_REDUCE_CALL = re.compile(
    r"\b(?:tl\.(?:sum|max|min|reduce|argmax|argmin)|\w*(?:max|min)_propagate_nan\w*)\("
)


def _last_argument(code: str, open_paren: int) -> str:
    """The last top-level argument of the call whose ``(`` is at ``open_paren``."""
    depth, start = 0, open_paren + 1
    for index in range(open_paren, len(code)):
        char = code[index]
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
            if depth == 0:
                return code[start:index].strip()
        elif char == "," and depth == 1:
            start = index + 1
    return ""


def count_reductions(triton_code: str) -> dict[str, int]:
    """Reductions in Helion's generated code: ``row`` (over a row, axis 1 of a tile of rows),
    ``column`` (over the rows of a tile: partial column sums of a parameter's gradient) and
    ``host`` (``.sum`` calls of the host wrapper that finish those partials)."""
    code = "\n".join(line.split("#")[0] for line in triton_code.splitlines())
    # the host wrapper is the last function; everything before it is device code
    device, _, host = code.rpartition("\ndef ")
    counts = {"row": 0, "column": 0, "host": len(re.findall(r"\.sum\(", host))}
    for match in _REDUCE_CALL.finditer(device):
        axis = _last_argument(device, match.end() - 1)
        counts["column" if axis == "0" else "row"] += 1
    return counts


def backward_code(name: str, m: int = 8, n: int = 64, device: str = "cpu") -> tuple[str, str]:
    """(Helion source, Triton code) of the backward Helion derives for ``name`` at m x n, at
    Helion's default config (on the CPU: run under TRITON_INTERPRET=1)."""
    kernel = KERNELS[name]
    x = torch.randn(m, n, device=device)
    tensors: tuple[Tensor, ...]
    scalars: tuple[Any, ...] = ()
    if name in ("rmsnorm", "layernorm"):
        tensors = (x, torch.randn(n, device=device))
        if name == "layernorm":
            tensors += (torch.randn(n, device=device),)
        scalars = (1e-5,)
    elif name == "softmax":
        tensors = (x,)
    else:
        tensors = (x, torch.randn(m, n, device=device))
    y = kernel(*tensors, *scalars)
    _grads, source, triton_code = helion.experimental.backward(
        kernel, torch.randn_like(y), *tensors, *scalars, return_code=True
    )
    return source, triton_code


@contextmanager
def interpreter_libdevice() -> Iterator[None]:
    """Helion's generated code calls ``libdevice.rsqrt`` / ``exp`` / ``erf``, which Triton's
    interpreter leaves as stubs that return None: route them to ``tl.math`` (which the
    interpreter implements) while the block runs. For CPU tests under TRITON_INTERPRET=1."""
    import triton.language as tl
    from triton.language.extra import libdevice

    saved: dict[str, Any] = {}
    for name in ("rsqrt", "sqrt", "exp", "exp2", "log", "log2", "erf", "fma", "abs"):
        if hasattr(tl.math, name) and hasattr(libdevice, name):
            saved[name] = getattr(libdevice, name)
            setattr(
                libdevice,
                name,
                lambda *args, _name=name, **kwargs: getattr(tl.math, _name)(*args, **kwargs),
            )
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(libdevice, name, fn)


__all__ = [
    "EFFORT",
    "KERNELS",
    "backward_code",
    "count_reductions",
    "derived_backward",
    "geglu",
    "interpreter_libdevice",
    "layer_norm",
    "rms_norm",
    "softmax",
    "swiglu",
]

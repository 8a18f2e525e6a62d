"""The benchmarked operators: how to call them, their inputs, and the bytes model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.timing import Workload

Tensor = torch.Tensor
OpFn = Callable[[Tensor, Sequence[Tensor]], Tensor]
"""A benchmarkable op: ``fn(x, params) -> y`` with ``params`` the learnable length-N vectors."""

LAYER_NORM_EPS = 1e-5
RMS_NORM_EPS = 1e-6

MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
MODE_TITLES: dict[str, str] = {
    "fwd": "forward",
    "bwd": "backward",
    "fwd+bwd": "forward+backward",
}


def _call_layer_norm(fn: Callable[..., Tensor], x: Tensor, params: Sequence[Tensor]) -> Tensor:
    weight, bias = params
    return fn(x, (x.shape[-1],), weight, bias, eps=LAYER_NORM_EPS)


def _call_rms_norm(fn: Callable[..., Tensor], x: Tensor, params: Sequence[Tensor]) -> Tensor:
    (weight,) = params
    return fn(x, (x.shape[-1],), weight, eps=RMS_NORM_EPS)


def _call_softmax(fn: Callable[..., Tensor], x: Tensor, params: Sequence[Tensor]) -> Tensor:
    return fn(x, dim=-1)


@dataclass(frozen=True)
class OpSpec:
    """One operator. ``call_torch_style`` calls a function that has torch's signature."""

    name: str
    n_params: int
    """Learnable length-N vectors: weight and bias for LayerNorm, weight for RMSNorm."""
    call_torch_style: Callable[[Callable[..., Tensor], Tensor, Sequence[Tensor]], Tensor]

    def bind(self, fn: Callable[..., Tensor]) -> OpFn:
        """Turn a function with torch's signature into an :data:`OpFn`."""

        def op_fn(x: Tensor, params: Sequence[Tensor]) -> Tensor:
            return self.call_torch_style(fn, x, params)

        return op_fn


OPS: dict[str, OpSpec] = {
    "layernorm": OpSpec("layernorm", 2, _call_layer_norm),
    "rmsnorm": OpSpec("rmsnorm", 1, _call_rms_norm),
    "softmax": OpSpec("softmax", 0, _call_softmax),
}


def bytes_moved(op: OpSpec, mode: str, m: int, n: int, element_size: int) -> int:
    """Bytes an ideal kernel must move between DRAM and the SMs for one call.

    With ``X = M*N*s`` (one activation-sized tensor), ``P = N*s`` (one parameter vector)
    and ``p = op.n_params``:

    * forward  = read x + write y                                  = 2*X + p*P (read params)
    * backward = read x (softmax: the saved y) + read dy + write dx = 3*X
      + (read weight if p > 0) + write the p parameter gradients   = 3*X + (min(p, 1) + p)*P
    * fwd+bwd  = forward + backward

    Not counted: per-row statistics (mean/rstd, <= 8 bytes a row) and implementation
    specific partial-sum buffers for the parameter gradients. Every provider is
    charged the same bytes, so GB/s compares like with like.
    """
    activation = m * n * element_size
    param = n * element_size
    forward = 2 * activation + op.n_params * param
    backward = 3 * activation + (min(op.n_params, 1) + op.n_params) * param
    per_mode = {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}
    return per_mode[mode]


@dataclass
class Inputs:
    """Input ``x``, parameters and upstream gradient ``dy`` for one (op, shape, dtype)."""

    x: Tensor
    params: tuple[Tensor, ...]
    dy: Tensor

    @property
    def grad_targets(self) -> tuple[Tensor, ...]:
        return (self.x, *self.params)


def make_inputs(op: OpSpec, m: int, n: int, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random inputs; every tensor that has a gradient in training requires grad."""
    generator = torch.Generator(device=device).manual_seed(m * 1_000_003 + n)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    x = randn(m, n).requires_grad_()
    params = tuple(
        (randn(n) * 0.1 + (1.0 if index == 0 else 0.0)).requires_grad_()
        for index in range(op.n_params)
    )
    return Inputs(x=x, params=params, dy=randn(m, n))


def forward_and_input_grad(fn: OpFn, inputs: Inputs) -> tuple[Tensor, Tensor]:
    """One training step of ``fn``: its output and the gradient with respect to ``x``."""
    y = fn(inputs.x, inputs.params)
    grads = torch.autograd.grad(y, inputs.grad_targets, inputs.dy)
    return y.detach(), grads[0]


TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 4e-2,
}


def max_relative_error(actual: Tensor, expected: Tensor) -> float:
    """``max|actual - expected| / max|expected|``: scale-free, fine for softmax's tiny values."""
    expected32 = expected.float()
    scale = expected32.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((actual.float() - expected32).abs().max() / scale)


def make_workload(fn: OpFn, inputs: Inputs, mode: str) -> Workload:
    """What one timed iteration of each mode runs.

    fwd:     y = fn(x, params), with x and params requiring grad (a training forward,
             which saves what the backward needs).
    bwd:     setup (untimed): a fresh forward each iteration; timed: only
             torch.autograd.grad(y, (x, *params), dy). No retain_graph and no .grad
             accumulation, the same for every provider, torch.compile included.
    fwd+bwd: the forward and torch.autograd.grad, timed together.
    """

    def forward(_state: object = None) -> torch.Tensor:
        return fn(inputs.x, inputs.params)

    def backward(y: Any) -> object:
        return torch.autograd.grad(y, inputs.grad_targets, inputs.dy)

    workloads = {
        "fwd": Workload(call=forward),
        "bwd": Workload(call=backward, setup=forward),
        "fwd+bwd": Workload(call=lambda _state: backward(forward())),
    }
    return workloads[mode]

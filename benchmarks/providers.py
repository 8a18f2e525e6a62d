"""Provider table: who implements each op. Every import is lazy, so a missing
package only makes its provider unavailable."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.ops import LAYER_NORM_EPS, RMS_NORM_EPS, OpFn, OpSpec, Tensor


class ProviderUnavailable(Exception):
    """The provider cannot run this op here (package missing, op not offered)."""


def _resolve(dotted: str) -> Any:
    """Import ``package.module.attr`` and return ``attr``."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # an import can fail in many ways; all mean "not available"
        raise ProviderUnavailable(f"cannot import {dotted}: {type(exc).__name__}: {exc}") from exc


TORCH_FUNCTIONS: dict[str, str] = {
    "layernorm": "torch.nn.functional.layer_norm",
    "rmsnorm": "torch.nn.functional.rms_norm",
    "softmax": "torch.softmax",
}

VJPFORGE_FUNCTIONS: dict[str, str] = {
    "layernorm": "generated.layernorm.layer_norm",
    "rmsnorm": "generated.rmsnorm.rms_norm",
    "softmax": "generated.softmax.softmax",
}


def _liger_layer_norm(function: Any, x: Tensor, params: Sequence[Tensor]) -> Tensor:
    weight, bias = params
    return function.apply(x, weight, bias, LAYER_NORM_EPS)


def _liger_rms_norm(function: Any, x: Tensor, params: Sequence[Tensor]) -> Tensor:
    # offset 0 and casting_mode "llama" are Liger's defaults; in_place=False keeps dy intact.
    (weight,) = params
    return function.apply(x, weight, RMS_NORM_EPS, 0.0, "llama", False)


def _liger_softmax(function: Any, x: Tensor, params: Sequence[Tensor]) -> Tensor:
    return function.apply(x)


LIGER_FUNCTIONS: dict[str, tuple[str, Callable[[Any, Tensor, Sequence[Tensor]], Tensor]]] = {
    "layernorm": (
        "liger_kernel.ops.layer_norm.LigerLayerNormFunction",
        _liger_layer_norm,
    ),
    "rmsnorm": ("liger_kernel.ops.rms_norm.LigerRMSNormFunction", _liger_rms_norm),
    "softmax": ("liger_kernel.ops.softmax.LigerSoftmaxFunction", _liger_softmax),
}


def _lookup(table: dict[str, str], op: OpSpec) -> Any:
    if op.name not in table:
        raise ProviderUnavailable(f"no {op.name}")
    return _resolve(table[op.name])


def load_torch(op: OpSpec) -> OpFn:
    return op.bind(_lookup(TORCH_FUNCTIONS, op))


def load_vjpforge(op: OpSpec) -> OpFn:
    return op.bind(_lookup(VJPFORGE_FUNCTIONS, op))


def load_liger(op: OpSpec) -> OpFn:
    if op.name not in LIGER_FUNCTIONS:
        raise ProviderUnavailable(f"Liger has no {op.name}")
    dotted, call = LIGER_FUNCTIONS[op.name]
    function = _resolve(dotted)

    def op_fn(x: Tensor, params: Sequence[Tensor]) -> Tensor:
        return call(function, x, params)

    return op_fn


HELION_FUNCTIONS: dict[str, str] = {
    "layernorm": "benchmarks.helion_ops.layer_norm",
    "rmsnorm": "benchmarks.helion_ops.rms_norm",
    "softmax": "benchmarks.helion_ops.softmax",
}

HELION_BACKWARD_REDUCTIONS: dict[str, str] = {
    "layernorm": "4 row + 2 column (vjpforge: 2 + 2)",
    "rmsnorm": "2 row + 1 column (vjpforge: 1 + 1)",
    "softmax": "5 row (vjpforge: 1)",
}
"""Reductions in the backward Helion derives (Triton code of ``helion.experimental.backward``,
``return_code=True``, at Helion's default config; row: over a row, column: a parameter
gradient's partial sums over a tile's rows, finished by a torch ``.sum(0)``) and in vjpforge's
(docs/ops/*.md, "Reduction count", mode ``default``). ``tests/test_bench_helion.py`` recounts
Helion's."""


def load_helion(op: OpSpec) -> OpFn:
    """A Helion forward kernel with the backward Helion derives (benchmarks/helion_ops.py)."""
    if op.name not in HELION_FUNCTIONS:
        raise ProviderUnavailable(f"no Helion kernel for {op.name}")
    if not torch.cuda.is_available():
        raise ProviderUnavailable("Helion's Triton kernels need a CUDA GPU")
    return op.bind(_resolve(HELION_FUNCTIONS[op.name]))


def raise_recompile_limits() -> None:
    """Let one process compile every shape of the grid without hitting dynamo's limits."""
    config = torch._dynamo.config
    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(config, name):
            setattr(config, name, 4096)


def load_compile(op: OpSpec) -> OpFn:
    """torch.compile of the eager function, fresh for each shape (static shapes)."""
    torch._dynamo.reset()
    return torch.compile(load_torch(op), dynamic=False)


@dataclass(frozen=True)
class Provider:
    name: str
    description: str
    load: Callable[[OpSpec], OpFn]
    fresh_per_shape: bool = False
    """Load again for every shape (torch.compile specialises on the shape)."""
    default: bool = True
    """In a run without --providers (Helion is not: it autotunes every shape first)."""


PROVIDERS: dict[str, Provider] = {
    provider.name: provider
    for provider in (
        Provider("vjpforge", "generated/*.py (this project)", load_vjpforge),
        Provider("torch", "eager: F.layer_norm / F.rms_norm / torch.softmax", load_torch),
        Provider(
            "compile",
            "torch.compile(eager, dynamic=False), fresh per shape",
            load_compile,
            True,
        ),
        Provider("liger", "Liger-Kernel Liger*Function.apply (Triton)", load_liger),
        Provider(
            "helion",
            "Helion 1.5.1 forward kernels (benchmarks/helion_ops.py), backward derived by "
            "helion.experimental.backward; autotune effort "
            f"{os.environ.get('VJPFORGE_HELION_EFFORT', 'quick')!r} (VJPFORGE_HELION_EFFORT) "
            "for both; backward reductions: "
            + "; ".join(f"{op} {count}" for op, count in HELION_BACKWARD_REDUCTIONS.items()),
            load_helion,
            default=False,
        ),
    )
}
DEFAULT_PROVIDERS: tuple[str, ...] = tuple(name for name, p in PROVIDERS.items() if p.default)
PROJECT_PROVIDER = "vjpforge"
BASELINE_PROVIDER = "torch"


@dataclass
class ProviderCache:
    """Loads each (provider, op) once (or once per shape); remembers why one is unavailable."""

    loaded: dict[tuple[str, str], OpFn] = field(default_factory=dict)
    unavailable: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, provider: Provider, op: OpSpec) -> OpFn:
        key = (provider.name, op.name)
        if key in self.unavailable:
            raise ProviderUnavailable(self.unavailable[key])
        if provider.fresh_per_shape or key not in self.loaded:
            try:
                self.loaded[key] = provider.load(op)
            except ProviderUnavailable as exc:
                self.unavailable[key] = str(exc)
                raise
        return self.loaded[key]

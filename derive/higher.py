"""Higher derivatives: the backward a memory mode runs where autograd records it.

A backward called with `create_graph=True` must itself be differentiable, and autograd can only
differentiate it through tensors that carry the graph: the op's inputs and its outputs. What a
mode saves besides (row statistics such as mean and rstd, values stored only for the backward
such as softmax's p before dropout) reaches the backward as a constant. So each mode gets a
second backward, run as differentiable torch ops, that reads only values carrying the graph:

- every value the mode saves is an input or an output: its own backward serves;
- else the values it saves that do (x, or the returned sum of a residual add) may determine the
  others: a backward derived from those alone recomputes them (mean and rstd from x);
- else, in the default mode only and only where no mode of the op has a backward of the kinds
  above, the op returns the values it saves besides as outputs of its own that the caller never
  sees, which makes them carry the graph: the backward is derived for those outputs too (an
  upstream gradient each), since autograd then sends a gradient into them. An extra output costs
  host time in every call, so a mode that only saves memory (an invertible norm) does not take
  it; it refuses create_graph=True instead, naming a mode that supports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from derive.algebra import Algebra
from derive.backward import BackwardResult, derive_backward
from derive.reverse import (
    DerivationError,
    learn_forward_reductions,
    reverse_mode,
    upstream_symbol,
)
from derive.spec import Kind, OpSpec


@dataclass(frozen=True)
class RecordedBackward:
    """How one mode's backward runs where autograd records it (create_graph=True)."""

    #: the saved values it reads, each an input or an output of the op (hidden ones included)
    reads: tuple[str, ...]
    #: saved values the op returns as extra outputs so that they carry the graph
    hidden: tuple[str, ...]
    #: its own derivation; None where the mode's backward serves
    result: BackwardResult | None


def carries_graph(spec: OpSpec, name: str) -> bool:
    """Whether autograd differentiates through a saved value: an input (class indices and
    other row inputs included, which have no gradient) or an output of the op."""
    return spec.node(name).kind in (Kind.INPUT, Kind.ROW_INPUT) or name in spec.differentiated


def recorded_backwards(spec: OpSpec) -> dict[str, RecordedBackward | None]:
    """Per memory mode, the backward autograd can differentiate (see the module doc), or None
    where there is none (the mode's backward then refuses create_graph=True); `spec` in
    canonical form."""
    recorded = {mode: _from_carrying(spec, saved) for mode, saved in spec.modes.items()}
    default = next(iter(spec.modes))
    if not any(recorded.values()):
        recorded[default] = _with_hidden_outputs(spec, spec.modes[default])
    return recorded


def _from_carrying(spec: OpSpec, saved: list[str]) -> RecordedBackward | None:
    """The mode's own backward, or one derived from the saved values that carry the graph."""
    carrying = [name for name in saved if carries_graph(spec, name)]
    if carrying == saved:
        return RecordedBackward(tuple(saved), (), None)
    try:
        return RecordedBackward(tuple(carrying), (), _derive(spec, carrying))
    except DerivationError:
        return None


def _with_hidden_outputs(spec: OpSpec, saved: list[str]) -> RecordedBackward | None:
    """A backward derived for the op's outputs and the saved values that carry no graph,
    returned besides them."""
    hidden = [name for name in saved if not carries_graph(spec, name)]
    if any(upstream_symbol(name).name in {n.name for n in spec.nodes} for name in hidden):
        return None  # an upstream gradient's name is taken by a value of the spec
    returning = dataclasses.replace(spec, outputs=[*spec.outputs, *hidden])
    try:
        return RecordedBackward(tuple(saved), tuple(hidden), _derive(returning, saved))
    except DerivationError:
        return None


def _derive(spec: OpSpec, saved: list[str]) -> BackwardResult:
    algebra = Algebra({node.symbol: node.level for node in spec.nodes})
    learn_forward_reductions(spec, algebra)
    return derive_backward(spec, algebra, reverse_mode(spec, algebra), saved)

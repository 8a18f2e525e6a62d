"""The derivation of one op, stage by stage: spec -> reverse mode -> simplified backward."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sympy

from derive.algebra import Algebra
from derive.api import KINDS as API_KINDS
from derive.api import api_mismatches
from derive.backward import BackwardResult, derive_backward
from derive.canonical import canonical
from derive.forward import forward_graph, saved_outputs
from derive.graph import RowGraph
from derive.higher import RecordedBackward, recorded_backwards
from derive.reverse import ReverseResult, learn_forward_reductions, reverse_mode
from derive.spec import OpSpec, SpecError, build_from_file
from derive.tangent import TangentResult, tangent_mode


@dataclass(frozen=True)
class Derivation:
    spec: OpSpec
    forward: RowGraph
    saved_outputs: frozenset[str]
    reverse: ReverseResult
    backwards: dict[str, BackwardResult]  # one per memory mode, default first
    rules: tuple[tuple[sympy.Expr, sympy.Expr], ...]
    #: per memory mode, the backward autograd can record (create_graph=True); None: none
    recorded: dict[str, RecordedBackward | None]
    #: the forward-mode derivative (JVP)
    tangent: TangentResult

    @property
    def backward(self) -> BackwardResult:
        return next(iter(self.backwards.values()))


def derive(spec: OpSpec) -> Derivation:
    spec = canonical(spec)
    algebra = Algebra({node.symbol: node.level for node in spec.nodes})
    learn_forward_reductions(spec, algebra)
    rules = tuple(algebra.rules.items())
    reverse = reverse_mode(spec, algebra)
    backwards = {mode: derive_backward(spec, algebra, reverse, saved)
                 for mode, saved in spec.modes.items()}
    recorded = recorded_backwards(spec)
    for mode, backward in backwards.items():
        _refuse_unread_saves(spec, mode, backward, recorded.get(mode))
    # saved values a mode returns so that they carry autograd's graph: a backward recorded
    # under forward mode (forward-over-reverse) reads their tangents
    hidden = [name for plan in recorded.values() if plan is not None for name in plan.hidden]
    tangent = tangent_mode(spec, algebra, reverse.stabilisers, tuple(dict.fromkeys(hidden)))
    return Derivation(spec, forward_graph(spec), saved_outputs(spec), reverse, backwards, rules,
                      recorded, tangent)


class UnreadSaveError(SpecError):
    """A memory mode saves values its derived backward never reads (`mode`, `names`)."""

    def __init__(self, message: str, mode: str, names: tuple[str, ...]):
        super().__init__(message)
        self.mode, self.names = mode, names


def _refuse_unread_saves(spec: OpSpec, mode: str, backward: BackwardResult,
                        recorded: RecordedBackward | None) -> None:
    """A saved value that neither the mode's backward kernels nor the backward autograd records
    read would only hold memory from the forward to the backward (an input the VJP does not
    need keeps a whole activation alive per call): refused, naming it."""
    def reads(graph: RowGraph) -> set[str]:
        return {*graph.element_inputs, *graph.row_inputs,
                *(source for _, source, _ in graph.partners)}

    read = reads(backward.graph)
    if recorded is not None and recorded.result is not None:  # None: the mode's own serves
        read |= reads(recorded.result.graph)
    unread = [name for name in spec.modes[mode] if name not in read]
    if unread:
        names = ", ".join(f"'{name}'" for name in unread)
        raise UnreadSaveError(
            f"{spec.mode_where.get(mode, spec.source)}: memory mode '{mode}' saves {names}, "
            "which its backward never reads (the derived VJP does not need it): saving it "
            "would only hold memory until the backward; drop it from op.save(...)",
            mode, tuple(unread))


def load_spec(path: Path, display: str) -> OpSpec:
    """Import a spec file and call its `spec()`; `display` is the path shown in output."""
    op = build_from_file(path, "spec", OpSpec)
    if not op.outputs:
        raise SpecError(f"{path}: spec '{op.name}' declares no output; call op.output(...)")
    if not op.modes:
        raise SpecError(f"{path}: spec '{op.name}' saves nothing; call op.save(...) (it may "
                        "save no value at all: op.save())")
    if op.api is None:
        raise SpecError(f"{path}: spec '{op.name}' sets no op.api (one of "
                        f"{', '.join(kind.__name__ for kind in API_KINDS)})")
    problems = api_mismatches(op)
    if problems:
        raise SpecError(f"{op.api_where}: op.api ({type(op.api).__name__}) does not match spec "
                        f"'{op.name}': " + "; ".join(problems))
    op.source = display
    return op

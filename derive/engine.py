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
    return Derivation(spec, forward_graph(spec), saved_outputs(spec), reverse, backwards, rules,
                      recorded)


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

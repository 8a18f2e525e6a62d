"""The engine's derivations, checked exactly: for a concrete row length the full SymPy Jacobian of
the forward, transposed and applied to an upstream gradient, equals the derived VJP."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import sympy

from derive.engine import derive, load_spec
from derive.graph import RowGraph
from derive.reverse import DerivationError
from derive.spec import REGENERATED, Kind, Level, N, OpSpec, Rounded, SpecError

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted(p.stem for p in (ROOT / "derive" / "ops").glob("*.py") if p.stem != "__init__")
ROW_LENGTH = 3
#: the row length of a spec that reads across a pairing of its columns (OpSpec.partner)
PAIRED_ROW_LENGTH = 4


def partner(j: int, pairing: str) -> int:
    """The column paired with j (derive/spec.py PAIRINGS)."""
    return (j + ROW_LENGTH // 2) % ROW_LENGTH if pairing == "half" else j ^ 1


def with_partners(elements: dict, partners) -> dict:
    """Each partner read (name, source, pairing) as its source's values at the partner
    columns, where the source is known."""
    for name, source, pairing in partners:
        if source in elements:
            elements[name] = [elements[source][partner(j, pairing)] for j in range(ROW_LENGTH)]
    return elements


def spec_of(name: str) -> OpSpec:
    return load_spec(ROOT / "derive" / "ops" / f"{name}.py", f"derive/ops/{name}.py")


def element_symbols(name: str) -> list[sympy.Symbol]:
    return [sympy.Symbol(f"{name}_{j}", real=True) for j in range(ROW_LENGTH)]


def evaluate_graph(definitions, env_rows: dict, env_elements: dict) -> None:
    """Evaluate definitions over a concrete row, in place: rows by name, elements per j."""
    for d in definitions:
        def at(j: int, expr: sympy.Expr = d.expr) -> sympy.Expr:
            values = {s: env_rows[s.name] for s in expr.free_symbols if s.name in env_rows}
            values |= {s: env_elements[s.name][j] for s in expr.free_symbols
                       if s.name in env_elements}
            values[N] = ROW_LENGTH
            return expr.xreplace(values)
        if d.reduction == "sum":
            env_rows[d.name] = d.scale.xreplace({N: ROW_LENGTH}) * sum(
                at(j) for j in range(ROW_LENGTH))
        elif d.reduction == "max":
            env_rows[d.name] = sympy.Max(*(at(j) for j in range(ROW_LENGTH)))
        elif d.level == "row":
            env_rows[d.name] = at(0)
        else:
            env_elements[d.name] = [at(j) for j in range(ROW_LENGTH)]


def concrete_forward(spec: OpSpec, graph: RowGraph, scalars: dict[str, sympy.Expr],
                     rng: random.Random):
    """One concrete row: symbolic inputs and parameters; random values, indices and per-row
    integer inputs take concrete values (they are not differentiated)."""
    rows = {name: value for name, value in scalars.items()}
    elements = {n.name: element_symbols(n.name) for n in spec.nodes
                if n.kind in (Kind.INPUT, Kind.COLUMN_PARAM)}
    for n in spec.nodes:
        if n.kind is Kind.RANDOM:
            elements[n.name] = [sympy.Rational(rng.randint(0, 9), 1000) for _ in range(ROW_LENGTH)]
        elif n.kind is Kind.INDEX and n.level is Level.COLUMN:
            elements[n.name] = [sympy.Integer(j) for j in range(ROW_LENGTH)]
        elif n.kind is Kind.INDEX or n.kind is Kind.ROW_INPUT:
            rows[n.name] = sympy.Integer(rng.randint(0, ROW_LENGTH - 1))
    with_partners(elements, graph.partners)
    evaluate_graph(graph.definitions, rows, elements)
    return rows, elements


@pytest.mark.parametrize("name", OPS)
def test_derived_vjp_equals_transposed_jacobian(name: str, monkeypatch) -> None:
    spec = spec_of(name)
    if spec.pairing is not None:  # a pairing pairs every column: an even row
        monkeypatch.setattr(sys.modules[__name__], "ROW_LENGTH", PAIRED_ROW_LENGTH)
    derivation = derive(spec)
    rng = random.Random(0)
    scalars = {n.name: sympy.Rational(rng.randint(1, 9), 1000) for n in spec.nodes
               if n.kind is Kind.SCALAR}
    rows, elements = concrete_forward(spec, derivation.forward, scalars, rng)
    upstream = {s.name: element_symbols(s.name) if spec.node(out).level is Level.ELEMENT
                else sympy.Symbol(s.name, real=True)
                for out, s in derivation.reverse.upstream.items()}
    point = {s: sympy.Rational(rng.randint(-30, 30), 10) for values in elements.values()
             for s in values if isinstance(s, sympy.Symbol)}
    point |= {s: sympy.Rational(rng.randint(-30, 30), 10) for values in upstream.values()
              for s in (values if isinstance(values, list) else [values])}
    # Transposed Jacobian applied to the upstream gradient, by plain differentiation.
    pairing = sum(upstream["d" + out][j] * elements[out][j]
                  for out in spec.differentiated if out in elements for j in range(ROW_LENGTH))
    pairing += sum(upstream["d" + out] * rows[out] for out in spec.differentiated if out in rows)
    # The derived backward, evaluated from what the forward saved.
    for mode, backward in derivation.backwards.items():
        check_mode(spec, backward, rows, elements, upstream, pairing, point, mode)


def check_mode(spec, backward, rows, elements, upstream, pairing, point, mode) -> None:
    # Only what the mode saved (plus parameters, scalars, regenerated values and upstream
    # gradients) reaches the backward.
    keep = set(spec.modes[mode]) | {n.name for n in spec.nodes
                                    if n.kind in (Kind.COLUMN_PARAM, Kind.SCALAR, *REGENERATED)}
    back_rows = {k: v for k, v in rows.items() if k in keep}
    back_rows |= {k: v for k, v in upstream.items() if not isinstance(v, list)}
    back_elements = {k: v for k, v in elements.items() if k in keep}
    back_elements |= {k: v for k, v in upstream.items() if isinstance(v, list)}
    with_partners(back_elements, backward.graph.partners)
    evaluate_graph(backward.graph.definitions, back_rows, back_elements)
    for gradient, expr in backward.gradients:
        node = spec.node(gradient)
        graph_env = {"rows": back_rows, "elements": back_elements}
        for j, symbol in enumerate(element_symbols(gradient)):
            expected = sympy.diff(pairing, symbol)
            values = {s: graph_env["rows"][s.name] for s in expr.free_symbols
                      if s.name in graph_env["rows"]}
            values |= {s: graph_env["elements"][s.name][j] for s in expr.free_symbols
                       if s.name in graph_env["elements"]}
            values[N] = ROW_LENGTH
            derived = expr.xreplace(values)
            assert not derived.free_symbols - set(point), (mode, gradient, derived)
            if node.kind is Kind.COLUMN_PARAM:
                assert node.kind is Kind.COLUMN_PARAM  # one row: the column sum is this value
            # exact arithmetic rounds nothing: a rounding (casting_mode="llama") is the
            # identity there, its derivative 1 in both the Jacobian and the derivation
            difference = (expected - derived).replace(Rounded, lambda value: value)
            difference = difference.xreplace(point)
            assert abs(sympy.N(difference, 40)) < sympy.Float("1e-30"), (mode, gradient, j)


def test_layernorm_backward_has_the_textbook_shape() -> None:
    backward = derive(spec_of("layernorm")).backward
    # the scale is weight_offset + weight (0 + weight: torch's LayerNorm)
    assert [name for name, _ in backward.reductions] == ["sum_dy_weight_weight_offset",
                                                         "sum_dy_x_hat_weight_weight_offset"]
    # var never reaches the backward: d rstd / d var is written as -rstd**3 / 2 in rstd's name.
    assert [(r.name, r.how) for r in backward.resolutions] == [("x_hat", "recomputed")]
    graph = backward.graph
    assert [c[0] for c in graph.column_outputs] == ["dweight", "dbias"]
    assert graph.row_inputs == ("mean", "rstd")


def test_softmax_max_is_proven_a_stabiliser_and_backward_uses_only_the_output() -> None:
    derivation = derive(spec_of("softmax"))
    assert derivation.reverse.stabilisers == ("row_max",)
    graph = derivation.backward.graph
    assert graph.element_inputs == ("dp", "p")
    assert dict(derivation.backward.gradients)["x"] == sympy.sympify(
        "p*(dp - sum_dp_p)", locals={"p": sympy.Symbol("p", positive=True),
                                     "dp": sympy.Symbol("dp", real=True),
                                     "sum_dp_p": sympy.Symbol("sum_dp_p", real=True)})


def test_a_max_that_matters_is_rejected() -> None:
    op = OpSpec("bad")
    x = op.input("x")
    top = op.row_max("top", x)
    op.output(op.element("y", x * top))
    op.save(x)
    with pytest.raises(DerivationError, match="'top' is a row max whose adjoint does not vanish"):
        derive(op)


def test_unsaved_and_underivable_value_is_reported() -> None:
    op = OpSpec("bad")
    x = op.input("x")
    total = op.row_sum("total", x**2)
    op.output(op.element("y", sympy.sin(x) * total))
    op.save()
    with pytest.raises(DerivationError, match="the backward needs 'x'"):
        derive(op)


def test_spec_errors_point_to_the_spec_line() -> None:
    op = OpSpec("bad")
    x = op.input("x")
    where = r"test_symbolic\.py:\d+: 'z': the expression .* uses q, not declared"
    with pytest.raises(SpecError, match=where):
        op.element("z", x + sympy.Symbol("q"))
    with pytest.raises(SpecError, match="declared twice"):
        op.input("x")
    with pytest.raises(SpecError, match="row\\(\\) needs an expression of row scalars"):
        op.row("r", x * 2)

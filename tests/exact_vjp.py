"""An exact oracle for derived backwards: for a concrete row length, the SymPy Jacobian of the
forward AS THE USER WROTE IT, transposed and applied to an upstream gradient, against the derived
VJP of every memory mode evaluated from what that mode saved alone.

The forward is evaluated from the spec's own nodes (not the engine's canonical graph), so the
canonical rewrites are checked too. Rows are symbolic; every comparison is at one rational point
to 40 digits."""

from __future__ import annotations

import random

import sympy

from derive.engine import Derivation
from derive.spec import REGENERATED, Kind, Level, N, OpSpec


def element_symbols(name: str, length: int) -> list[sympy.Symbol]:
    return [sympy.Symbol(f"{name}_{j}", real=True) for j in range(length)]


def _at(expr, rows, elements, j, length):
    values = {s: rows[s.name] for s in expr.free_symbols if s.name in rows}
    values |= {s: elements[s.name][j] for s in expr.free_symbols if s.name in elements}
    values[N] = length
    return expr.xreplace(values)


def evaluate_spec(spec: OpSpec, rows: dict, elements: dict, length: int) -> None:
    """The spec's definitions over one concrete row, in place."""
    for node in spec.nodes:
        if not node.is_definition:
            continue
        if node.kind is Kind.REDUCE:
            values = [_at(node.expr, rows, elements, j, length) for j in range(length)]
            if node.reduction == "max":
                rows[node.name] = sympy.Max(*values)
            else:
                rows[node.name] = sum(values) / (length if node.reduction == "mean" else 1)
        elif node.level is Level.ROW:
            rows[node.name] = _at(node.expr, rows, elements, 0, length)
        else:
            elements[node.name] = [_at(node.expr, rows, elements, j, length)
                                   for j in range(length)]


def evaluate_graph(definitions, rows: dict, elements: dict, length: int) -> None:
    for d in definitions:
        if d.reduction == "sum":
            rows[d.name] = d.scale.xreplace({N: length}) * sum(
                _at(d.expr, rows, elements, j, length) for j in range(length))
        elif d.reduction == "max":
            rows[d.name] = sympy.Max(*(_at(d.expr, rows, elements, j, length)
                                       for j in range(length)))
        elif d.level == "row":
            rows[d.name] = _at(d.expr, rows, elements, 0, length)
        else:
            elements[d.name] = [_at(d.expr, rows, elements, j, length) for j in range(length)]


def check_exact(spec: OpSpec, derivation: Derivation, seed: int = 0, length: int = 3,
                point: dict | None = None) -> None:
    """Assert that every memory mode's derived VJP equals Jᵀ·u of `spec` at one random point."""
    rng = random.Random(seed)
    rows: dict = {n.name: sympy.Rational(rng.randint(1, 9), 10) for n in spec.nodes
                  if n.kind is Kind.SCALAR}
    rows |= {n.name: sympy.Symbol(n.name, real=True) for n in spec.nodes
             if n.kind is Kind.SCALAR_PARAM}
    elements = {n.name: element_symbols(n.name, length) for n in spec.nodes
                if n.kind in (Kind.INPUT, Kind.COLUMN_PARAM)}
    for n in spec.nodes:
        if n.kind is Kind.RANDOM:
            elements[n.name] = [sympy.Rational(rng.randint(0, 9), 10) for _ in range(length)]
        elif n.kind is Kind.INDEX and n.level is Level.COLUMN:
            elements[n.name] = [sympy.Integer(j) for j in range(length)]
        elif n.kind in (Kind.INDEX, Kind.ROW_INPUT):
            rows[n.name] = sympy.Integer(rng.randint(0, length - 1))
    inputs = dict(rows), {k: list(v) for k, v in elements.items()}
    evaluate_spec(spec, rows, elements, length)
    upstream = {"d" + out: element_symbols("d" + out, length)
                if spec.node(out).level is Level.ELEMENT else sympy.Symbol("d" + out, real=True)
                for out in spec.outputs}
    variables = [s for values in inputs[1].values() for s in values if isinstance(s, sympy.Symbol)]
    variables += [v for k, v in inputs[0].items() if isinstance(v, sympy.Symbol)]
    if point is None:
        # denominators of 7 keep every random point away from ties of Max/Abs/Piecewise
        point = {s: sympy.Rational(rng.randint(-20, 20), 7) or sympy.Rational(1, 7)
                 for s in variables}
    point |= {s: sympy.Rational(rng.randint(-20, 20), 10)
              for values in upstream.values()
              for s in (values if isinstance(values, list) else [values])}
    pairing = sum(upstream["d" + out][j] * elements[out][j]
                  for out in spec.outputs if out in elements for j in range(length))
    pairing += sum(upstream["d" + out] * rows[out] for out in spec.outputs if out in rows)
    expected = {s: sympy.N(sympy.diff(pairing, s).xreplace(point), 40) for s in variables}
    for mode, backward in derivation.backwards.items():
        keep = set(spec.modes[mode]) | {n.name for n in spec.nodes if n.kind in (
            Kind.COLUMN_PARAM, Kind.SCALAR, Kind.SCALAR_PARAM, *REGENERATED)}
        back_rows = {k: v for k, v in rows.items() if k in keep}
        back_rows |= {k: v for k, v in upstream.items() if not isinstance(v, list)}
        back_elements = {k: v for k, v in elements.items() if k in keep}
        back_elements |= {k: v for k, v in upstream.items() if isinstance(v, list)}
        evaluate_graph(backward.graph.definitions, back_rows, back_elements, length)
        for gradient, expr in backward.gradients:
            node = spec.node(gradient)
            if node.kind is Kind.SCALAR_PARAM:
                symbols = [sympy.Symbol(gradient, real=True)]
                derived_values = [_at(expr, back_rows, back_elements, 0, length)]
            else:
                symbols = element_symbols(gradient, length)
                derived_values = [_at(expr, back_rows, back_elements, j, length)
                                  for j in range(length)]
            for symbol, derived in zip(symbols, derived_values, strict=True):
                derived = derived.xreplace(point)
                assert not derived.free_symbols, (mode, gradient, derived.free_symbols)
                difference = sympy.N(expected[symbol] - sympy.N(derived, 40), 40)
                scale = 1 + abs(expected[symbol])
                assert abs(difference) < sympy.Float("1e-25") * scale, (
                    mode, gradient, str(symbol), expected[symbol], sympy.N(derived, 20))

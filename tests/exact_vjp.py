"""An exact oracle for derived backwards: for a concrete row length, the SymPy Jacobian of the
forward AS THE USER WROTE IT, transposed and applied to an upstream gradient, against the derived
VJP of every memory mode evaluated from what that mode saved alone.

The forward is evaluated from the spec's own nodes (not the engine's canonical graph), so the
canonical rewrites are checked too. Rows are symbolic; every comparison is at one rational point
to 25 digits, in 60-digit arithmetic."""

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


def localize(expr: sympy.Expr, point: dict) -> sympy.Expr:
    """expr with every Max/Min/Abs/sign/Heaviside/Piecewise replaced by the branch it takes at
    `point`: the same function in a neighbourhood of a point without ties, so derivatives there
    are exact and stay small."""
    def value(e: sympy.Expr) -> sympy.Expr:
        return sympy.N(e.xreplace(point), 60)

    def pick(e: sympy.Expr) -> sympy.Expr:
        if isinstance(e, sympy.Max):
            return max(e.args, key=value)
        if isinstance(e, sympy.Min):
            return min(e.args, key=value)
        if isinstance(e, sympy.Abs):
            return e.args[0] if value(e.args[0]) > 0 else -e.args[0]
        if isinstance(e, sympy.sign):
            return sympy.Integer(1 if value(e.args[0]) > 0 else -1)
        if isinstance(e, sympy.Heaviside):
            return sympy.Integer(1 if value(e.args[0]) > 0 else 0)
        for branch, condition in e.args:
            if condition == sympy.true or bool(condition.xreplace(
                    {s: v for s, v in point.items()})):
                return branch
        raise AssertionError(e)

    kinds = (sympy.Max, sympy.Min, sympy.Abs, sympy.sign, sympy.Heaviside, sympy.Piecewise)
    return expr.replace(lambda e: isinstance(e, kinds), pick)


def evaluate_spec(spec: OpSpec, rows: dict, elements: dict, length: int,
                  point: dict | None = None) -> None:
    """The spec's definitions over one concrete row, in place. With `point`, a row max is the
    element that is largest there: equal to the max in a neighbourhood of a point without ties,
    so its derivative there is exact (and small)."""
    for node in spec.nodes:
        if not node.is_definition:
            continue
        if node.kind is Kind.REDUCE:
            values = [_at(node.expr, rows, elements, j, length) for j in range(length)]
            if point is not None:
                values = [localize(v, point) for v in values]
            if node.reduction == "max" and point is not None:
                rows[node.name] = max(values, key=lambda v: sympy.N(v.xreplace(point), 60))
            elif node.reduction == "max":
                rows[node.name] = sympy.Max(*values)
            else:
                rows[node.name] = sum(values) / (length if node.reduction == "mean" else 1)
        elif node.level is Level.ROW:
            rows[node.name] = _at(node.expr, rows, elements, 0, length)
            if point is not None:
                rows[node.name] = localize(rows[node.name], point)
        else:
            elements[node.name] = [_at(node.expr, rows, elements, j, length)
                                   for j in range(length)]
            if point is not None:
                elements[node.name] = [localize(v, point) for v in elements[node.name]]


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
    variables = [s for values in elements.values() for s in values if isinstance(s, sympy.Symbol)]
    variables += [v for v in rows.values() if isinstance(v, sympy.Symbol)]
    upstream = {"d" + out: element_symbols("d" + out, length)
                if spec.node(out).level is Level.ELEMENT else sympy.Symbol("d" + out, real=True)
                for out in spec.outputs}
    if point is None:
        # a distinct offset per variable keeps the point away from ties of Max/Abs/Piecewise
        point = {s: sympy.Rational(rng.randint(-20, 20), 7) + sympy.Rational(k + 1, 1009)
                 for k, s in enumerate(variables)}
    point |= {s: sympy.Rational(rng.randint(-20, 20), 10)
              for values in upstream.values()
              for s in (values if isinstance(values, list) else [values])}
    # 60-digit floats: every value collapses to a number at once (exact nested exp/log/Max of
    # rationals grow without bound), and 60 digits leave 35 after any cancellation we compare
    point = {s: sympy.Float(v, 60) for s, v in point.items()}
    rows = {k: sympy.Float(v, 60) if isinstance(v, sympy.Rational) and not v.is_Integer else v
            for k, v in rows.items()}

    def pairing_in(variable: sympy.Symbol | None) -> tuple[dict, dict, sympy.Expr]:
        """The forward with every variable but `variable` at the point: one variable keeps each
        derivative small (nested maxes of whole rows otherwise blow up)."""
        fixed = {s: v for s, v in point.items() if s != variable}
        at_rows = {k: sympy.sympify(v).xreplace(fixed) for k, v in rows.items()}
        at_elements = {k: [sympy.sympify(v).xreplace(fixed) for v in values]
                       for k, values in elements.items()}
        evaluate_spec(spec, at_rows, at_elements, length, point)
        up = {k: [point[s] for s in v] if isinstance(v, list) else point[v]
              for k, v in upstream.items()}
        total = sum(up["d" + out][j] * at_elements[out][j]
                    for out in spec.outputs if out in at_elements for j in range(length))
        total += sum(up["d" + out] * at_rows[out] for out in spec.outputs if out in at_rows)
        return at_rows, at_elements, total

    expected = {}
    for s in variables:
        expected[s] = sympy.N(sympy.diff(pairing_in(s)[2], s).xreplace({s: point[s]}), 60)
    rows, elements, _ = pairing_in(None)
    upstream = {k: [point[s] for s in v] if isinstance(v, list) else point[v]
                for k, v in upstream.items()}
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
                assert not derived.free_symbols, (mode, gradient, derived.free_symbols)
                difference = sympy.N(expected[symbol] - sympy.N(derived, 60), 60)
                scale = 1 + abs(expected[symbol])
                assert abs(difference) < sympy.Float("1e-25") * scale, (
                    mode, gradient, str(symbol), expected[symbol], sympy.N(derived, 20))

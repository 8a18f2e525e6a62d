"""Forward mode over the two-level graph: the Jacobian-vector product (JVP) of the forward
(docs/design.md, "Forward mode").

Forward mode walks the definitions from the first to the last and keeps a tangent per node,
the derivative of the node along the tangents of the inputs (`x_dot`, `weight_dot`, ...):

- an element or row definition c = f(a, ...) has the tangent Σ_a ∂f/∂a · ȧ;
- a reduction r = s Σ_j g(a_j, b) has the tangent s Σ_j Σ_a ∂g/∂a · ȧ_j (a varying along the
  row: one new row reduction) plus s Σ_b ḃ · Σ_j ∂g/∂b (b a row value: its tangent leaves the
  sum, and the sum of the derivative is simplified by the reduction algebra, which makes
  Σ_j (x_j − mean) vanish);
- a stabilising max (rule 5: the output does not depend on it) has tangent 0, as have
  indices, random values, class indices and inputs declared `grad=False`;
- a partner read x_p(j) has the tangent ẋ read at the partner column.

The tangents are written in the forward's own values, which the JVP recomputes from the
inputs; no sum is expanded across a subtraction, so a centred sum stays centred (stable at
large offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from derive.algebra import Algebra, RowSum, sorted_symbols, substitute
from derive.backward import name_reductions, pivot_table, tidy
from derive.forward import extras, forward_graph
from derive.graph import ColumnParam, Definition, RowGraph
from derive.reverse import in_own_value
from derive.spec import Kind, Level, N, OpSpec

#: the kinds of input that carry a tangent of their own (where declared grad=True)
_TANGENT_KINDS = (Kind.INPUT, Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)


@dataclass(frozen=True)
class TangentResult:
    """The JVP of one op: its kernel's graph and, per node, the derived tangent."""

    graph: RowGraph
    #: input name -> its tangent's name, in the op's input order
    inputs: tuple[tuple[str, str], ...]
    #: output name -> its tangent's name
    outputs: tuple[tuple[str, str], ...]
    #: (node, tangent expression) per definition with a tangent, for the derivation page
    tangents: tuple[tuple[str, sympy.Expr], ...]


def tangent_name(name: str, taken: set[str]) -> str:
    candidate, index = f"{name}_dot", 2
    while candidate in taken:
        candidate, index = f"{name}_dot{index}", index + 1
    taken.add(candidate)
    return candidate


def tangent_mode(spec: OpSpec, algebra: Algebra, stabilisers: tuple[str, ...],
                 hidden: tuple[str, ...] = ()) -> TangentResult:
    """The forward's tangent graph; `spec` in canonical form, `stabilisers` the row maxes
    reverse mode proved the outputs do not depend on, `hidden` the saved values the op returns
    besides its outputs (derive/higher.py), whose tangents it returns too."""
    taken = {n.name for n in spec.nodes}
    dot: dict[sympy.Symbol, sympy.Symbol] = {}
    inputs: list[tuple[str, str]] = []
    for node in spec.nodes:
        if node.kind in _TANGENT_KINDS and node.grad:
            symbol = sympy.Symbol(tangent_name(node.name, taken), real=True)
            dot[node.symbol] = symbol
            algebra.levels[symbol] = node.level
            inputs.append((node.name, symbol.name))
    partners: list[tuple[str, str, str]] = []
    for node in spec.nodes:
        source = spec.node(node.partner_of) if node.kind is Kind.PARTNER else None
        if source is not None and source.symbol in dot:
            symbol = sympy.Symbol(tangent_name(node.name, taken), real=True)
            dot[node.symbol] = symbol
            algebra.levels[symbol] = node.level
            partners.append((symbol.name, dot[source.symbol].name, node.pairing))

    forward = forward_graph(spec)
    pivots = dict(pivot_table(spec, algebra))
    definitions: list[Definition] = []
    tangents: list[tuple[str, sympy.Expr]] = []
    by_name = {d.name: d for d in forward.definitions}
    # an element tangent is not named: it is written out where it is used, in the tangents of
    # the inputs and of row values, and pivoted there, so the pivots see whole chains
    # (e·ġ·s² with e = 1/s − 1 is s(1 − s)·ġ, finite where e overflows)
    value: dict[sympy.Symbol, sympy.Expr] = dict(dot)

    def stable(expr: sympy.Expr) -> sympy.Expr:
        return (tidy(substitute(expr, pivots), algebra.varies) if expr.free_symbols & set(pivots)
                else expr)

    reads = {n.symbol: n.expr.free_symbols for n in spec.nodes if n.is_definition}

    def reductions_read(expr: sympy.Expr) -> set[sympy.Symbol]:
        seen, pending = set(), list(expr.free_symbols)
        while pending:
            symbol = pending.pop()
            if symbol not in seen and symbol in reads:
                seen.add(symbol)
                pending.extend(reads[symbol])
        return {s for s in seen if spec.node(s.name).kind is Kind.REDUCE}

    def stable_body(expr: sympy.Expr) -> sympy.Expr:
        """A reduction's body pivoted only where that reads no later reduction: a pass more
        for the same value (Σ ẋ·x̂/rstd needs rstd, Σ 2ẋ(x − mean) does not)."""
        pivoted = stable(expr)
        return pivoted if reductions_read(pivoted) <= reductions_read(expr) else expr

    for node in spec.nodes:
        if not node.is_definition:
            continue
        definitions.append(by_name[node.name])
        if node.reduction in ("max", "min") and (node.reduction == "min"
                                                 or node.name in stabilisers):
            continue  # no tangent: a shift the outputs do not depend on, or an index
        arguments = [s for s in sorted_symbols(node.expr.free_symbols) if s in value]
        if not arguments:
            continue
        if node.kind is Kind.REDUCE:
            symbol = sympy.Symbol(tangent_name(node.name, taken), real=True)
            algebra.levels[symbol] = Level.ROW
            scale = 1 / N if node.reduction == "mean" else sympy.Integer(1)
            along = sympy.Integer(0)  # the terms that vary along the row: one new reduction
            across = sympy.Integer(0)  # row tangents times the sum of their derivative
            for argument in arguments:
                derivative = sympy.diff(node.expr, argument)
                if algebra.varies(argument):
                    along += derivative * value[argument]
                else:
                    across += value[argument] * algebra.normalize(RowSum(derivative))
            along = stable_body(along)
            across = sympy.expand(across) if across.has(RowSum) else across
            if across == 0:
                tangent = scale * RowSum(along)
                definitions.append(Definition(symbol.name, "row", along, "sum", scale))
            else:
                summed = sympy.Symbol(tangent_name(f"sum_{node.name}", taken), real=True)
                algebra.levels[summed] = Level.ROW
                definitions.append(Definition(summed.name, "row", along, "sum"))
                named, reductions = name_reductions({"across": across}, algebra)
                for name, body in reductions:  # named apart from every value so far
                    unique = tangent_name(name, taken)[:-len("_dot")] if name in taken else name
                    taken.add(unique)
                    named = {k: v.xreplace({sympy.Symbol(name, real=True):
                                            sympy.Symbol(unique, real=True)})
                             for k, v in named.items()}
                    algebra.levels[sympy.Symbol(unique, real=True)] = Level.ROW
                    definitions.append(Definition(unique, "row", body, "sum"))
                tangent = scale * (RowSum(along) + across)
                definitions.append(Definition(symbol.name, "row",
                                              scale * (summed + named["across"])))
            value[node.symbol] = symbol
        else:
            terms = []
            for argument in arguments:
                derivative = sympy.diff(node.expr, argument)
                # in the node's own value where it reappears (σ' = σ(1 − σ)), as reverse mode
                derivative = in_own_value(node, derivative.subs(node.expr, node.symbol),
                                          algebra)
                terms.append(derivative * value[argument])
            tangent = sympy.Add(*terms)
            if tangent == 0:
                continue
            if node.level is Level.ROW:
                symbol = sympy.Symbol(tangent_name(node.name, taken), real=True)
                algebra.levels[symbol] = Level.ROW
                definitions.append(Definition(symbol.name, "row", tangent))
                value[node.symbol] = symbol
            else:
                value[node.symbol] = tangent
        tangents.append((node.name, tangent))

    definitions = _in_dependency_order(definitions)
    named_rows = {d.name for d in definitions}
    outputs = [(name, value[spec.node(name).symbol].name
                if getattr(value.get(spec.node(name).symbol), "name", None) in named_rows
                else tangent_name(name, taken)) for name in [*spec.differentiated, *hidden]]
    levels = {name: spec.node(name).level for name, _ in outputs}
    output_value = {name: stable(value.get(spec.node(name).symbol, sympy.Integer(0)))
                    for name, _ in outputs}
    shared = extras(spec)
    element_tangents = [dot[n.symbol].name for n in spec.nodes
                        if n.kind is Kind.INPUT and n.symbol in dot]
    graph = RowGraph(
        element_inputs=forward.element_inputs + tuple(element_tangents),
        column_inputs=forward.column_inputs + tuple(
            ColumnParam(dot[n.symbol].name, sympy.Integer(0)) for n in spec.nodes
            if n.kind is Kind.COLUMN_PARAM and n.symbol in dot),
        row_inputs=forward.row_inputs,
        scalars=forward.scalars,
        definitions=tuple(definitions),
        element_outputs=tuple((out, output_value[name]) for name, out in outputs
                              if levels[name] is Level.ELEMENT),
        row_outputs=tuple((out, output_value[name]) for name, out in outputs
                          if levels[name] is Level.ROW),
        column_outputs=(),
        # a tangent not given is zero, as autograd's forward mode takes it
        element_absent=forward.element_absent + tuple(
            (name, sympy.Integer(0)) for name in element_tangents),
        scalar_inputs=forward.scalar_inputs + tuple(
            dot[n.symbol].name for n in spec.nodes
            if n.kind is Kind.SCALAR_PARAM and n.symbol in dot),
        generated=shared["generated"] + tuple((name, "partner") for name, _, _ in partners),
        partners=shared["partners"] + tuple(partners),
        broadcast_inputs=shared["broadcast_inputs"] + tuple(
            dot[spec.node(name).symbol].name for name in shared["broadcast_inputs"]
            if spec.node(name).symbol in dot),
        integer_inputs=shared["integer_inputs"],
        scalar_absent=shared["scalar_absent"],
    )
    return TangentResult(graph, tuple(inputs), tuple(outputs), tuple(tangents))


def _in_dependency_order(definitions: list[Definition]) -> list[Definition]:
    """The definitions in their order, each moved after every definition it reads: a pivot may
    write a tangent in a value the forward defines later (Σ ẋ·x̂/rstd, before rstd)."""
    pending = list(definitions)
    names = {d.name for d in definitions}
    ordered: list[Definition] = []
    done: set[str] = set()
    while pending:
        ready = next(d for d in pending
                     if all(s.name in done or s.name not in names for s in d.expr.free_symbols))
        pending.remove(ready)
        ordered.append(ready)
        done.add(ready.name)
    return ordered

"""The canonical form of a spec: one spelling per op, whatever the user wrote.

Reverse mode and the backward simplifier see the same graph whether a value was named or written
inline, so the derived backward depends on the op, not on its spelling:

1. an expression the spec already named is replaced by its name wherever it reappears;
2. non-smooth functions (Max, Min, Abs, Heaviside, sign) become `Piecewise`, whose derivative is
   again a `Piecewise` the printers know, with torch's derivative at a tie (docs/spec_language.md);
   overflow-prone forms get their safe equivalents (exp(u) / (exp(u) + 1) -> 1 / (1 + exp(-u)),
   also where exp(u) is a named value; logs of products of exponentials, softmaxes and sigmoids
   as sums of their arguments and softplus terms, and x·log x as 0 where x = 0; a row sum of
   exponentials that no max stabilises shifted by the max of its exponents: derive/stable.py);
3. every sigmoid 1 / (1 + c·exp(u)) inside a definition is named, so its derivative is written
   in its own value (σ(1 − σ), derive/reverse.py), never through exp(u), which overflows first;
4. every function of an elementwise value used more than once, or inside a reduction body, is
   named once (CSE): a backward reuses it instead of recomputing it, and the reduction
   recognition rules see the same atom wherever the forward used it;
5. the normalised part of an elementwise definition, a rational function of ONE element input
   and row scalars ((x - mean) * rstd inside (x - mean) * rstd * weight + bias), is named, so the
   backward pivots on it and comes out centred (the textbook form) rather than expanded in x;
6. the terms of a sum that are of the inputs' own magnitude (max(x) − x[target] inside
   log Σ exp(x − max(x)) + max(x) − x[target]) are named, so they are added first, exactly.

Extracted values are named after their function and arguments. Cross-element and cross-row
dependencies are refused here, at the line that wrote them.
"""

from __future__ import annotations

import dataclasses

import sympy

from derive.spec import RESERVED, Kind, Level, N, Node, OpSpec, SpecError
from derive.stable import (
    known_positive,
    shift_exponential_sums,
    softplus,
    stable_logs,
    xlogy,
)

#: The functions a spec may use; error messages and docs/spec_language.md point here.
SUPPORTED_FUNCTIONS = (
    "exp", "log", "sqrt (and x**r for rational r)", "tanh", "erf", "sin", "cos",
    "sinh", "cosh", "Abs", "Max", "Min", "Heaviside", "sign", "Piecewise", "Rounded",
    "Detached",
    "Mod (of the column index by an integer)",
)

_SMOOTH = (sympy.exp, sympy.log, sympy.tanh, sympy.erf, sympy.sin, sympy.cos)


def canonical(spec: OpSpec) -> OpSpec:
    """A new OpSpec equal in value to `spec`, in canonical form (see the module doc)."""
    spec = shift_exponential_sums(spec)
    levels = {node.symbol: node.level for node in spec.nodes}
    kept: dict[sympy.Expr, sympy.Symbol] = {}  # a value already named, by its expression
    exponentials: dict[sympy.Symbol, sympy.Expr] = {}  # values named that are an exp(u)
    values: dict[sympy.Symbol, sympy.Expr] = {}  # element and row definitions, by name
    positive = {node.symbol for node in spec.nodes if node.symbol.is_positive}
    nodes: list[Node] = []
    for node in spec.nodes:
        if node.is_definition:
            expr = rewrite_functions(node.expr)
            # e = exp(x) named, then e / (e + 1): the safe form seen through the name
            inlined = expr.xreplace(exponentials)
            if _safe_forms(inlined) != inlined:
                expr = _safe_forms(inlined)
            expr = xlogy(stable_logs(expr, values, positive))
            if node.kind is not Kind.REDUCE:
                values[node.symbol] = expr
            if node.reduction != "min" and known_positive(expr, positive):
                positive.add(node.symbol)
            expr = expr.xreplace(kept)
            _refuse_cross_element(spec, node, expr)
            node = dataclasses.replace(node, expr=expr)
            if node.kind is not Kind.REDUCE and not expr.is_Atom:
                kept.setdefault(expr, node.symbol)
            if node.kind is Kind.ELEMENT and isinstance(expr, sympy.exp):
                exponentials[node.symbol] = expr
        nodes.append(node)
    taken = {node.name for node in spec.nodes} | set(RESERVED)
    nodes = _extract(nodes, levels, taken, _sigmoids)
    nodes = _extract(nodes, levels, taken, _shared_functions)
    nodes = _extract(nodes, levels, taken, _normalised_parts)
    nodes = _extract(nodes, levels, taken, _input_scale_parts)
    nodes = _partner_leaves(nodes, taken)
    return dataclasses.replace(spec, nodes=nodes, outputs=list(spec.outputs),
                               modes={k: list(v) for k, v in spec.modes.items()},
                               mode_docs=dict(spec.mode_docs),
                               mode_where=dict(spec.mode_where))


# ---------------------------------------------------------------------- function rewriting
def rewrite_functions(expr: sympy.Expr) -> sympy.Expr:
    """Non-smooth functions as Piecewise, hyperbolic ones through exp, overflow-safe forms."""
    expr = expr.replace(lambda e: isinstance(e, (sympy.sinh, sympy.cosh)),
                        lambda e: e.rewrite(sympy.exp))
    expr = expr.replace(lambda e: isinstance(e, (sympy.Max, sympy.Min)), _min_max_piecewise)
    expr = expr.replace(lambda e: isinstance(e, sympy.Abs), _abs_piecewise)
    expr = expr.replace(lambda e: isinstance(e, sympy.sign),
                        lambda e: sympy.Piecewise((1, e.args[0] > 0), (-1, e.args[0] < 0),
                                                  (0, True)))
    expr = expr.replace(lambda e: isinstance(e, sympy.Heaviside), _heaviside_piecewise)
    expr = _safe_forms(expr)
    return expr


def _min_max_piecewise(e: sympy.Expr) -> sympy.Expr:
    """Max (Min) as a selection whose derivative is torch's: where k arguments tie at the
    extreme, each gets 1/k of the gradient (torch.maximum's halves; torch.amax's share of a
    stacked tie). A tie's branch is the tied arguments' mean, their common value, so its
    derivative is the mean of theirs; NaN reaches it (no comparison holds) and stays NaN, as in
    torch.maximum. The comparisons are of the arguments themselves, one at a time: a decision
    tree, never a comparison of a selection."""
    beats = sympy.Gt if isinstance(e, sympy.Max) else sympy.Lt

    def extreme(tied: list[sympy.Expr], rest: list[sympy.Expr]) -> sympy.Expr:
        if not rest:
            return sympy.Add(*tied) / len(tied)
        top, following, later = tied[0], rest[0], rest[1:]
        return sympy.Piecewise((extreme(tied, later), beats(top, following)),
                               (extreme([following], later), beats(following, top)),
                               (extreme([*tied, following], later), True))

    return extreme([e.args[0]], list(e.args[1:]))


def _abs_piecewise(e: sympy.Abs) -> sympy.Expr:
    """|u| with torch.abs's derivative, 0 at u = 0 (sgn(0)); NaN stays NaN."""
    u = e.args[0]
    return sympy.Piecewise((0, sympy.Eq(u, 0)), (-u, u < 0), (u, True))


def _heaviside_piecewise(e: sympy.Expr) -> sympy.Expr:
    at_zero = e.args[1] if len(e.args) > 1 else sympy.Rational(1, 2)
    return sympy.Piecewise((1, e.args[0] > 0), (0, e.args[0] < 0), (at_zero, True))


def _safe_forms(expr: sympy.Expr) -> sympy.Expr:
    """exp(u) / (exp(u) + c) -> 1 / (1 + c·exp(-u)), finite where exp(u) overflows (inf / inf);
    log(1 + exp(u)) -> softplus(u), finite where exp(u) overflows."""
    def sigmoid_like(e: sympy.Expr) -> bool:
        if not isinstance(e, sympy.Mul):
            return False
        return _sigmoid_parts(e) is not None

    def sigmoid(e: sympy.Expr) -> sympy.Expr:
        rest, u, c = _sigmoid_parts(e)
        return rest / (1 + c * sympy.exp(-u))

    expr = expr.replace(sigmoid_like, sigmoid)

    def softplus_like(e: sympy.Expr) -> bool:
        return isinstance(e, sympy.log) and _softplus_argument(e.args[0]) is not None

    return expr.replace(softplus_like, lambda e: softplus(_softplus_argument(e.args[0])))


def _sigmoid_parts(e: sympy.Mul) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr] | None:
    """(rest, u, c) when e = rest · exp(u) / (exp(u) + c) with c a positive number."""
    factors = sympy.Mul.make_args(e)
    exps = [f for f in factors if isinstance(f, sympy.exp)]
    for numerator in exps:
        u = numerator.args[0]
        for denominator in factors:
            base, exponent = denominator.as_base_exp()
            if exponent != -1 or not isinstance(base, sympy.Add):
                continue
            c = sympy.expand(base - numerator)
            if c.is_number and c.is_positive:
                rest = sympy.Mul(*(f for f in factors if f is not numerator
                                   and f is not denominator))
                return rest, u, c
    return None


def _softplus_argument(argument: sympy.Expr) -> sympy.Expr | None:
    terms = sympy.Add.make_args(argument)
    if len(terms) == 2 and sympy.Integer(1) in terms:
        other = terms[0] if terms[1] == 1 else terms[1]
        if isinstance(other, sympy.exp) and not other.args[0].is_number:
            return other.args[0]
    return None


def _partner_leaves(nodes: list[Node], taken: set[str]) -> list[Node]:
    """A partner read of every element input and column parameter the spec does not read
    across itself, where it reads any: the adjoint of a partner read, moved to the partner
    column, reads every leaf there (sin at j's partner, in rotary's dx). Never differentiated:
    the forward reads none."""
    pairing = next((n.pairing for n in nodes if n.kind is Kind.PARTNER), None)
    if pairing is None:
        return nodes
    read = {n.partner_of for n in nodes if n.kind is Kind.PARTNER}
    added = []
    for node in nodes:
        if node.kind not in (Kind.INPUT, Kind.COLUMN_PARAM) or node.name in read:
            continue
        name, index = f"{node.name}_partner", 2
        while name in taken:
            name, index = f"{node.name}_partner{index}", index + 1
        taken.add(name)
        added.append(Node(name, sympy.Symbol(name, real=True), Kind.PARTNER, node.level,
                          where=node.where, grad=False, partner_of=node.name, pairing=pairing))
    return nodes + added


# ---------------------------------------------------------------------- refusals
def _refuse_cross_element(spec: OpSpec, node: Node, expr: sympy.Expr) -> None:
    """The language is one generic element j of one row: two column indices in one value would
    relate two elements (a cumulative sum, a shift), which a row reduction cannot express."""
    indices = sorted(s.name for s in expr.free_symbols if s != N and
                      spec.node_of(s, "expression").kind is Kind.INDEX and
                      spec.node_of(s, "expression").level is Level.COLUMN)
    if len(indices) > 1:
        raise SpecError(
            f"{node.where}: '{node.name}' combines the column indices {', '.join(indices)}: "
            "every index names the same element j of the row, so this does not relate two "
            "elements (a cumulative sum or a shift is outside the language: a value may depend "
            "on its own element and on row reductions only; see docs/spec_language.md)")


# ---------------------------------------------------------------------- extraction
def _varying(expr: sympy.Expr, levels: dict[sympy.Symbol, Level]) -> set[sympy.Symbol]:
    return {s for s in expr.free_symbols
            if s != N and levels.get(s) in (Level.ELEMENT, Level.COLUMN)}


def _sigmoids(nodes: list[Node], levels: dict[sympy.Symbol, Level]) -> list[sympy.Expr]:
    """Every 1 / (1 + c·exp(u)) of an elementwise u that is not a whole elementwise definition
    (a reduction's whole body is one: its name is the sum): named, its derivative is written in
    its own value, σ' = σ(1 − σ) (derive/reverse.py), never through exp(u), which overflows
    where σ is still finite (x·σ(x) at x = −89)."""
    found = []
    for node in nodes:
        if not node.is_definition:
            continue
        for sub in sympy.preorder_traversal(node.expr):
            whole = sub == node.expr and node.kind is not Kind.REDUCE
            if not whole and _is_sigmoid(sub) and _varying(sub, levels):
                found.append(sub)
    return found


def _is_sigmoid(e: sympy.Expr) -> bool:
    if not (isinstance(e, sympy.Pow) and e.exp == -1 and isinstance(e.base, sympy.Add)):
        return False
    exps = [t for t in e.base.args if isinstance(t.as_coeff_Mul()[1], sympy.exp)]
    rest = e.base - sum(exps)
    return len(exps) == 1 and rest == 1 and exps[0].as_coeff_Mul()[0] > 0


def _shared_functions(nodes: list[Node], levels: dict[sympy.Symbol, Level]) -> list[sympy.Expr]:
    """Functions of elementwise values used twice or more, or inside a reduction body."""
    counts: dict[sympy.Expr, int] = {}
    for node in nodes:
        if not node.is_definition:
            continue
        weight = 2 if node.kind is Kind.REDUCE else 1
        for sub in sympy.preorder_traversal(node.expr):
            if _is_function(sub) and _varying(sub, levels) and sub != node.expr:
                counts[sub] = counts.get(sub, 0) + weight
            elif node.kind is Kind.REDUCE and sub == node.expr and _is_function(sub) \
                    and _varying(sub, levels):
                counts[sub] = counts.get(sub, 0) + weight
    return [e for e, count in counts.items() if count >= 2]


def _is_function(e: sympy.Expr) -> bool:
    if isinstance(e, sympy.Piecewise):
        return False  # selections stay where they are (a mask is cheaper than a name)
    if isinstance(e, sympy.Function):
        return True
    return isinstance(e, sympy.Pow) and not e.exp.is_Integer


def _normalised_parts(nodes: list[Node], levels: dict[sympy.Symbol, Level]) -> list[sympy.Expr]:
    """Maximal sub-sums/sub-products of an elementwise definition that are a function of one
    element input and row scalars only, where the definition as a whole is not."""
    found: list[sympy.Expr] = []

    def visit(expr: sympy.Expr) -> None:
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            part = expr.func(*(a for a in expr.args
                               if not _varying(a, levels) or _pure(a, levels)))
            if part != expr and _pure(part, levels) and not isinstance(part, sympy.Symbol) \
                    and any(levels.get(s) is Level.ROW for s in part.free_symbols):
                found.append(part)
                return
        for arg in expr.args:
            visit(arg)

    for node in nodes:
        if node.kind is Kind.ELEMENT and not _pure(node.expr, levels):
            visit(node.expr)
    return found


def _input_scale_parts(nodes: list[Node], levels: dict[sympy.Symbol, Level]
                       ) -> list[sympy.Expr]:
    """The terms of a sum that are values of the inputs' own magnitude (an input, a row max or
    mean of one, one element of it selected by a one-hot sum), where the sum holds a function
    term (a log, an exp) too: named, they are added first, while their difference is exact.
    log Σ exp(x − max) + max − x[target] + s, evaluated as (max − x[target]) + s + log Σ …,
    keeps the digits that adding s or the log to a logit of 1e4 first would round away."""
    scaled = _input_scale_symbols(nodes)
    found: list[sympy.Expr] = []
    for node in nodes:
        if not node.is_definition:
            continue
        for sub in sympy.preorder_traversal(node.expr):
            if not isinstance(sub, sympy.Add):
                continue
            parts = [t for t in sub.args if _scaled_term(t, scaled)]
            if len(parts) >= 2 and any(t.has(*_SMOOTH) for t in sub.args):
                found.append(sympy.Add(*parts))
    return found


def _input_scale_symbols(nodes: list[Node]) -> set[sympy.Symbol]:
    """Values of the inputs' magnitude: inputs, and row maxes, row means and one-hot picks
    (Σ_j Piecewise((v, condition), (0, True))) of such values, and names of such values."""
    scaled: set[sympy.Symbol] = set()
    for node in nodes:
        body = node.expr
        if node.kind is Kind.INPUT:
            scaled.add(node.symbol)
        elif node.kind is Kind.REDUCE and node.reduction == "sum":
            if isinstance(body, sympy.Piecewise) and len(body.args) == 2 \
                    and body.args[1] == (0, True) and _scaled_term(body.args[0][0], scaled):
                scaled.add(node.symbol)
        elif node.is_definition and _scaled_term(body, scaled):
            scaled.add(node.symbol)
    return scaled


def _scaled_term(term: sympy.Expr, scaled: set[sympy.Symbol]) -> bool:
    coefficient, rest = term.as_coeff_Mul()
    return coefficient.is_Number and rest in scaled


def _pure(expr: sympy.Expr, levels: dict[sympy.Symbol, Level]) -> bool:
    varying = _varying(expr, levels)
    return len(varying) == 1 and levels[next(iter(varying))] is Level.ELEMENT and not any(
        isinstance(sub, sympy.Function) and _varying(sub, levels)
        for sub in sympy.preorder_traversal(expr))


def _extract(nodes: list[Node], levels: dict[sympy.Symbol, Level], taken: set[str],
             find) -> list[Node]:
    """Name each expression `find` returns (smallest first, so inner ones are named before the
    expressions holding them), just before the first definition that uses it."""
    while True:
        candidates = sorted(set(find(nodes, levels)),
                            key=lambda e: (sympy.count_ops(e), sympy.default_sort_key(e)))
        if not candidates:
            return nodes
        expr = candidates[0]
        name = _fresh_name(expr, taken)
        symbol = sympy.Symbol(name, positive=True) if expr.is_positive else \
            sympy.Symbol(name, real=True)
        kind, level = (Kind.ELEMENT, Level.ELEMENT) if _varying(expr, levels) else \
            (Kind.ROW, Level.ROW)
        node = Node(name, symbol, kind, level, expr, where=_first_use(nodes, expr))
        taken.add(name)
        levels[node.symbol] = level
        replaced: list[Node] = []
        for other in nodes:
            if other.is_definition:
                new = _replace(other.expr, expr, node.symbol)
                if new != other.expr:
                    if node not in replaced:
                        replaced.append(node)
                    other = dataclasses.replace(other, expr=new)
            replaced.append(other)
        if node not in replaced:
            raise AssertionError(f"extracted {expr} is used nowhere")
        nodes = replaced


def _first_use(nodes: list[Node], part: sympy.Expr) -> str:
    return next((n.where for n in nodes if n.is_definition and
                 _replace(n.expr, part, sympy.Dummy()) != n.expr), "")


def _replace(expr: sympy.Expr, part: sympy.Expr, symbol: sympy.Symbol) -> sympy.Expr:
    """expr with `part` (a whole subexpression, or a sub-sum / sub-product) named `symbol`."""
    if expr == part:
        return symbol
    if isinstance(part, (sympy.Add, sympy.Mul)):
        wanted = part.args

        def holds(e: sympy.Expr) -> bool:
            return isinstance(e, part.func) and all(a in e.args for a in wanted)

        def swap(e: sympy.Expr) -> sympy.Expr:
            rest = list(e.args)
            for a in wanted:
                rest.remove(a)
            return e.func(symbol, *rest)

        return expr.replace(holds, swap)
    return expr.xreplace({part: symbol})


def _fresh_name(expr: sympy.Expr, taken: set[str]) -> str:
    head = type(expr).__name__.lower() if isinstance(expr, sympy.Function) else (
        "sigmoid" if _is_sigmoid(expr) else "pow" if isinstance(expr, sympy.Pow) else "part")
    symbols = sorted(s.name for s in expr.free_symbols if s != N)
    base = "_".join([head] + symbols[:2])
    name, index = base, 2
    while name in taken:
        name, index = f"{base}{index}", index + 1
    return name

"""Overflow-safe forms of logs and of sums of exponentials, whatever the spelling (the canonical
form's rule 2).

A log whose argument, seen through the names it is made of, is a product of exponentials,
positive values and binomials c0 + c1·exp(w) is written as a sum: log exp(u) = u, a positive
value keeps its log, and each binomial becomes a softplus, which never overflows:

- log σ(x) = log(1 / (1 + exp(-x))) = -softplus(-x);
- log(1 - σ(x)) = log(exp(-x) / (1 + exp(-x))) = -softplus(x) (an exponential factor is
  absorbed into a binomial where that cancels terms: -x - softplus(-x) would round);
- log softmax = log(exp(x - m) / Σ_j exp(x_j - m)) = x - m - log Σ_j exp(x_j - m), finite
  where exp(x - m) underflows to 0;
- log(1 + exp(u)) = softplus(u).

A row sum of exponentials that no row max stabilises, Σ_j exp(u_j)·w_j, is shifted by the max
of its exponents, as torch.logsumexp is (a +inf max shifts by itself, as torch.softmax's
does: such a row is NaN, docs/design.md rule 5): m = max_j u_j and s' = Σ_j exp(u_j - m)·w_j
are named, the sum is exp(m)·s', and each later value that reads the sum reads exp(m)·s', where the
exponentials meet: log Σ_j exp(x_j) = m + log s', exp(x) / Σ_j exp(x_j) = exp(x - m) / s'. The
max cancels from every output (the engine proves it, docs/design.md rule 5). A sum that is an
output or saved, or that a later value reads other than in a log or beside exponentials, is
left as written.

A product that holds a log of one of its own factors (x·log x, t·(log t - log p)) is 0 where
that factor is 0, and so is its derivative there: torch.xlogy's value and torch.kl_div's
gradient, where the product as written is 0·(-inf) = NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import sympy
from sympy.codegen.cfunctions import log1p

from derive.spec import RESERVED, Kind, Level, Node, OpSpec


def softplus(u: sympy.Expr) -> sympy.Expr:
    """log(1 + exp(u)) as max(u, 0) + log1p(exp(-|u|)), finite everywhere. Both selections
    switch at the same test, so at u = 0 the derivative is log1p(exp(u))'s, σ(0) = 1/2, not
    one side's of each. log1p: log(1 + exp(-|u|)) would round exp(-|u|) < 2^-24 away
    (softplus(-30) = 0)."""
    return (sympy.Piecewise((u, u > 0), (0, True))
            + log1p(sympy.exp(sympy.Piecewise((-u, u > 0), (u, True)))))


def known_positive(expr: sympy.Expr, positive: set[sympy.Symbol]) -> bool:
    """expr > 0 for every input: a positive number, an exponential, a value known positive, or
    sums, products and powers of these."""
    if expr in positive or expr.is_positive:
        return True
    if isinstance(expr, sympy.exp):
        return expr.args[0].is_real is not False
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return all(known_positive(arg, positive) for arg in expr.args)
    if isinstance(expr, sympy.Pow):
        return known_positive(expr.base, positive) and expr.exp.is_real is True
    return False


def stable_logs(expr: sympy.Expr, values: Mapping[sympy.Symbol, sympy.Expr],
                positive: set[sympy.Symbol]) -> sympy.Expr:
    """Every log of expr in its overflow-safe form (see the module doc), where it has one;
    `values` are the definitions a log's argument may be seen through, `positive` the values
    known positive."""
    def rewrite(e: sympy.log) -> sympy.Expr:
        terms = _log_terms(e.args[0], values, positive)
        return e if terms is None else terms

    return expr.replace(lambda e: isinstance(e, sympy.log), rewrite)


def _see_through(expr: sympy.Expr, values: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    while inner := {s: values[s] for s in expr.free_symbols if s in values}:
        expr = expr.xreplace(inner)
    return expr


def _log_terms(argument: sympy.Expr, values: Mapping[sympy.Symbol, sympy.Expr],
               positive: set[sympy.Symbol]) -> sympy.Expr | None:
    """log(argument) as a sum of arguments of exponentials, logs of positive values and
    softplus terms; None where the argument is not such a product."""
    seen = sympy.together(_see_through(argument, values))
    numerator, denominator = sympy.fraction(seen)
    linear = sympy.Integer(0)  # the sum of the exponentials' arguments
    logs = sympy.Integer(0)
    binomials: list[tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]] = []
    for side, sign in ((numerator, 1), (denominator, -1)):
        for factor in sympy.Mul.make_args(side):
            if isinstance(factor, sympy.exp):
                linear += sign * factor.args[0]
                continue
            base, power = factor.as_base_exp()
            if not power.is_real:
                return None
            if base.is_number and base.is_positive:
                logs += sign * power * sympy.log(base)
            elif isinstance(base, sympy.Add) and (parts := _binomial(base)) is not None:
                binomials.append((*parts, sign * power))
            elif known_positive(base, positive) and not base.has(sympy.exp):
                logs += sign * power * sympy.log(base)
            else:
                return None
    if not binomials and not linear.free_symbols:
        return None  # a log of positive values alone: it is its own safe form
    result = logs
    for c0, c1, w, power in binomials:
        absorbed = sympy.expand(linear + power * w)
        if _term_count(absorbed) < _term_count(linear):
            # exp(-x) / (1 + exp(-x)) = 1 / (exp(x) + 1): no x - x to round
            linear, c0, c1, w = absorbed, c1, c0, -w
        shift = sympy.log(c1 / c0)
        result += power * (sympy.log(c0) + softplus(w + shift))
    return linear + result


def _term_count(expr: sympy.Expr) -> int:
    return 0 if expr == 0 else len(sympy.Add.make_args(expr))


def _binomial(base: sympy.Add) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr] | None:
    """(c0, c1, w) where base = c0 + c1·exp(w), c0 and c1 positive numbers."""
    constant, rest = base.as_coeff_Add()
    if not (constant.is_number and constant.is_positive):
        return None
    c1, exponential = rest.as_coeff_Mul()
    if not isinstance(exponential, sympy.exp) or not (c1.is_number and c1.is_positive):
        return None
    return constant, c1, exponential.args[0]


def xlogy(expr: sympy.Expr) -> sympy.Expr:
    """Each product holding a log of one of its own factors, 0 where that factor is 0 (see the
    module doc)."""
    def factor_logged(e: sympy.Mul) -> sympy.Expr | None:
        for factor in e.args:
            base, power = factor.as_base_exp()
            if base.is_number or not power.is_positive:
                continue
            others = sympy.Mul(*(f for f in e.args if f is not factor))
            if any(arg.as_base_exp()[0] == base
                   for arg in (log.args[0] for log in others.atoms(sympy.log))):
                return base
        return None

    def guarded(e: sympy.Mul) -> sympy.Expr:
        return sympy.Piecewise((0, sympy.Eq(factor_logged(e), 0)), (e, True))

    return expr.replace(lambda e: isinstance(e, sympy.Mul) and factor_logged(e) is not None,
                        guarded)


def shift_exponential_sums(spec: OpSpec) -> OpSpec:
    """`spec` with each row sum of exponentials that no row max stabilises shifted by the max
    of its exponents (see the module doc), where the shift cancels: the sum is no output and
    no saved value, and every value that reads it reads it in a log or beside exponentials
    that take exp(m) in. Elsewhere exp(m) would stay a factor, and its derivative
    exp(x - m)·exp(m), 0·inf where exp(x) alone is finite."""
    kept: set[str] = set()
    while True:
        shifted, scaled = _shifted(spec, kept)
        if not scaled:
            return shifted
        kept |= scaled


def _shifted(spec: OpSpec, kept: set[str]) -> tuple[OpSpec, set[str]]:
    """`spec` with the sums not in `kept` shifted, and those whose shift does not cancel."""
    levels = {node.symbol: node.level for node in spec.nodes}
    maxes = {node.symbol for node in spec.nodes if node.reduction == "max"}
    taken = {node.name for node in spec.nodes} | set(RESERVED)
    exponentials: dict[sympy.Symbol, sympy.Expr] = {}  # element values that are an exp(u)
    shifted: dict[sympy.Symbol, sympy.Expr] = {}  # each shifted sum: exp(m)·s'
    factors: dict[str, sympy.Expr] = {}  # each shifted sum's exp(m)
    saved = spec.saved_anywhere() | set(spec.outputs)
    scaled: set[str] = set()  # sums whose exp(m) stays a factor
    nodes: list[Node] = []
    for node in spec.nodes:
        if node.is_definition and node.expr.has(*shifted):
            # where the sum meets an exponential, exp(x)·exp(-m) = exp(x - m)
            expr = merge_exponentials(node.expr.xreplace(shifted).xreplace(exponentials))
            outside = expr.replace(lambda e: isinstance(e, sympy.log), lambda e: sympy.Integer(1))
            scaled |= {name for name, factor in factors.items() if outside.has(factor)}
            node = dataclasses.replace(node, expr=expr)
        parts = None if node.name in kept | saved else \
            _exponential_sum(node, exponentials, levels, maxes)
        if parts is None:
            if node.kind is Kind.ELEMENT and isinstance(node.expr, sympy.exp):
                exponentials[node.symbol] = node.expr
            nodes.append(node)
            continue
        exponent, rest = parts
        top = _declare(f"max_{node.name}", taken, node, Kind.REDUCE, exponent, "max")
        total = _declare(f"{node.name}_shifted", taken, node, Kind.REDUCE,
                         merge_exponentials(sympy.exp(exponent - top.symbol) * rest),
                         node.reduction)
        levels[top.symbol] = levels[total.symbol] = Level.ROW
        maxes.add(top.symbol)
        factors[node.name] = sympy.exp(top.symbol)
        shifted[node.symbol] = factors[node.name] * total.symbol
        nodes += [top, total, dataclasses.replace(node, kind=Kind.ROW, reduction=None,
                                                  expr=shifted[node.symbol])]
    if not shifted:
        return spec, scaled
    return dataclasses.replace(spec, nodes=nodes), scaled


def _exponential_sum(node: Node, exponentials: Mapping[sympy.Symbol, sympy.Expr],
                     levels: Mapping[sympy.Symbol, Level], maxes: set[sympy.Symbol]
                     ) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(u, w) where node is Σ_j exp(u_j)·w_j (a sum or mean), u elementwise and shifted by no
    row max, w free of elementwise exponentials."""
    if node.kind is not Kind.REDUCE or node.reduction not in ("sum", "mean"):
        return None
    factors = sympy.Mul.make_args(merge_exponentials(node.expr.xreplace(exponentials)))

    def varies(e: sympy.Expr) -> bool:
        return any(levels.get(s) in (Level.ELEMENT, Level.COLUMN) for s in e.free_symbols)

    exps = [f for f in factors if isinstance(f, sympy.exp) and varies(f.args[0])]
    if len(exps) != 1 or exps[0].args[0].free_symbols & maxes:
        return None
    rest = sympy.Mul(*(f for f in factors if f is not exps[0]))
    if any(varies(e.args[0]) for e in rest.atoms(sympy.exp)):
        return None
    return exps[0].args[0], rest


def _declare(base: str, taken: set[str], source: Node, kind: Kind, expr: sympy.Expr,
             reduction: str) -> Node:
    name, index = base, 2
    while name in taken:
        name, index = f"{base}{index}", index + 1
    taken.add(name)
    return Node(name, sympy.Symbol(name, real=True), kind, Level.ROW, expr, reduction,
                where=source.where)


def merge_exponentials(expr: sympy.Expr) -> sympy.Expr:
    """Each product's exponential factors as one: exp(x)·exp(-m) = exp(x - m)."""
    def several(e: sympy.Expr) -> bool:
        return isinstance(e, sympy.Mul) and sum(isinstance(f, sympy.exp) for f in e.args) > 1

    def merged(e: sympy.Mul) -> sympy.Expr:
        exps = [f for f in e.args if isinstance(f, sympy.exp)]
        rest = [f for f in e.args if not isinstance(f, sympy.exp)]
        return sympy.Mul(sympy.exp(sympy.Add(*(f.args[0] for f in exps))), *rest)

    return expr.replace(several, merged)

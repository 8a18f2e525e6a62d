"""Overflow-safe forms of logs, whatever the spelling (the canonical form's rule 2).

A log whose argument, seen through the names it is made of, is a product of exponentials,
positive values and binomials c0 + c1·exp(w) is written as a sum: log exp(u) = u, a positive
value keeps its log, and each binomial becomes a softplus, which never overflows:

- log σ(x) = log(1 / (1 + exp(-x))) = -softplus(-x);
- log(1 - σ(x)) = log(exp(-x) / (1 + exp(-x))) = -softplus(x) (an exponential factor is
  absorbed into a binomial where that cancels terms: -x - softplus(-x) would round);
- log softmax = log(exp(x - m) / Σ_j exp(x_j - m)) = x - m - log Σ_j exp(x_j - m), finite
  where exp(x - m) underflows to 0;
- log(1 + exp(u)) = softplus(u).

A product that holds a log of one of its own factors (x·log x, t·(log t - log p)) is 0 where
that factor is 0, and so is its derivative there: torch.xlogy's value and torch.kl_div's
gradient, where the product as written is 0·(-inf) = NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
from sympy.codegen.cfunctions import log1p


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

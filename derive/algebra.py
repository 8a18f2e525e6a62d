"""Reduction algebra: Σ_j as a first-class SymPy node and the rules plain simplify lacks.

- linearity: Σ_j (a·u_j + b) = a·Σ_j u_j + N·b for row-invariant a, b;
- recognition: a sum that a forward reduction already names is replaced by it
  (Σ_j x_j = N·mean), which also makes vanishing sums vanish (Σ_j (x_j − mean) = 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import sympy

from derive.spec import Level, N


class RowSum(sympy.Function):
    """Σ_j body_j over the elements of one row: a row scalar."""

    nargs = 1
    is_real = True

    def _latex(self, printer: sympy.printing.latex.LatexPrinter) -> str:
        return r"\sum_j \left(" + printer._print(self.args[0]) + r"\right)"

    def _sympystr(self, printer: sympy.printing.str.StrPrinter) -> str:
        return "Σ_j(" + printer._print(self.args[0]) + ")"


class GuardedReciprocal(sympy.Function):
    """1 / w with |w| clamped from below (Apex's clamp_by_magnitude): the guard of a value
    recovered by dividing by a parameter, so a zero weight gives finite gradients, not NaN."""

    nargs = 1
    is_real = True
    #: the clamp, as the generated modules' INVERSION_GUARD
    guard = sympy.Rational(1, 10**6)

    @classmethod
    def eval(cls, value: sympy.Expr) -> sympy.Expr | None:
        if value.is_number and value.is_comparable:
            magnitude = sympy.Max(abs(value), cls.guard)
            return -1 / magnitude if value < 0 else 1 / magnitude
        return None

    def _eval_is_zero(self) -> bool:
        return False  # 1 / w, |w| clamped below: dividing by it is safe

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        """d/dw (1/w) = -1/w², the guard's flat region aside (where it binds, the value it
        guards is defined by the spec, not by a limit)."""
        return -GuardedReciprocal(self.args[0]) ** 2

    def _latex(self, printer: sympy.printing.latex.LatexPrinter, exp: str | None = None) -> str:
        text = r"\frac{1}{\lfloor " + printer._print(self.args[0]) + r" \rceil}"
        return text if exp is None else r"\left(" + text + r"\right)^{" + exp + "}"


def unguarded(expr: sympy.Expr) -> sympy.Expr:
    """expr with every guarded reciprocal a plain one: equal wherever no guard binds."""
    return expr.replace(lambda e: isinstance(e, GuardedReciprocal), lambda e: 1 / e.args[0])


@dataclass
class Algebra:
    """Knows each symbol's level and the recognition rules of one derivation."""

    levels: dict[sympy.Symbol, Level]
    rules: dict[sympy.Expr, sympy.Expr] = field(default_factory=dict)

    def varies(self, expr: sympy.Expr) -> bool:
        """True when expr changes along the row (a Σ_j is a row scalar, so it does not)."""
        if isinstance(expr, RowSum):
            return False
        if isinstance(expr, sympy.Symbol):
            if expr == N:
                return False
            return self.levels[expr] in (Level.ELEMENT, Level.COLUMN)
        return any(self.varies(arg) for arg in expr.args)

    def normalize(self, expr: sympy.Expr) -> sympy.Expr:
        """Rewrite every Σ_j in expr (innermost first) by linearity and recognition."""
        if not expr.has(RowSum):
            return expr
        if isinstance(expr, RowSum):
            return self.row_sum(self.normalize(expr.args[0]))
        return expr.func(*(self.normalize(arg) for arg in expr.args))

    def row_sum(self, body: sympy.Expr) -> sympy.Expr:
        """Σ_j body, split by linearity into row-invariant coefficients times simple sums."""
        expanded = sympy.expand(body, power_exp=False, power_base=False, log=False)
        total = sympy.Integer(0)
        for term in sympy.Add.make_args(expanded):
            invariant, varying = [], []
            # Row-invariant factors hidden in a sum (a denominator N·e·s² + N·s⁴) come out too,
            # so sums that differ by a row-invariant factor are one sum.
            term = self._guarded(term)
            for factor in sympy.Mul.make_args(sympy.factor_terms(term)):
                if isinstance(factor, sympy.Piecewise) and self.varies(factor):
                    common, factor = self.shared_factor(factor)
                    invariant.append(common)
                (varying if self.varies(factor) else invariant).append(factor)
            element_part = sympy.Mul(*varying)
            if element_part == 1:
                total += sympy.Mul(*invariant) * N
            else:
                atom = RowSum(element_part)
                total += sympy.Mul(*invariant) * self.rules.get(atom, atom)
        return total

    def _guarded(self, term: sympy.Expr) -> sympy.Expr:
        """term with its elementwise factors moved into the first varying selection with a 0
        branch that it holds, and that selection dropped where the guard is needless: a guard
        holds the product it guards before it may go (Piecewise((0, Eq(t, 0)), (t, True)) / t
        is 0/0 at t = 0, not 1)."""
        factors = sympy.Mul.make_args(term)
        guard = next((f for f in factors if isinstance(f, sympy.Piecewise) and self.varies(f)
                      and any(value == 0 for value, _ in f.args)), None)
        if guard is None:
            return term
        inside = sympy.Mul(*(f for f in factors if f is not guard and self.varies(f)))
        outside = sympy.Mul(*(f for f in factors if f is not guard and not self.varies(f)))
        return outside * needless_guards(sympy.Piecewise(
            *((inside * value if value != 0 else value, condition)
              for value, condition in guard.args)), self.varies)

    def shared_factor(self, piece: sympy.Piecewise) -> tuple[sympy.Expr, sympy.Expr]:
        """(r, selection) with piece = r·selection, r the row-invariant factor every nonzero
        branch holds: Σ_j Piecewise((0, t = 0), (t/s, True)) is (1/s)·Σ_j Piecewise((0, t = 0),
        (t, True)), the same sum as its 1/s-free form."""
        values = [value for value, _ in piece.args if value != 0]
        shares = {sympy.Mul(*(f for f in sympy.Mul.make_args(sympy.factor_terms(value))
                              if not self.varies(f))) for value in values}
        if len(shares) != 1 or (common := shares.pop()) == 1:
            return sympy.Integer(1), piece
        return common, sympy.Piecewise(*((value / common if value != 0 else value, condition)
                                         for value, condition in piece.args))

    def learn(self, relation_sum: sympy.Expr, value: sympy.Expr) -> sympy.Expr | None:
        """Record Σ_j body = value as a rewrite rule for its leading sum; return that sum."""
        lhs = self.row_sum(relation_sum)
        atoms = sorted(lhs.atoms(RowSum), key=sympy.default_sort_key)
        if not atoms:
            return None
        lead = max(atoms, key=lambda atom: (sympy.count_ops(atom), sympy.default_sort_key(atom)))
        coefficient = lhs.coeff(lead)
        if coefficient == 0 or coefficient.has(lead):
            return None
        rest = sympy.expand(lhs - coefficient * lead)
        self.rules[lead] = sympy.expand((value - rest) / coefficient)
        return lead


def into_selections(expr: sympy.Expr) -> sympy.Expr:
    """Each product holding a selection with a 0 branch, the product's other factors moved into
    the selection's branches: Piecewise((a·b, c), (0, True)), exactly 0 where c fails, never
    a·Piecewise((b, c), (0, True)), which is inf·0 = NaN there when a is not finite (1/‖x‖ of
    a zero row, where a clamp max(‖x‖, eps) takes its floor)."""
    def selection(e: sympy.Expr) -> sympy.Piecewise | None:
        return next((f for f in e.args if isinstance(f, sympy.Piecewise)
                     and any(value == 0 for value, _ in f.args)), None)

    def fold(e: sympy.Mul) -> sympy.Expr:
        piece = selection(e)
        rest = sympy.Mul(*(f for f in e.args if f is not piece))
        return sympy.Piecewise(*((into_selections(rest * value) if value != 0 else value, cond)
                                 for value, cond in piece.args))

    return expr.replace(lambda e: isinstance(e, sympy.Mul) and selection(e) is not None, fold)


def needless_guards(expr: sympy.Expr, varies: Callable[[sympy.Expr], bool]) -> sympy.Expr:
    """Each selection Piecewise((a, Eq(v, c)), (b, True)) of an elementwise v (`varies`) whose
    b is a at v = c, written b: a guard of x·log x differentiated, Piecewise((0, Eq(t, 0)),
    (t, True)), is t. A switch on a scalar stays: the kernels are compiled for its cases."""
    def needless(e: sympy.Expr) -> bool:
        if not (isinstance(e, sympy.Piecewise) and len(e.args) == 2):
            return False
        (value, condition), (other, otherwise) = e.args
        return (otherwise == sympy.true and isinstance(condition, sympy.Eq)
                and isinstance(condition.lhs, sympy.Symbol) and varies(condition.lhs)
                and other.subs(condition.lhs, condition.rhs) == value)

    return expr.replace(needless, lambda e: e.args[1][0])


def expand_sums(expr: sympy.Expr) -> sympy.Expr:
    """expr as a sum of terms with every Σ_j in a term of its own: a product is distributed over
    a sum only where that sum holds a Σ_j. Every other sum stays as written, because expanding
    it is what loses precision: dy·z·(1 − t²) expanded rounds dy·z and dy·z·t² apart and
    subtracts them (0 where t rounds to 1), where the factored form subtracts first, exactly."""
    if not expr.has(RowSum) or isinstance(expr, RowSum):
        return expr
    if isinstance(expr, sympy.Add):
        return sympy.Add(*(expand_sums(arg) for arg in expr.args))
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 1:
        factors = [expr.base] * int(expr.exp)
    elif isinstance(expr, sympy.Mul):
        factors = list(expr.args)
    else:
        return expr  # a function of a sum, a negative power, a selection: one factor
    terms = [sympy.Integer(1)]
    for factor in factors:
        parts = sympy.Add.make_args(expand_sums(factor))
        terms = [term * part for term in terms for part in parts]
    return sympy.Add(*terms)


def sorted_symbols(symbols: Iterable[sympy.Basic]) -> list[sympy.Symbol]:
    """Free symbols in a fixed order, so output never depends on PYTHONHASHSEED."""
    return sorted((s for s in symbols if isinstance(s, sympy.Symbol)), key=lambda s: s.name)


def substitute(expr: sympy.Expr, replacements: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """Simultaneous substitution that also reaches inside Σ_j bodies."""
    if not replacements:
        return expr
    return expr.xreplace(dict(replacements))


def _in_domain(symbol: sympy.Symbol, value: sympy.Rational) -> sympy.Rational:
    """`value` (> 0) moved into what the symbol's assumptions allow, as simplify assumes it:
    an integer (even or odd), negative, zero."""
    if symbol.is_zero:
        return sympy.Integer(0)
    if symbol.is_integer:
        value = sympy.Integer(value.p + value.q)
        if symbol.is_even and value % 2 or symbol.is_odd and not value % 2:
            value += 1
    return -value if symbol.is_negative or symbol.is_nonpositive else value


def surely_nonzero(expr: sympy.Expr) -> bool:
    """Whether expr is nonzero at some point, found by evaluating it at a few fixed rational
    points (each sum, function of a sum and unknown function a value of its own): a proof of
    "not identically 0" in microseconds, where `simplify` takes seconds to fail to prove 0. False
    means only that no point showed it (the caller then simplifies)."""
    atoms = sorted(expr.atoms(RowSum), key=sympy.default_sort_key)
    expr = expr.xreplace({atom: sympy.Dummy() for atom in atoms})
    symbols = sorted(expr.free_symbols, key=sympy.default_sort_key)
    for trial in range(3):
        point = {s: _in_domain(s, sympy.Rational(3 + 5 * index + 7 * trial, 11 + 2 * trial))
                 for index, s in enumerate(symbols)}
        try:
            value = expr.xreplace(point).evalf(30, chop=True)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if value.is_number and value.is_finite and value.is_zero is False \
                and abs(value) > sympy.Float(1e-20):
            return True
    return False

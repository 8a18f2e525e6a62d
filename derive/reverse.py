"""Reverse mode over the two-level graph of elements and row reductions (docs/design.md,
rules 1-5)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import sympy
from sympy.codegen.cfunctions import log1p

from derive.algebra import Algebra, RowSum, sorted_symbols, surely_nonzero, unguarded
from derive.spec import Kind, Level, N, Node, OpSpec, is_language_power


class DerivationError(ValueError):
    """The engine cannot derive what the spec asks for; the message says which value and why."""


@dataclass(frozen=True)
class Step:
    """One reverse-mode contribution, kept for the derivation page."""

    rule: str
    source: str
    target: str
    contribution: sympy.Expr


@dataclass(frozen=True)
class ReverseResult:
    adjoints: dict[str, sympy.Expr]
    upstream: dict[str, sympy.Symbol]
    steps: tuple[Step, ...]
    stabilisers: tuple[str, ...]
    #: every partner read the backward may load: name -> (the tensor it reads, the pairing);
    #: the spec's own (OpSpec.partner, and those canonical() adds for every element input and
    #: column parameter) and one per elementwise upstream gradient
    partners: tuple[tuple[str, str, str], ...] = ()


RULE_ELEMENT = "1 (elementwise chain rule)"
RULE_ROW_CONSUMED = "2 (row scalar used by elements: new row reduction)"
RULE_REDUCTION = "3 (reduction: broadcast of the row adjoint)"
RULE_ROW = "row scalar chain rule"
RULE_MAX = "5 (stabilising max: adjoint simplifies to 0)"
RULE_PARTNER = "6 (partner read: its adjoint, shifted to the partner column)"


def learn_forward_reductions(spec: OpSpec, algebra: Algebra) -> None:
    """Every forward sum/mean names a Σ_j: record it so later sums are recognised."""
    for node in spec.nodes:
        if node.kind is Kind.REDUCE and node.reduction in ("sum", "mean"):
            value = node.symbol * (N if node.reduction == "mean" else 1)
            algebra.learn(node.expr, value)


def upstream_symbol(output: str) -> sympy.Symbol:
    return sympy.Symbol("d" + output, real=True)


def reverse_mode(spec: OpSpec, algebra: Algebra) -> ReverseResult:
    """Walk the forward definitions backwards, keeping an adjoint for every node."""
    upstream = {name: upstream_symbol(name) for name in spec.outputs
                if name not in spec.undifferentiated}
    for name, symbol in upstream.items():
        algebra.levels[symbol] = spec.node(name).level
    adjoint: dict[str, sympy.Expr] = defaultdict(lambda: sympy.Integer(0))
    for name, symbol in upstream.items():
        adjoint[name] += symbol
    steps: list[Step] = []
    stabilisers: list[str] = []

    def add(rule: str, source: Node, target: sympy.Symbol, contribution: sympy.Expr) -> None:
        target_node = spec.node_of(target, "adjoint")
        if target_node.kind is Kind.SCALAR or not target_node.grad or contribution == 0:
            return  # constants, indices, random values and masks have no gradient
        adjoint[target_node.name] += contribution
        steps.append(Step(rule, source.name, target_node.name, contribution))

    for node in reversed(spec.nodes):
        if not node.is_definition:
            continue
        bar = algebra.normalize(adjoint[node.name])
        adjoint[node.name] = bar
        if node.reduction == "max":
            if not _vanishes(bar, spec, algebra):
                raise DerivationError(
                    f"{node.where}: '{node.name}' is a row max whose adjoint does not vanish: "
                    f"{bar}. A max is supported only where it stabilises (the output must not "
                    "depend on it).")
            stabilisers.append(node.name)
            steps.append(Step(RULE_MAX, node.name, node.name, sympy.Integer(0)))
            continue
        if node.reduction == "min":
            # an index reduction (an argmax's column) has no derivative: only outputs never
            # differentiated may read it
            if bar != 0:
                raise DerivationError(
                    f"{node.where}: '{node.name}' is a row min, which is never differentiated, "
                    f"and a differentiated output depends on it (adjoint {bar}); a row min "
                    "may reach only outputs declared output(..., grad=False)")
            continue
        if bar == 0:
            continue
        arguments = [s for s in sorted_symbols(node.expr.free_symbols) if s != N]
        for argument in arguments:
            derivative = sympy.diff(node.expr, argument)
            if node.kind is not Kind.REDUCE:
                # Written in the node's own name where it reappears: d exp(u) = exp(u) du = e du.
                # Never for a reduction: its symbol is the sum of its body, not the body.
                derivative = in_own_value(node, _in_own_name(node, derivative), algebra)
            if derivative == 0:
                continue
            varies = algebra.levels[argument] in (Level.ELEMENT, Level.COLUMN)
            if node.kind is Kind.REDUCE:
                scale = 1 / N if node.reduction == "mean" else sympy.Integer(1)
                if varies:
                    add(RULE_REDUCTION, node, argument, bar * derivative * scale)
                else:
                    add(RULE_REDUCTION, node, argument,
                        bar * scale * algebra.normalize(RowSum(derivative)))
            elif node.kind is Kind.ELEMENT and not varies:
                add(RULE_ROW_CONSUMED, node, argument, algebra.normalize(RowSum(bar * derivative)))
            else:
                add(RULE_ELEMENT if node.kind is Kind.ELEMENT else RULE_ROW, node, argument,
                    bar * derivative)
    partners = _partner_reads(spec, upstream, algebra)
    swap = _partner_swap(spec, upstream, partners)
    for node in spec.nodes:
        # Rule 6: y_j = f(x_j, x_p(j)) reads x at j's partner, so x_k reaches y at k and at p(k):
        # dx_k = (dy · ∂f/∂x_self)_k + (dy · ∂f/∂x_partner)_p(k), the second the partner read's
        # adjoint with every element leaf and the column index moved to the partner column
        if node.kind is Kind.PARTNER and node.grad:
            bar = algebra.normalize(adjoint[node.name])
            if bar != 0:
                source = spec.node(node.partner_of)
                add(RULE_PARTNER, node, source.symbol,
                    partner_shift(bar, spec, swap, node.pairing, node))
    return ReverseResult(dict(adjoint), upstream, tuple(steps), tuple(stabilisers),
                         tuple((name, source, pairing)
                               for name, (source, pairing) in partners.items()))


def _partner_reads(spec: OpSpec, upstream: dict[str, sympy.Symbol], algebra: Algebra
                   ) -> dict[str, tuple[str, str]]:
    """name -> (source, pairing) of every partner read: the spec's, and one per elementwise
    upstream gradient (d<output>_partner), which a shifted adjoint reads."""
    pairing = spec.pairing
    if pairing is None:
        return {}
    reads = {n.name: (n.partner_of, pairing) for n in spec.nodes if n.kind is Kind.PARTNER}
    taken = {n.name for n in spec.nodes} | {s.name for s in upstream.values()}
    for name, symbol in upstream.items():
        if spec.node(name).level is not Level.ELEMENT:
            continue
        partner, index = f"{symbol.name}_partner", 2
        while partner in taken:
            partner, index = f"{symbol.name}_partner{index}", index + 1
        taken.add(partner)
        reads[partner] = (symbol.name, pairing)
        algebra.levels[sympy.Symbol(partner, real=True)] = Level.ELEMENT
    return reads


def _partner_swap(spec: OpSpec, upstream: dict[str, sympy.Symbol],
                  partners: dict[str, tuple[str, str]]) -> dict[sympy.Symbol, sympy.Symbol]:
    """Each element or column leaf and its partner read, both ways (the pairing is an
    involution)."""
    symbols = {n.name: n.symbol for n in spec.nodes}
    symbols |= {s.name: s for s in upstream.values()}
    swap: dict[sympy.Symbol, sympy.Symbol] = {}
    for name, (source, _) in partners.items():
        partner = symbols.get(name, sympy.Symbol(name, real=True))
        swap[symbols[source]] = partner
        swap[partner] = symbols[source]
    return swap


def partner_shift(expr: sympy.Expr, spec: OpSpec, swap: dict[sympy.Symbol, sympy.Symbol],
                  pairing: str, node: Node) -> sympy.Expr:
    """expr evaluated at the partner column: elementwise definitions written out down to their
    leaves, each leaf swapped with its partner read and the column index j replaced by p(j).
    Row values are the same at every column and stay; so does a row sum Σ_j (p permutes j)."""
    sums = {atom: sympy.Dummy() for atom in expr.atoms(RowSum)}
    shifted = expr.xreplace(sums)
    definitions = {n.symbol: n.expr for n in spec.nodes if n.kind is Kind.ELEMENT}
    while inner := {s: definitions[s] for s in shifted.free_symbols if s in definitions}:
        shifted = shifted.xreplace(inner)
    indices = [n.symbol for n in spec.nodes if n.kind is Kind.INDEX and n.level is Level.COLUMN]
    for s in sorted_symbols(shifted.free_symbols):
        found = next((n for n in spec.nodes if n.symbol == s), None)
        if found is not None and found.level in (Level.ELEMENT, Level.COLUMN) \
                and found.kind is not Kind.INDEX and s not in swap:
            raise DerivationError(
                f"{node.where}: the adjoint of the partner read '{node.name}' holds "
                f"{found.kind.value} '{found.name}', which cannot be read at the partner column")
    for index in indices:
        shifted = _shift_index(shifted, index, pairing, node)
    return shifted.xreplace(swap).xreplace({d: atom for atom, d in sums.items()})


def _shift_index(expr: sympy.Expr, j: sympy.Symbol, pairing: str, node: Node) -> sympy.Expr:
    """expr with the column index j moved to its partner p(j), where that can be written in j:
    "half" swaps the halves, so j < N/2 at p(j) is j >= N/2 at j (and the converse);
    "interleaved" flips the parity: Mod(j, 2) at p(j) is 1 - Mod(j, 2)."""
    if j not in expr.free_symbols:
        return expr
    moved = sympy.Dummy("p")
    expr = expr.xreplace({j: moved})
    if pairing == "interleaved":
        expr = expr.replace(lambda e: isinstance(e, sympy.Mod) and e.args == (moved, 2),
                            lambda e: 1 - sympy.Mod(j, 2))
    else:
        half = N / 2
        flipped = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}

        def boundary(e: sympy.Expr) -> bool:
            if not isinstance(e, sympy.core.relational.Relational) or e.rel_op not in flipped:
                return False
            return sympy.expand(e.lhs - e.rhs) in (moved - half, half - moved)

        def across(e: sympy.Expr) -> sympy.Expr:
            op = e.rel_op if sympy.expand(e.lhs - e.rhs) == moved - half else flipped[e.rel_op]
            if op == "<":  # p(j) in the first half: j in the second
                return sympy.Ge(j, half)
            if op == ">=":
                return sympy.Lt(j, half)
            return e  # p(j) > N/2 or p(j) <= N/2: no comparison of j alone; refused below

        expr = expr.replace(boundary, across)
    if moved in expr.free_symbols:
        raise DerivationError(
            f"{node.where}: the adjoint of the partner read '{node.name}' uses the column index "
            f"'{j}' in {expr.xreplace({moved: sympy.Symbol(f'p({j})')})}, which the engine "
            "cannot move to the partner column: with pairing 'half' compare the index with N/2 "
            "(j < N/2 or j >= N/2); with 'interleaved' use its parity Mod(j, 2)")
    return expr


def _in_own_name(node: Node, derivative: sympy.Expr) -> sympy.Expr:
    """derivative with node's expression written as its name, unless that takes a power
    outside the language (y = u**(-3/2) makes u**(-5/2) into y**(5/3))."""
    named = derivative.subs(node.expr, node.symbol)
    if all(is_language_power(p.exp) for p in named.atoms(sympy.Pow)):
        return named
    return derivative


def in_own_value(node: Node, derivative: sympy.Expr, algebra: Algebra) -> sympy.Expr:
    """The derivative of v = R(exp(u)), R rational, written in v: exp(u) = R⁻¹(v) where that
    inverse is unique and rational, so σ' = exp(−u)·σ² becomes σ(1 − σ), finite wherever σ is,
    where exp(−u) overflows first (inf · 0 at u = −89 in fp32)."""
    exps = sorted((e for e in node.expr.atoms(sympy.exp) if algebra.varies(e)),
                  key=sympy.default_sort_key)
    if len(exps) != 1 or not derivative.has(exps[0]):
        return derivative
    unknown = sympy.Dummy("E", positive=True)
    rational = node.expr.xreplace({exps[0]: unknown})
    if any(algebra.varies(s) for s in rational.free_symbols - {unknown}) \
            or rational.has(sympy.Function):
        return derivative
    try:
        solutions = sympy.solve(sympy.Eq(node.symbol, rational), unknown)
    except NotImplementedError:
        return derivative
    if len(solutions) != 1:
        return derivative
    return sympy.factor(sympy.cancel(derivative.xreplace({exps[0]: solutions[0]})))


def _vanishes(expr: sympy.Expr, spec: OpSpec, algebra: Algebra) -> bool:
    """Prove expr == 0, inlining elementwise and row definitions and row sums one at a time,
    latest first, so the recognition rules still see the names the forward reductions were
    written in until a name is what hides the cancellation (an entropy's Σ_j p·log p, whose
    p = e / s cancels the stabilising max only once written in e)."""
    definitions = [n for n in spec.nodes if n.kind in (Kind.ELEMENT, Kind.ROW)
                   or (n.kind is Kind.REDUCE and n.reduction in ("sum", "mean"))]
    expr = algebra.normalize(unguarded(expr))
    for node in reversed(definitions):
        if _is_zero(expr):
            return True
        if node.symbol in expr.free_symbols or any(
                node.symbol in atom.free_symbols for atom in expr.atoms(RowSum)):
            value = node.expr
            if node.kind is Kind.REDUCE:
                value = RowSum(value) / (N if node.reduction == "mean" else 1)
                # without the rule that names this sum, which would only fold it back
                algebra = Algebra(algebra.levels, {
                    lead: rule for lead, rule in algebra.rules.items()
                    if node.symbol not in rule.free_symbols})
            expr = algebra.normalize(unguarded(expr.xreplace({node.symbol: value})))
    return _is_zero(expr)


def _is_zero(expr: sympy.Expr) -> bool:
    """expr == 0, by simplification, or else case by case: one selection's condition true, then
    false, each case simplified on its own (smoothing · [smoothing ≠ 0] − smoothing is 0 in
    both cases, and in neither form alone)."""
    expr = expr.replace(lambda e: isinstance(e, log1p), lambda e: sympy.log(1 + e.args[0]))
    if surely_nonzero(expr):  # no simplification can make it 0 (and it may take minutes to try)
        return False
    if sympy.simplify(expr) == 0:
        return True
    cases = _cases(expr)
    return len(cases) > 1 and all(sympy.simplify(case) == 0 for case in cases)


def _cases(expr: sympy.Expr, depth: int = 4) -> list[sympy.Expr]:
    """expr split on the conditions of its selections (`depth` of them at most), each case with
    its condition decided; an equality that holds substitutes its symbol (smoothing = 0)."""
    conditions = sorted({condition for piece in expr.atoms(sympy.Piecewise)
                         for _, condition in piece.args if condition not in (sympy.true,
                                                                             sympy.false)},
                        key=sympy.default_sort_key)
    if not conditions or depth == 0:
        return [expr]
    condition = conditions[0]
    holds = expr.xreplace({condition: sympy.true})
    if isinstance(condition, sympy.Eq) and isinstance(condition.lhs, sympy.Symbol):
        holds = holds.subs(condition.lhs, condition.rhs)
    fails = expr.xreplace({condition: sympy.false})
    return _cases(holds, depth - 1) + _cases(fails, depth - 1)

"""From raw adjoints to a backward kernel's math, written only in what the forward saved.

Three passes, each a verb:
- `pivot`: write every elementwise input in terms of the normalised value a pure elementwise
  definition makes of it (x = mean + x_hat / rstd), so sums regroup into the textbook form;
- `resolve`: every value the backward still needs and the forward did not save is solved for
  from a saved value (var from rstd, x_hat from the output y), or else recomputed;
- `name_reductions`: each remaining Σ_j becomes a named row reduction of the backward kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from derive.algebra import (
    Algebra,
    GuardedReciprocal,
    RowSum,
    expand_sums,
    into_selections,
    needless_guards,
    sorted_symbols,
    substitute,
    surely_nonzero,
)
from derive.forward import extras
from derive.graph import ColumnParam, Definition, RowGraph
from derive.reverse import DerivationError, ReverseResult, upstream_symbol
from derive.spec import REGENERATED, Kind, Level, N, Node, OpSpec, Rounded, is_language_power


@dataclass(frozen=True)
class Resolution:
    """How the backward obtains one value the forward did not save."""

    name: str
    how: str  # "solved" | "recomputed" | "inverted"
    expr: sympy.Expr


@dataclass(frozen=True)
class BackwardResult:
    graph: RowGraph
    gradients: tuple[tuple[str, sympy.Expr], ...]
    pivots: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    resolutions: tuple[Resolution, ...]
    reductions: tuple[tuple[str, sympy.Expr], ...]


def gradient_name(name: str) -> str:
    return "d" + name


def differentiable_nodes(spec: OpSpec) -> list[Node]:
    """Inputs with a gradient, then parameters, in spec order."""
    return [n for kinds in ((Kind.INPUT,), (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM))
            for n in spec.nodes if n.kind in kinds and n.grad]


def derive_backward(spec: OpSpec, algebra: Algebra, reverse: ReverseResult,
                    saved: list[str]) -> BackwardResult:
    differentiable = differentiable_nodes(spec)
    targets = {n.name: reverse.adjoints.get(n.name, sympy.Integer(0)) for n in differentiable}
    pivots = pivot_table(spec, algebra)
    targets = {name: pivoted(expr, dict(pivots)) for name, expr in targets.items()}
    basis_algebra = Algebra(algebra.levels)
    for node in spec.nodes:
        if node.kind is Kind.REDUCE and node.reduction in ("sum", "mean"):
            value = node.symbol * (N if node.reduction == "mean" else 1)
            basis_algebra.learn(pivoted(node.expr, dict(pivots)), value)
    targets = {name: tidy(basis_algebra.normalize(expr), algebra.varies)
               for name, expr in targets.items()}
    targets, resolutions = resolve(spec, basis_algebra, targets, saved, reverse.partners)
    targets = {name: basis_algebra.normalize(expr) for name, expr in targets.items()}
    merged = {name: merge_sums(expr, algebra) for name, expr in targets.items()}
    # Merging moves row-invariant factors (scalar parameters included) inside sums; where that
    # leaves more distinct sums than the split form (t·Σ dp·p beside Σ dp·p·t, or a·Σ dy·x +
    # b·Σ dy·x² merged beside both), the split form is kept: fewer reductions either way.
    if _distinct_sums(merged) <= _distinct_sums(targets):
        targets = merged
    targets, reductions = name_reductions(targets, algebra)
    gradients = tuple((name, tidy(expr, algebra.varies)) for name, expr in targets.items())
    graph = backward_graph(spec, reverse, gradients, resolutions, reductions, saved,
                           reverse.partners)
    return BackwardResult(graph, gradients, tuple(pivots), tuple(resolutions), tuple(reductions))


def pivot_table(spec: OpSpec, algebra: Algebra) -> list[tuple[sympy.Symbol, sympy.Expr]]:
    """u -> g(e) for every pure elementwise definition e = f(u, row scalars) with a unique
    rational inverse. Later pivots rewrite earlier ones (x -> e -> p for softmax)."""
    pivots: list[tuple[sympy.Symbol, sympy.Expr]] = []
    for node in spec.nodes:
        if node.kind is not Kind.ELEMENT:
            continue
        varying = [s for s in sorted_symbols(node.expr.free_symbols) if algebra.varies(s)]
        if len(varying) != 1 or algebra.levels[varying[0]] is not Level.ELEMENT:
            continue
        # only rational inverses are worth a pivot (through a rounding: `unrounded`)
        if _has_functions(unrounded(node.expr), algebra):
            continue
        solutions = solve_for(node.symbol, node.expr, varying[0])
        if len(solutions) == 1 and not _has_functions(solutions[0], algebra) \
                and not _divides_by_possible_zero(solutions[0]):
            pivots = [(u, substitute(g, {varying[0]: solutions[0]})) for u, g in pivots]
            pivots.append((varying[0], solutions[0]))
    return pivots


def pivoted(expr: sympy.Expr, pivots: dict[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """expr with the pivots substituted everywhere but in its selections' conditions: a test
    of x at a tie (Eq(w·x, 0)) stays one of x, where x = m + (2x - 2m)/2, rounded, is no
    longer exactly 0 (docs/spec_language.md, the gradient at a kink)."""
    if isinstance(expr, sympy.Piecewise):
        return sympy.Piecewise(*((pivoted(value, pivots), condition)
                                 for value, condition in expr.args))
    if not expr.args:
        return pivots.get(expr, expr)
    return expr.func(*(pivoted(arg, pivots) for arg in expr.args))


def _divides_by_possible_zero(expr: sympy.Expr) -> bool:
    """Whether expr divides by a value not known to be nonzero (a learnable scale that may be 0:
    t = y / alpha). A pivot is a rewrite, not a necessity: without it the backward keeps the
    value it has, where the division would give NaN at alpha = 0 (rstd, declared positive,
    divides safely)."""
    return any(isinstance(e, sympy.Pow) and e.exp.is_negative and e.base.is_zero is not False
               for e in sympy.preorder_traversal(expr))


def resolve(spec: OpSpec, algebra: Algebra, targets: dict[str, sympy.Expr], saved: list[str],
            partners: tuple[tuple[str, str, str], ...] = ()
            ) -> tuple[dict[str, sympy.Expr], list[Resolution]]:
    """Make every value the gradients use available to the backward (see module doc)."""
    available = set(saved) | {n.name for n in spec.nodes if n.kind in (
        Kind.COLUMN_PARAM, Kind.SCALAR_PARAM, Kind.SCALAR, *REGENERATED)}
    available |= {upstream_symbol(name).name for name in spec.outputs}
    # a partner read is a load of its tensor at other columns: there where that tensor is
    available |= {name for name, source, _ in partners if source in available}
    resolutions: list[Resolution] = []
    order = {node.name: index for index, node in enumerate(spec.nodes)}
    while True:
        defined = available | {r.name for r in resolutions}
        exprs = list(targets.values()) + [r.expr for r in resolutions]
        missing = sorted({s.name for e in exprs for s in e.free_symbols if s != N} - defined,
                         key=lambda name: order[name])
        if not missing:
            break
        node = spec.node(missing[0])
        if node.kind is Kind.PARTNER:
            raise DerivationError(
                f"{node.where}: the backward reads '{node.partner_of}' at the partner column "
                f"('{node.name}'), but the spec saves {', '.join(saved) or 'nothing'}: save "
                f"'{node.partner_of}'.")
        solved = _solve_from_saved_row(spec, node, available)
        if solved is not None:
            replacement = {node.symbol: solved}
            targets = {k: substitute(unrounded_in(v, node.symbol), replacement)
                       for k, v in targets.items()}
            resolutions = [Resolution(r.name, r.how,
                                      substitute(unrounded_in(r.expr, node.symbol), replacement))
                           for r in resolutions]
            resolutions.append(Resolution(node.name, "solved", solved))
            continue
        if _recomputable(spec, node.name, defined):
            resolutions.append(Resolution(node.name, "recomputed", node.expr))
            continue
        inverted = _invert_from_saved_element(spec, node, available)
        if inverted is None:
            raise DerivationError(
                f"{node.where}: the backward needs '{node.name}', but the spec saves "
                f"{', '.join(saved) or 'nothing'}, from which it can neither be recomputed "
                "nor solved for. Save it, or save a value that determines it.")
        resolutions.append(Resolution(node.name, "inverted",
                                      guard_parameter_division(spec, inverted)))
    recomputed = [r for r in resolutions if r.how != "solved"]
    recomputed.sort(key=lambda r: order[r.name])
    return targets, [r for r in resolutions if r.how == "solved"] + recomputed


def _recomputable(spec: OpSpec, name: str, available: set[str]) -> bool:
    """name follows from saved values by re-running forward definitions alone."""
    if name in available or name == N.name:
        return True
    node = spec.node(name)
    if not node.is_definition:
        return False
    return all(_recomputable(spec, s.name, available) for s in node.expr.free_symbols)


def _solve_from_saved_row(spec: OpSpec, node: Node, available: set[str]) -> sympy.Expr | None:
    """A row scalar from a saved row definition that uses it: var = 1/rstd**2 - eps."""
    if node.level is not Level.ROW:
        return None
    for other in spec.nodes:
        if other.kind is not Kind.ROW or other.name not in available:
            continue
        if node.symbol not in other.expr.free_symbols:
            continue
        if any(s.name not in available and s != node.symbol and s != N
               for s in other.expr.free_symbols):
            continue
        solutions = solve_for(other.symbol, other.expr, node.symbol)
        if len(solutions) == 1:
            return solutions[0]
    return None


def _invert_from_saved_element(spec: OpSpec, node: Node, available: set[str]
                               ) -> sympy.Expr | None:
    """An elementwise value from a saved later definition: x_hat = (y - bias) / weight."""
    for other in spec.nodes:
        if other.kind is not Kind.ELEMENT or other.name not in available:
            continue
        if node.symbol not in other.expr.free_symbols:
            continue
        solutions = solve_for(other.symbol, other.expr, node.symbol)
        if len(solutions) == 1:
            return solutions[0]
    return None


def unrounded(expr: sympy.Expr) -> sympy.Expr:
    """expr with its roundings to the input's dtype (`Rounded`) taken as the values they round,
    for inverting it: what an inverse is taken from is a value of that dtype already (a saved
    output), or one a rounding away from it, which the backward's own rounding to that dtype
    matches (y = rd(x_hat) * w gives x_hat = y / w; x_hat = rd(x * rstd), x = x_hat / rstd).
    A switch between a value and its rounding is then that value."""
    return _single_branches(expr.replace(lambda e: isinstance(e, Rounded), lambda e: e.args[0]))


def unrounded_in(expr: sympy.Expr, symbol: sympy.Symbol) -> sympy.Expr:
    """expr with the roundings of values that depend on `symbol`, a row value the backward
    solves for from a saved one (`unrounded`), taken as the values they round. The solution
    is the unrounded forward's (mean_square = 1/rstd**2 - eps), taken from a saved value that
    the forward rounded already: a rounding of what is recovered would round a value
    reconstructed from a rounded one, where torch's autograd evaluates a rounded step's
    derivative at its saved, rounded result (rsqrt's backward: -rstd**3 / 2)."""
    if not expr.has(Rounded):
        return expr
    expr = expr.replace(lambda e: isinstance(e, Rounded) and symbol in e.args[0].free_symbols,
                        lambda e: e.args[0])
    return _single_branches(expr.replace(lambda e: isinstance(e, sympy.Add),
                                         _merged_switches))


def _single_branches(expr: sympy.Expr) -> sympy.Expr:
    """expr with each Piecewise whose branches are one value taken as that value."""
    return expr.replace(lambda e: isinstance(e, sympy.Piecewise)
                        and len({value for value, _ in e.args}) == 1,
                        lambda e: e.args[0][0])


def _merged_switches(add: sympy.Add) -> sympy.Expr:
    """A sum whose Piecewise terms on the same conditions are one Piecewise of their branch
    sums: Piecewise((0, c), (t, True)) + Piecewise((t, c), (0, True)) is t once the branches
    agree."""
    groups: dict[tuple, list[sympy.Piecewise]] = {}
    rest = []
    for term in add.args:
        if isinstance(term, sympy.Piecewise):
            groups.setdefault(tuple(c for _, c in term.args), []).append(term)
        else:
            rest.append(term)
    if all(len(terms) == 1 for terms in groups.values()):
        return add
    merged = [terms[0] if len(terms) == 1 else _single_branches(sympy.Piecewise(*(
        (sympy.Add(*(t.args[i][0] for t in terms)), condition)
        for i, condition in enumerate(conditions))))
        for conditions, terms in groups.items()]
    return sympy.Add(*rest, *merged)


def solve_for(symbol: sympy.Symbol, expr: sympy.Expr, unknown: sympy.Symbol) -> list[sympy.Expr]:
    """The solutions of symbol = expr for unknown; none when SymPy has no algorithm for it.

    A value the forward rounds to the input's dtype (`Rounded`) is solved for as if unrounded
    (`unrounded`)."""
    expr = unrounded(expr)
    try:
        solutions = list(sympy.solve(sympy.Eq(symbol, expr), unknown, dict=False))
    except NotImplementedError:
        return []
    # a solution undefined somewhere (nan where a clamp max(norm, eps) takes its floor and
    # forgets norm) inverts one branch only: the value is not determined there; one through a
    # power the kernels do not take (s = r**(2/3) from r = s**(3/2)) is no use to them
    if any(s.has(sympy.nan, sympy.zoo) or any(
            not p.is_number and not is_language_power(p.exp) for p in s.atoms(sympy.Pow))
           for s in solutions):
        return []
    return solutions


def merge_sums(expr: sympy.Expr, algebra: Algebra) -> sympy.Expr:
    """Undo what linearity split apart: sums multiplied by the same non-constant factor merge
    into one, constants moving inside (Σ dy·w·x̂ + c·Σ dy·x̂ = Σ dy·x̂·(w + c))."""
    groups: dict[sympy.Expr, list[sympy.Expr]] = {}
    rest = sympy.Integer(0)
    for term in sympy.Add.make_args(expand_sums(expr)):
        factors = sympy.Mul.make_args(term)
        sums = [f for f in factors if isinstance(f, RowSum)]
        if len(sums) != 1:
            rest += term
            continue
        constant = sympy.Mul(*(f for f in factors if f is not sums[0] and _is_constant(f, algebra)))
        key = sympy.Mul(*(f for f in factors if f is not sums[0]
                          and not _is_constant(f, algebra)))
        groups.setdefault(key, []).append(constant * sums[0].args[0])
    merged = rest
    for key in sorted(groups, key=sympy.default_sort_key):
        combined = sympy.Add(*groups[key])
        if len(groups[key]) > 1:
            combined = sympy.factor(combined)
        coefficient, body = sympy.factor_terms(combined).as_coeff_Mul()
        merged += coefficient * key * RowSum(body)
    return merged


def _distinct_sums(targets: dict[str, sympy.Expr]) -> int:
    return len({atom for expr in targets.values() for atom in expr.atoms(RowSum)})


def _is_constant(expr: sympy.Expr, algebra: Algebra) -> bool:
    # N stays outside: a sum divided once per row, not each element once.
    return all(s != N and algebra.levels.get(s) is Level.SCALAR for s in expr.free_symbols)


def name_reductions(targets: dict[str, sympy.Expr], algebra: Algebra
                    ) -> tuple[dict[str, sympy.Expr], list[tuple[str, sympy.Expr]]]:
    """Replace each Σ_j body by a row symbol named after the body's factors."""
    atoms = sorted({a for e in targets.values() for a in e.atoms(RowSum)},
                   key=sympy.default_sort_key)
    reductions: list[tuple[str, sympy.Expr]] = []
    replacement: dict[sympy.Expr, sympy.Symbol] = {}
    for atom in atoms:
        name = reduction_name(atom.args[0], {n for n, _ in reductions})
        symbol = sympy.Symbol(name, real=True)
        algebra.levels[symbol] = Level.ROW
        replacement[atom] = symbol
        reductions.append((name, atom.args[0]))
    return {k: v.xreplace(replacement) for k, v in targets.items()}, reductions


def reduction_name(body: sympy.Expr, taken: set[str]) -> str:
    parts = []
    for factor in sorted(sympy.Mul.make_args(body), key=sympy.default_sort_key):
        base, exponent = factor.as_base_exp()
        if isinstance(base, sympy.Symbol) and exponent.is_Integer and exponent > 0:
            parts.append(base.name + (str(exponent) if exponent != 1 else ""))
        elif isinstance(base, sympy.Add) and exponent == 1:
            parts.append("_".join(s.name for s in sorted_symbols(base.free_symbols)))
        elif not factor.is_Number:
            parts.append("term")
    name = "sum_" + "_".join(parts)
    candidate, index = name, 2
    while candidate in taken:
        candidate, index = f"{name}{index}", index + 1
    return candidate


def tidy(expr: sympy.Expr, varies: Callable[[sympy.Expr], bool]) -> sympy.Expr:
    """The cheapest of a few equivalent forms (by operation count): expanded with common
    factors pulled out suits sums of reductions; elementwise chains are cheaper left nested."""
    expanded = sympy.factor_terms(expand_sums(expr))
    candidates = [expanded, sympy.factor_terms(expr), expr]
    chosen = min(candidates, key=sympy.count_ops)
    selections = into_selections(denominators_into_sums(chosen))
    return hoist_zero_branches(needless_guards(selections, varies))


def denominators_into_sums(expr: sympy.Expr) -> sympy.Expr:
    """(c·u + q) / q written back as c/q·u + 1, as the spec had it: pulling common factors out
    clears a sum's denominators, which scales its terms by q (200000 in GELU's
    1 + 0.134145·z², whose 26829·z² then overflows at |z| = 1.1e17, not with z² at 1.8e19)."""
    def cleared(e: sympy.Expr) -> bool:
        if not isinstance(e, sympy.Mul):
            return False
        coefficient = e.as_coeff_Mul()[0]
        return coefficient.is_Rational and coefficient.q > 1 and any(
            isinstance(f, sympy.Add) and coefficient.q in f.args for f in e.args)

    def restore(e: sympy.Mul) -> sympy.Expr:
        coefficient, rest = e.as_coeff_Mul()
        total = next(f for f in sympy.Mul.make_args(rest)
                     if isinstance(f, sympy.Add) and coefficient.q in f.args)
        others = sympy.Mul(*(f for f in sympy.Mul.make_args(rest) if f is not total))
        scaled = sympy.Add(*(term / coefficient.q for term in total.args))
        return coefficient.p * others * scaled

    return expr.replace(cleared, restore)


def hoist_zero_branches(expr: sympy.Expr) -> sympy.Expr:
    """Piecewise((0, c), (rest, True)) when the whole expression vanishes under condition c:
    one test instead of one per term, and the 0 is exact whatever `rest` holds (NaN logits of
    an ignored row give a zero gradient, not 0 * NaN)."""
    for piece in sorted(expr.atoms(sympy.Piecewise), key=sympy.default_sort_key):
        value, condition = piece.args[0]
        if value != 0 or condition == sympy.true:
            continue
        holds = expr.xreplace({condition: sympy.true})
        if not surely_nonzero(holds) and sympy.simplify(holds) == 0:
            rest = hoist_zero_branches(expr.xreplace({condition: sympy.false}))
            return sympy.Piecewise((0, condition), (rest, True))
    return expr


def backward_graph(spec: OpSpec, reverse: ReverseResult,
                   gradients: tuple[tuple[str, sympy.Expr], ...],
                   resolutions: list[Resolution] | tuple[Resolution, ...],
                   reductions: list[tuple[str, sympy.Expr]], saved: list[str],
                   partners: tuple[tuple[str, str, str], ...] = ()) -> RowGraph:
    used = {s.name for _, e in gradients for s in e.free_symbols}
    used |= {s.name for r in resolutions if r.how != "solved" for s in r.expr.free_symbols}
    used |= {s.name for _, body in reductions for s in body.free_symbols}
    # a partner read loads its tensor: the kernel takes that tensor
    read = [(name, source, pairing) for name, source, pairing in partners if name in used]
    used |= {source for _, source, _ in read}
    recomputed = [r for r in resolutions if r.how != "solved"]
    defined = {r.name for r in recomputed}
    definitions = []
    for r in recomputed:
        node = spec.node(r.name)
        if r.how == "recomputed" and node.kind is Kind.REDUCE:
            scale = 1 / N if node.reduction == "mean" else sympy.Integer(1)
            reduction = node.reduction if node.reduction in ("max", "min") else "sum"
            definitions.append(Definition(r.name, "row", r.expr, reduction, scale))
        else:
            definitions.append(Definition(r.name, node.level.value if node.level is Level.ROW
                                          else "element", r.expr))
    definitions += [Definition(name, "row", body, "sum") for name, body in reductions]
    upstream = [s.name for name, s in reverse.upstream.items()
                if spec.node(name).level is Level.ELEMENT]
    row_upstream = [s.name for name, s in reverse.upstream.items()
                    if spec.node(name).level is Level.ROW]
    element_inputs = [n.name for n in spec.nodes if n.name in saved and
                      n.level is Level.ELEMENT and n.name in used and n.name not in defined]
    row_inputs = row_upstream + [n.name for n in spec.nodes if n.name in saved and
                                 n.level is Level.ROW and n.name in used and n.name not in defined]
    columns = [ColumnParam(n.name, n.absent) for n in spec.nodes
               if n.kind is Kind.COLUMN_PARAM]
    scalars = [n.name for n in spec.nodes if n.kind is Kind.SCALAR and n.name in used]
    kinds = {n.name: n.kind for n in spec.nodes}
    return RowGraph(
        element_inputs=tuple([u for u in upstream] + element_inputs),
        column_inputs=tuple(columns),
        row_inputs=tuple(row_inputs),
        scalars=tuple(scalars),
        definitions=tuple(definitions),
        element_outputs=tuple((gradient_name(k), e) for k, e in gradients
                              if kinds[k] is Kind.INPUT),
        row_outputs=(),
        column_outputs=tuple((gradient_name(k), k, e) for k, e in gradients
                             if kinds[k] is Kind.COLUMN_PARAM),
        element_absent=tuple((u, sympy.Integer(0)) for u in upstream[1:]),
        scalar_inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.SCALAR_PARAM),
        scalar_outputs=tuple((gradient_name(k), k, e) for k, e in gradients
                             if kinds[k] is Kind.SCALAR_PARAM),
        **_with_partners(extras(spec), read),
    )


def _with_partners(shared: dict[str, tuple], read: list[tuple[str, str, str]]
                   ) -> dict[str, tuple]:
    """The kernels' shared extras with the backward's partner reads, those of upstream
    gradients included (which are no values of the spec)."""
    names = [name for name, _ in shared["generated"]]
    return {**shared,
            "generated": shared["generated"] + tuple((name, "partner") for name, _, _ in read
                                                     if name not in names),
            "partners": tuple(read)}


def guard_parameter_division(spec: OpSpec, expr: sympy.Expr) -> sympy.Expr:
    """Every division by a learnable value (a per-column weight, a learnable scalar) guarded:
    either may be 0, where the plain inversion gives NaN."""
    params = {n.symbol for n in spec.nodes if n.kind in (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)}

    def is_division(e: sympy.Expr) -> bool:
        return (isinstance(e, sympy.Pow) and bool(e.base.free_symbols & params)
                and e.exp.is_Integer and e.exp < 0)

    return expr.replace(is_division, lambda e: GuardedReciprocal(e.base) ** (-e.exp))


def _has_functions(expr: sympy.Expr, algebra: Algebra) -> bool:
    """A function of an elementwise value (a function of row scalars is a row constant)."""
    # A root is a function too: its inverse holds only on one branch (x·sqrt(x² + 1) = e has
    # one solution for x >= 0 only), so it is never a pivot.
    return any((isinstance(sub, sympy.Function) or
                (isinstance(sub, sympy.Pow) and not sub.exp.is_Integer)) and algebra.varies(sub)
               for sub in sympy.preorder_traversal(expr))

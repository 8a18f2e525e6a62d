"""One sweep for two passes: reductions of pass k + 1 that a running accumulator can carry in
pass k's sweep over a looped row.

A looped row is read from memory once per pass. Two dependent reductions need two passes as
written (the second needs the first's value), but some shapes of them can be carried together
per lane and combined at the end of one sweep, as torch and inductor do by hand:

- a centred second moment after a mean, `mean = 1/N Σ b`, `v = s Σ (b - mean)^2`: each lane
  keeps a running mean and sum of squared deviations (Welford), and the lanes merge by the
  parallel-variance formula (Chan et al.): the row's mean from the lanes' means, then each
  lane's squared deviations plus its count times its mean's squared deviation. No sum of
  squares, so no cancellation when the mean dwarfs the spread; the merge is a plain sum, a
  tree on the GPU;
- a sum of exponentials shifted by a max, `m = max_j g`, `d = s Σ A exp(g - m)` (A free of m):
  the row's running max (each step's tile max joins it) and each lane's sum, rescaled once a
  step when that max grows (the online softmax): one exponential an element, and the lanes
  share the max, so they merge by a plain sum.

- a sum affine in a max, `m = max_j g`, `t = s Σ (A·m + B)` (A and B free of m; the gaps
  below the max, Σ w·(m - g)): each lane's sum at the running max, and its sum of the slopes
  A, which moves that sum along when the max grows: `t += ΣA · (m' - m)`. Every term is then
  taken at the max seen so far, as the two passes take it at the row's: gaps ≥ 0, no sum of
  the g themselves to cancel (Σ A·m - Σ A·g would round at the scale of g), and a gap to a
  -inf is +inf, not inf - inf;

- the first column where a row reaches its max, `m = max_j g`, `f = min_j (v where g >= m,
  else c)` (an argmax, torch's first index of the max): each lane's least candidate at the
  running max, dropped whenever that max changes (every earlier candidate then falls short
  of it), so that at the end the lanes hold the candidates at the row's max alone.

Persistent rows hold the whole row in registers, so their passes cost no memory and are left
as they are. Anything else keeps its own pass. The looped kernel has both forms of a joined
sweep; its ONE_SWEEP constexpr (the schedule's choice: long rows, ONE_SWEEP_MIN_N)
picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from codegen.ir import Assign, Kernel, Pass, RowReduce


@dataclass(frozen=True)
class Moments:
    """mean = 1/N Σ body and second = scale Σ (body - mean)^2, carried in one sweep."""

    mean: RowReduce
    second: RowReduce


@dataclass(frozen=True)
class OnlineExp:
    """peak = max_j g and total = scale Σ factor·exp(g - peak), carried in one sweep."""

    peak: RowReduce
    total: RowReduce
    factor: sympy.Expr


@dataclass(frozen=True)
class OnlineFirst:
    """peak = max_j g and first = min_j Piecewise((value, peak <= g), (other, True)), carried
    in one sweep (the peak's running max shared with an OnlineExp of it, if any)."""

    peak: RowReduce
    first: RowReduce
    value: sympy.Expr
    other: sympy.Expr


@dataclass(frozen=True)
class OnlineGap:
    """peak = max_j g and total = scale Σ (slope·peak + rest), slope and rest free of the peak,
    carried in one sweep (on the peak's running max, shared with its other pairs)."""

    peak: RowReduce
    total: RowReduce
    slope: sympy.Expr


Fused = Moments | OnlineExp | OnlineFirst | OnlineGap


@dataclass(frozen=True)
class Sweep:
    """One read of the row: element work, then accumulators of every kind, then row assigns.

    `reductions` are plain ones; `fused` pair each reduction of a joined pass with its partner
    of the pass before; `after` are the row assigns of both passes, in order."""

    loads: tuple[str, ...]
    assigns: tuple[Assign, ...]
    reductions: tuple[RowReduce, ...]
    fused: tuple[Fused, ...]
    after: tuple[Assign, ...]
    joined: tuple[int, ...]  # the pass numbers (from 1) this sweep carries


def sweeps(kernel: Kernel) -> tuple[Sweep, ...]:
    """The looped kernel's sweeps: each pass, with the next one joined where it can be."""
    result: list[Sweep] = []
    passes = list(kernel.passes)
    index = 0
    while index < len(passes):
        first = passes[index]
        second = passes[index + 1] if index + 1 < len(passes) else None
        carried = _fusible(first, second) if second is not None else None
        if carried is None:
            result.append(Sweep(first.loads, first.assigns, first.reductions, (), first.after,
                                (index + 1,)))
            index += 1
            continue
        fused, plain = carried
        partners = {id(f.mean if isinstance(f, Moments) else f.peak) for f in fused}
        dependent = _dependent(second, {r.name for r in first.reductions})
        assigns = first.assigns + tuple(
            a for a in second.assigns
            if a.name not in dependent and a.name not in {b.name for b in first.assigns})
        result.append(Sweep(
            loads=tuple(sorted(set(first.loads) | set(second.loads))),
            assigns=assigns,
            reductions=tuple(r for r in first.reductions if id(r) not in partners) + plain,
            fused=fused,
            after=first.after + second.after,
            joined=(index + 1, index + 2)))
        index += 2
    return tuple(result)


def _dependent(step: Pass, names: set[str]) -> set[str]:
    """The element assigns of a pass that use (directly or not) one of `names`."""
    dependent = set(names)
    for a in step.assigns:
        if {s.name for s in a.expr.free_symbols} & dependent:
            dependent.add(a.name)
    return dependent - names


def _inline(expr: sympy.Expr, step: Pass, names: set[str]) -> sympy.Expr:
    """expr with the pass's assigns that depend on `names` written out."""
    dependent = _dependent(step, names)
    by_name = {a.name: a.expr for a in step.assigns if a.name in dependent}
    while any(s.name in by_name for s in expr.free_symbols):
        expr = expr.xreplace({s: by_name[s.name] for s in expr.free_symbols
                              if s.name in by_name})
    return expr


def _fusible(first: Pass, second: Pass
             ) -> tuple[tuple[Fused, ...], tuple[RowReduce, ...]] | None:
    """Each reduction of `second` carried with its partner in `first`, and those that use no
    value of `first` (a one-hot sum they used is read as one element before the sweep) as plain
    ones; or None when any one can't be (or when `second` uses a row value of `first` another
    way)."""
    earlier = {r.name: r for r in first.reductions}
    after = {a.name for a in first.after}
    fused: list[Fused] = []
    plain: list[RowReduce] = []
    for r in second.reductions:
        body = _inline(r.body, second, set(earlier))
        names = {s.name for s in body.free_symbols}
        if names & after:
            return None
        if not names & set(earlier):
            plain.append(r)
            continue
        if len(names & set(earlier)) != 1:
            return None
        partner = earlier[(names & set(earlier)).pop()]
        symbol = next(s for s in body.free_symbols if s.name == partner.name)
        pair = (_moments(partner, r, body, symbol) or _online_exp(partner, r, body, symbol)
                or _online_first(partner, r, body, symbol)
                or _online_gap(partner, r, body, symbol))
        if pair is None:
            return None
        fused.append(pair)
    # an argmax and a sum affine in the max ride along on its peak's running max: any number
    # of them a peak
    paired = [f for f in fused if isinstance(f, Moments | OnlineExp)]
    if len({id(f.mean if isinstance(f, Moments) else f.peak) for f in paired}) != len(paired):
        return None  # one partner, two fused reductions: not a shape carried here
    return (tuple(fused), tuple(plain)) if fused else None


def _moments(mean: RowReduce, second: RowReduce, body: sympy.Expr,
             symbol: sympy.Symbol) -> Moments | None:
    if mean.op != "sum" or second.op != "sum":
        return None
    n = [s for s in mean.scale.free_symbols if s.name == "N"]
    if len(n) != 1 or sympy.simplify(mean.scale * n[0] - 1) != 0:
        return None
    if symbol in mean.body.free_symbols or symbol in second.scale.free_symbols:
        return None
    if sympy.expand(body - (mean.body - symbol) ** 2) != 0:
        return None
    return Moments(mean, RowReduce(second.name, second.op, body, second.scale))


def _sum_after_max(peak: RowReduce, total: RowReduce, symbol: sympy.Symbol) -> bool:
    """Whether `total` is a sum that may ride on `peak`, a plain row max, in its sweep: only
    its body (not its scale) reads the max's value `symbol`."""
    return (peak.op == "max" and total.op == "sum" and peak.scale == 1
            and symbol not in peak.body.free_symbols
            and symbol not in total.scale.free_symbols)


def _online_exp(peak: RowReduce, total: RowReduce, body: sympy.Expr,
                symbol: sympy.Symbol) -> OnlineExp | None:
    if not _sum_after_max(peak, total, symbol):
        return None
    factor = sympy.powsimp(sympy.expand(body * sympy.exp(symbol - peak.body)), combine="exp")
    # an exponential left in the factor could overflow where the shifted one can't
    if symbol in factor.free_symbols or factor.has(sympy.exp, sympy.zoo, sympy.nan):
        return None
    return OnlineExp(peak, RowReduce(total.name, total.op, body, total.scale), factor)


def _online_first(peak: RowReduce, first: RowReduce, body: sympy.Expr,
                  symbol: sympy.Symbol) -> OnlineFirst | None:
    if peak.op != "max" or first.op != "min" or peak.scale != 1 or first.scale != 1:
        return None
    if not isinstance(body, sympy.Piecewise) or len(body.args) != 2 or body.args[1][1] is not \
            sympy.true:
        return None
    (value, condition), (other, _) = body.args
    if condition not in (sympy.Le(symbol, peak.body), sympy.Ge(peak.body, symbol)):
        return None
    if symbol in value.free_symbols or symbol in other.free_symbols \
            or symbol in peak.body.free_symbols:
        return None
    return OnlineFirst(peak, RowReduce(first.name, first.op, body, first.scale), value, other)


def _online_gap(peak: RowReduce, total: RowReduce, body: sympy.Expr,
                symbol: sympy.Symbol) -> OnlineGap | None:
    if not _sum_after_max(peak, total, symbol):
        return None
    slope = body.diff(symbol)
    if slope == 0 or symbol in slope.free_symbols \
            or symbol in sympy.expand(body - slope * symbol).free_symbols:
        return None
    return OnlineGap(peak, RowReduce(total.name, total.op, body, total.scale), slope)


@dataclass(frozen=True)
class Pick:
    """name = scale · Σ_j (body_j where j == index, else 0): one element of the row, read at
    column `index` (a row input) instead of summed over every column."""

    name: str
    index: str
    body: sympy.Expr
    scale: sympy.Expr
    loads: tuple[str, ...]
    #: column inputs read at column `index` (a class weight)
    columns: tuple[str, ...] = ()


def picks(kernel: Kernel) -> tuple[Kernel, tuple[Pick, ...]]:
    """The kernel without its one-hot sums, and those sums as gathers.

    `Σ_j Piecewise((e, Eq(j, t)), (0, True))` with j the column index and t an integer row
    input is e at column t when 0 <= t < N, else 0: one load a row instead of a compare,
    select and add per element (cross-entropy's target logit: 7 of the 13 instructions an
    element of its first sweep, sm_90 SASS; its target's class weight). Kept as a sum where e
    needs more than element inputs, column inputs, scalars and row values, or where its pass
    would be left with no reduction."""
    index = {name for name, kind in kernel.generated if kind == "column_index"}
    rows = {t.name for t in kernel.inputs if t.level == "row" and t.integer}
    plain = {t.name for t in kernel.inputs if t.level == "element"
             and not t.optional and not t.broadcast}
    columns = {t.name for t in kernel.inputs if t.level == "column"}
    known = (plain | columns | {t.name for t in kernel.inputs if t.level in ("row", "scalar")}
             | set(kernel.scalars) | {a.name for a in kernel.prologue} | {"N"})
    found: list[Pick] = []
    passes = []
    for step in kernel.passes:
        # element values of the pass, in terms of what the kernel reads: a one-hot sum of one
        # (capped logits) is that value at the row's column, computed from the gathered inputs
        elements: dict[str, sympy.Expr] = {}
        for a in step.assigns:
            if a.level == "element":
                elements[a.name] = _inlined(a.expr, elements)
        kept = []
        for r in step.reductions:
            pick = _pick(replace(r, body=_inlined(r.body, elements)), index, rows, known, plain,
                         columns)
            if pick is None:
                kept.append(r)
            else:
                found.append(pick)
        if not kept:  # the pass would have nothing to sweep for: leave it whole
            found = [p for p in found if p.name not in {r.name for r in step.reductions}]
            kept = list(step.reductions)
        passes.append(Pass(step.loads, step.assigns, tuple(kept), step.after))
    if not found:
        return kernel, ()
    return replace(kernel, passes=tuple(passes)), tuple(found)


def _inlined(expr: sympy.Expr, elements: dict[str, sympy.Expr]) -> sympy.Expr:
    """`expr` with the element values named in `elements` replaced by their definitions."""
    return expr.xreplace({s: elements[s.name] for s in expr.free_symbols if s.name in elements})


def _pick(r: RowReduce, index: set[str], rows: set[str], known: set[str],
          plain: set[str], columns: set[str]) -> Pick | None:
    if r.op != "sum" or not isinstance(r.body, sympy.Piecewise) or len(r.body.args) != 2:
        return None
    (value, condition), (other, otherwise) = r.body.args
    if other != 0 or otherwise is not sympy.true or not isinstance(condition, sympy.Eq):
        return None
    names = {s.name for s in condition.free_symbols}
    if len(names) != 2 or not names & index or not names & rows:
        return None
    if set(condition.args) != set(condition.free_symbols):
        return None  # Eq(j, t) itself, not of expressions of them
    used = {s.name for s in value.free_symbols}
    if not used <= known or r.scale.free_symbols - {s for s in r.scale.free_symbols
                                                     if s.name in known}:
        return None
    return Pick(r.name, (names & rows).pop(), value, r.scale,
                tuple(sorted(used & plain)), tuple(sorted(used & columns)))

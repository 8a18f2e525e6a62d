"""Lowering: a simplified RowGraph becomes a Kernel in canonical form (see codegen/ir.py).

Steps, in order: keep what the outputs need, give every row value the pass after which it is
known, group the reductions of the same pass into one sweep over the row, and share common
subexpressions of the epilogue.
"""

from __future__ import annotations

import sympy

from codegen.ir import Assign, Kernel, Pass, RowReduce, Store, Tensor
from derive.graph import Definition, RowGraph

ROW_LENGTH = "N"


def lower(graph: RowGraph, name: str, saved: frozenset[str] = frozenset()) -> Kernel:
    definitions = {d.name: d for d in graph.definitions}
    order = {d.name: index for index, d in enumerate(graph.definitions)}
    levels = _levels(graph)
    stores = _stores(graph, saved)
    needed = _needed(stores, definitions)
    depth = _depths(graph, definitions, needed)

    reductions = [d for d in graph.definitions if d.name in needed and d.reduction]
    row_defs = [d for d in graph.definitions
                if d.name in needed and d.level == "row" and not d.reduction]
    pass_count = max((depth[d.name] for d in reductions), default=0)
    prologue = tuple(Assign(d.name, d.expr, "row") for d in row_defs if depth[d.name] == 0)
    passes = []
    for index in range(1, pass_count + 1):
        in_pass = [d for d in reductions if depth[d.name] == index]
        assigns, loads = _element_work([d.expr for d in in_pass], definitions, order, levels)
        passes.append(Pass(
            loads=loads,
            assigns=assigns,
            reductions=tuple(RowReduce(d.name, d.reduction or "sum", d.expr, d.scale)
                             for d in in_pass),
            after=tuple(Assign(d.name, d.expr, "row") for d in row_defs
                        if depth[d.name] == index)))

    element_stores = [s for s in stores if s.level in ("element", "column")]
    assigns, loads = _element_work([s.expr for s in element_stores], definitions, order, levels)
    epilogue_assigns, rewritten = _share_subexpressions(
        assigns, [s.expr for s in element_stores], levels, graph.scalar_absent)
    by_name = {s.name: expr for s, expr in zip(element_stores, rewritten, strict=True)}
    final_stores = tuple(Store(s.name, by_name.get(s.name, s.expr), s.level, s.flag, s.like)
                         for s in stores)
    outputs = tuple(Tensor(s.name, s.level) for s in final_stores)
    epilogue = Pass(loads=loads, assigns=epilogue_assigns, reductions=(), after=())

    absent = dict(graph.element_absent)
    inputs = tuple(Tensor(t, "element", absent.get(t), broadcast=t in graph.broadcast_inputs)
                   for t in graph.element_inputs)
    inputs += tuple(Tensor(p.name, "column", p.absent) for p in graph.column_inputs)
    inputs += tuple(Tensor(t, "scalar") for t in graph.scalar_inputs)
    inputs += tuple(Tensor(t, "row", integer=t in graph.integer_inputs)
                    for t in graph.row_inputs)
    generated = tuple((n, kind) for n, kind in graph.generated if n in needed)
    element_inputs = {t.name for t in inputs if t.level == "element"}
    final_stores, aliases = _alias_identical(final_stores, element_inputs)
    switches = tuple((s, value) for s, value in graph.scalar_absent if s in graph.scalars)
    partners = tuple(p for p in graph.partners if p[0] in needed)
    return Kernel(name, inputs, outputs, graph.scalars, prologue, tuple(passes), epilogue,
                  final_stores, aliases, generated, switches, partners)


def _alias_identical(stores: tuple[Store, ...], element_inputs: set[str]
                     ) -> tuple[tuple[Store, ...], tuple[tuple[str, str], ...]]:
    """An element output equal to an earlier unconditional one is not written twice: it is
    that tensor (dx and dresidual of a fused residual add); one equal to an element input is
    that input (the upstream gradient passed through to a residual)."""
    kept: list[Store] = []
    aliases: list[tuple[str, str]] = []
    for store in stores:
        if (store.level == "element" and store.flag is None
                and isinstance(store.expr, sympy.Symbol) and store.expr.name in element_inputs):
            aliases.append((store.name, store.expr.name))
            continue
        twin = next((k for k in kept if k.level == "element" == store.level
                     and k.flag is None and k.expr == store.expr), None)
        if twin is None:
            kept.append(store)
        else:
            aliases.append((store.name, twin.name))
    return tuple(kept), tuple(aliases)


def _levels(graph: RowGraph) -> dict[str, str]:
    levels = {t: "element" for t in graph.element_inputs}
    levels |= {p.name: "element" for p in graph.column_inputs}
    levels |= {t: "row" for t in graph.row_inputs + graph.scalar_inputs}
    levels |= {s: "row" for s in graph.scalars}
    levels[ROW_LENGTH] = "row"
    levels |= {n: "row" if kind == "row_index" else "element" for n, kind in graph.generated}
    levels |= {d.name: d.level for d in graph.definitions}
    return levels


def _stores(graph: RowGraph, saved: frozenset[str]) -> list[Store]:
    def flag(name: str) -> str | None:
        return f"STORE_{name.upper()}" if name in saved else None

    stores = [Store(n, e, "element", flag(n)) for n, e in graph.element_outputs]
    stores += [Store(n, e, "row", flag(n)) for n, e in graph.row_outputs]
    stores += [Store(n, e, "column", like=param) for n, param, e in graph.column_outputs]
    stores += [Store(n, e, "scalar", like=param) for n, param, e in graph.scalar_outputs]
    return stores


def _needed(stores: list[Store], definitions: dict[str, Definition]) -> set[str]:
    needed: set[str] = set()
    pending = [s.name for st in stores for s in st.expr.free_symbols]
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.add(name)
        if name in definitions:
            pending.extend(s.name for s in definitions[name].expr.free_symbols)
    return needed


def _depths(graph: RowGraph, definitions: dict[str, Definition], needed: set[str]
            ) -> dict[str, int]:
    """The pass after which each value is known: reductions over values known after pass k
    run in pass k + 1."""
    depth: dict[str, int] = {}
    for d in graph.definitions:
        inner = max((depth.get(s.name, 0) for s in d.expr.free_symbols), default=0)
        depth[d.name] = inner + 1 if d.reduction else inner
    return {name: value for name, value in depth.items() if name in needed}


def _element_work(exprs: list[sympy.Expr], definitions: dict[str, Definition],
                  order: dict[str, int], levels: dict[str, str]
                  ) -> tuple[tuple[Assign, ...], tuple[str, ...]]:
    """The element definitions and tensor loads a set of element expressions needs."""
    names: set[str] = set()
    loads: set[str] = set()
    pending = [s.name for e in exprs for s in e.free_symbols]
    while pending:
        name = pending.pop()
        if name in names or name in loads or levels.get(name) != "element":
            continue
        if name in definitions and not definitions[name].reduction:
            names.add(name)
            pending.extend(s.name for s in definitions[name].expr.free_symbols)
        else:
            loads.add(name)
    assigns = tuple(Assign(n, definitions[n].expr, "element")
                    for n in sorted(names, key=order.__getitem__))
    return assigns, tuple(sorted(loads))


def _share_subexpressions(assigns: tuple[Assign, ...], exprs: list[sympy.Expr],
                          levels: dict[str, str],
                          switches: tuple[tuple[str, sympy.Expr], ...] = ()
                          ) -> tuple[tuple[Assign, ...], list[sympy.Expr]]:
    """Common subexpression elimination over the epilogue: its element definitions and its
    outputs together, so that a value the backward prints again inside an output (GeGLU's
    erf(sqrt(2)*gate/2), in the activation it recomputes and in the activation's derivative)
    is evaluated once. Returns the epilogue's assigns (each temporary placed before the first
    definition that uses it) and the outputs rewritten."""
    if not exprs:
        return assigns, exprs
    names = (sympy.Symbol(f"common_{i}", real=True) for i in range(10_000))
    replacements, reduced = sympy.cse([a.expr for a in assigns] + exprs, symbols=names,
                                      optimizations=None)
    # Keep only elementwise temporaries; row-level ones (1/N) print inline at row shape.
    temporaries: list[Assign] = []
    inline: dict[sympy.Symbol, sympy.Expr] = {}
    for symbol, expr in replacements:
        expr = expr.xreplace(inline)
        if any(levels.get(s.name) == "element" for s in expr.free_symbols):
            levels[symbol.name] = "element"
            temporaries.append(Assign(symbol.name, expr, "element"))
        else:
            inline[symbol] = expr
    reduced = [e.xreplace(inline) for e in reduced]
    temporaries = _switched_off(temporaries, reduced, switches)
    # sympy orders the temporaries so that each follows those it uses; a temporary goes before
    # the first definition that uses it, directly or through a later temporary
    result: list[Assign] = []
    placed: set[str] = set()

    def place(needs: set[str]) -> None:
        for temporary in temporaries:
            if temporary.name in needs and temporary.name not in placed:
                place({s.name for s in temporary.expr.free_symbols})
                placed.add(temporary.name)
                result.append(temporary)

    for assign, expr in zip(assigns, reduced, strict=False):
        place({s.name for s in expr.free_symbols})
        result.append(Assign(assign.name, expr, assign.level))
    outputs = reduced[len(assigns):]
    place({s.name for e in outputs for s in e.free_symbols})
    return tuple(result), outputs


def _switched_off(temporaries: list[Assign], uses: list[sympy.Expr],
                  switches: tuple[tuple[str, sympy.Expr], ...]) -> list[Assign]:
    """Temporaries of a scalar that may be off (`OpSpec.scalar(absent=...)`) that are read only
    where it is on, computed only there: `t = Piecewise((0, Eq(s, absent)), (t, True))`, whose
    branch the kernel's constexpr picks. A temporary shared by the branches of a switch (the
    tanh of capped logits and of their derivative) would otherwise be computed, and thrown
    away, for every element of a call with the scalar off."""
    result = []
    for index, temporary in enumerate(temporaries):
        expr = temporary.expr
        symbol = sympy.Symbol(temporary.name, real=True)
        readers = uses + [t.expr for t in temporaries[index + 1:]]
        for name, absent in switches:
            scalar = next((s for s in expr.free_symbols if s.name == name), None)
            if scalar is None:
                continue
            off = sympy.Eq(scalar, absent)
            if not any(_read_when(e, symbol, off) for e in readers):
                expr = sympy.Piecewise((0, off), (expr, True))
        result.append(Assign(temporary.name, expr, temporary.level))
    return result


def _read_when(expr: sympy.Basic, symbol: sympy.Symbol, off: sympy.Basic) -> bool:
    """Whether `expr` may read `symbol` where condition `off` holds (the branches of a
    Piecewise that `off` rules out are skipped; others are assumed reachable)."""
    if expr == symbol:
        return True
    if isinstance(expr, sympy.Piecewise):
        for value, condition in expr.args:
            if condition == off:
                return _read_when(value, symbol, off)  # off: this branch, never a later one
            if condition == sympy.Not(off):
                continue
            if _read_when(value, symbol, off) or _read_when(condition, symbol, off):
                return True
        return False
    return any(_read_when(arg, symbol, off) for arg in expr.args)

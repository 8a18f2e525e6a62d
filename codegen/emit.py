"""Render a derived op into one Python module (Triton kernels, torch path, autograd, API).

Templates hold structure only; every math string comes from a printer. A kernel's facts
(`KernelFacts`: its tensors by role, stores and flags, what it can do) are computed once from
the IR; two views print it: `TritonKernel`, the kernel text, and `TorchPath`, the expressions
the torch path's template writes. Host code (the launchers' statements, autograd, the
torch.library ops, the API, the torch path, tests) is written by the templates alone, and the
launchers' bodies by the runtime (codegen/runtime/launcher.py).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import sympy

from codegen.fuse import Moments, OnlineExp, OnlineFirst, OnlineGap, Sweep, picks, sweeps
from codegen.ir import Assign, Kernel, Pass, RowReduce
from codegen.lower import ROW_LENGTH
from codegen.printers import TORCH, TRITON, Dialect, KernelPrinter, PrintError
from codegen.runtime import amp
from codegen.runtime.launcher import Signature
from codegen.schedule import ScheduleTable, default_table
from derive.api import replaces_kind
from derive.reverse import upstream_symbol
from derive.spec import Rounded

TEMPLATES = Path(__file__).parent / "templates"

#: the column a partner read loads, per pairing (derive/spec.py PAIRINGS), as Triton source
PARTNER_COLUMNS = {"half": "(cols + N // 2) % N", "interleaved": "(cols ^ 1)"}


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["declared"] = declared
    return env


def launcher_signature(k: KernelFacts, kind: str) -> Signature:
    """What the runtime builds kernel `k`'s launcher from (codegen/runtime/launcher.py)."""
    return Signature(
        name=k.name,
        kind=kind,
        inputs=tuple(k.inputs),
        elements=tuple((e, k.element_flags.get(e)) for e in k.element_inputs),
        pointers=tuple([(c["name"], c["flag"]) for c in k.columns]
                       + [(name, None) for name in k.scalar_inputs + k.row_inputs]
                       + [("seed", None)] * k.seeded),
        broadcast=tuple(k.broadcast_inputs),
        scalars=tuple(k.scalars),
        switches=tuple((s["name"], s["absent"], s["flag"]) for s in k.switches),
        element_stores=tuple((s["name"], s["flag"]) for s in k.element_stores),
        row_stores=tuple((s["name"], s["flag"]) for s in k.row_stores),
        column_stores=tuple((s["name"], s["like"], s["flag"]) for s in k.column_stores),
        scalar_stores=tuple((s["name"], s["like"], s["flag"]) for s in k.scalar_stores),
        required_loads=k.required_loads,
        foldable=k.foldable,
        windowed=k.windowed,
        row_shape=k.row_shape,
        one_sweep=k.one_sweep,
        split_span=k.split_span if k.splittable else None,
        into=tuple(k.into_stores) if kind == "bwd" else (),
        returns=tuple(k.returns),
    )


def declared(k: KernelFacts, kind: str) -> list[tuple[str, Any]]:
    """The fields of kernel `k`'s launcher signature that differ from their defaults, (name,
    value) in the signature's order: what its module states (module.py.j2 `launcher`)."""
    sig = launcher_signature(k, kind)
    return [(f.name, getattr(sig, f.name)) for f in dataclasses.fields(sig)
            if getattr(sig, f.name) != f.default]


@dataclass(frozen=True)
class ModuleSpec:
    """Everything a module template needs besides the kernels."""

    op: str
    doc: str
    source: str
    api: Any
    inputs: tuple[str, ...]
    params: tuple[str, ...]  # column and scalar parameters, in spec order
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    modes: tuple[tuple[str, tuple[str, ...], str], ...]  # (mode, saved names, doc)
    upstream: tuple[str, ...]
    #: (argument, its gradient output) for each differentiable input, then each parameter
    gradients: tuple[tuple[str, str], ...]
    #: per-row tensors of the call, never differentiated (class indices)
    row_inputs: tuple[str, ...] = ()
    #: upstream gradients of per-row outputs (a loss): (M,) tensors
    row_upstream: tuple[str, ...] = ()
    #: the call takes a seed (a 0-d int64 tensor): random values regenerated in the backward
    seeded: bool = False
    #: the kernels index rows by the input's leading dims (broadcast inputs, row indices)
    row_shape: bool = False
    #: element inputs given broadcastable to the first input (never differentiated)
    broadcast_inputs: tuple[str, ...] = ()
    #: outputs never differentiated (returned on request; their gradient is dropped)
    undifferentiated: tuple[str, ...] = ()
    #: the pairing of the columns the spec reads across (derive/spec.py PAIRINGS), or None:
    #: the API then checks the row width is one the pairing takes
    pairing: str | None = None
    #: (input or parameter, its tangent) for each one forward mode differentiates, then
    #: (output, its tangent) for each differentiated output (derive/tangent.py)
    tangent_inputs: tuple[tuple[str, str], ...] = ()
    tangent_outputs: tuple[tuple[str, str], ...] = ()


def formula(expr: sympy.Expr) -> str:
    return sympy.sstr(expr, order="lex").replace("**", "^")


def _exact_matters(expr: sympy.Expr) -> bool:
    """Whether expr holds an exponential or a division (a negative power) of a non-number."""
    return expr.has(sympy.exp) or any(
        p.exp.is_negative and not p.base.is_number for p in expr.atoms(sympy.Pow))


def typed(absent: str) -> str:
    """An absent tensor's number as a scalar of the accumulator's dtype: a bare Python float is
    fp32 in Triton wherever no tensor sets the type (tl.where(mask, 1.0, 0.0) and the mean of it
    are fp32, and a compiled fp32 division is not correctly rounded: an fp64 kernel's mean of
    absent class weights came out 1 - 2^-24)."""
    return f"tl.full([], {absent}, ACC)"


class KernelFacts:
    """What the templates read of a Kernel whatever prints it: its names, its tensors by role,
    its stores and their flags, what it can do (fold, run on a window, split rows). Computed
    once a kernel; its printed views (`TritonKernel`, `TorchPath`) read it."""

    def __init__(self, kernel: Kernel, backward: bool = True, windowed: bool = False):
        #: the derived formulas, as the kernels' docstrings state them
        self.formulas = kernel.formulas()
        # one-hot sums are read as one gathered element a row (codegen/fuse.py), by the Triton
        # kernels and the torch path alike
        kernel, self.picks = picks(kernel)
        self.kernel = kernel
        self.name = kernel.name
        self.backward = backward
        #: a window of the row: the launcher takes `col_start` and `row_length`, and the
        #: (M, N) tensors it is given are columns col_start .. col_start + N of rows of
        #: row_length columns (a linear loss's block of the classes, codegen/runtime/
        #: linear_loss.py). Only where each element's value needs its row's values and its
        #: own: no row reductions, no column or scalar sums, no gathered element (which may lie
        #: outside the window), nothing drawn per element or read by row position
        self.windowed = windowed and not (
            any(p.reductions for p in kernel.passes) or kernel.stores_of("column")
            or kernel.stores_of("scalar") or self.picks
            or any(kind != "column_index" for _, kind in kernel.generated)
            or any(t.broadcast for t in kernel.tensors("element")))
        #: element stores whose memory the launcher takes from its caller (`into`)
        self.into_stores: list[int] = []
        element = {t.name for t in kernel.inputs if t.level in ("element", "column")}
        element |= {a.name for p in (*kernel.passes, kernel.epilogue) for a in p.assigns
                    if a.level == "element"}
        element |= {name for name, kind in kernel.generated if kind != "row_index"}
        #: the values that vary along the row (a printer's `varies`)
        self.elementwise = frozenset(element)
        self.generated = dict(kernel.generated)
        #: partner reads: name -> (the element tensor it loads, the pairing)
        self.partners = {name: (source, pairing) for name, source, pairing in kernel.partners}
        # scalars that may be off: a constexpr flag each (HAS_<NAME>), the kernel compiled for
        # whether the call has it (`OpSpec.scalar(absent=...)`)
        self.switch_flags = {(name, value): f"HAS_{name.upper()}"
                             for name, value in kernel.switches}
        self.switches = [{"name": name, "flag": flag, "absent": repr(float(value))}
                         for (name, value), flag in self.switch_flags.items()]
        # values that are 0 where the mask is off: plain element inputs load as 0 there
        self._zero_masked = {t.name for t in kernel.tensors("element") if not t.optional}
        self._element_exprs = {a.name: a.expr for p in (*kernel.passes, kernel.epilogue)
                               for a in p.assigns if a.level == "element"}
        self.generated_elements = [n for n, kind in kernel.generated if kind != "row_index"]
        self.broadcast_inputs = [t.name for t in kernel.tensors("element") if t.broadcast]
        self.integer_inputs = [t.name for t in kernel.tensors("row") if t.integer]
        self.seeded = "random" in self.generated.values()
        self.row_shape = bool(self.broadcast_inputs) or "row_index" in self.generated.values()
        self.element_inputs = [t.name for t in kernel.tensors("element")]
        # element tensors read: the required ones, and each optional one where given
        self.required_loads = sum(not t.optional for t in kernel.tensors("element"))
        self.first = next(t.name for t in kernel.tensors("element") if not t.optional)
        #: whether the kernel takes an exponential or a quotient (and so decides which form:
        #: `helpers.exp`, `helpers.div`)
        self.exact = any(_exact_matters(sympy.sympify(e)) for e in kernel.expressions())
        # values rounded to the input's dtype (`Rounded`): the kernel's ROUND constexpr
        self.rounds = any(sympy.sympify(e).has(Rounded) for e in kernel.expressions())
        self.element_flags = {t.name: f"HAS_{t.name.upper()}"
                              for t in kernel.tensors("element") if t.optional}
        self.aliases = dict(kernel.aliases)
        self.row_inputs = [t.name for t in kernel.tensors("row")]
        self.scalar_inputs = [t.name for t in kernel.tensors("scalar")]
        #: per-column parameters: name, the constexpr saying it is given (None: always) and
        #: the value it takes where it is not
        self.columns = [{"name": t.name, "flag": f"HAS_{t.name.upper()}" if t.optional else None,
                         "absent": t.absent if t.optional else None}
                        for t in kernel.tensors("column")]
        self.kernel_columns = [c["name"] for c in self.columns]
        self.scalars = list(kernel.scalars)
        #: the forward values that only stores made on request read, each with the stores
        #: whose request computes it (`_gates`); none in a backward
        self.gates = {} if backward else _gates(kernel)
        #: the looped kernel's sweeps over a row: passes joined where codegen/fuse.py can
        self.sweep_plan = sweeps(kernel)
        self.one_sweep = any(s.fused for s in self.sweep_plan)
        #: the stores by level: name, the flag saying it is stored (None: always), the tensor
        #: whose shape and dtype a sum takes
        self.stores = {level: [{"name": s.name, "flag": _store_flag(s), "like": s.like}
                               for s in kernel.stores_of(level)]
                       for level in ("element", "row", "column", "scalar")}
        self.element_stores = self.stores["element"]
        self.row_stores = self.stores["row"]
        self.column_stores = self.stores["column"]
        self.scalar_stores = self.stores["scalar"]
        self.reduced_stores = self.column_stores + self.scalar_stores
        self.flagged_stores = [s for s in self.element_stores + self.row_stores
                               + self.reduced_stores if s["flag"]]
        # split rows (`{name}_split`): a row's column slabs spread over programs that run at
        # once and exchange their slabs' partial row sums; for backward kernels with row
        # reductions, nothing kept per row or per program, no values drawn per element or read
        # at a row's column. Not forwards: an exchange per pass and row costs more than a
        # forward's row takes to stream (measured: a split layer-norm forward ran at a third
        # of the looped one's speed)
        # Backwards with column partials and no row reductions (a bias gradient: GELU's) split
        # too, with no exchange: each program's slab of columns over a group of rows is a
        # column-slab grid, the partials in registers (a looped row reads, adds to and writes
        # back its program's partial row every step)
        self.splittable = (backward and (any(p.reductions for p in kernel.passes)
                                         or bool(self.column_stores))
                           and not (self.picks or kernel.generated or self.broadcast_inputs
                                    or self.row_stores or self.scalar_stores or self.row_shape))
        #: partial row sums a program publishes per exchange: the most of any pass (0: the
        #: split kernel never exchanges, and needs no cooperative launch)
        self.split_span = (max((len(p.reductions) for p in kernel.passes), default=0)
                           if self.splittable else 0)
        self.extra_inputs = ["seed"] * self.seeded + ["row_shape"] * self.row_shape
        self.inputs = (self.element_inputs + self.kernel_columns + self.scalar_inputs
                       + self.row_inputs + self.scalars + self.extra_inputs)
        self.returns = [self.aliases.get(o.name, o.name) for o in kernel.outputs]
        self.unique_returns = [o.name for o in kernel.outputs if o.name not in self.aliases]
        # inputs that may be None
        self.optional_inputs = [t.name for t in kernel.tensors("element") + kernel.tensors(
            "column") if t.optional]
        used = {name for p in (*kernel.passes, kernel.epilogue) for name in p.loads}
        self.used_columns = [c for c in self.columns if c["name"] in used]
        # elementwise through and through: no reductions, nothing per row or per column, no
        # values from the element's position, every element tensor given. Its rows may be read
        # as rows of another width (the launcher's fold)
        exprs = [a.expr for a in (*kernel.prologue, *kernel.epilogue.assigns)]
        exprs += [s.expr for s in kernel.stores]
        self.foldable = (not (kernel.passes or self.row_inputs or self.columns
                              or self.row_stores or self.reduced_stores or kernel.generated
                              or self.element_flags or self.broadcast_inputs
                              or self.aliases)
                         and all(ROW_LENGTH not in {s.name for s in e.free_symbols}
                                 for e in exprs))

    def vanishes_where_masked(self, expr: sympy.Expr) -> bool:
        """Whether expr is 0 wherever the mask is off, so a sum of it needs no select: with its
        element assigns written out, it is 0 once every plain element input is (they load as
        0 there). Row values may be anything finite; a row whose values are not finite gives
        a non-finite sum either way."""
        for _ in range(len(self._element_exprs) + 1):
            inner = {s: self._element_exprs[s.name] for s in expr.free_symbols
                     if s.name in self._element_exprs}
            if not inner:
                break
            expr = expr.xreplace(inner)
        zeroed = expr.xreplace({s: sympy.Integer(0) for s in expr.free_symbols
                                if s.name in self._zero_masked})
        return zeroed == 0

    def broadcast(self, names: set[str]) -> str | None:
        """What a reduction's body of the values `names` is broadcast to before the torch path
        sums it: None where it holds element values (it is every element already). A body
        without element values (a mean of class weights) varies along the row through columns
        alone: summed as broadcast to one row ("row"), or to every row where it reads row
        values too ("rows")."""
        elements = ({t.name for t in self.kernel.tensors("element")} | set(self._element_exprs)
                    | {name for name, kind in self.kernel.generated if kind == "random"})
        if names & elements:
            return None
        per_column = ({t.name for t in self.kernel.inputs if t.level in ("column", "scalar")}
                      | {name for name, kind in self.kernel.generated if kind == "column_index"}
                      | set(self.kernel.scalars) | {"N"})
        return "row" if names <= per_column else "rows"


def _store_flag(store: Any) -> str | None:
    """The constexpr saying a store is made (None: always): a column or scalar sum's is its
    STORE_<NAME>, made where its `like` needs a gradient."""
    return f"STORE_{store.name.upper()}" if store.level in ("column", "scalar") else store.flag


def _gates(kernel: Kernel) -> dict[str, list[str]]:
    """The row values of a forward kernel that only stores made on request read (the argmax
    of a loss's predicted class, an output the call may not ask for), each with those stores,
    by name: a value is computed where any of them is asked for (the kernel's STORE_<NAME>
    constexprs, the torch path's store_<name> flags). Where none is, the kernel computes
    nothing for them: the kernels of the spec without those outputs."""
    reads: dict[str, set[str]] = {}  # a value -> the values and stores that read it
    stored: dict[str, bool] = {}  # a store -> whether only a request makes it
    definitions = [(a.name, [a.expr]) for a in kernel.prologue]
    for step in (*kernel.passes, kernel.epilogue):
        definitions += [(a.name, [a.expr]) for a in (*step.assigns, *step.after)]
        definitions += [(r.name, [r.body, r.scale]) for r in step.reductions]
    stores = {}
    for store in kernel.stores:
        key = ("store", store.name)
        stores[key] = store.name
        definitions.append((key, [store.expr]))
        stored[key] = store.flag is not None and store.level in ("element", "row")
    for name, exprs in definitions:
        for expr in exprs:
            for symbol in sympy.sympify(expr).free_symbols:
                reads.setdefault(symbol.name, set()).add(name)
    gated = {r.name for step in kernel.passes for r in step.reductions}
    gated |= {a.name for step in kernel.passes for a in step.after}
    gates = {}
    for name in sorted(gated):
        reached, todo, seen = set(), [name], {name}
        while todo:
            for reader in reads.get(todo.pop(), ()):
                if reader in stored:
                    reached.add(reader)
                elif reader not in seen:
                    seen.add(reader)
                    todo.append(reader)
        if reached and all(stored[store] for store in reached):
            gates[name] = sorted(stores[store] for store in reached)
    return gates


class _Printed:
    """A kernel's values printed in one dialect: its prologue, passes, epilogue and stores,
    each expression by the dialect's printer (codegen/printers.py). Reads its facts' attributes
    as its own."""

    def __init__(self, facts: KernelFacts, dialect: Dialect):
        self.facts = facts
        self.dialect = dialect
        self._element = set(facts.elementwise)  # the printer reads it: names added later vary
        kernel = facts.kernel
        self.printer = KernelPrinter(dialect, self._element.__contains__, facts.switch_flags,
                                     facts.first)
        if facts.windowed:
            # the formulas' row length is the whole row's, not the window's N
            self.printer = _Renamed(self.printer, {ROW_LENGTH: "row_length"})
        self.optional_elements = {t.name: self.printer(t.absent)
                                  for t in kernel.tensors("element") if t.optional}
        self.column_inputs = [self._column(c["name"]) for c in facts.columns]
        self.prologue = self._assigns(kernel.prologue)
        self.passes = [self._pass(p) for p in kernel.passes]
        self.epilogue = self._pass(kernel.epilogue)
        self.element_stores = [self._store(s) for s in kernel.stores_of("element")]
        self.row_stores = [self._store(s) for s in kernel.stores_of("row")]
        self.column_stores = [self._store(s) for s in kernel.stores_of("column")]
        self.scalar_stores = [self._store(s) for s in kernel.stores_of("scalar")]
        self.reduced_stores = self.column_stores + self.scalar_stores
        done: set[str] = set()
        self.persistent_passes = []
        for p in self.passes:
            fresh = [a for a in p["assigns"] if a["name"] not in done]
            done |= {a["name"] for a in fresh}
            self.persistent_passes.append({**p, "assigns": fresh})
        self.persistent_epilogue = [a for a in self.epilogue["assigns"] if a["name"] not in done]

    def __getattr__(self, name: str) -> Any:
        # the facts' attributes, for the templates (not found here)
        if name == "facts":
            raise AttributeError(name)
        return getattr(self.facts, name)

    def gate(self, name: str) -> Any:
        """The condition under which value `name` is computed (None: always)."""
        raise NotImplementedError

    def _column(self, name: str) -> dict[str, Any]:
        column = next(c for c in self.facts.columns if c["name"] == name)
        return {**column, "absent": self.printer(column["absent"]) if column["flag"] else None}

    def print_named(self, name: str, expr: sympy.Expr) -> str:
        """Print expr; a failure names the value it defines (for the spec-line error)."""
        try:
            return self.printer(expr)
        except PrintError as error:
            raise PrintError(f"'{name}' = {expr}: {error}", name, error.offending) from error

    def _assigns(self, assigns: tuple[Assign, ...]) -> list[dict[str, Any]]:
        return [{"name": a.name, "src": self.print_named(a.name, a.expr),
                 "formula": f"{a.name} = {formula(a.expr)}",
                 "gate": self.gate(a.name)} for a in assigns]

    def _reduction(self, r: RowReduce) -> dict[str, Any]:
        # divide the accumulated sum (`sum / N`): a `1.0 / N` alone would be fp32
        prefix, suffix = self.printer.scale_parts(r.scale) if r.scale != 1 else ("", "")
        return {
            "name": r.name, "op": r.op, "body": self.print_named(r.name, r.body),
            "identity": {"max": 'float("-inf")', "min": 'float("inf")'}.get(r.op, "0.0"),
            # computed only where a store that reads it is asked for (`_gates`)
            "gate": self.gate(r.name),
            "scale_prefix": prefix,
            "scale_suffix": suffix,
            "formula": f"{r.name} = {formula(r.scale)} * {r.op}_j({formula(r.body)})",
            # a max is only ever a proven stabiliser, so any finite shift serves: a row of
            # -inf (fully masked) shifts by 0, not by -inf (exp(-inf + inf) = NaN); a +inf
            # max shifts by itself, NaN throughout its row as torch.softmax's
            "finite": "a stabiliser: a row of -inf shifts by 0"}

    def _pass(self, step: Pass) -> dict[str, Any]:
        columns = {c["name"] for c in self.facts.columns}
        return {
            "element_loads": [n for n in step.loads if n not in columns],
            "column_inputs": [self._column(n) for n in step.loads if n in columns],
            "assigns": self._assigns(step.assigns),
            "reductions": [self._reduction(r) for r in step.reductions],
            "after": self._assigns(step.after),
        }

    def _store(self, store: Any) -> dict[str, Any]:
        return {"name": store.name, "src": self.print_named(store.name, store.expr),
                "like": store.like, "flag": _store_flag(store),
                "formula": f"{store.name} = {formula(store.expr)}"}


class TritonKernel(_Printed):
    """A kernel printed as Triton, for triton_kernels.py.j2: every expression, and the kernel
    text of its loads, sweeps, stores and arguments as lines, each relative to the block it
    goes in."""

    def __init__(self, facts: KernelFacts):
        super().__init__(facts, TRITON)
        self.used_column_inputs = [self._column(c["name"]) for c in facts.used_columns]
        # the looped kernel's sweeps over a row: passes joined where codegen/fuse.py can,
        # each joined sweep next to its two passes (the ONE_SWEEP constexpr picks)
        self.sweeps = [{"one": self._sweep(s) if s.fused else None,
                        "two": [self._sweep(Sweep(p.loads, p.assigns, p.reductions, (), p.after,
                                                  (i,)))
                                for i, p in enumerate(facts.kernel.passes, start=1)
                                if i in s.joined]}
                       for s in facts.sweep_plan]
        self.args = self._args()

    def gate(self, name: str) -> str | None:
        stores = self.facts.gates.get(name)
        if stores is None:
            return None
        flags = {s["name"]: s["flag"] for s in self.facts.element_stores + self.facts.row_stores}
        return " or ".join(sorted(flags[store] for store in stores))

    def _reduction(self, r: RowReduce) -> dict[str, Any]:
        printed = super()._reduction(r)
        body, identity = printed["body"], printed["identity"]
        # a body that is 0 wherever the mask is off needs no select in its sum
        printed["masked"] = (body if r.op == "sum" and self.vanishes_where_masked(r.body)
                             else f"tl.where(mask, {body}, {identity})")
        return printed

    def _store(self, store: Any) -> dict[str, Any]:
        printed = super()._store(store)
        # the column partials' sum over the rows of a step: masked rows add 0
        printed["masked"] = (printed["src"] if self.vanishes_where_masked(store.expr)
                             else f"tl.where(mask, {printed['src']}, 0.0)")
        return printed

    # Line snippets: each a list of source lines relative to the block they go in.
    def column_load_lines(self, columns: list[dict[str, Any]]) -> list[str]:
        lines = []
        for c in columns:
            name = c["name"]
            at = "col_start + cols" if self.windowed else "cols"
            load = f"{name} = tl.load({name}_ptr + {at}, mask=col_mask, other=0.0).to(ACC)"
            if c["flag"]:
                lines += [f"if {c['flag']}:", f"    {load}", "else:",
                          f"    {c['name']} = {typed(c['absent'])}"]
            else:
                lines.append(load)
        return lines

    def element_load_lines(self, names: list[str],
                           again: Collection[str] | None = None) -> list[str]:
        """Loads of element inputs. A looped row reads its elements once a sweep: where the
        schedule keeps the row in L2 (KEEP), those `again` names (read again by a later sweep
        or the epilogue) load `evict_last` and the last reads `evict_first`; otherwise, and for
        whole rows (`again` None, each element read once), the default policy."""
        lines = []
        for e in names:
            kind = self.generated.get(e)
            if kind == "column_index":
                lines.append(f"{e} = cols + col_start" if self.windowed else f"{e} = cols")
                continue
            if kind == "random":
                lines.append(f"{e} = helpers.uniform(seed, offsets, col0, N, BLOCK_N).to(ACC)")
                continue
            at = "cols"
            if kind == "partner":
                # the tensor at each column's partner, loaded from memory: a whole row or one
                # block of a looped row alike (the partner of a column past N is masked)
                e, target = self.partners[e][0], e
                at = PARTNER_COLUMNS[self.partners[target][1]]
                if e in self.kernel_columns:  # a per-column parameter's
                    c = self._column(e)
                    load = (f"{target} = tl.load({e}_ptr + {at}, mask=col_mask, "
                            "other=0.0).to(ACC)")
                    lines += ([f"if {c['flag']}:", f"    {load}", "else:",
                               f"    {target} = {typed(c['absent'])}"] if c["flag"] else [load])
                    continue
            else:
                target = e
            row = f"{e}_rows" if e in self.broadcast_inputs else f"offsets * {e}_row_stride"
            hint = "evict_last" if again is not None and e in again else "evict_first"
            policy = "" if again is None else f', eviction_policy="{hint}" if KEEP else ""'
            load = (f"{target} = tl.load({e}_ptr + {row} + {at}, mask=mask, "
                    f"other=0.0{policy}).to(ACC)")
            if e in self.optional_elements:
                lines += [f"if {self.element_flags[e]}:", f"    {load}", "else:",
                          f"    {target} = {typed(self.optional_elements[e])}"]
            else:
                lines.append(load)
        return lines

    @staticmethod
    def assign_lines(assigns: list[dict[str, str]]) -> list[str]:
        lines = []
        for a in assigns:
            line = f"{a['name']} = {a['src']}  # {a['formula']}"
            lines += [f"if {a['gate']}:", f"    {line}"] if a.get("gate") else [line]
        return lines

    @staticmethod
    def _gated(gate: str | None, lines: list[str]) -> list[str]:
        """lines, run only where `gate` (a `_gates` condition) holds."""
        if not gate or not lines:
            return lines
        return [f"if {gate}:", *("    " + line for line in lines)]

    def store_lines(self) -> list[str]:
        lines = []
        for s in self.element_stores:
            store = (f"tl.store({s['name']}_ptr + offsets * {s['name']}_row_stride + cols, "
                     f"({s['src']}).to({s['name']}_ptr.dtype.element_ty), mask=mask)")
            lines += [f"if {s['flag']}:", f"    {store}"] if s["flag"] else [store]
        return lines

    def row_store_lines(self) -> list[str]:
        lines = []
        for s in self.row_stores:
            store = f"tl.store({s['name']}_ptr + rows, {s['src']}, mask=row_mask)"
            lines += [f"if {s['flag']}:", f"    {store}"] if s["flag"] else [store]
        return lines

    def scalar_load_lines(self) -> list[str]:
        # Triton passes Python floats as fp32: a scalar travels as two (its fp32 rounding and
        # the rest), summed at the accumulator's precision (fp64 kernels get ~48 bits)
        lines = [f"{name} = tl.cast({name}_high, ACC) + tl.cast({name}_low, ACC)"
                 for name in self.scalars]
        lines += [f"{name} = tl.load({name}_ptr).to(ACC)" for name in self.scalar_inputs]
        return lines + ["seed = tl.load(seed_ptr)"] * self.seeded

    def scalar_accumulate_lines(self) -> list[str]:
        return [line for s in self.scalar_stores for line in (
            f"if {s['flag']}:",
            f"    {s['name']}_acc += tl.where(row_mask, {s['src']}, 0.0)  # {s['formula']}")]

    def scalar_store_lines(self) -> list[str]:
        return [line for s in self.scalar_stores for line in (
            f"if {s['flag']}:",
            f"    tl.store({s['name']}_partial_ptr + pid + tl.arange(0, 1), "
            f"tl.sum({s['name']}_acc, axis=0))")]

    def row_load_lines(self) -> list[str]:
        lines = [f"{r} = tl.load({r}_ptr + rows, mask=row_mask, other=0)"
                 if r in self.integer_inputs else
                 f"{r} = tl.load({r}_ptr + rows, mask=row_mask, other=0.0).to(ACC)"
                 for r in self.row_inputs]
        lines += [f"{name} = offsets % D2" for name, kind in self.kernel.generated
                  if kind == "row_index"]
        # a broadcast tensor's row: leading dims (D0, D1, D2) through its (zero) strides
        lines += [f"{e}_rows = offsets // (D1 * D2) * {e}_stride0 + offsets // D2 % D1 * "
                  f"{e}_stride1 + offsets % D2 * {e}_stride2" for e in self.broadcast_inputs]
        return lines

    def pick_lines(self) -> list[str]:
        """The one-hot sums, each read at its row's column (after the row loads)."""
        if self.dialect is TORCH:
            return self._torch_pick_lines()
        lines = []
        for p in self.picks:
            mask = f"{p.name}_mask"
            lines.append(f"{mask} = row_mask & ({p.index} >= 0) & ({p.index} < N)")
            for e in p.loads:
                lines.append(f"{p.name}_{e} = tl.load({e}_ptr + offsets * {e}_row_stride + "
                             f"{p.index}, mask={mask}, other=0.0).to(ACC)")
            for c in map(self._column, p.columns):
                load = (f"{p.name}_{c['name']} = tl.load({c['name']}_ptr + {p.index}, "
                        f"mask={mask}, other=0.0).to(ACC)")
                absent = f"    {p.name}_{c['name']} = {typed(c['absent'])}"
                lines += ([f"if {c['flag']}:", f"    {load}", "else:", absent] if c["flag"]
                          else [load])
            value = f"tl.where({mask}, {self.print_named(p.name, _gathered(p))}, 0.0)"
            reduce = RowReduce(p.name, "sum", p.body, p.scale)
            lines.append(f"{p.name} = {self._scaled(reduce, value)}  # {p.name} = "
                         f"{formula(p.scale)} * ({formula(p.body)} at column {p.index}): a "
                         "one-hot sum over the row, read as one element")
        return lines

    def sweep_lines(self) -> list[str]:
        """The looped kernel's reduction sweeps, relative to its row-block loop. Where the
        schedule says REVERSE, every other sweep (and the epilogue after an odd count) runs from
        the last column block to the first: it starts on the columns the sweep before it ended
        on, the likeliest still in L2."""
        lines = []
        # sweeps run so far with ONE_SWEEP set and without it: their parity sets a direction
        one, two = 0, 0
        for g, group in enumerate(self.sweeps):
            # what the sweeps after this group and the epilogue read again
            after = set(self.epilogue["element_loads"]).union(
                *(p["element_loads"] for later in self.sweeps[g + 1:] for p in later["two"]))
            if group["one"] is None:
                lines += self._sweep_lines(group["two"][0], after, self._backwards(one, two))
                one, two = one + 1, two + 1
                continue
            if one % 2:
                # a joined sweep counts steps per lane from the first column block (Welford)
                raise ValueError(f"kernel {self.name}: a joined sweep must run forwards, "
                                 f"got one after {one} sweeps")
            lines.append("if ONE_SWEEP:")
            lines += ["    " + line for line in self._sweep_lines(group["one"], after, "0")]
            lines.append("else:")
            for i, p in enumerate(group["two"]):
                again = after.union(*(q["element_loads"] for q in group["two"][i + 1:]))
                lines += ["    " + line for line in self._sweep_lines(
                    p, again, self._backwards(two + i, two + i))]
            one, two = one + 1, two + len(group["two"])
        return lines

    def epilogue_columns_lines(self) -> list[str]:
        """`cols` of the looped kernel's epilogue step, after every sweep (sweep_lines)."""
        return self.columns_lines(self._backwards(len(self.sweeps),
                                                  sum(len(group["two"]) for group in self.sweeps)))

    @staticmethod
    def _backwards(one: int, two: int) -> str:
        """Whether a sweep after `one` sweeps (ONE_SWEEP set) or `two` (not set) runs backwards
        under REVERSE: the parity of those counts, as a constexpr expression."""
        if one % 2 == two % 2:
            return str(one % 2)
        return "ONE_SWEEP" if one % 2 else "(1 - ONE_SWEEP)"

    def columns_lines(self, backwards: str) -> list[str]:
        """`cols` of a sweep's step `chunk`: its column block, counted from the last one where
        the sweep runs backwards; in a kernel that draws random values, `col0`, the block's first
        column, too (`helpers.uniform` draws from it a Philox call per four columns)."""
        block = "chunk" if backwards == "0" else (
            "helpers.column_block(chunk, CHUNKS, REVERSE"
            f"{'' if backwards == '1' else ' * ' + backwards})")
        if not self.seeded:
            return [f"cols = {block} * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"]
        return [f"col0 = {block} * BLOCK_N", "cols = col0 + tl.arange(0, BLOCK_N)[None, :]"]

    def _sweep_lines(self, p: dict[str, Any], again: set[str], backwards: str) -> list[str]:
        body = (self.column_load_lines(p["column_inputs"])
                + self.element_load_lines(p["element_loads"], again)
                + self.assign_lines(p["assigns"]) + p["step"])
        return (p["init"]
                + ["for chunk in tl.range(0, CHUNKS, num_stages=STAGES):"]
                + ["    " + line for line in self.columns_lines(backwards)]
                + ["    col_mask = helpers.below(cols, N, EVEN)",
                   "    mask = row_mask & col_mask"]
                + ["    " + line for line in body]
                + p["merge"] + self.assign_lines(p["after"]))

    def _sweep(self, sweep: Sweep) -> dict[str, Any]:
        """A sweep of the looped kernel as lines: accumulators set up before the column loop,
        updated in it, merged across lanes after it."""
        printed = self._pass(Pass(sweep.loads, sweep.assigns, sweep.reductions, sweep.after))
        init, update, finish = [], [], []
        for r in printed["reductions"]:
            name, identity, gate = r["name"], r["identity"], r["gate"]
            init += self._gated(gate, [
                f"{name}_acc = tl.full((ROWS, BLOCK_N), {identity}, dtype=ACC)"])
            combine = {"max": "tl.maximum", "min": "tl.minimum"}.get(r["op"])
            update += self._gated(gate, [
                f"{name}_acc = {combine}({name}_acc, {r['masked']})" if combine
                else f"{name}_acc += {r['masked']}"])
            done = [f"{name} = {r['scale_prefix']}tl.{r['op']}({name}_acc, axis=1)"
                    f"[:, None]{r['scale_suffix']}  # {r['formula']}"]
            if r["op"] == "max":
                done.append(f"{name} = helpers.stable_shift({name})  # {r['finite']}")
            finish += self._gated(gate, done)
        # a running max is set up once for the pairs that share it (a sum of exponentials, sums
        # affine in it and an argmax of one max), and moves on after every one of them read its
        # old value
        peaks: list[str] = []
        for pair in sorted(sweep.fused, key=lambda pair: isinstance(pair, OnlineFirst)):
            if isinstance(pair, Moments):
                lines = self._moments(pair)
            else:
                running = self._running_max(pair.peak, peaks)
                if isinstance(pair, OnlineExp):
                    lines = self._online_exp(pair)
                elif isinstance(pair, OnlineGap):
                    lines = tuple(self._gated(self.gate(pair.total.name), part)
                                  for part in self._online_gap(pair))
                else:
                    lines = tuple(self._gated(self.gate(pair.first.name), part)
                                  for part in self._online_first(pair))
                lines = tuple(a + b for a, b in zip(running, lines, strict=True))
            init += lines[0]
            update += lines[1]
            finish += lines[2]
        update += [f"{peak}_shift = {peak}_next" for peak in peaks]
        return {**printed, "init": init, "step": update, "merge": finish,
                "joined": sweep.joined}

    def _scaled(self, reduce: Any, merged: str) -> str:
        """`scale · merged`, printed as `_pass` prints a reduction's scale."""
        printed = self._reduction(reduce)
        return f"{printed['scale_prefix']}{merged}{printed['scale_suffix']}"

    def _moments(self, pair: Moments) -> tuple[list[str], list[str], list[str]]:
        mean, second = pair.mean.name, pair.second.name
        running = sympy.Symbol(f"{mean}_acc", real=True)
        self._element.add(running.name)
        deviation = self.print_named(mean, pair.mean.body - running)
        init = [f"{mean}_acc = tl.zeros((ROWS, BLOCK_N), dtype=ACC)",
                f"{second}_acc = tl.zeros((ROWS, BLOCK_N), dtype=ACC)"]
        update = [
            f"{mean}_delta = tl.where(mask, {deviation}, 0.0)",
            # where the mask holds, this lane has seen chunk + 1 values: Welford's running mean
            f"{mean}_acc += {mean}_delta * (1.0 / tl.cast(chunk + 1, ACC))",
            f"{second}_acc += {mean}_delta * tl.where(mask, {deviation}, 0.0)"]
        merged = (f"tl.sum({second}_acc + {mean}_count * ({mean}_acc - {mean}) * "
                  f"({mean}_acc - {mean}), axis=1)[:, None]")
        finish = [
            # each lane's count of values: CHUNKS, less one where the last step is past N
            f"{mean}_count = tl.where((CHUNKS - 1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :] < N, "
            "CHUNKS, CHUNKS - 1).to(ACC)",
            f"{mean} = helpers.div(tl.sum({mean}_acc * {mean}_count, axis=1)[:, None], N, True)"
            f"  # {mean} = "
            f"{formula(pair.mean.scale)} * sum_j({formula(pair.mean.body)}), from the lane means",
            # the lanes' squared deviations about the row's mean: theirs plus their means' own
            f"{second} = {self._scaled(pair.second, merged)}"
            f"  # {second} = {formula(pair.second.scale)} * sum_j({formula(pair.second.body)})"]
        return init, update, finish

    def _running_max(self, peak: Any, peaks: list[str]) -> tuple[list[str], list[str], list[str]]:
        """The row's running max of a joined sweep (once per max: `peaks` holds those set up):
        `<peak>_next`, its stable shift after this step, and `<peak>_shift`, before it (moved
        on by the sweep once every pair of it read both)."""
        if peak.name in peaks:
            return [], [], []
        peaks.append(peak.name)
        name = peak.name
        self._element.add(f"{name}_next")
        body = self.print_named(name, peak.body)
        # the running max is the row's (a max over each step's tile), so a sum shifted by it
        # rescales once a step: one exponential an element, not two as with a running max per
        # lane. The sum is kept at `_shift`, the running max's stable shift
        # (`helpers.stable_shift`).
        init = [f'{name}_acc = tl.full((ROWS, 1), float("-inf"), dtype=ACC)',
                f"{name}_shift = tl.zeros((ROWS, 1), dtype=ACC)"]
        update = [
            f'{name}_acc = tl.maximum({name}_acc, tl.max(tl.where(mask, {body}, float("-inf")), '
            "axis=1)[:, None])",
            f"{name}_next = helpers.stable_shift({name}_acc)"]
        finish = [f"{name} = {name}_shift  # {name} = {formula(peak.scale)} * "
                  f"max_j({formula(peak.body)}), -inf made 0"]
        return init, update, finish

    def _online_exp(self, pair: OnlineExp) -> tuple[list[str], list[str], list[str]]:
        peak, total = pair.peak.name, pair.total.name
        shift = sympy.Symbol(f"{peak}_next", real=True)
        term = self.print_named(total, pair.factor * sympy.exp(pair.peak.body - shift))
        init = [f"{total}_acc = tl.zeros((ROWS, BLOCK_N), dtype=ACC)"]
        update = [
            # the shift only falls where a row of -inf so far (shift 0, every lane's sum 0)
            # meets its first finite value: the factor is 1 there, so no lane's 0 meets an
            # overflowed exp (0 * exp(1000) = NaN)
            f"{total}_acc = {total}_acc * tl.exp(tl.minimum({peak}_shift - {peak}_next, 0.0))"
            f" + tl.where(mask, {term}, 0.0)  # rescaled to the row's new max"]
        return init, update, self._merged_at_max(pair.total)

    def _merged_at_max(self, total: Any) -> list[str]:
        """A sum carried with a running max, its lanes' sums (each at the row's max) merged."""
        merged = f"tl.sum({total.name}_acc, axis=1)[:, None]"
        return [f"{total.name} = {self._scaled(total, merged)}"
                f"  # {total.name} = {formula(total.scale)} * sum_j({formula(total.body)}), "
                "every lane at the row's max"]

    def _online_gap(self, pair: OnlineGap) -> tuple[list[str], list[str], list[str]]:
        peak, total = pair.peak.name, pair.total.name
        shift = sympy.Symbol(f"{peak}_next", real=True)
        symbol = next(s for s in pair.total.body.free_symbols if s.name == peak)
        term = self.print_named(total, pair.total.body.xreplace({symbol: shift}))
        slope = self.print_named(total, pair.slope)
        init = [f"{total}_acc = tl.zeros((ROWS, BLOCK_N), dtype=ACC)",
                f"{total}_slope = tl.zeros((ROWS, BLOCK_N), dtype=ACC)"]
        update = [
            # the terms so far move with the max by their slopes' sum; where the max stays
            # (most steps) nothing moves, even at a +inf (inf - inf is no move)
            f"{total}_acc += tl.where({peak}_next != {peak}_shift, "
            f"{total}_slope * ({peak}_next - {peak}_shift), 0.0)"
            f" + tl.where(mask, {term}, 0.0)  # at the row's max so far",
            f"{total}_slope += tl.where(mask, {slope}, 0.0)"]
        return init, update, self._merged_at_max(pair.total)

    def _online_first(self, pair: OnlineFirst) -> tuple[list[str], list[str], list[str]]:
        peak, first = pair.peak.name, pair.first.name
        shift = sympy.Symbol(f"{peak}_next", real=True)
        symbol = next(s for s in pair.first.body.free_symbols if s.name == peak)
        body = self.print_named(first, pair.first.body.xreplace({symbol: shift}))
        init = [f'{first}_acc = tl.full((ROWS, BLOCK_N), float("inf"), dtype=ACC)']
        update = [
            # where the running max moved, every candidate so far falls short of it (a shift
            # that falls, from a row of -inf so far, had none)
            f'{first}_acc = tl.where({peak}_next != {peak}_shift, float("inf"), {first}_acc)',
            f'{first}_acc = tl.minimum({first}_acc, tl.where(mask, {body}, float("inf")))'
            "  # the candidates at the row's max so far"]
        finish = [f"{first} = tl.min({first}_acc, axis=1)[:, None]  # {first} = "
                  f"{formula(pair.first.scale)} * min_j({formula(pair.first.body)})"]
        return init, update, finish

    def flag_args(self) -> list[str]:
        """The constexpr flags of every kernel form: optional inputs given, outputs stored."""
        return ([f"{flag}: tl.constexpr" for flag in self.element_flags.values()]
                + [f"{s['flag']}: tl.constexpr" for s in self.switches]
                + [f"{c['flag']}: tl.constexpr" for c in self.column_inputs if c["flag"]]
                + [f"{s['flag']}: tl.constexpr" for s in self.flagged_stores])

    def split_load_lines(self) -> tuple[list[str], list[str]]:
        """The split kernel's element loads, relative to its row-block loop: (those of the next
        row block, issued before this block's partial row sums are exchanged so that they are
        in flight while the program waits, into `<name>_next`; this block's, taken from them)."""
        issue, take = [], []
        for e in self.element_inputs:
            load = (f"{e}_next = tl.load({e}_ptr + next_offsets * {e}_row_stride + cols, "
                    "mask=next_mask, other=0.0)")
            if e in self.optional_elements:
                issue += [f"if {self.element_flags[e]}:", f"    {load}"]
                take += [f"if {self.element_flags[e]}:", f"    {e} = {e}_next.to(ACC)", "else:",
                         f"    {e} = {typed(self.optional_elements[e])}"]
            else:
                issue.append(load)
                take.append(f"{e} = {e}_next.to(ACC)")
        return issue, take

    def split_pass_lines(self, p: dict[str, Any]) -> list[str]:
        """One pass of the split kernel: each reduction over this program's slab, published in
        the group's exchange slot; the group's programs meet (`helpers.split_exchange`); each
        reduction then the sum (or max) of its members' partials, in member order."""
        lines = self.assign_lines(p["assigns"])
        if not p["reductions"]:
            return lines + self.assign_lines(p["after"])
        span = self.split_span
        # two slots a group, used in turn: a program can only write a slot again after every
        # program of its group met it at the exchange after this one, so all have read it
        lines.append(f"split_slot = split_sums_ptr + (group * 2 + exchanges % 2) * MEMBERS * "
                     f"{span} * ROWS")
        for i, r in enumerate(p["reductions"]):
            lines.append(f"tl.store(split_slot + (member * {span} + {i}) * ROWS + "
                         f"tl.arange(0, ROWS), tl.{r['op']}({r['masked']}, axis=1))")
        lines += ["exchanges += 1",
                  "helpers.split_exchange(split_count_ptr + group, exchanges * SPLIT)"]
        for i, r in enumerate(p["reductions"]):
            partials = (f"tl.load(split_slot + (members * {span} + {i}) * ROWS + lanes, "
                        f"mask=members < SPLIT, other={r['identity']}, cache_modifier=\".cg\")")
            lines.append(f"{r['name']} = {r['scale_prefix']}tl.{r['op']}({partials}, axis=0)"
                         f"[:, None]{r['scale_suffix']}  # {r['formula']}")
            if r["op"] == "max":
                lines.append(f'{r["name"]} = helpers.stable_shift({r["name"]})  # {r["finite"]}')
        return lines + self.assign_lines(p["after"])

    def _args(self) -> list[str]:
        args = []
        for name in self.element_inputs:
            if name in self.broadcast_inputs:
                args += [f"{name}_ptr", f"{name}_stride0", f"{name}_stride1", f"{name}_stride2"]
            else:
                args += [f"{name}_ptr", f"{name}_row_stride"]
        args += [f"{c['name']}_ptr" for c in self.column_inputs]
        args += [f"{name}_ptr" for name in self.scalar_inputs]
        args += [f"{name}_ptr" for name in self.row_inputs]
        args += ["seed_ptr"] * self.seeded
        for store in self.element_stores:
            args += [f"{store['name']}_ptr", f"{store['name']}_row_stride"]
        args += [f"{s['name']}_ptr" for s in self.row_stores]
        args += [f"{s['name']}_partial_ptr" for s in self.reduced_stores]
        args += [f"{name}_{part}" for name in self.scalars for part in ("high", "low")]
        args += ["M", "N"] + ["col_start", "row_length"] * self.windowed
        args += ["D1", "D2"] * self.row_shape
        # the split kernel's exchange buffers (the other kernels take them and leave them be)
        args += ["split_sums_ptr", "split_count_ptr"] * self.splittable
        args += self.flag_args()
        self.split_args = [*args, "ACC: tl.constexpr", "ROWS: tl.constexpr",
                           "BLOCK_N: tl.constexpr", "SPLIT: tl.constexpr", "MEMBERS: tl.constexpr",
                           "FIXED_N: tl.constexpr"]
        args += ["ACC: tl.constexpr", "ROWS: tl.constexpr", "BLOCK_N: tl.constexpr"]
        args += ["STAGES: tl.constexpr", "CHUNKS: tl.constexpr"]
        args += ["ONE_SWEEP: tl.constexpr"] * self.one_sweep
        return args + ["KEEP: tl.constexpr", "EVEN: tl.constexpr", "STRIDED: tl.constexpr",
                       "REVERSE: tl.constexpr", "LAST_FIRST: tl.constexpr", "FIXED_N: tl.constexpr"]


class TorchPath(_Printed):
    """A kernel printed as plain torch, for torch_path.py.j2: every expression, each gate as
    the stores whose `store_<name>` flags compute it, each one-hot sum read at its row's
    column as the template gathers it."""

    def __init__(self, facts: KernelFacts):
        super().__init__(facts, TORCH)
        self.pick_reads = [self._pick(p) for p in facts.picks]

    def gate(self, name: str) -> list[str] | None:
        return self.facts.gates.get(name)

    def _reduction(self, r: RowReduce) -> dict[str, Any]:
        return {**super()._reduction(r),
                "broadcast": self.facts.broadcast({s.name for s in r.body.free_symbols})}

    def _pick(self, p: Any) -> dict[str, Any]:
        prefix, suffix = self.printer.scale_parts(p.scale) if p.scale != 1 else ("", "")
        return {"name": p.name, "index": p.index, "loads": list(p.loads),
                "columns": list(p.columns), "value": self.print_named(p.name, _gathered(p)),
                "scale_prefix": prefix, "scale_suffix": suffix,
                "formula": f"{p.name} = {formula(p.scale)} * ({formula(p.body)} at column "
                           f"{p.index}): a one-hot sum over the row, read as one element"}


def _gathered(p: Any) -> sympy.Expr:
    """A one-hot sum's body in the values gathered at its row's column, each named
    `<pick>_<tensor>` after the tensor it is read from."""
    tensors = set(p.loads) | set(p.columns)
    return p.body.xreplace({s: sympy.Symbol(f"{p.name}_{s.name}", real=True)
                            for s in p.body.free_symbols if s.name in tensors})


class _Renamed:
    """A printer that prints some symbols under other names."""

    def __init__(self, printer: KernelPrinter, names: dict[str, str]):
        self.printer, self.names = printer, names

    def __call__(self, expr: sympy.Expr) -> str:
        return self.printer(self._renamed(expr))

    def scale_parts(self, scale: sympy.Expr) -> tuple[str, str]:
        return self.printer.scale_parts(self._renamed(scale))

    def _renamed(self, expr: sympy.Expr) -> sympy.Expr:
        expr = sympy.sympify(expr)
        return expr.xreplace({s: sympy.Symbol(self.names[s.name], **s.assumptions0)
                              for s in expr.free_symbols if s.name in self.names})


#: API kinds whose autograd Functions take a `layout` (render_module)
SHAPED_KINDS = ("elementwise", "normalized_shape", "position_embedding")


def render_module(module: ModuleSpec, forward: Kernel, backwards: dict[str, Kernel],
                  schedule: ScheduleTable | None = None, *, jvp: Kernel,
                  recorded: dict[str, tuple[Any, Kernel | None] | None],
                  siblings: dict[str, Any] | None = None) -> str:
    """`recorded`: per mode, the backward autograd can record (derive/higher.py's
    RecordedBackward) and the kernel derived for it (None: the mode's own), or None.
    `siblings`: the APIs of the ops the API's variant argument selects, by op name."""
    schedule = schedule or default_table()
    env = environment()
    params = list(module.params)
    in_place = bool(getattr(module.api, "in_place", False))
    several = len(module.modes) > 1
    forward_facts = KernelFacts(forward, backward=False)
    fwd = TritonKernel(forward_facts)
    # APIs whose Function takes its dense tensors as the caller gave them and the layout of
    # their rows (codegen/runtime/launch.py `layout`), and returns its results in the caller's
    # shape: views taken outside the Function would each be a node of autograd's graph
    shaped = module.api.kind in SHAPED_KINDS
    layout_inputs = [name for name in module.inputs
                     if name in fwd.element_inputs and name not in fwd.broadcast_inputs] * shaped
    element_stores = {s["name"] for s in fwd.element_stores}
    layout_outputs = [name for name in module.outputs if name in element_stores] * shaped
    # a norm's output is contiguous whatever its rows' order, as torch's norms return it (the
    # residual sum beside it keeps the inputs' layout, as torch's `x + r`)
    dense_outputs = module.outputs[:1] * (module.api.kind == "normalized_shape")
    # the Function's arguments: the custom op's inputs in its order (so that an input's
    # gradient sits at one index for both, `_Function.backward` serving the op's autograd
    # too), then a flag of the call the backward reads (ctx.in_place), the rows' layout and the
    # memory mode
    function_args = [*fwd.inputs, *["in_place"] * in_place, *["layout"] * shaped,
                     *["memory"] * several]
    given = [*module.inputs, *module.row_inputs, *params, *module.scalars]
    given += ["seed"] * module.seeded + ["row_shape"] * module.row_shape
    if sorted(given) != sorted(fwd.inputs):
        raise ValueError(f"{module.op}: the forward kernel takes {fwd.inputs}, the op {given}")
    gradient_of = dict(module.gradients)
    # optional outputs (those after the first) are stored when asked for (want_<name>); element
    # ones may take another dtype (<name>_dtype; the custom op's <name>_fp32)
    dtyped = [s["name"] for s in fwd.element_stores if s["name"] in module.outputs[1:]]
    modes = []
    emitted: set[str] = set()  # recorded kernels already in the module
    for mode, saved, doc in module.modes:
        backward = backwards[mode]
        # a row loss's backward may run on a window of the row (its linear variant's blocks of
        # classes)
        facts = KernelFacts(backward, windowed=module.api.kind == "row_loss")
        modes.append({
            "name": mode,
            "doc": doc,
            "saved": list(saved),
            "saved_for_backward": [*saved, *params] + ["seed"] * module.seeded,
            "bwd": TritonKernel(facts),
            "bwd_torch": TorchPath(facts),
            "unpack": [o.name for o in backward.outputs],
            # saved values the backward takes as rows again (the Function saves dense inputs
            # as given and results as returned: their rows are views the backward takes,
            # recorded where it is differentiated)
            "saved_shaped": [name for name in saved
                             if name in layout_inputs or name in layout_outputs],
        })
        bwd = modes[-1]["bwd"]
        stores = [s["name"] for s in bwd.element_stores]
        # saved inputs an elementwise backward may write its gradient over, by element store
        # (codegen/runtime/launch.py `reusable`): each element is read before it is written,
        # by the program that writes it
        modes[-1]["reused"] = dict(sorted(
            (stores.index(gradient_of[a]), a) for a in layout_inputs
            if bwd.foldable and a in saved and gradient_of.get(a) in stores
            and not bwd.element_stores[stores.index(gradient_of[a])]["flag"]))
        # element stores the launcher takes memory for (`into`): the input gradient's, written
        # into an upstream gradient (in_place) or a chunk's logits (a row loss); the reused
        # inputs' gradients
        first = ([0] if (in_place or module.api.kind == "row_loss")
                 and stores and not bwd.element_stores[0]["flag"] else [])
        facts.into_stores = sorted({*first, *modes[-1]["reused"]})
        modes[-1]["recorded"] = _recorded(recorded[mode], backward, modes[-1], fwd, emitted)
    supported = [m["name"] for m in modes if m["recorded"]]
    with_hidden = next((m["recorded"] for m in modes
                        if m["recorded"] and m["recorded"]["hidden"]), None)
    hidden = with_hidden["hidden"] if with_hidden else []
    tangents = _tangents(module, jvp, layout_inputs)
    for m in modes:
        m["unrecorded"] = None if m["recorded"] else _unrecorded(module, m, supported)
    # the tensors `_save` takes: the first input (its dtype and device), then every mode's
    # saved values
    save_tensors = list(dict.fromkeys(
        [fwd.first, *(name for m in modes for name in m["saved_for_backward"])]))
    # what each mode keeps for its backward of the forward's results stored on request: the
    # forward stores those, and the outputs the caller asks for (`want_<name>`)
    for m in modes:
        m["keeps"] = [store.name for store in forward.stores
                      if store.flag and store.name in m["saved"]]
    context = {
        "module": module,
        "fwd": fwd,
        "modes": modes,
        "several": several,
        "in_place": in_place,
        "upstream": module.upstream,
        "function_args": function_args,
        "gradient_of": gradient_of,
        # each differentiated argument's index among the Function's (and the op's) arguments
        "needs_index": {gradient_of[a]: i for i, a in enumerate(function_args)
                        if a in gradient_of},
        "save_tensors": save_tensors,
        # values the Function returns besides the op's outputs (saved values a recorded
        # backward differentiates through), with their upstream gradients
        "hidden": hidden,
        "hidden_upstream": with_hidden["hidden_upstream"] if with_hidden else [],
        "optional_outputs": list(module.outputs[1:]),
        "dtyped_outputs": dtyped,
        # Function.backward's arguments: a gradient per output (those of undifferentiated
        # outputs dropped)
        "output_grads": [upstream_symbol(name).name for name in module.outputs],
        "function_tensors": [*(name for name, _ in module.gradients)],
        # public argument name -> spec input name (elementwise APIs name every input)
        "rows": list(zip(getattr(module.api, "inputs", ()), module.inputs, strict=False)),
        # an elementwise forward's result keeps a permuted input's layout, as torch's
        # elementwise ops do; one with row reductions (a softmax) returns contiguous rows, as
        # torch's do
        "keeps_layout": not any(p.reductions for p in forward.passes),
        "layout_inputs": layout_inputs,
        "layout_outputs": layout_outputs,
        "dense_outputs": dense_outputs,
        "fwd_torch": TorchPath(forward_facts),
        "schedule": schedule.constants(module.op),
        "measured_schedules": schedule.measured(module.op),
        "dispatch_table": schedule.dispatch(module.op),
        "split_exchange": any(m["bwd"].split_span for m in modes),
        "sympy_version": sympy.__version__,
        "api_template": f"api_{module.api.kind}.py.j2",
        "siblings": siblings or {},
        "tangents": tangents,
        # the op of its torch counterpart that torch's autocast runs in float32, if any
        "autocast": autocast_policy(module.api.torch_function),
    }
    source = env.get_template("module.py.j2").render(**context)
    return _without_unused_imports(source).rstrip("\n") + "\n"


#: a torch function called in a counterpart expression: its name in torch or torch.nn.functional
_TORCH_CALL = re.compile(r"\btorch\.(?:nn\.functional\.)?(\w+)")


def autocast_policy(torch_function: str) -> str | None:
    """The first torch function that `torch_function` (an API's counterpart, such as
    "torch.nn.functional.layer_norm(input + residual, ...)") calls and that torch's autocast
    runs in float32 on some device type (codegen/runtime/amp.py `FLOAT32`); None where it
    calls none."""
    listed = frozenset().union(*amp.FLOAT32.values())
    for name in _TORCH_CALL.findall(torch_function):
        if name in listed:
            return name
    return None


def _recorded(plan: tuple[Any, Kernel | None] | None, backward: Kernel, mode: dict[str, Any],
              fwd: TritonKernel, emitted: set[str]) -> dict[str, Any] | None:
    """What a mode's autograd Function needs for the backward autograd records: the torch path
    it calls, whether the module defines it here, and the values the op returns besides its
    outputs (hidden), each with its upstream gradient and that gradient's index among the
    custom op's outputs."""
    if plan is None:
        return None
    recorded, kernel = plan
    rows = {s["name"] for s in fwd.row_stores}
    k = TorchPath(KernelFacts(kernel)) if kernel is not None else mode["bwd_torch"]
    fresh = kernel is not None and kernel.name not in emitted
    if kernel is not None:
        emitted.add(kernel.name)
    return {
        "k": k,
        "emit": fresh,
        "unpack": [o.name for o in (kernel or backward).outputs],
        "hidden": list(recorded.hidden),
        "reads": list(recorded.reads),
        "hidden_upstream": [{"name": upstream_symbol(name).name, "row": name in rows,
                             "index": fwd.returns.index(name)} for name in recorded.hidden],
    }


def _tangents(module: ModuleSpec, jvp: Kernel, layout_inputs: list[str]) -> dict[str, Any]:
    """What each autograd Function's `jvp` needs: the JVP's torch path, the primal tensors the
    forward keeps for it (`save_for_forward`), each argument's tangent and each output's (a
    Function's argument without one takes `_<name>`)."""
    k = TorchPath(KernelFacts(jvp, backward=False))
    tangent_of = dict(module.tangent_inputs)
    given = set(tangent_of.values())
    return {
        "k": k,
        "saved": [name for name in k.inputs if name not in given
                  and name not in (*module.scalars, "row_shape")],
        "of": tangent_of,
        "of_output": dict(module.tangent_outputs),
        "rows": [(tangent_of[name], name in layout_inputs) for name in module.inputs
                 if name in tangent_of and name not in module.broadcast_inputs],
        "unpack": [t.name for t in jvp.outputs],
        # tangents the JVP cannot take as None (zero): a learnable scalar's, and one read at
        # the partner column
        "zeros": [(tangent, name) for name, tangent in module.tangent_inputs
                  if any(t.name == tangent and t.level == "scalar" for t in jvp.inputs)
                  or any(source == tangent for _, source, _ in jvp.partners)],
    }


def _unrecorded(module: ModuleSpec, mode: dict[str, Any], supported: list[str]) -> str:
    """The error a mode raises where autograd would record its backward and cannot."""
    several = len(module.modes) > 1
    call = f"{module.api.function}(memory={mode['name']!r})" if several else module.api.function
    needs = f"needs memory={supported[0]!r}" if supported and several else "is not supported"
    saved = ", ".join(mode["saved"]) or "nothing"
    return (f"{call}: double backward (create_graph=True) {needs}: "
            f"{'this mode' if several else 'it'} saves {saved}, through which autograd cannot "
            "differentiate its backward")


#: imports the module template makes that only some ops' modules use, and how a use reads
_OPTIONAL_IMPORTS = {"import math": r"(?<![\w.])math\.", "import numbers": r"(?<![\w.])numbers\.",
                     "from typing import Optional": r"\bOptional\["}


def _without_unused_imports(source: str) -> str:
    """The module without the optional imports it does not use."""
    lines = source.split("\n")
    for line, use in _OPTIONAL_IMPORTS.items():
        if line in lines and not re.search(use, source):
            lines.remove(line)
    return "\n".join(lines)


def render_patch(apis: list[tuple[str, Any]], memory: dict[str, tuple[str, ...]]) -> str:
    """generated/patch.py: the replacement rules every spec's API declares, in spec order, as
    rows of the runtime's rule table. `memory`: each op's memory modes, default first."""
    rules = []
    for op, api in apis:
        for rule in getattr(api, "replaces", ()):
            kind = replaces_kind(api, rule)
            params = [p for p in getattr(api, "params", ()) if not p.scalar]
            rules.append({
                "kind": kind, "pattern": rule.pattern, "op": op,
                # an API with a Hugging Face-style function (a position embedding's
                # apply_rotary_pos_emb) is called through it
                "function": getattr(api, "embed", None) or api.function,
                # an MLP or a loss is computed by the function, not by the op's module
                "module": api.module if kind in ("norm", "activation") else None,
                "params": [(p.name, p.flag, p.offset) for p in params],
                "tries": [(name, tuple(v if isinstance(v, str) else float(v) for v in values))
                          for name, values in rule.tries],
                "eps": api.eps if kind == "norm" else None,
                "memory": memory[op] if len(memory[op]) > 1 else (),
            })
    ops = sorted({rule["op"] for rule in rules})
    return environment().get_template("patch.py.j2").render(rules=rules, ops=ops)


def render_facade(sources: dict[str, str]) -> str:
    """vjpforge.py: every public function and class each generated module defines (by module
    name -> source), under its own name. Two modules defining one name is an error."""
    homes: dict[str, str] = {}
    for module, source in sorted(sources.items()):
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                if node.name in homes:
                    raise ValueError(f"generated.{homes[node.name]} and generated.{module} "
                                     f"both define {node.name}: vjpforge can export only one")
                homes[node.name] = module
    modules = sorted({module for module in homes.values()})
    return environment().get_template("vjpforge.py.j2").render(
        names=sorted(homes.items()),
        modules=[(m, sorted(n for n, home in homes.items() if home == m)) for m in modules])


def render_user_test(module: ModuleSpec, spec_path: str,
                     positive: frozenset[str] = frozenset()) -> str:
    """A finite-difference test that sits next to a module derived from a user's spec: it calls
    the op as its API kind says, varying every tensor that gets a gradient; the tensors named
    in `positive` (spec names, `positive_tensors`) are drawn positive."""
    api = module.api
    ignored = None
    if api.kind == "row_loss":
        # a row whose target is the ignored class (loss 0)
        ignore = next(o.default for o in api.options if o.name == api.ignore)
        ignored = int(ignore) if float(ignore).is_integer() else 0
    return environment().get_template("user_test.py.j2").render(
        module=module, spec_path=spec_path, modes=[mode for mode, _, _ in module.modes],
        positive=positive, ignored=ignored)


def positive_tensors(spec: Any) -> frozenset[str]:
    """The tensors of a spec (inputs and parameters) that its generated test draws positive:
    those a log's argument or a root's base depends on, where that argument may be negative
    for real values of them (log(x), sqrt(x * w), but not log(1 + exp(x)) nor sqrt(sum(x**2)):
    a random draw is 0 with probability 0). Proved with SymPy's assumptions: each value is
    written in the tensors, the row sums as values of their own, nonnegative or positive where
    their bodies are; a value declared positive is; a scalar is its option's default where the
    API has one."""
    from derive.spec import Kind

    tensors = {n.name for n in spec.nodes
               if n.kind in (Kind.INPUT, Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)}
    defaults = {o.name: o.default for o in getattr(spec.api, "options", ())
                if isinstance(o.default, (int, float)) and not isinstance(o.default, bool)}
    positive: set[str] = set()
    while True:
        values, depends = _values_in_tensors(spec, positive, defaults)
        needing: set[str] = set()
        for node in spec.nodes:
            if node.expr is None:
                continue
            for argument in _needs_positive(node.expr):
                written = argument.xreplace(values)
                if written.is_nonnegative is not True:
                    needing |= {name for s in argument.free_symbols
                                for name in depends.get(s.name, ())} & tensors
        if needing <= positive:
            return frozenset(positive)
        positive |= needing


def _needs_positive(expr: sympy.Expr) -> list[sympy.Expr]:
    """The arguments of logs and the bases of roots in expr."""
    found = [e.args[0] for e in expr.atoms(sympy.log)]
    found += [e.base for e in expr.atoms(sympy.Pow) if not e.exp.is_integer]
    return found


def _values_in_tensors(spec: Any, positive: set[str], defaults: dict[str, float]
                       ) -> tuple[dict[sympy.Symbol, sympy.Expr], dict[str, set[str]]]:
    """Each value of the spec written in its tensors (positive ones as positive symbols), and
    the tensors each depends on, by name."""
    from derive.spec import Kind

    values: dict[sympy.Symbol, sympy.Expr] = {}
    depends: dict[str, set[str]] = {}
    for node in spec.nodes:
        name = node.name
        depends[name] = {name}
        if node.kind in (Kind.INPUT, Kind.COLUMN_PARAM, Kind.SCALAR_PARAM):
            values[node.symbol] = sympy.Symbol(name, positive=True) if name in positive \
                else sympy.Symbol(name, real=True)
        elif node.kind is Kind.PARTNER:
            # the value at another column, of the same sign as the tensor read
            read = values[spec.node(node.partner_of).symbol]
            values[node.symbol] = sympy.Symbol(name, **read.assumptions0)
            depends[name] = {node.partner_of}
        elif node.kind is Kind.SCALAR and not node.symbol.is_positive and name in defaults:
            values[node.symbol] = sympy.nsimplify(defaults[name])
        elif node.kind is Kind.RANDOM or node.kind is Kind.INDEX:
            values[node.symbol] = sympy.Symbol(name, nonnegative=True)
        elif node.expr is not None:
            depends[name] = {d for s in node.expr.free_symbols for d in depends.get(s.name, ())}
            body = node.expr.xreplace(values)
            if node.symbol.is_positive:
                values[node.symbol] = node.symbol  # declared positive
            elif node.kind is Kind.REDUCE:
                # a sum of positive values is positive; a max of them too
                assumptions = {"positive": True} if body.is_positive else \
                    {"nonnegative": True} if body.is_nonnegative else {"real": True}
                values[node.symbol] = sympy.Symbol(name, **assumptions)
            else:
                values[node.symbol] = body
    return values, depends

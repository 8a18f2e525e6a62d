"""The public spec API: what an op computes over ONE generic element j of a row.

A spec never sees a whole row. It names the row's element values (inputs), per-column
parameters shared by every row, scalars, row reductions and elementwise definitions, then
says what the forward returns and what it keeps for the backward. The engine derives the rest.

    op = OpSpec("rmsnorm")
    x = op.input("x")
    weight = op.column_param("weight", absent=1)
    eps = op.scalar("eps")
    mean_square = op.row_mean("mean_square", x**2)
    rstd = op.row("rstd", 1 / sympy.sqrt(mean_square + eps), positive=True)
    x_hat = op.element("x_hat", x * rstd)
    op.output("y", x_hat * weight)
    op.save(x, rstd)
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import sympy


class Level(Enum):
    """Where a value varies: along the row (element), across columns only, per row, or nowhere."""

    ELEMENT = "element"
    COLUMN = "column"
    ROW = "row"
    SCALAR = "scalar"


class Kind(Enum):
    INPUT = "input"
    COLUMN_PARAM = "column_param"
    SCALAR_PARAM = "scalar_param"
    SCALAR = "scalar"
    ELEMENT = "element"
    ROW = "row"
    REDUCE = "reduce"
    ROW_INPUT = "row_input"
    INDEX = "index"
    RANDOM = "random"
    PARTNER = "partner"


#: kinds that are never differentiated and that a backward can always regenerate
REGENERATED = (Kind.INDEX, Kind.RANDOM)


REDUCTIONS = ("sum", "mean", "max", "min")

#: The involutive pairings of a row's columns that `OpSpec.partner` reads across: "half" pairs
#: column j with (j + N/2) mod N (Hugging Face's rotate_half), "interleaved" j with j XOR 1
#: (GPT-J's). Each needs an even row width.
PAIRINGS = ("half", "interleaved")

#: Names the generated code uses for itself (kernel, launcher and API locals).
RESERVED = frozenset({
    "mask", "row_mask", "col_mask", "rows", "cols", "offsets", "pid", "programs", "row_block",
    "start", "seed", "row_shape", "M", "D1", "D2", "acc", "dtype", "device", "shape", "columns",
    "function", "outputs", "schedule", "kernel", "ctx", "needs", "torch", "tl", "triton",
    "training", "memory", "stores", "gradients", "input",
    # what a generated module imports: a spec value of that name would shadow it
    "math", "numbers", "Optional", "checks", "launch", "helpers", "losses", "Constants",
    "Schedules", "fixed_n", "maxnreg"})

#: The row length. Every mean carries a 1/N.
N = sympy.Symbol("N", positive=True, integer=True)


class Rounded(sympy.Function):
    """Its argument rounded to the dtype of the op's input (a 16-bit input's bf16 or fp16; an
    fp32 or fp64 input's own, a no-op there), then computed on at the accumulator's precision:
    a framework's `.to(input_dtype)` between two fp32 steps (Hugging Face's LlamaRMSNorm
    rounds x_hat so before its weight multiplies it). Its derivative is 1, as torch's autograd
    takes a cast's: the gradient passes through it unrounded."""

    nargs = 1
    is_real = True

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        # 0 is 0 in every dtype: a rounded value that vanishes where a row is padded still does
        return sympy.Integer(0) if arg.is_zero else None

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return sympy.Integer(1)

    def _latex(self, printer: Any, exp: str | None = None) -> str:
        text = r"\operatorname{rd}\left(" + printer._print(self.args[0]) + r"\right)"
        return text if exp is None else f"{text}^{{{exp}}}"


class Detached(sympy.Function):
    """Its argument's value, never differentiated: torch's `.detach()` inside an expression
    (a weight computed from the inputs that the gradient must not flow through, as a token's
    predicted probability scaling its loss). Its derivative is 0, in the backward, the
    tangent of forward-mode AD and every higher derivative."""

    nargs = 1
    is_real = True

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        # a number has no derivative to drop
        return arg if arg.is_number else None

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return sympy.Integer(0)

    def _eval_is_positive(self) -> bool | None:
        return self.args[0].is_positive

    def _latex(self, printer: Any, exp: str | None = None) -> str:
        text = r"\operatorname{sg}\left(" + printer._print(self.args[0]) + r"\right)"
        return text if exp is None else f"{text}^{{{exp}}}"


#: The functions of the spec language (docs/spec_language.md, "Supported functions"); a
#: function of numbers alone is a number and may be any SymPy evaluates (sqrt(2), log(2)).
FUNCTIONS = (sympy.exp, sympy.log, sympy.tanh, sympy.erf, sympy.sin, sympy.cos,
             sympy.sinh, sympy.cosh, sympy.Abs, sympy.Max, sympy.Min, sympy.Heaviside,
             sympy.sign, sympy.Piecewise, sympy.Mod, Rounded, Detached)

#: What else an expression of the language is built of: arithmetic, and the conditions of a
#: Piecewise (comparisons joined by And, Or, Not)
_STRUCTURE = (sympy.Symbol, sympy.Add, sympy.Mul, sympy.core.relational.Relational, sympy.And,
              sympy.Or, sympy.Not, sympy.ITE, sympy.logic.boolalg.BooleanAtom,
              sympy.functions.elementary.piecewise.ExprCondPair)


#: the most square roots nested in a power of the language: x**(1/16)
ROOT_DEPTH = 4


def is_language_power(exponent: sympy.Expr) -> bool:
    """Whether x**exponent is a power of the spec language: an integer power times square
    roots nested at most ROOT_DEPTH deep (x**6, x**(-3/2), sqrt(sqrt(x)) = x**(1/4))."""
    return bool(exponent.is_Rational) and exponent.q <= 2**ROOT_DEPTH and \
        exponent.q & (exponent.q - 1) == 0


def outside_language(expr: sympy.Basic) -> str | None:
    """Why `expr` is outside the spec language, or None where it is inside."""
    if getattr(expr, "is_number", False) and not expr.free_symbols:
        if expr.has(sympy.nan, sympy.zoo) or expr.is_extended_real is False:
            return f"the number {expr} is not a real number or ±oo"
        return None
    from derive.algebra import GuardedReciprocal  # the engine's own, which specs may use too

    if isinstance(expr, sympy.Mod) and not (expr.args[0].is_integer and
                                             expr.args[1].is_Integer and expr.args[1] > 0):
        return (f"{expr}: Mod is of the column index by a positive integer (its parity, "
                "Mod(j, 2)) in the spec language (docs/spec_language.md)")
    if isinstance(expr, (*FUNCTIONS, GuardedReciprocal)):
        pass
    elif isinstance(expr, sympy.Pow):
        exponent = expr.exp
        if not is_language_power(exponent):
            return (f"the power {expr} is outside the spec language, which has integer "
                    "powers and powers of square roots (x**6, x**-3, sqrt(x), x**(3/2), "
                    "sqrt(sqrt(x)) = x**(1/4)); write a power of a positive base with another "
                    "exponent as exp(exponent * log(base))")
    elif isinstance(expr, sympy.Function):
        name = getattr(type(expr), "__name__", str(expr.func))
        return (f"{name} is not a function of the spec language (its functions: "
                f"{', '.join(f.__name__ for f in FUNCTIONS)}, sqrt and powers; "
                "docs/spec_language.md)")
    elif not isinstance(expr, _STRUCTURE):
        return (f"{type(expr).__name__} ({expr}) is outside the spec language "
                "(docs/spec_language.md)")
    return next((why for arg in expr.args if (why := outside_language(arg)) is not None), None)


def _exact_exponents(expr: sympy.Expr) -> sympy.Expr:
    """A float exponent that is a power's of the language as that rational (x**0.5 is sqrt(x),
    x**2.0 is x*x, x**0.25 is sqrt(sqrt(x)))."""
    def exact(e: sympy.Basic) -> bool:
        return isinstance(e, sympy.Pow) and e.exp.is_Float and \
            is_language_power(sympy.Rational(float(e.exp)))

    return expr.replace(exact, lambda e: sympy.Pow(e.base, sympy.Rational(float(e.exp))))


class SpecError(ValueError):
    """A malformed spec. The message names the spec file and line that declared the culprit."""


@dataclass(frozen=True)
class Node:
    """One named value of the forward graph."""

    name: str
    symbol: sympy.Symbol
    kind: Kind
    level: Level
    expr: sympy.Expr | None = None
    reduction: str | None = None
    absent: sympy.Expr | None = None
    where: str = ""
    grad: bool = True  # an input that gets a gradient
    broadcast: bool = False  # an element input given broadcastable to the first input
    integer: bool = False  # a per-row integer (a class index)
    partner_of: str | None = None  # a partner read: the element input it reads
    pairing: str | None = None  # ... at the partner column of this pairing (PAIRINGS)

    @property
    def is_definition(self) -> bool:
        return self.kind in (Kind.ELEMENT, Kind.ROW, Kind.REDUCE)


@dataclass
class OpSpec:
    """The forward of one row op, built by calling its methods in definition order."""

    name: str
    doc: str = ""
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    #: outputs never differentiated (`output(..., grad=False)`), the last of `outputs`
    undifferentiated: list[str] = field(default_factory=list)
    modes: dict[str, list[str]] = field(default_factory=dict)
    mode_docs: dict[str, str] = field(default_factory=dict)
    #: file:line of each mode's save() call, for errors about what it saves
    mode_where: dict[str, str] = field(default_factory=dict)
    api: Any = None
    source: str = ""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "api" and value is not None:
            # where the spec sets op.api: an API that does not match the spec is refused there
            object.__setattr__(self, "_api_where", _caller_location())
        object.__setattr__(self, name, value)

    @property
    def api_where(self) -> str:
        """file:line of the spec's `op.api = ...` (the spec file where that is unknown)."""
        return getattr(self, "_api_where", self.source)

    # ------------------------------------------------------------------ declarations
    def input(self, name: str, absent: float | None = None, grad: bool = True,
              broadcast: bool = False) -> sympy.Symbol:
        """An element of a row of an input tensor (the tensor is differentiated).

        `absent` makes the tensor optional: the value it takes when the caller passes None
        (0 for a residual). The first input is always required. `grad=False` declares a
        tensor that is never differentiated (an attention mask); `broadcast=True` lets the
        caller pass it broadcastable to the first input over its leading dims (the kernel
        reads it through strides, never materialising the broadcast).
        """
        first = not any(n.kind is Kind.INPUT for n in self.nodes)
        if first and (absent is not None or not grad or broadcast):
            raise SpecError(f"{_caller_location()}: the first input '{name}' sets the shape: "
                            "it cannot be optional, broadcast or without a gradient")
        if broadcast and grad:
            raise SpecError(f"{_caller_location()}: '{name}': a broadcast input must be "
                            "declared grad=False (its gradient would be a sum over broadcasts)")
        node_absent = None if absent is None else sympy.sympify(absent)
        return self._declare(name, Kind.INPUT, Level.ELEMENT, absent=node_absent, grad=grad,
                             broadcast=broadcast)

    def row_input(self, name: str, integer: bool = False) -> sympy.Symbol:
        """One value per row given by the caller and never differentiated (a class index:
        `integer=True` keeps it an integer in the kernel)."""
        return self._declare(name, Kind.ROW_INPUT, Level.ROW, grad=False, integer=integer)

    def column_index(self, name: str) -> sympy.Symbol:
        """The index j of the element within its row (0 .. N-1)."""
        return self._declare(name, Kind.INDEX, Level.COLUMN, grad=False, integer=True)

    def row_index(self, name: str) -> sympy.Symbol:
        """The index of the row along the input's dim -2 (a query position of attention
        scores (..., Q, K))."""
        return self._declare(name, Kind.INDEX, Level.ROW, grad=False, integer=True)

    def random(self, name: str) -> sympy.Symbol:
        """A uniform random value in [0, 1) for every element, from the call's seed and the
        element's index (Philox). Never stored: a backward regenerates it."""
        return self._declare(name, Kind.RANDOM, Level.ELEMENT, grad=False)

    def partner(self, name: str, value: sympy.Symbol, pairing: str = "half") -> sympy.Symbol:
        """The element input (or per-column parameter) `value` read at the partner column
        p(j) of a fixed involutive pairing of the row's columns (PAIRINGS): "half" (p(j) =
        (j + N/2) mod N, Hugging Face's rotate_half) or "interleaved" (p(j) = j XOR 1). The one
        cross-element read of the language: its adjoint reaches `value` shifted to the partner
        column (docs/spec_language.md). A row width the pairing cannot take (odd) raises at
        the call."""
        where = _caller_location()
        if pairing not in PAIRINGS:
            raise SpecError(f"{where}: '{name}': partner() takes pairing "
                            f"{' or '.join(map(repr, PAIRINGS))}, got {pairing!r}")
        source = next((n for n in self.nodes if n.symbol == value), None)
        if source is None or source.kind not in (Kind.INPUT, Kind.COLUMN_PARAM):
            what = (f"{source.kind.value} '{source.name}'" if source is not None
                    else repr(value))
            raise SpecError(f"{where}: '{name}': partner() reads an element input or a column "
                            f"parameter at the partner column (a tensor in memory); got {what}: "
                            "read the inputs it is made of at the partner column instead")
        if source.absent is not None:
            raise SpecError(f"{where}: '{name}': partner() reads a tensor the caller always "
                            f"gives; {source.kind.value} '{source.name}' is optional "
                            f"(absent={source.absent})")
        for node in self.nodes:
            if node.kind is Kind.PARTNER and node.pairing != pairing:
                raise SpecError(f"{where}: '{name}': pairing {pairing!r} differs from the "
                                f"{node.pairing!r} of '{node.name}': a spec reads across one "
                                "pairing of its columns")
            if node.kind is Kind.PARTNER and node.partner_of == source.name:
                raise SpecError(f"{where}: '{name}': '{node.name}' reads '{source.name}' at "
                                "its partner column already; use it")
        return self._declare(name, Kind.PARTNER, source.level, grad=source.grad,
                             partner_of=source.name, pairing=pairing)

    @property
    def pairing(self) -> str | None:
        """The pairing the spec's partner reads use, None where it has none."""
        return next((n.pairing for n in self.nodes if n.kind is Kind.PARTNER), None)

    def column_param(self, name: str, absent: float | None = None,
                     grad: bool = True) -> sympy.Symbol:
        """A per-column parameter shared by all rows; its gradient is a column reduction.

        `absent` is the value it takes when the caller passes None (1 for a scale, 0 for a
        shift); None means the parameter is required. `grad=False` declares one that is never
        differentiated (cross-entropy's class weights, as torch's).
        """
        node_absent = None if absent is None else sympy.sympify(absent)
        return self._declare(name, Kind.COLUMN_PARAM, Level.COLUMN, absent=node_absent,
                             grad=grad)

    def scalar_param(self, name: str) -> sympy.Symbol:
        """A learnable scalar (a 0-d tensor) shared by every element: its gradient is a sum over
        all rows and columns (DyT's alpha)."""
        return self._declare(name, Kind.SCALAR_PARAM, Level.SCALAR)

    def scalar(self, name: str, positive: bool = False,
               absent: float | None = None) -> sympy.Symbol:
        """A constant of the call, not differentiated (eps, a scale).

        `absent` declares a scalar that may be off (an option whose default turns a feature
        off): the value it then takes. The kernels are compiled for whether it is: every
        Piecewise branch on `Eq(name, absent)` (or `Ne`) is chosen at compile time, so a call
        with the scalar off runs the kernels as if the spec never had it (no select, nothing
        computed per element for it).
        """
        node_absent = None if absent is None else sympy.sympify(absent)
        if node_absent is not None and not (node_absent.is_number and node_absent.is_finite):
            raise SpecError(f"{_caller_location()}: scalar '{name}': absent must be a finite "
                            f"number, got {absent!r}")
        if node_absent is not None and positive and not node_absent > 0:
            # SymPy would read Eq(name, absent) as False: the scalar could never be off
            raise SpecError(f"{_caller_location()}: scalar '{name}' is declared positive, so it "
                            f"cannot take its absent value {absent!r}")
        return self._declare(name, Kind.SCALAR, Level.SCALAR, positive=positive,
                             absent=node_absent)

    def element(self, name: str, expr: Any, positive: bool = False) -> sympy.Symbol:
        """An elementwise definition over the generic element j."""
        expr = self._expression(name, expr)
        level = self._level_of(expr)
        if level not in (Level.ELEMENT, Level.COLUMN):
            raise self._error(name, f"element() needs an expression that varies along the row; "
                                    f"got {expr}, which is {level.value}-level: use row()")
        return self._declare(name, Kind.ELEMENT, Level.ELEMENT, expr=expr, positive=positive)

    def rounded(self, name: str, expr: Any) -> sympy.Symbol:
        """`expr` rounded to the input's dtype (`Rounded`, whose derivative is 1): an element
        value where `expr` varies along the row, else a row value. `Rounded(expr)` may also be
        written inside any expression (under a `Piecewise` of a scalar declared `absent=`, so
        that the kernels round only where the call asks)."""
        expr = Rounded(self._expression(name, expr))
        if self._level_of(expr) in (Level.ELEMENT, Level.COLUMN):
            return self.element(name, expr)
        return self.row(name, expr)

    def row(self, name: str, expr: Any, positive: bool = False) -> sympy.Symbol:
        """A per-row scalar computed from other row scalars and scalars."""
        expr = self._expression(name, expr)
        level = self._level_of(expr)
        if level in (Level.ELEMENT, Level.COLUMN):
            raise self._error(name, f"row() needs an expression of row scalars; got {expr}, "
                                    f"which varies along the row: reduce it with row_sum/row_mean")
        return self._declare(name, Kind.ROW, Level.ROW, expr=expr, positive=positive)

    def row_sum(self, name: str, body: Any, positive: bool = False) -> sympy.Symbol:
        """name = Σ_j body_j."""
        return self._reduce(name, "sum", body, positive)

    def row_mean(self, name: str, body: Any, positive: bool = False) -> sympy.Symbol:
        """name = (1/N) Σ_j body_j."""
        return self._reduce(name, "mean", body, positive)

    def row_max(self, name: str, body: Any) -> sympy.Symbol:
        """name = max_j body_j. Allowed only where it stabilises: the engine proves the output
        does not depend on it."""
        return self._reduce(name, "max", body, False)

    def row_min(self, name: str, body: Any) -> sympy.Symbol:
        """name = min_j body_j. Never differentiated: allowed only where no differentiated
        output depends on it, as an index for an output declared `output(..., grad=False)`
        (the first column where a row reaches its max: an argmax, torch.argmax's tie rule)."""
        return self._reduce(name, "min", body, False)

    def output(self, *symbols: sympy.Symbol, grad: bool = True) -> None:
        """The results returned by the forward, in order: elementwise values, or one value per
        row (a loss).

        `grad=False` declares outputs that are never differentiated: values the call returns
        on request besides its result (a loss's z-loss term, for logging), whose gradient,
        if any reaches them, is dropped. They come after every differentiated output."""
        for symbol in symbols:
            node = self.node_of(symbol, "output")
            if node.level not in (Level.ELEMENT, Level.ROW) or not node.is_definition:
                raise self._error(node.name, "output() takes elementwise or per-row "
                                             f"definitions; got {node.level.value}-level "
                                             f"{node.kind.value} '{node.name}'")
            if node.name in self.outputs:
                raise self._error(node.name, f"'{node.name}' is an output already")
            if grad and self.undifferentiated:
                raise self._error(node.name, f"the differentiated output '{node.name}' must "
                                             "come before the outputs declared grad=False ("
                                             f"{', '.join(self.undifferentiated)})")
            if not grad and not self.outputs:
                raise self._error(node.name, "the first output is the op's result and is "
                                             "differentiated: declare it without grad=False")
            self.outputs.append(node.name)
            if not grad:
                self.undifferentiated.append(node.name)

    @property
    def differentiated(self) -> list[str]:
        """The outputs a backward takes an upstream gradient of."""
        return [name for name in self.outputs if name not in self.undifferentiated]

    def save(self, *symbols: sympy.Symbol, mode: str = "default", doc: str = "") -> None:
        """What the forward keeps for the backward (inputs, elementwise values, row scalars).

        Each `mode` is one memory policy; the engine derives a backward for every mode from
        its saved set alone. The first mode declared is the default.
        """
        if mode in self.modes:
            raise SpecError(f"{_caller_location()}: memory mode '{mode}' is declared twice")
        if not mode.isidentifier():
            raise SpecError(f"{_caller_location()}: a memory mode name must be an identifier, "
                            f"got {mode!r}")
        self.modes[mode] = []
        self.mode_docs[mode] = doc
        self.mode_where[mode] = _caller_location()
        for symbol in symbols:
            node = self.node_of(symbol, "save")
            if node.kind is Kind.PARTNER:
                raise self._error(node.name, f"'{node.name}' is input '{node.partner_of}' read "
                                             "at the partner column: save "
                                             f"'{node.partner_of}' instead")
            if node.kind in (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM, Kind.SCALAR, *REGENERATED):
                raise self._error(node.name, f"save() keeps activations and row statistics; "
                                             f"'{node.name}' is a {node.kind.value} and is "
                                             "always available to the backward")
            self.modes[mode].append(node.name)

    @property
    def saved(self) -> list[str]:
        """The default mode's saved set."""
        return next(iter(self.modes.values()), [])

    def saved_anywhere(self) -> set[str]:
        return {name for names in self.modes.values() for name in names}

    # ------------------------------------------------------------------ queries
    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def node_of(self, symbol: Any, role: str) -> Node:
        for node in self.nodes:
            if node.symbol == symbol:
                return node
        raise SpecError(f"{_caller_location()}: {role}() got {symbol!r}, which is not a value "
                        f"declared in spec '{self.name}'")

    def level_of(self, symbol: sympy.Symbol) -> Level:
        if symbol == N:
            return Level.SCALAR
        return self.node_of(symbol, "expression").level

    # ------------------------------------------------------------------ internals
    def _declare(self, name: str, kind: Kind, level: Level, expr: sympy.Expr | None = None,
                 reduction: str | None = None, absent: sympy.Expr | None = None,
                 positive: bool = False, grad: bool = True, broadcast: bool = False,
                 integer: bool = False, partner_of: str | None = None,
                 pairing: str | None = None) -> sympy.Symbol:
        where = _caller_location()
        if not name.isidentifier() or name.startswith("_") or name == "N":
            raise SpecError(f"{where}: a name must be a Python identifier that does not start "
                            f"with '_' and is not 'N'; got {name!r}")
        if name in RESERVED:
            raise SpecError(f"{where}: '{name}' is a name the generated code uses for itself; "
                            f"choose another (reserved: {', '.join(sorted(RESERVED))})")
        if any(node.name == name for node in self.nodes):
            raise SpecError(f"{where}: '{name}' is declared twice in spec '{self.name}'")
        assumptions = ({"positive": True} if positive else {"integer": True} if integer
                       else {"real": True})
        symbol = sympy.Symbol(name, **assumptions)
        self.nodes.append(Node(name, symbol, kind, level, expr, reduction, absent, where, grad,
                               broadcast, integer, partner_of, pairing))
        return symbol

    def _reduce(self, name: str, reduction: str, body: Any, positive: bool) -> sympy.Symbol:
        body = self._expression(name, body)
        if self._level_of(body) not in (Level.ELEMENT, Level.COLUMN):
            raise self._error(name, f"row_{reduction}() reduces over the row; its body {body} "
                                    "does not vary along the row")
        return self._declare(name, Kind.REDUCE, Level.ROW, expr=body, reduction=reduction,
                             positive=positive)

    def _expression(self, name: str, expr: Any) -> sympy.Expr:
        try:
            expr = sympy.sympify(expr)
        except (sympy.SympifyError, TypeError) as error:
            raise self._error(name, f"cannot read the expression {expr!r}: {error}") from error
        if isinstance(expr, sympy.logic.boolalg.Boolean) and not isinstance(expr, sympy.Expr):
            raise self._error(name, f"{expr} is a condition, not a value: a condition selects "
                                    f"in a Piecewise, as Piecewise((1, {expr}), (0, True))")
        expr = _exact_exponents(expr)
        why = outside_language(expr)
        if why is not None:
            raise self._error(name, why)
        unknown = sorted((s for s in expr.free_symbols if s != N and
                          not any(node.symbol == s for node in self.nodes)), key=str)
        if unknown:
            raise self._error(name, f"the expression {expr} uses {', '.join(map(str, unknown))}, "
                                    "not declared before it in this spec")
        return expr

    def _level_of(self, expr: sympy.Expr) -> Level:
        levels = {self.level_of(s) for s in expr.free_symbols}
        for level in (Level.ELEMENT, Level.COLUMN, Level.ROW):
            if level in levels:
                if level is Level.COLUMN and Level.ELEMENT in levels:
                    return Level.ELEMENT
                return level
        return Level.SCALAR

    def _error(self, name: str, message: str) -> SpecError:
        return SpecError(f"{_caller_location()}: '{name}': {message}")


def build_from_file(path: Path, function: str, expected: type) -> Any:
    """Import a spec file and call its `function()`, which must return an `expected`."""
    module_spec = importlib.util.spec_from_file_location(f"_vjpforge_{function}_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:
        raise SpecError(f"{error.filename or path}:{error.lineno}: syntax error: {error.msg}") \
            from None
    except SpecError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of user code is reported at its line
        raise _user_code_error(path, error) from None
    build = getattr(module, function, None)
    if not callable(build):
        raise SpecError(f"{path}: a spec file defines `def {function}() -> {expected.__name__}`; "
                        "none found")
    try:
        built = build()
    except SpecError:
        raise
    except Exception as error:  # noqa: BLE001
        raise _user_code_error(path, error) from None
    if not isinstance(built, expected):
        raise SpecError(f"{path}: {function}() must return an object of type "
                        f"{expected.__name__}, got {type(built).__name__}")
    return built


def _user_code_error(path: Path, error: Exception) -> SpecError:
    """A failure inside a spec file, reported at the spec line that raised it, with a hint for
    the usual causes."""
    line = "?"
    frames = traceback.extract_tb(error.__traceback__)
    for frame in frames:
        if Path(frame.filename).resolve() == path.resolve():
            line = str(frame.lineno)
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, AttributeError) and "OpSpec" in str(error):
        methods = sorted(m for m in dir(OpSpec) if not m.startswith("_") and
                         callable(getattr(OpSpec, m)))
        message += f" (OpSpec's methods: {', '.join(methods)})"
    elif isinstance(error, TypeError) and "truth value of Relational" in str(error):
        message += (" (Python's `and`, `or`, `not`, a chained comparison `a < x < b` or the "
                    "builtin max/min asked for the truth of a symbolic comparison: write "
                    "sympy.And(a < x, x < b), sympy.Or, sympy.Not, sympy.Max, sympy.Min)")
    elif isinstance(error, TypeError) and ("float" in str(error) or "real number" in str(error)):
        message += (" (a math-module function got a symbol: use the sympy function instead, "
                    "e.g. sympy.tanh, not math.tanh; the supported functions are listed in "
                    "docs/spec_language.md)")
    return SpecError(f"{path}:{line}: {message}")


def _caller_location() -> str:
    """file:line of the first frame outside this module: the spec line that declared a value."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "<spec>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"

"""Block specs: a whole layer as a dataflow of generated ops, torch GEMMs and attention.

An op spec (derive/spec.py) says what ONE row op computes, and the engine derives its backward.
A block spec composes ops: it names the layer's constructor options and its parameters (shapes
from the options), declared as an op's API declares them (derive/api.py Option and Param, checked
by the same runtime checks), its forward inputs, and the steps of its forward, each one call:

    block = BlockSpec("bert_layer", "BertLayer", doc=__doc__)
    hidden = block.size("hidden_size", "width of the hidden states")
    eps = block.positive("layer_norm_eps", 1e-12, "LayerNorm epsilon")
    weight = block.param("norm_w", (hidden,), "ones", "LayerNorm weight")
    x = block.input("hidden_states", "(batch, seq, hidden_size)")
    y = block.call(op("layernorm", "layer_norm"), x, (hidden,), weight, None, eps, out="y")
    block.output(y, "the normalized hidden states")

Nothing here is differentiated: autograd runs through the generated ops (whose backwards the
engine derived), torch's GEMMs and attention, and torch.utils.checkpoint. Options steer the
dataflow with `block.branch()` (if / elif / else over conditions on options and
`training`) and `block.checkpoint(...)` (a region recomputed in the backward when a flag option
is on). Every value is assigned once (once per branch case), so the emitted forward is
straight-line code that reads like a hand-written layer. codegen/layers.py renders the module.
"""

from __future__ import annotations

import keyword
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derive.api import REQUIRED, Option, Param
from derive.spec import SpecError, build_from_file

# Expressions: what a step passes. Printed by codegen/layers.py, never evaluated here.


class Expr:
    """A value of a block spec. Arithmetic and comparisons build bigger expressions; `&`, `|`
    and `~` combine conditions (Python's `and`/`not` cannot be overloaded)."""

    def __add__(self, other: object) -> Binary:
        return Binary("+", self, lift(other))

    def __radd__(self, other: object) -> Binary:
        return Binary("+", lift(other), self)

    def __sub__(self, other: object) -> Binary:
        return Binary("-", self, lift(other))

    def __mul__(self, other: object) -> Binary:
        return Binary("*", self, lift(other))

    def __rmul__(self, other: object) -> Binary:
        return Binary("*", lift(other), self)

    def __truediv__(self, other: object) -> Binary:
        return Binary("/", self, lift(other))

    def __floordiv__(self, other: object) -> Binary:
        return Binary("//", self, lift(other))

    def __mod__(self, other: object) -> Binary:
        return Binary("%", self, lift(other))

    def __pow__(self, other: object) -> Binary:
        return Binary("**", self, lift(other))

    def __and__(self, other: object) -> Binary:
        return Binary("and", self, lift(other))

    def __or__(self, other: object) -> Binary:
        return Binary("or", self, lift(other))

    def __invert__(self) -> Not:
        return Not(self)

    def equals(self, other: object) -> Binary:
        return Binary("==", self, lift(other))

    def greater(self, other: object) -> Binary:
        return Binary(">", self, lift(other))


@dataclass(frozen=True)
class Value(Expr):
    """A tensor (or tuple element) of the forward: a local variable of the emitted code."""

    name: str


@dataclass(frozen=True)
class Attr(Expr):
    """An attribute of the layer: an option, a derived constant, a parameter, or `training`."""

    name: str


@dataclass(frozen=True)
class Const(Expr):
    value: bool | int | float | str | None


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Not(Expr):
    operand: Expr


@dataclass(frozen=True)
class Select(Expr):
    """`then if condition else otherwise`."""

    condition: Expr
    then: Expr
    otherwise: Expr

    def __post_init__(self) -> None:
        for name in ("condition", "then", "otherwise"):
            object.__setattr__(self, name, lift(getattr(self, name)))


@dataclass(frozen=True)
class Pack(Expr):
    """A tuple, such as a normalized_shape."""

    items: tuple[Expr, ...]


def lift(value: object) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, tuple):
        return Pack(tuple(lift(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return Const(value)
    raise SpecError(f"{caller_location()}: a block spec passes Values, Attrs, numbers, strings, "
                    f"None or tuples of them; got {type(value).__name__}: {value!r}")


#: nn.Module's own train/eval flag, readable by every block.
TRAINING = Attr("training")


def references(expr: Expr) -> Iterator[Value | Attr]:
    """Every Value and Attr an expression reads, in print order."""
    if isinstance(expr, (Value, Attr)):
        yield expr
    elif isinstance(expr, Binary):
        yield from references(expr.left)
        yield from references(expr.right)
    elif isinstance(expr, Not):
        yield from references(expr.operand)
    elif isinstance(expr, Select):
        yield from references(expr.condition)
        yield from references(expr.then)
        yield from references(expr.otherwise)
    elif isinstance(expr, Pack):
        for item in expr.items:
            yield from references(item)


# Functions a step calls.


@dataclass(frozen=True)
class Function:
    """A callable: `name` inside `module`, which the emitted file imports as `alias`. A
    function without a module is a helper of the runtime modules the layer template imports
    (`blocks.<name>`, `checks.<name>`); an op's function (`op` set) must be the API function of
    the spec derive/ops/<op>.py."""

    name: str
    module: str | None = None
    alias: str | None = None
    op: str | None = None


def op(name: str, function: str) -> Function:
    """The API function of the generated op `name` (derive/ops/<name>.py)."""
    return Function(function, f"generated.{name}", name, op=name)


LINEAR = Function("linear", "torch.nn.functional", "F")
MATMUL = Function("matmul", "torch", "torch")
TRANSPOSE = Function("transpose", "torch", "torch")
#: (batch, seq, parts * heads * head_dim) -> `parts` tensors of (batch, heads, seq, head_dim)
SPLIT_HEADS = Function("blocks.split_heads")
#: (batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)
MERGE_HEADS = Function("blocks.merge_heads")
#: torch's scaled_dot_product_attention(q, k, v, mask, *, scale, causal, dropout_p); a causal
#: layer given a mask too gets both in attn_mask (torch takes is_causal only without one)
ATTENTION = Function("blocks.attention")
#: (label, name, tensor, hidden_size): a (batch, seq, hidden_size) floating tensor
CHECK_HIDDEN = Function("checks.check_hidden_states")
#: (label, name, mask, hidden_states, num_heads): None, or bool or of hidden_states' dtype,
#: broadcastable to (batch, num_heads, seq, seq)
CHECK_MASK = Function("checks.check_attention_mask")
#: every runtime helper a step may call
HELPERS = (SPLIT_HEADS, MERGE_HEADS, ATTENTION, CHECK_HIDDEN, CHECK_MASK)


# Declarations beyond an op's Option and Param (derive/api.py).


@dataclass(frozen=True)
class Derived:
    """A constant computed once in the constructor from the options."""

    name: str
    expr: Expr
    doc: str


@dataclass(frozen=True)
class Input:
    name: str
    doc: str
    optional: bool = False


@dataclass(frozen=True)
class Requirement:
    """The constructor raises ValueError(message) when `violated` holds."""

    violated: Expr
    message: str


# Steps.


@dataclass(frozen=True)
class Call:
    """`outputs = function(*args, **kwargs)`; a call with no outputs is a check."""

    outputs: tuple[str, ...]
    function: Function
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Expr], ...]
    where: str


@dataclass(frozen=True)
class Case:
    condition: Expr | None  # None: otherwise
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Branch:
    """if / elif / else: the first case whose condition holds runs."""

    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Checkpoint:
    """Steps emitted as a method, run under torch.utils.checkpoint.checkpoint when `flag` holds:
    their intermediates are not kept for the backward but recomputed."""

    method: str
    flag: Attr
    doc: str
    steps: tuple[Call, ...]


Step = Call | Branch | Checkpoint


@dataclass(frozen=True)
class Output:
    value: Value
    doc: str


@dataclass
class BlockSpec:
    """A layer, built by calling its methods in order. `name` is the generated module
    (generated/<name>.py), `class_name` its nn.Module."""

    name: str
    class_name: str
    doc: str = ""
    options: list[Option] = field(default_factory=list)
    derived: list[Derived] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)
    inputs: list[Input] = field(default_factory=list)
    requirements: list[Requirement] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    source: str = ""  # the spec file, set by the loader
    _open: list[list[Step]] = field(default_factory=list, repr=False)
    _values: set[str] = field(default_factory=set, repr=False)
    _used: set[str] = field(default_factory=set, repr=False)
    _where: dict[str, str] = field(default_factory=dict, repr=False)
    _value_names: set[str] = field(default_factory=set, repr=False)
    _in_checkpoint: bool = field(default=False, repr=False)

    # Constructor options: each an Option of derive/api.py, checked by the constructor as an
    # op's are (codegen/runtime/checks.py).

    def size(self, name: str, doc: str) -> Attr:
        """A required positive int (a width, a head count)."""
        return self._option(Option(name, REQUIRED, check="size", doc=doc))

    def probability(self, name: str, default: float, doc: str) -> Attr:
        """A float in [0, 1): a dropout probability."""
        return self._option(Option(name, default, check="probability", doc=doc))

    def positive(self, name: str, default: float, doc: str) -> Attr:
        """A finite float > 0 (an epsilon, an init scale)."""
        return self._option(Option(name, default, check="positive", doc=doc))

    def flag(self, name: str, default: bool, doc: str) -> Attr:
        """A keyword-only bool."""
        return self._option(Option(name, default, check="flag", doc=doc, keyword_only=True))

    def choice(self, name: str, default: str, choices: tuple[str, ...], doc: str) -> Attr:
        """A keyword-only string, one of `choices`."""
        if default not in choices:
            raise SpecError(f"{caller_location()}: option '{name}': default {default!r} is not "
                            f"one of {choices}")
        return self._option(Option(name, default, doc=doc, keyword_only=True, choices=choices))

    def derive(self, name: str, expr: Expr, doc: str) -> Attr:
        """A constant of the options, computed in the constructor (self.<name>)."""
        self._declare(name)
        self._check_reads(lift(expr), attrs_only=True)
        self.derived.append(Derived(name, lift(expr), doc))
        return Attr(name)

    def require(self, violated: Expr, message: str) -> None:
        """The constructor rejects option values for which `violated` holds."""
        self._check_reads(violated, attrs_only=True)
        self.requirements.append(Requirement(violated, message))

    def param(self, name: str, shape: tuple[Any, ...], init: str, doc: str,
              std: Any = None) -> Attr:
        """A Parameter of `shape` (expressions of the options), initialized by `init`: "ones",
        "zeros" or "normal" (mean 0, standard deviation `std`)."""
        if (init == "normal") != (std is not None) or init not in ("ones", "zeros", "normal"):
            raise SpecError(f"{caller_location()}: parameter '{name}': init is 'ones', 'zeros' "
                            f"or 'normal' with a std; got {init!r} with std={std!r}")
        self._declare(name)
        dims = tuple(lift(d) for d in shape)
        std = std if std is None else lift(std)
        for expr in dims + ((std,) if std is not None else ()):
            self._check_reads(expr, attrs_only=True)
        self.params.append(Param(name, init, shape=dims, std=std, doc=doc))
        return Attr(name)

    # The forward.

    def input(self, name: str, doc: str, optional: bool = False) -> Value:
        """An argument of forward(); `optional` ones default to None and come after the rest."""
        if self.steps:
            raise SpecError(f"{caller_location()}: declare inputs before the first step")
        if not optional and any(i.optional for i in self.inputs):
            raise SpecError(f"{caller_location()}: input '{name}' is required but follows an "
                            "optional one")
        self._declare(name)
        self._values.add(name)
        self._value_names.add(name)
        self.inputs.append(Input(name, doc, optional))
        return Value(name)

    def call(self, function: Function, *args: Any, out: str | tuple[str, ...],
             **kwargs: Any) -> Any:
        """`out = function(*args, **kwargs)`; returns the Value (a tuple of them for a tuple
        `out`)."""
        names = (out,) if isinstance(out, str) else tuple(out)
        if not names:
            raise SpecError(f"{caller_location()}: a call needs at least one output; use "
                            "check() for a call that returns nothing")
        self._append(Call(names, function, tuple(lift(a) for a in args),
                          tuple((k, lift(v)) for k, v in kwargs.items()), caller_location()))
        values = tuple(Value(n) for n in names)
        return values[0] if isinstance(out, str) else values

    def value(self, name: str) -> Value:
        """A value defined earlier, e.g. in the cases of a branch."""
        ref = Value(name)
        self._read(ref)
        return ref

    def check(self, function: Function, value: Value, *args: Any) -> None:
        """A validation helper called as function(label, name, value, *args): it raises an
        error naming the argument, what was expected and what was got."""
        label = Const(f"{self.class_name}.forward")
        self._append(Call((), function, (label, Const(value.name), value,
                                         *(lift(a) for a in args)), (), caller_location()))

    @contextmanager
    def branch(self) -> Iterator[BranchBuilder]:
        where = caller_location()
        builder = BranchBuilder(self)
        before = set(self._values)
        yield builder
        if not builder.cases:
            raise SpecError(f"{where}: a branch needs at least one case")
        self._values = before | builder.defined
        self._top().append(Branch(tuple(builder.cases)))

    @contextmanager
    def checkpoint(self, method: str, flag: Attr, doc: str) -> Iterator[None]:
        where = caller_location()
        self._declare(method)
        option = next((o for o in self.options if o.name == flag.name), None)
        if option is None or option.check != "flag":
            raise SpecError(f"{where}: checkpoint '{method}': {flag.name!r} is not a flag option")
        self._read(flag)
        if self._in_checkpoint:
            raise SpecError(f"{where}: checkpoint regions do not nest")
        self._open.append([])
        self._in_checkpoint = True
        yield
        self._in_checkpoint = False
        steps = self._open.pop()
        if not steps or not all(isinstance(s, Call) for s in steps):
            raise SpecError(f"{where}: checkpoint '{method}' holds calls only (no branches, "
                            "no nested regions), at least one")
        self._top().append(Checkpoint(method, flag, doc, tuple(steps)))

    def output(self, value: Value, doc: str) -> None:
        self._read(value)
        self.outputs.append(Output(value, doc))

    def finish(self) -> None:
        """Checks once the whole spec is built: something is returned, nothing is dead."""
        if self._open:
            raise SpecError(f"{self.source}: block '{self.name}' ends inside a branch or region")
        if not self.outputs:
            raise SpecError(f"{self.source}: block '{self.name}' declares no output; call "
                            "block.output(...)")
        unused = [n for n in self._where if n in self._values and n not in self._used]
        if unused:
            name = unused[0]
            raise SpecError(f"{self._where[name]}: value '{name}' is computed but never used")
        unused_attrs = [p.name for p in self.params if p.name not in self._used]
        unused_attrs += [o.name for o in self.options if o.name not in self._used]
        unused_attrs += [d.name for d in self.derived if d.name not in self._used]
        if unused_attrs:
            raise SpecError(f"{self.source}: block '{self.name}': {', '.join(unused_attrs)} "
                            "never used")

    # Bookkeeping.

    def attrs(self) -> set[str]:
        return ({o.name for o in self.options} | {d.name for d in self.derived}
                | {p.name for p in self.params} | {TRAINING.name})

    def _option(self, option: Option) -> Attr:
        if self.params or self.derived:
            raise SpecError(f"{caller_location()}: declare options before derived constants "
                            "and parameters")
        if option.required and any(not o.required for o in self.options):
            raise SpecError(f"{caller_location()}: required option '{option.name}' follows one "
                            "with a default")
        self._declare(option.name)
        self.options.append(option)
        return Attr(option.name)

    def _declare(self, name: str) -> None:
        where = caller_location()
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("__"):
            raise SpecError(f"{where}: '{name}' is not a usable Python identifier")
        reserved = {TRAINING.name, "self", "forward", "reset_parameters", "extra_repr"}
        # the emitted module reaches the helpers through the runtime modules `blocks`, `checks`
        if name in reserved or name in {f.name.split(".")[0] for f in HELPERS}:
            raise SpecError(f"{where}: '{name}' is reserved in the emitted module")
        taken = self.attrs() | {i.name for i in self.inputs} | self._where.keys()
        if name in taken:
            raise SpecError(f"{where}: '{name}' is declared twice in block '{self.name}'")
        self._where[name] = where

    def _top(self) -> list[Step]:
        return self._open[-1] if self._open else self.steps

    def _append(self, call: Call) -> None:
        if call.function.module is None and call.function not in HELPERS:
            raise SpecError(f"{call.where}: '{call.function.name}' is neither a runtime helper "
                            "(HELPERS) nor a function of an imported module")
        for expr in (*call.args, *(v for _, v in call.kwargs)):
            self._check_reads(expr)
        for name in call.outputs:
            if name in self._values:
                raise SpecError(f"{call.where}: value '{name}' is assigned twice (once per "
                                "branch case at most)")
            if name not in self._value_names:
                self._declare(name)  # a value of another branch case keeps its first line
            self._value_names.add(name)
            self._values.add(name)
        self._top().append(call)

    def _check_reads(self, expr: Expr, attrs_only: bool = False) -> None:
        for ref in references(expr):
            if isinstance(ref, Value) and attrs_only:
                raise SpecError(f"{caller_location()}: '{ref.name}' is a forward value; "
                                "constructor expressions read options only")
            self._read(ref)

    def _read(self, ref: Value | Attr) -> None:
        known = self._values if isinstance(ref, Value) else self.attrs()
        if ref.name not in known:
            kind = "value" if isinstance(ref, Value) else "option or parameter"
            raise SpecError(f"{caller_location()}: {kind} '{ref.name}' is used before it is "
                            f"defined in block '{self.name}'")
        self._used.add(ref.name)


class BranchBuilder:
    """`with block.branch() as branch:` then `with branch.when(cond):` ... `with
    branch.otherwise():`."""

    def __init__(self, block: BlockSpec):
        self.block = block
        self.cases: list[Case] = []
        self.defined: set[str] = set()
        self._closed = False

    @contextmanager
    def when(self, condition: Expr) -> Iterator[None]:
        self.block._check_reads(condition)
        with self._case(condition):
            yield

    @contextmanager
    def otherwise(self) -> Iterator[None]:
        with self._case(None):
            yield
        self._closed = True

    @contextmanager
    def _case(self, condition: Expr | None) -> Iterator[None]:
        if self._closed:
            raise SpecError(f"{caller_location()}: nothing may follow otherwise() in a branch")
        before = set(self.block._values)
        self.block._open.append([])
        yield
        steps = self.block._open.pop()
        self.defined |= self.block._values - before
        self.block._values = before
        self.cases.append(Case(condition, tuple(steps)))


def caller_location() -> str:
    """file:line of the first frame outside this module: the spec line being declared."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (__file__, _CONTEXTLIB):
        frame = frame.f_back
    if frame is None:
        return "<block spec>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_CONTEXTLIB = sys.modules[contextmanager.__module__].__file__


def load_block(path: Path, display: str) -> BlockSpec:
    """Import a block spec file and call its `block()`; `display` is the path shown in output."""
    block = build_from_file(path, "block", BlockSpec)
    block.source = display
    block.finish()
    return block


def check_ops(block: BlockSpec, functions: dict[str, str]) -> None:
    """Every op a block calls is a spec in derive/ops/ whose API function is the one called.
    `functions` maps op name -> API function name."""
    for call in calls(block.steps):
        name = call.function.op
        if name is None:
            continue
        if name not in functions:
            raise SpecError(f"{call.where}: no op spec derive/ops/{name}.py (ops: "
                            f"{', '.join(sorted(functions))})")
        if functions[name] != call.function.name:
            raise SpecError(f"{call.where}: op '{name}' has the API function "
                            f"'{functions[name]}', not '{call.function.name}'")


def calls(steps: tuple[Step, ...] | list[Step]) -> Iterator[Call]:
    """Every call, in program order (branch cases one after the other)."""
    for step in steps:
        if isinstance(step, Call):
            yield step
        elif isinstance(step, Branch):
            for case in step.cases:
                yield from calls(case.steps)
        else:
            yield from step.steps

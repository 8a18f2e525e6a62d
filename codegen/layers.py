"""Render a block spec into one Python module: an nn.Module whose forward is straight-line code.

Generic over blocks: the ops a block calls, its options and parameters all come from the spec
(derive/blocks.py). This module prints expressions and steps, finds what each checkpoint region
takes and returns (liveness), and hands the lines to codegen/templates/layer.py.j2.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

from codegen.emit import environment
from derive.api import Option
from derive.blocks import (
    Attr,
    Binary,
    BlockSpec,
    Branch,
    Call,
    Checkpoint,
    Const,
    Expr,
    Function,
    Not,
    Pack,
    Select,
    Step,
    Value,
    references,
)

#: emitted lines longer than this wrap their arguments
LINE_LENGTH = 100
INDENT = "    "

# Binding strength, for parentheses: atoms bind tightest.
_SELECT, _OR, _AND, _NOT, _COMPARE, _ADD, _MUL, _UNARY, _POWER, _ATOM = range(10)
_BINARY = {"or": _OR, "and": _AND, "==": _COMPARE, ">": _COMPARE, "+": _ADD, "-": _ADD,
           "*": _MUL, "/": _MUL, "//": _MUL, "%": _MUL, "**": _POWER}


class PythonPrinter:
    """Block expressions as Python source; attributes read from `owner` ("self." in the
    module, "" in docs tables)."""

    def __init__(self, owner: str = "self."):
        self.owner = owner

    def __call__(self, expr: Expr) -> str:
        return self._print(expr)[0]

    def _print(self, expr: Expr) -> tuple[str, int]:
        if isinstance(expr, Value):
            return expr.name, _ATOM
        if isinstance(expr, Attr):
            return f"{self.owner}{expr.name}", _ATOM
        if isinstance(expr, Const):
            return self._const(expr.value)
        if isinstance(expr, Pack):
            items = [self(item) for item in expr.items]
            return (f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"), _ATOM
        if isinstance(expr, Not):
            return f"not {self._wrap(expr.operand, _NOT)}", _NOT
        if isinstance(expr, Select):
            return (f"{self._wrap(expr.then, _OR)} if {self._wrap(expr.condition, _OR)} "
                    f"else {self._wrap(expr.otherwise, _SELECT)}"), _SELECT
        if isinstance(expr, Binary):
            strength = _BINARY[expr.op]
            if expr.op == "**":  # right-associative; a unary minus may follow it
                left, right = self._wrap(expr.left, _ATOM), self._wrap(expr.right, _UNARY)
            elif strength == _COMPARE:  # comparisons chain: never leave one bare inside another
                left = self._wrap(expr.left, strength + 1)
                right = self._wrap(expr.right, strength + 1)
            else:
                left = self._wrap(expr.left, strength)
                right = self._wrap(expr.right, strength + 1)
            return f"{left} {expr.op} {right}", strength
        raise TypeError(f"cannot print {type(expr).__name__}: {expr!r}")

    def _wrap(self, expr: Expr, strength: int) -> str:
        source, own = self._print(expr)
        return source if own >= strength else f"({source})"

    @staticmethod
    def _const(value: object) -> tuple[str, int]:
        if isinstance(value, str):
            return json.dumps(value), _ATOM
        text = repr(value)
        return text, (_UNARY if text.startswith("-") else _ATOM)


PRINT = PythonPrinter()
PRINT_BARE = PythonPrinter("")


def function_source(function: Function) -> str:
    return f"{function.alias}.{function.name}" if function.alias else function.name


def call_lines(targets: str, callee: str, arguments: list[str], indent: str) -> list[str]:
    """`targets = callee(arguments)`; longer than LINE_LENGTH, the arguments fill continuation
    lines."""
    head = f"{indent}{targets} = {callee}(" if targets else f"{indent}{callee}("
    one_line = head + ", ".join(arguments) + ")"
    if len(one_line) <= LINE_LENGTH:
        return [one_line]
    inner = indent + INDENT
    lines = [head, inner]
    for argument in arguments:
        piece = f"{argument},"
        if lines[-1] != inner and len(lines[-1]) + 1 + len(piece) > LINE_LENGTH:
            lines.append(inner)
        lines[-1] += piece if lines[-1] == inner else f" {piece}"
    return [*lines, f"{indent})"]


def call_source(call: Call, indent: str) -> list[str]:
    arguments = [PRINT(a) for a in call.args] + [f"{k}={PRINT(v)}" for k, v in call.kwargs]
    return call_lines(", ".join(call.outputs), function_source(call.function), arguments, indent)


def reads(step: Step) -> Iterator[str]:
    """Names of the forward values a step reads, in order (repeats possible)."""
    if isinstance(step, Call):
        for expr in (*step.args, *(v for _, v in step.kwargs)):
            yield from (r.name for r in references(expr) if isinstance(r, Value))
    elif isinstance(step, Branch):
        for case in step.cases:
            if case.condition is not None:
                yield from (r.name for r in references(case.condition) if isinstance(r, Value))
            for inner in case.steps:
                yield from reads(inner)
    else:
        for inner in step.steps:
            yield from reads(inner)


def flat(steps: tuple[Step, ...] | list[Step]) -> Iterator[Step]:
    """Calls and checkpoint regions in program order, branch cases one after the other."""
    for step in steps:
        if isinstance(step, Branch):
            for case in step.cases:
                yield from flat(case.steps)
        else:
            yield step


class Region:
    """A checkpoint region as emitted: a method taking the values it reads from outside and
    returning the values read after it."""

    def __init__(self, region: Checkpoint, later_reads: set[str]):
        self.region = region
        written: list[str] = []
        inputs: list[str] = []
        for call in region.steps:
            for name in reads(call):
                if name not in written and name not in inputs:
                    inputs.append(name)
            written += call.outputs
        self.inputs = inputs
        self.outputs = [name for name in written if name in later_reads]

    def call_lines(self, indent: str) -> list[str]:
        targets = ", ".join(self.outputs)
        method = f"self.{self.region.method}"
        flag = PRINT(self.region.flag)
        return [f"{indent}if {flag}:",
                *call_lines(targets, "checkpoint", [method, *self.inputs, "use_reentrant=False"],
                            indent + INDENT),
                f"{indent}else:",
                *call_lines(targets, method, self.inputs, indent + INDENT)]

    def method(self) -> dict[str, Any]:
        body = [line for call in self.region.steps for line in call_source(call, INDENT * 2)]
        return {"def": method_def(self.region.method, ["self", *self.inputs]),
                "doc": self.region.doc, "body": body, "returns": ", ".join(self.outputs)}


class LayerContext:
    """A block spec as the layer template reads it."""

    def __init__(self, block: BlockSpec):
        self.block = block
        self.regions = self._regions()
        self.forward = self._lines(block.steps, INDENT * 2)
        self.methods = [region.method() for region in self.regions.values()]
        self.imports = self._imports()
        self.ops = sorted({c.function.op for c in self._calls() if c.function.op})

    def _calls(self) -> Iterator[Call]:
        for step in flat(self.block.steps):
            yield from ([step] if isinstance(step, Call) else step.steps)

    def _regions(self) -> dict[str, Region]:
        order = list(flat(self.block.steps))
        outputs = {o.value.name for o in self.block.outputs}
        regions = {}
        for position, step in enumerate(order):
            if isinstance(step, Checkpoint):
                later = {name for after in order[position + 1:] for name in reads(after)}
                regions[step.method] = Region(step, later | outputs)
        return regions

    def _lines(self, steps: tuple[Step, ...] | list[Step], indent: str) -> list[str]:
        lines = []
        for step in steps:
            if isinstance(step, Call):
                lines += call_source(step, indent)
            elif isinstance(step, Checkpoint):
                lines += self.regions[step.method].call_lines(indent)
            else:
                for index, case in enumerate(step.cases):
                    if case.condition is None:
                        lines.append(f"{indent}else:")
                    else:
                        keyword = "if" if index == 0 else "elif"
                        lines.append(f"{indent}{keyword} {PRINT(case.condition)}:")
                    lines += self._lines(case.steps, indent + INDENT)
        return lines

    def _imports(self) -> list[str]:
        """Import lines beyond `import torch`, `torch.nn.functional as F` and checkpoint (the
        template's own): other modules, then the generated ops."""
        modules = set()
        generated = set()
        for call in self._calls():
            function = call.function
            if function.op is not None:
                generated.add(function.op)
            elif function.module is not None and function.module not in ("torch",
                                                                         "torch.nn.functional"):
                modules.add((function.module, function.alias))
        lines = [f"import {module} as {alias}" if alias != module else f"import {module}"
                 for module, alias in sorted(modules)]
        if generated:
            lines.append("")
            lines.append(f"from generated import {', '.join(sorted(generated))}")
        return lines


def described(name: str, doc: str, indent: int) -> list[str]:
    """`name: doc` wrapped at LINE_LENGTH, continuation lines indented one level more."""
    return textwrap.wrap(f"{name}: {doc}", LINE_LENGTH, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + len(INDENT)))


def arguments(block: BlockSpec) -> list[str]:
    """The constructor's arguments after self."""
    arguments, keyword_only = [], False
    for option in block.options:
        if option.keyword_only and not keyword_only:
            arguments.append("*")
            keyword_only = True
        default = "" if option.required else f"={PRINT(Const(option.default))}"
        arguments.append(f"{option.name}{default}")
    if not keyword_only:
        arguments.append("*")
    return [*arguments, "device=None", "dtype=None"]


def method_def(name: str, args: list[str]) -> str:
    """`def name(args):` as a method of the layer has it, its lines unindented: the ops'
    writer of def lines (the `def_line` macro of macros.j2)."""
    macros = environment().get_template("macros.j2").module
    return str(macros.def_line(name, args, LINE_LENGTH - len(INDENT)))


def forward_def(block: BlockSpec) -> str:
    return method_def("forward", ["self", *(i.name + ("=None" if i.optional else "")
                                            for i in block.inputs)])


def option_check(block: BlockSpec, option: Option) -> str:
    """The constructor's check of an option, codegen/runtime/checks.py's as for an op's
    options: it returns the value."""
    head = f'"{block.class_name}", "{option.name}", {option.name}'
    if option.choices:
        return f"checks.check_variant({head}, {PRINT(Pack(tuple(map(Const, option.choices))))})"
    if option.check in ("size", "flag"):
        return f"checks.check_{option.check}({head})"
    # an op's positive option may be off (None); a layer's has no off value
    off = ", off=False" if option.check == "positive" else ""
    return f'checks.check_option({head}, "{option.check}"{off})'


def _options(block: BlockSpec) -> list[dict[str, Any]]:
    result = []
    for o in block.options:
        kind = "str" if o.choices else {"size": "int", "flag": "bool"}.get(o.check, "float")
        result.append({"name": o.name, "doc": o.doc, "required": o.required,
                       "doc_lines": described(f"{o.name} ({kind})", o.doc, 8),
                       "default": None if o.required else PRINT(Const(o.default)),
                       "check": option_check(block, o)})
    return result


def _requirements(block: BlockSpec) -> list[dict[str, str]]:
    result = []
    for requirement in block.requirements:
        names = []
        for ref in references(requirement.violated):
            if ref.name not in names:
                names.append(ref.name)
        got = ", ".join(f"{name}={{self.{name}!r}}" for name in names)
        # the message lands in an f-string literal: its braces and quotes are text
        text = requirement.message.replace("{", "{{").replace("}", "}}").replace('"', '\\"')
        result.append({"condition": PRINT(requirement.violated), "message": f"{text}, got {got}"})
    return result


def _params(block: BlockSpec) -> list[dict[str, str]]:
    result = []
    for p in block.params:
        init = [("mean", Const(0.0)), ("std", p.std)] if p.init == "normal" else []
        result.append({
            "name": p.name, "doc": p.doc, "shape": PRINT(Pack(p.shape)),
            "shape_doc": PRINT_BARE(Pack(p.shape)), "init": f"torch.nn.init.{p.init}_",
            "init_args": "".join(f", {k}={PRINT(v)}" for k, v in init),
            "init_doc": f"{p.init}_(" + ", ".join(f"{k}={PRINT_BARE(v)}" for k, v in init) + ")"})
    return result


def _listing(block: BlockSpec, layer: LayerContext) -> list[str]:
    """forward() and the region methods as the module has them, without the docstrings."""
    lines = forward_def(block).splitlines()
    lines += [line[len(INDENT):] for line in layer.forward]
    lines.append(f"{INDENT}return {', '.join(o.value.name for o in block.outputs)}")
    for method in layer.methods:
        lines += ["", *method["def"].splitlines()]
        lines += [line[len(INDENT):] for line in method["body"]]
        lines.append(f"{INDENT}return {method['returns']}")
    return lines


def _context(block: BlockSpec) -> dict[str, Any]:
    layer = LayerContext(block)
    return {
        "block": block,
        "layer": layer,
        "arguments": arguments(block),
        "init_def": method_def("__init__", ["self", *arguments(block)]),
        "forward_def": forward_def(block),
        "options": _options(block),
        "derived": [{"name": d.name, "doc": d.doc[:1].upper() + d.doc[1:], "src": PRINT(d.expr),
                     "bare": PRINT_BARE(d.expr)} for d in block.derived],
        "requirements": _requirements(block),
        "params": _params(block),
        "returns": ", ".join(o.value.name for o in block.outputs),
        "listing": _listing(block, layer),
        "input_lines": [line for i in block.inputs for line in described(
            f"{i.name} (torch.Tensor{' | None' if i.optional else ''})", i.doc, 12)],
        "output_lines": [line for o in block.outputs
                         for line in described(f"{o.value.name} (torch.Tensor)", o.doc, 12)],
    }


def render_layer(block: BlockSpec) -> str:
    return environment().get_template("layer.py.j2").render(**_context(block))


def render_layer_page(block: BlockSpec) -> str:
    env = environment()
    env.filters["bare"] = PRINT_BARE
    return env.get_template("layer_page.md.j2").render(**_context(block))

"""The kernel IR: frozen, small, printable. One Kernel works on a block of rows.

Canonical form (what lowering guarantees and printers rely on):
- a Kernel is: row-level prologue, then passes over the row, then an epilogue pass;
- each Pass reads the element tensors it lists, computes its element assigns in order,
  accumulates its row reductions (always in the accumulation dtype, at least fp32) and then
  computes the row-level assigns that the new reductions make possible;
- the epilogue pass writes element outputs and accumulates column partials (Σ over rows);
- every name is unique in the kernel and every expression uses only names defined before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class Tensor:
    """A kernel argument tensor. `absent` is the value of an optional column tensor the caller
    left out (None: the tensor is required)."""

    name: str
    level: str  # "element" | "column" | "row" | "scalar" (a 0-d tensor)
    absent: sympy.Expr | None = None
    broadcast: bool = False  # an element tensor read through strides over the leading dims
    integer: bool = False  # a row tensor of integers, read as they are

    @property
    def optional(self) -> bool:
        return self.absent is not None


@dataclass(frozen=True)
class Assign:
    name: str
    expr: sympy.Expr
    level: str  # "element" | "row"


@dataclass(frozen=True)
class RowReduce:
    """name = scale · op_j body_j, accumulated in the accumulation dtype."""

    name: str
    op: str  # "sum" | "max" | "min"
    body: sympy.Expr
    scale: sympy.Expr


@dataclass(frozen=True)
class Store:
    name: str  # the output tensor
    expr: sympy.Expr
    level: str  # "element" | "row" | "column" | "scalar" (the last two: Σ over rows, partials)
    flag: str | None = None  # written only when this constexpr is set (values for a backward)
    like: str | None = None  # a column output takes this column input's dtype


@dataclass(frozen=True)
class Pass:
    loads: tuple[str, ...]
    assigns: tuple[Assign, ...]
    reductions: tuple[RowReduce, ...]
    after: tuple[Assign, ...]


@dataclass(frozen=True)
class Kernel:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    scalars: tuple[str, ...]
    prologue: tuple[Assign, ...]
    passes: tuple[Pass, ...]
    epilogue: Pass
    stores: tuple[Store, ...]
    aliases: tuple[tuple[str, str], ...] = ()  # (output, the stored output it equals)
    #: values made in the kernel: (name, "column_index" | "row_index" | "random")
    generated: tuple[tuple[str, str], ...] = ()
    #: scalars that may be off, and the value each then takes: a constexpr flag says whether
    #: it is (its Piecewise branches on that value are chosen at compile time)
    switches: tuple[tuple[str, sympy.Expr], ...] = ()
    #: partner reads (generated kind "partner"): (name, the element tensor it loads at the
    #: partner column, the pairing)
    partners: tuple[tuple[str, str, str], ...] = ()

    def tensors(self, level: str) -> tuple[Tensor, ...]:
        return tuple(t for t in self.inputs if t.level == level)

    def stores_of(self, level: str) -> tuple[Store, ...]:
        return tuple(s for s in self.stores if s.level == level)

    def listing(self) -> str:
        """A readable dump, used by `derive --show` and the derivation pages."""
        lines = [f"kernel {self.name}"]
        lines.append("  inputs: " + ", ".join(f"{t.name}[{t.level}]" for t in self.inputs))
        lines.append("  outputs: " + ", ".join(f"{t.name}[{t.level}]" for t in self.outputs))
        if self.scalars:
            lines.append("  scalars: " + ", ".join(self.scalars))
        return "\n".join(lines + ["  " + line for line in self.formulas()])

    def expressions(self) -> list[sympy.Expr]:
        """Every expression the kernel evaluates (assignments, reduction bodies and scales,
        stores)."""
        steps = (*self.passes, self.epilogue)
        return [*(a.expr for a in self.prologue),
                *(a.expr for step in steps for a in (*step.assigns, *step.after)),
                *(e for step in steps for r in step.reductions for e in (r.body, r.scale)),
                *(s.expr for s in self.stores)]

    def formulas(self) -> list[str]:
        """What the kernel computes, pass by pass, as derived: its generated kernels carry
        these lines as their docstring."""
        at = {"half": "(j + N/2) mod N", "interleaved": "j xor 1"}
        reads = {name: f"{source} at column {at[pairing]}"
                 for name, source, pairing in self.partners}
        lines = [f"{name} = {reads.get(name, kind.replace('_', ' '))}"
                 for name, kind in self.generated]
        lines += [f"{a.name} = {a.expr}" for a in self.prologue]
        for index, step in enumerate((*self.passes, self.epilogue), start=1):
            title = "epilogue" if step is self.epilogue else f"pass {index}"
            lines.append(f"{title}: load {', '.join(step.loads) or '-'}")
            lines += [f"  {a.name} = {a.expr}" for a in step.assigns]
            lines += [f"  {r.name} = {r.scale} * {r.op}_j({r.body})" for r in step.reductions]
            lines += [f"  {a.name} = {a.expr}" for a in step.after]
        for alias, target in self.aliases:
            lines.append(f"output {alias} is {target} (same values, stored once)")
        for s in self.stores:
            note = " (Σ over rows)" if s.level in ("column", "scalar") else ""
            note += f" (if {s.flag})" if s.flag else ""
            lines.append(f"store {s.name} = {s.expr}{note}")
        return lines

"""The simplified graph handed to codegen: what one row kernel loads, defines and writes."""

from __future__ import annotations

from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class Definition:
    """name = expr (element or row level), or name = scale · reduce_j body_j."""

    name: str
    level: str  # "element" | "row"
    expr: sympy.Expr
    reduction: str | None = None  # "sum" | "max" for reductions
    scale: sympy.Expr = sympy.Integer(1)

    @property
    def symbol(self) -> sympy.Symbol:
        return sympy.Symbol(self.name, real=True)


@dataclass(frozen=True)
class ColumnParam:
    name: str
    absent: sympy.Expr | None  # value when the caller passes None; None = required


@dataclass(frozen=True)
class RowGraph:
    """The math of one kernel over rows, independent of how it is scheduled.

    Element tensors are read and written per row; column tensors are shared by all rows;
    row tensors hold one value per row; column outputs are summed over rows (rule 4).
    """

    element_inputs: tuple[str, ...]
    column_inputs: tuple[ColumnParam, ...]
    row_inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    definitions: tuple[Definition, ...]
    element_outputs: tuple[tuple[str, sympy.Expr], ...]
    row_outputs: tuple[tuple[str, sympy.Expr], ...]
    column_outputs: tuple[tuple[str, str, sympy.Expr], ...]  # (name, parameter, row-local)
    #: optional element inputs and the value each takes when absent
    element_absent: tuple[tuple[str, sympy.Expr], ...] = ()
    #: learnable scalars (0-d tensors) read by the kernel
    scalar_inputs: tuple[str, ...] = ()
    #: (name, parameter, row-level value) summed over all rows: a scalar parameter's gradient
    scalar_outputs: tuple[tuple[str, str, sympy.Expr], ...] = ()
    #: values the kernel makes itself: (name, "column_index" | "row_index" | "random")
    generated: tuple[tuple[str, str], ...] = ()
    #: element inputs read through broadcast strides over the leading dims
    broadcast_inputs: tuple[str, ...] = ()
    #: row inputs that stay integers (class indices)
    integer_inputs: tuple[str, ...] = ()
    #: scalars that may be off and the value each then takes (the kernels are compiled for
    #: whether it is)
    scalar_absent: tuple[tuple[str, sympy.Expr], ...] = ()
    #: partner reads (generated kind "partner"): (name, the element tensor read, the pairing)
    partners: tuple[tuple[str, str, str], ...] = ()

    def describe(self) -> str:
        lines = [f"reads elements {', '.join(self.element_inputs) or '-'}; "
                 f"columns {', '.join(p.name for p in self.column_inputs) or '-'}; "
                 f"rows {', '.join(self.row_inputs) or '-'}; "
                 f"scalars {', '.join(self.scalars) or '-'}"]
        for d in self.definitions:
            if d.reduction:
                lines.append(f"  {d.name} = {d.scale} * {d.reduction}_j({d.expr})")
            else:
                lines.append(f"  {d.name} = {d.expr}")
        for kind, outputs in (("element", self.element_outputs), ("row", self.row_outputs)):
            for name, expr in outputs:
                lines.append(f"  write {kind} {name} = {expr}")
        for name, _, expr in self.column_outputs:
            lines.append(f"  write column {name} = Σ_rows {expr}")
        for name, _, expr in self.scalar_outputs:
            lines.append(f"  write scalar {name} = Σ_rows {expr}")
        return "\n".join(lines)

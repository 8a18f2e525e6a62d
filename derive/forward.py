"""The forward kernel's graph, read straight off the spec."""

from __future__ import annotations

import sympy

from derive.graph import ColumnParam, Definition, RowGraph
from derive.spec import REGENERATED, Kind, Level, N, OpSpec


def forward_graph(spec: OpSpec) -> RowGraph:
    definitions = []
    for node in spec.nodes:
        if node.kind is Kind.REDUCE:
            scale = 1 / N if node.reduction == "mean" else sympy.Integer(1)
            reduction = node.reduction if node.reduction in ("max", "min") else "sum"
            definitions.append(Definition(node.name, "row", node.expr, reduction, scale))
        elif node.kind in (Kind.ELEMENT, Kind.ROW):
            definitions.append(Definition(node.name, node.level.value
                                          if node.level is Level.ROW else "element", node.expr))
    inputs = {n.name for n in spec.nodes if n.kind in (Kind.INPUT, Kind.ROW_INPUT)}
    saved = spec.saved_anywhere()
    # Outputs first, in output order, then values stored only for a backward.
    stored_elements = [spec.node(name) for name in spec.outputs
                       if spec.node(name).level is Level.ELEMENT]
    stored_elements += [n for n in spec.nodes if n.name not in spec.outputs and
                        n.name in saved and n.level is Level.ELEMENT and n.name not in inputs]
    stored_rows = [spec.node(name) for name in spec.outputs
                   if spec.node(name).level is Level.ROW]
    stored_rows += [n for n in spec.nodes if n.name not in spec.outputs and n.name in saved
                    and n.level is Level.ROW and n.name not in inputs]
    return RowGraph(
        element_inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.INPUT),
        column_inputs=tuple(ColumnParam(n.name, n.absent) for n in spec.nodes
                            if n.kind is Kind.COLUMN_PARAM),
        row_inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.ROW_INPUT),
        scalars=tuple(n.name for n in spec.nodes if n.kind is Kind.SCALAR),
        definitions=tuple(definitions),
        element_outputs=tuple((n.name, n.symbol) for n in stored_elements),
        row_outputs=tuple((n.name, n.symbol) for n in stored_rows),
        column_outputs=(),
        element_absent=tuple((n.name, n.absent) for n in spec.nodes
                             if n.kind is Kind.INPUT and n.absent is not None),
        scalar_inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.SCALAR_PARAM),
        **extras(spec),
    )


def extras(spec: OpSpec) -> dict[str, tuple]:
    """What both kernels of a spec share: generated values (partner reads among them: an element
    input read at the partner column), broadcast and integer inputs."""
    kinds = {Level.COLUMN: "column_index", Level.ROW: "row_index", Level.ELEMENT: "random"}
    return {
        "generated": tuple((n.name, kinds[n.level]) for n in spec.nodes
                           if n.kind in REGENERATED)
        + tuple((n.name, "partner") for n in spec.nodes if n.kind is Kind.PARTNER),
        "partners": tuple((n.name, n.partner_of, n.pairing) for n in spec.nodes
                          if n.kind is Kind.PARTNER),
        "broadcast_inputs": tuple(n.name for n in spec.nodes if n.broadcast),
        "integer_inputs": tuple(n.name for n in spec.nodes
                                if n.integer and n.kind is Kind.ROW_INPUT),
        "scalar_absent": tuple((n.name, n.absent) for n in spec.nodes
                               if n.kind is Kind.SCALAR and n.absent is not None),
    }


def saved_outputs(spec: OpSpec) -> frozenset[str]:
    """Stores behind their own flag: values only a backward needs (a memory mode stores only
    what it saves, inference none), and every output after the first (stored when asked for
    or saved)."""
    return frozenset(n.name for n in spec.nodes
                     if (n.name in spec.saved_anywhere() and n.name not in spec.outputs[:1]
                         and n.kind not in (Kind.INPUT, Kind.ROW_INPUT))
                     or n.name in spec.outputs[1:])

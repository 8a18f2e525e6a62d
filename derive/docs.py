"""The derivation page of one op: every stage, from spec to kernel IR, in Markdown + LaTeX."""

from __future__ import annotations

import sympy

from codegen.emit import environment
from codegen.ir import Kernel
from derive.algebra import RowSum
from derive.engine import Derivation
from derive.spec import Kind


def latex(expr: sympy.Expr) -> str:
    return sympy.latex(expr, order="lex")


def render_page(derivation: Derivation, forward: Kernel, backwards: dict[str, Kernel]) -> str:
    spec = derivation.spec
    definitions = []
    for node in spec.nodes:
        symbol = latex(node.symbol)
        if node.kind is Kind.REDUCE:
            scale = r"\frac{1}{N}" if node.reduction == "mean" else ""
            operator = r"\max_j" if node.reduction == "max" else r"\sum_j"
            math = f"{symbol} = {scale}{operator} {latex(node.expr)}"
        elif node.expr is not None:
            math = f"{symbol} = {latex(node.expr)}"
        else:
            note = {Kind.INPUT: "input element", Kind.COLUMN_PARAM: "per-column parameter",
                    Kind.SCALAR_PARAM: "learnable scalar", Kind.SCALAR: "scalar",
                    Kind.ROW_INPUT: "per-row input",
                    Kind.RANDOM: "uniform random in [0, 1), regenerated from the seed",
                    Kind.INDEX: "column index" if node.level.value == "column"
                    else "row index along dim -2"}[node.kind]
            if node.kind is Kind.INPUT and not node.grad:
                note += ", not differentiated"
            if node.broadcast:
                note += ", broadcast over the leading dims"
            if node.absent is not None:
                note += f", {latex(node.absent)} when not given"
            math = rf"{symbol} \;:\; \text{{{note}}}"
        definitions.append({"name": node.name, "kind": node.kind.value, "math": math})
    modes = []
    for mode, result in derivation.backwards.items():
        modes.append({
            "name": mode,
            "doc": spec.mode_docs[mode],
            "saved": spec.modes[mode],
            "pivots": [latex(sympy.Eq(u, g)) for u, g in result.pivots],
            "resolutions": [{"name": r.name, "how": r.how,
                             "math": latex(sympy.Eq(sympy.Symbol(r.name), r.expr))}
                            for r in result.resolutions],
            "reductions": [latex(sympy.Eq(sympy.Symbol(name), RowSum(body), evaluate=False))
                           for name, body in result.reductions],
            "gradients": [{"name": name,
                           "math": latex(sympy.Eq(sympy.Symbol(r"\bar{" + name + "}"), expr))}
                          for name, expr in result.gradients],
            "ir": backwards[mode].listing(),
        })
    context = {
        "spec": spec,
        "definitions": definitions,
        "rules": [latex(sympy.Eq(k, v)) for k, v in derivation.rules],
        "steps": [{"rule": s.rule, "source": s.source, "target": s.target,
                   "math": latex(s.contribution)} for s in derivation.reverse.steps],
        "stabilisers": derivation.reverse.stabilisers,
        "modes": modes,
        "column_params": [n.name for n in spec.nodes if n.kind is Kind.COLUMN_PARAM],
        "forward_ir": forward.listing(),
    }
    return environment().get_template("doc_page.md.j2").render(**context)


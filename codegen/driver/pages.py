"""The derivation page of one op: every stage, from spec to kernel IR, in Markdown + LaTeX.

The LaTeX is written for the docs site, which converts it to MathML when it builds
(`docs/hooks/mathml.py`): a name of several letters is one upright name (`\\mathrm{rstd}`),
not a product of italic letters, and a product puts a thin space between its factors.
"""

from __future__ import annotations

import sympy
from sympy.printing.latex import LatexPrinter

from codegen.emit import environment
from codegen.fuse import sweeps
from codegen.ir import Kernel
from derive.algebra import RowSum
from derive.engine import Derivation
from derive.spec import Kind, Node


class _NamePrinter(LatexPrinter):
    """SymPy's LaTeX with the spec's names kept whole."""

    def _print_Symbol(self, expr: sympy.Symbol, style: str = "plain") -> str:
        return name_latex(expr.name)

    def _print_ExpBase(self, expr: sympy.Expr, exp: str | None = None) -> str:
        """exp(u) as \\exp, not e^u: specs name values e (softmax's exponentials)."""
        base = r"\exp\left(" + self._print(expr.args[0]) + r"\right)"
        return base if exp is None else rf"{base}^{{{exp}}}"


def name_latex(name: str) -> str:
    """One spec name as LaTeX: a single letter (x, y, N) or a Greek letter's name stays an
    italic symbol, a name already in LaTeX (\\bar{x}) is kept, any other name is upright and
    whole (\\mathrm{x\\_hat})."""
    if name.endswith("_dot") and len(name) > 4:  # a tangent (derive/tangent.py)
        return tangent_latex(name[:-4])
    if len(name) == 1 or name.startswith("\\"):
        return name
    if name.lower() in _GREEK:
        return "\\" + name
    return r"\mathrm{" + name.replace("_", r"\_") + "}"


_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
          "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi",
          "omega"}


def latex(expr: sympy.Expr) -> str:
    return _NamePrinter({"order": "lex", "mul_symbol": r"\,"}).doprint(expr)


def reduction_latex(node: Node) -> str:
    """A forward reduction's definition: mean = 1/N Σ_j body, var, max_j ..."""
    scale = r"\frac{1}{N}" if node.reduction == "mean" else ""
    operator = {"max": r"\max_j", "min": r"\min_j"}.get(node.reduction, r"\sum_j")
    return f"{latex(node.symbol)} = {scale}{operator} {latex(node.expr)}"


def gradient_latex(name: str, expr: sympy.Expr) -> str:
    """The adjoint of an input or parameter: a bar over its name."""
    symbol = name_latex(name)
    bar = r"\bar" if len(name) == 1 else r"\overline"
    return f"{bar}{{{symbol}}} = {latex(expr)}"


def tangent_latex(name: str) -> str:
    """The tangent of a value (its derivative along the inputs' tangents): a dot over its
    name."""
    return rf"\dot{{{name_latex(name)}}}"


def reduction_count(title: str, kernel: Kernel) -> dict[str, object]:
    """How many times one kernel goes over a row and what it reduces: its passes, each pass's
    row reductions, the sweeps a looped row takes (fused passes, and the epilogue when it
    writes elements or column sums) and its column sums over the rows."""
    passes = [", ".join(f"`{r.name}` ({r.op})" for r in p.reductions) for p in kernel.passes]
    epilogue = bool(kernel.stores_of("element") or kernel.stores_of("column"))
    return {
        "kernel": title,
        "passes": len(kernel.passes),
        "reductions": sum(len(p.reductions) for p in kernel.passes),
        "per_pass": "; ".join(f"{i}: {names}" for i, names in enumerate(passes, start=1))
                    or "none",
        "sweeps": len(sweeps(kernel)) + epilogue,
        "column_sums": len(kernel.stores_of("column")) + len(kernel.stores_of("scalar")),
    }


def render_page(derivation: Derivation, forward: Kernel, backwards: dict[str, Kernel],
                jvp: Kernel, module_path: str | None = None) -> str:
    """The page of one op. `module_path` is where the module was written for a spec outside
    this repo (`derive SPEC --out DIR`): its page sits there too, away from the docs site, so
    it names the project's pages instead of linking them."""
    spec = derivation.spec
    definitions = []
    for node in spec.nodes:
        symbol = latex(node.symbol)
        if node.kind is Kind.REDUCE:
            math = reduction_latex(node)
        elif node.expr is not None:
            math = f"{symbol} = {latex(node.expr)}"
        elif node.kind is Kind.PARTNER:
            at = {"half": r"(j + N/2) \bmod N", "interleaved": r"j \oplus 1"}[node.pairing]
            note = "" if node.grad else r" \;(\text{read by the backward})"
            # the source at column p(j), as a subscript (a bar would end the table's cell)
            math = (rf"{symbol} = {{{latex(spec.node(node.partner_of).symbol)}}}"
                    rf"_{{{at}}}{note}")
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
    reductions = {n.name: n for n in spec.nodes if n.kind is Kind.REDUCE}

    def resolution_latex(r) -> str:
        if r.how == "recomputed" and r.name in reductions:
            return reduction_latex(reductions[r.name])
        return latex(sympy.Eq(sympy.Symbol(r.name), r.expr))

    modes = []
    for mode, result in derivation.backwards.items():
        modes.append({
            "name": mode,
            "doc": spec.mode_docs[mode],
            "saved": spec.modes[mode],
            "pivots": [latex(sympy.Eq(u, g)) for u, g in result.pivots],
            "resolutions": [{"name": r.name, "how": r.how,
                             "math": resolution_latex(r)}
                            for r in result.resolutions],
            "reductions": [latex(sympy.Eq(sympy.Symbol(name), RowSum(body), evaluate=False))
                           for name, body in result.reductions],
            "gradients": [{"name": name, "math": gradient_latex(name, expr)}
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
        "tangent_inputs": [{"name": name, "math": tangent_latex(name)}
                           for name, tangent in derivation.tangent.inputs],
        "tangents": [{"name": name, "math": f"{tangent_latex(name)} = {latex(expr)}"}
                     for name, expr in derivation.tangent.tangents],
        "jvp_ir": jvp.listing(),
        "counts": [reduction_count("forward", forward)]
                  + [reduction_count(f"backward, mode `{mode}`", kernel)
                     for mode, kernel in backwards.items()],
        "module_path": module_path or f"generated/{spec.name}.py",
        "site": module_path is None,
    }
    return environment().get_template("doc_page.md.j2").render(**context)


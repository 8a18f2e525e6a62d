"""The derived backward depends on the op, not on how its spec spells it: a value named first or
written inline derives the same backward IR (up to the names of intermediate values), the
textbook centred form, with no two reductions that are row-invariant multiples of each other."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
from exact_vjp import check_exact

from derive.engine import derive
from derive.graph import RowGraph
from derive.spec import OpSpec


def ir(graph: RowGraph) -> str:
    """describe() with every defined value renamed v0, v1, ... in definition order (the renamed
    expressions re-sorted, so only the structure is compared)."""
    names = {d.name: f"v{index}" for index, d in enumerate(graph.definitions)}

    def rename(expr: sympy.Expr) -> sympy.Expr:
        return expr.xreplace({s: sympy.Symbol(names[s.name], real=True)
                              for s in expr.free_symbols if s.name in names})

    renamed = dataclasses.replace(
        graph,
        definitions=tuple(dataclasses.replace(d, name=names[d.name], expr=rename(d.expr))
                          for d in graph.definitions),
        element_outputs=tuple((n, rename(e)) for n, e in graph.element_outputs),
        row_outputs=tuple((n, rename(e)) for n, e in graph.row_outputs),
        column_outputs=tuple((n, p, rename(e)) for n, p, e in graph.column_outputs),
        scalar_outputs=tuple((n, p, rename(e)) for n, p, e in graph.scalar_outputs))
    return renamed.describe()


def softmax(named: bool, stabilised: bool) -> OpSpec:
    op = OpSpec("softmax")
    x = op.input("x")
    u = x - op.row_max("top", x) if stabilised else x
    e = op.element("e", sympy.exp(u)) if named else sympy.exp(u)
    total = op.row_sum("total", e)
    op.output(op.element("p", e / total))
    op.save(x)
    return op


def layernorm(named: bool) -> OpSpec:
    op = OpSpec("layernorm")
    x = op.input("x")
    weight = op.column_param("weight")
    bias = op.column_param("bias")
    eps = op.scalar("eps", positive=True)
    mean = op.row_mean("mean", x)
    var = op.row_mean("var", (x - mean) ** 2)
    rstd = op.row("rstd", 1 / sympy.sqrt(var + eps), positive=True)
    x_hat = op.element("x_hat", (x - mean) * rstd) if named else (x - mean) * rstd
    op.output(op.element("y", x_hat * weight + bias))
    op.save(x, mean, rstd)
    return op


def log_softmax(named: bool) -> OpSpec:
    op = OpSpec("log_softmax")
    x = op.input("x")
    top = op.row_max("top", x)
    e = op.element("e", sympy.exp(x - top)) if named else sympy.exp(x - top)
    total = op.row_sum("total", e)
    lse = op.row("lse", sympy.log(total) + top)
    op.output(op.element("y", x - lse))
    op.save(x)
    return op


def mean_tanh(named: bool) -> OpSpec:
    op = OpSpec("mean_tanh")
    x = op.input("x")
    t = op.element("t", sympy.tanh(x)) if named else sympy.tanh(x)
    op.output(op.element("y", x - op.row_mean("m", t)))
    op.save(x)
    return op


PAIRS = {
    "softmax": lambda named: softmax(named, stabilised=False),
    "stable softmax": lambda named: softmax(named, stabilised=True),
    "layernorm": layernorm,
    "log_softmax": log_softmax,
    "mean of tanh": mean_tanh,
}


@pytest.mark.parametrize("case", sorted(PAIRS))
def test_named_and_inline_spellings_derive_the_same_backward(case: str) -> None:
    named, inline = PAIRS[case](True), PAIRS[case](False)
    named_derivation, inline_derivation = derive(named), derive(inline)
    assert ir(named_derivation.backward.graph) == ir(inline_derivation.backward.graph)
    check_exact(inline, inline_derivation)
    check_exact(named, named_derivation)


def test_inline_softmax_backward_is_the_textbook_one() -> None:
    gradient = dict(derive(softmax(named=False, stabilised=False)).backward.gradients)["x"]
    p, dp, total = sympy.symbols("p dp sum_dp_p", real=True)
    assert gradient.xreplace({s: sympy.Symbol(s.name, real=True)
                              for s in gradient.free_symbols}) == p * (dp - total)


def test_inline_layernorm_backward_is_centred() -> None:
    """No Σ dy·w·x and no mean² terms: the reductions are Σ dy·w and Σ dy·w·x̂."""
    backward = derive(layernorm(named=False)).backward
    bodies = [body for _, body in backward.reductions]
    assert len(bodies) == 2
    assert all(sympy.Symbol("x", real=True) not in body.free_symbols for body in bodies)


def reductions(spec: OpSpec) -> int:
    derivation = derive(spec)
    graphs = [derivation.forward] + [b.graph for b in derivation.backwards.values()]
    return sum(1 for graph in graphs for d in graph.definitions if d.reduction)


def test_scalar_multiples_share_one_reduction() -> None:
    """Softmax with a learnable temperature: max and sum forward, one sum backward."""
    op = OpSpec("tempered")
    x = op.input("x")
    t = op.scalar_param("t")
    top = op.row_max("top", x)
    e = sympy.exp((x - top) * t)
    total = op.row_sum("total", e)
    op.output(op.element("p", e / total))
    op.save(x, top, total)
    # forward: top, total; backward: Σ dp·p, Σ p·x, Σ dp·p·x (t·Σ dp·p is not a sum of its own)
    assert reductions(op) == 5
    check_exact(op, derive(op))


def test_polynomial_norm_reductions() -> None:
    """y = (a·x + b·x² + c·x³) · rstd with three learnable scalars."""
    op = OpSpec("poly")
    x = op.input("x")
    a, b, c = (op.scalar_param(n) for n in "abc")
    eps = op.scalar("eps", positive=True)
    rstd = op.row("rstd", 1 / sympy.sqrt(op.row_mean("ms", x**2) + eps), positive=True)
    op.output(op.element("y", (a * x + b * x**2 + c * x**3) * rstd))
    op.save(x, rstd)
    # forward: ms; backward: Σ dy·x, Σ dy·x², Σ dy·x³ (dx's sum is a·, b·, c· those three)
    assert reductions(op) == 4
    check_exact(op, derive(op))

"""The printers, as tiny exact-string tests."""

import pytest
import sympy

from codegen.printers import TORCH, TRITON, KernelPrinter, PrintError

x, y, rstd, total, c = sympy.symbols("x y rstd total c", real=True)
N = sympy.Symbol("N", positive=True, integer=True)
ELEMENTS = {"x", "y"}


def triton(expr: sympy.Expr) -> str:
    return KernelPrinter(TRITON, ELEMENTS.__contains__)(expr)


def torch_(expr: sympy.Expr) -> str:
    return KernelPrinter(TORCH, ELEMENTS.__contains__)(expr)


@pytest.mark.parametrize(("expr", "source"), [
    (x + y, "x + y"),
    (x - y, "x - y"),
    (-x, "-x"),
    (x * y, "x * y"),
    # quotients through helpers.div: correctly rounded where the kernel's elements are fp32
    (x / y, "helpers.div(x, y, EXACT)"),
    (total / N * x, "helpers.div(total, N, EXACT) * x"),
    (rstd * (x - total / N), "rstd * (x - helpers.div(total, N, EXACT))"),
    (x**2, "x * x"),
    (x**-2, "helpers.div(1.0, x * x, EXACT)"),
    # a quotient of numbers and integers alone at the accumulator's precision: Triton's 1.0 / N
    # is fp32, one rounding off in an fp64 kernel
    (1 / N, "helpers.div(tl.full([], 1.0, ACC), N, EXACT)"),
    (x - 3 / N, "x - helpers.div(tl.full([], 3.0, ACC), N, EXACT)"),
    (2 * x / N, "helpers.div(tl.full([], 2.0, ACC), N, EXACT) * x"),
    (N**-2, "helpers.div(tl.full([], 1.0, ACC), N * N, EXACT)"),
    (total / (2 * N), "helpers.div(0.5 * total, N, EXACT)"),
    (sympy.sqrt(x), "helpers.sqrt(x)"),
    # a reciprocal square root: correctly rounded unless the kernel is compiled for its width
    (1 / sympy.sqrt(x + y), "helpers.rsqrt(x + y, FIXED_N)"),
    (x ** sympy.Rational(-3, 2), "helpers.div(1.0, x * helpers.sqrt(x), EXACT)"),
    (x ** sympy.Rational(3, 2), "x * helpers.sqrt(x)"),
    (sympy.exp(x - total), "helpers.exp(x - total, EXACT)"),
    (sympy.Rational(1, 2) * x, "0.5 * x"),
    (sympy.Max(x, y), "tl.maximum(x, y)"),
    (sympy.Piecewise((x, x > 0), (y, True)), "tl.where((x > 0.0), x, y)"),
    # integer powers past the fourth by squaring: each repeated factor evaluated once
    (x**5, "(x * x) * (x * x) * x"),
    (x**6, "(x * x * x) * (x * x * x)"),
    (x**-9, "helpers.div(1.0, (x * x * x * x) * (x * x * x * x) * x, EXACT)"),
    (x ** sympy.Rational(11, 2), "(x * x) * (x * x) * x * helpers.sqrt(x)"),
    (x ** sympy.Rational(-5, 2), "helpers.div(1.0, x * x * helpers.sqrt(x), EXACT)"),
    # sqrt(sqrt(x)), as SymPy writes it, and its powers: square roots nested
    (x ** sympy.Rational(3, 4), "helpers.sqrt(x) * helpers.sqrt(helpers.sqrt(x))"),
    # conditions joined as selections, a negation pushed onto the comparisons
    (sympy.Piecewise((x, sympy.And(x > -1, x < 1)), (y, True)),
     "tl.where(tl.where((x > -1.0), (x < 1.0), False), x, y)"),
    (sympy.Piecewise((x, sympy.Or(x < -1, y > 1)), (y, True)),
     "tl.where(tl.where((y > 1.0), True, (x < -1.0)), x, y)"),
    (sympy.Piecewise((x, sympy.Not(sympy.And(x > -1, y < 1))), (y, True)),
     "tl.where(tl.where((y >= 1.0), True, (x <= -1.0)), x, y)"),
    # ReLU6's min(max(x, 0), 6): SymPy writes a comparison of a selection as an ITE
    (sympy.Piecewise((x, sympy.ITE(c, x < 6, True)), (6, True)),
     "tl.where(tl.where((c == 0), True, (x < 6.0)), x, 6.0)"),
])
def test_triton_printer(expr: sympy.Expr, source: str) -> None:
    assert triton(expr) == source


def test_torch_printer_uses_torch_functions() -> None:
    # its quotients divide as the Triton printer's do (an element, not times a reciprocal)
    assert torch_(sympy.exp(x) / sympy.sqrt(y)) == "(torch.exp(x)) / (torch.sqrt(y))"
    assert torch_(sympy.erf(x)) == "torch.erf(x)"
    # its conditions joined by & and |, elementwise for tensors and Python bools alike
    assert torch_(sympy.Piecewise((x, sympy.Or(sympy.And(x > 0, y < 1), c)), (y, True))) == \
        "torch.where((c | ((x > 0.0) & (y < 1.0))), x, y).to(acc)"


def test_row_invariant_factors_print_first() -> None:
    # sum / N evaluates once per row, not once per element.
    assert triton(x * total / N) == "helpers.div(total, N, EXACT) * x"
    # a bare reciprocal of a row value divides the element instead: one rounding, as torch's
    assert triton(x / total) == "helpers.div(x, total, EXACT)"


@pytest.mark.parametrize("expr", [x ** sympy.Rational(1, 3), sympy.atan(x), sympy.zoo])
def test_unprintable_expressions_raise(expr: sympy.Expr) -> None:
    with pytest.raises(PrintError):
        triton(expr)


#: expressions whose printed torch source must compute what SymPy does, at every point
EVALUATED = [
    x**5, x**6, x**7, x**-6, x**12, (x + y) ** 9, x ** sympy.Rational(7, 2),
    x ** sympy.Rational(-9, 2), y ** -13, x ** sympy.Rational(3, 4),
    x ** sympy.Rational(-5, 4), x ** sympy.Rational(23, 16),
    sympy.Piecewise((x, sympy.And(x > -1, x < 1)), (y, True)),
    sympy.Piecewise((x, sympy.Or(x < -1, y > 1)), (-y, True)),
    sympy.Piecewise((x, sympy.Not(sympy.Or(x < -1, y > 1))), (y**2, True)),
    sympy.Piecewise((x, sympy.ITE(x > 0, y < 1, x < -1)), (6, True)),
    sympy.Piecewise((x**2, sympy.And(sympy.Or(x < 0, y < 0), sympy.Ne(x, y))), (x * y, True)),
]


@pytest.mark.parametrize("expr", EVALUATED, ids=str)
def test_printed_torch_source_computes_the_expression(expr: sympy.Expr) -> None:
    import torch

    # x never 0 (negative powers), positive under a root
    rooted = any(not p.exp.is_Integer for p in expr.atoms(sympy.Pow))
    values = torch.linspace(-2.5, 2.5, 11, dtype=torch.float64) + 0.1
    grid_x, grid_y = (t.reshape(-1) for t in torch.meshgrid(values, values + 0.25,
                                                             indexing="ij"))
    if rooted:
        grid_x = grid_x.abs()
    printed = eval(torch_(expr), {"torch": torch, "acc": torch.float64},  # noqa: S307
                   {"x": grid_x, "y": grid_y})
    function = sympy.lambdify((x, y), expr, modules="math")
    for index in range(len(grid_x)):
        want = float(function(grid_x[index].item(), grid_y[index].item()))
        assert float(printed[index]) == pytest.approx(want, rel=1e-14), (expr, index)

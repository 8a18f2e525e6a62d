"""The printers, as tiny exact-string tests."""

import pytest
import sympy

from codegen.printers import TORCH, TRITON, KernelPrinter, PrintError

x, y, rstd, total = sympy.symbols("x y rstd total", real=True)
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
    (sympy.sqrt(x), "helpers.sqrt(x)"),
    # a reciprocal square root: correctly rounded unless the kernel is compiled for its width
    (1 / sympy.sqrt(x + y), "helpers.rsqrt(x + y, FIXED_N)"),
    (x ** sympy.Rational(-3, 2), "helpers.div(1.0, x * helpers.sqrt(x), EXACT)"),
    (x ** sympy.Rational(3, 2), "x * helpers.sqrt(x)"),
    (sympy.exp(x - total), "helpers.exp(x - total, EXACT)"),
    (sympy.Rational(1, 2) * x, "0.5 * x"),
    (sympy.Max(x, y), "tl.maximum(x, y)"),
    (sympy.Piecewise((x, x > 0), (y, True)), "tl.where((x > 0.0), x, y)"),
])
def test_triton_printer(expr: sympy.Expr, source: str) -> None:
    assert triton(expr) == source


def test_torch_printer_uses_torch_functions() -> None:
    # its quotients divide as the Triton printer's do (an element, not times a reciprocal)
    assert torch_(sympy.exp(x) / sympy.sqrt(y)) == "(torch.exp(x)) / (torch.sqrt(y))"
    assert torch_(sympy.erf(x)) == "torch.erf(x)"


def test_row_invariant_factors_print_first() -> None:
    # sum / N evaluates once per row, not once per element.
    assert triton(x * total / N) == "helpers.div(total, N, EXACT) * x"
    # a bare reciprocal of a row value divides the element instead: one rounding, as torch's
    assert triton(x / total) == "helpers.div(x, total, EXACT)"


@pytest.mark.parametrize("expr", [x ** sympy.Rational(1, 3), sympy.atan(x), sympy.zoo])
def test_unprintable_expressions_raise(expr: sympy.Expr) -> None:
    with pytest.raises(PrintError):
        triton(expr)

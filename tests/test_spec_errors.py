"""Every malformed spec ends as `derive: error: file:line: ...`, never a traceback; refusals of
what is outside the language name the line that wrote it."""

from __future__ import annotations

import re

import pytest

from codegen.driver.command import main

HEADER = ("import math\nimport sympy\n\nfrom derive.api import DimAPI\n"
          "from derive.spec import OpSpec\n\n\ndef spec():\n    op = OpSpec('bad')\n")
FOOTER = ("    op.api = DimAPI(function='bad', module='Bad', torch_function='none')\n"
          "    return op\n")

CASES = {
    "syntax": ("    x = op.input('x'\n", r"bad\.py:\d+: syntax error"),
    "misspelled method": ("    x = op.inptu('x')\n",
                          r"bad\.py:10: AttributeError: .*'inptu'.*OpSpec's methods: "),
    "math on a symbol": ("    x = op.input('x')\n    op.element('y', math.tanh(x))\n",
                         r"bad\.py:11: TypeError: .*sympy\.tanh, not math\.tanh"),
    "two column indices": (
        "    x = op.input('x')\n    j = op.column_index('j')\n    k = op.column_index('k')\n"
        "    op.output(op.element('y', sympy.Piecewise((x, k <= j), (0, True))))\n"
        "    op.save(x)\n",
        r"bad\.py:13: 'y' combines the column indices j, k"),
    # partner reads (OpSpec.partner): of an input only, one pairing, never saved, and an
    # adjoint the engine can move to the partner column
    "partner of a definition": (
        "    x = op.input('x')\n    y = op.element('y', x * 2)\n    op.partner('p', y)\n",
        r"bad\.py:12: 'p': partner\(\) reads an element input or a column parameter at the "
        r"partner column .*got element 'y'"),
    "unknown pairing": (
        "    x = op.input('x')\n    op.partner('p', x, pairing='cyclic')\n",
        r"bad\.py:11: 'p': partner\(\) takes pairing 'half' or 'interleaved', got 'cyclic'"),
    "two pairings": (
        "    x = op.input('x')\n    op.partner('p', x)\n"
        "    op.partner('q', x, pairing='interleaved')\n",
        r"bad\.py:12: 'q': pairing 'interleaved' differs from the 'half' of 'p'"),
    "partner read twice": (
        "    x = op.input('x')\n    op.partner('p', x)\n    op.partner('q', x)\n",
        r"bad\.py:12: 'q': 'p' reads 'x' at its partner column already"),
    "partner saved": (
        "    x = op.input('x')\n    p = op.partner('p', x)\n"
        "    op.output(op.element('y', x * p))\n    op.save(p)\n",
        r"bad\.py:13: 'p': 'p' is input 'x' read at the partner column: save 'x' instead"),
    "partner's input not saved": (
        "    x = op.input('x')\n    p = op.partner('p', x)\n    y = op.element('y', x * p)\n"
        "    op.output(y)\n    op.save(y)\n",
        r"bad\.py:11: the backward reads 'x' at the partner column \('p'\), but the spec saves "
        r"y: save 'x'"),
    "index the pairing cannot move": (
        "    x = op.input('x')\n    j = op.column_index('j')\n    p = op.partner('p', x)\n"
        "    op.output(op.element('y', sympy.Piecewise((p, j < 3), (0, True))))\n"
        "    op.save(x)\n",
        r"bad\.py:12: the adjoint of the partner read 'p' uses the column index 'j' in .*, which "
        r"the engine cannot move to the partner column"),
    # outside the language: refused where written, before the engine differentiates it
    "function outside the language": (
        "    x = op.input('x')\n    beta = op.scalar('beta')\n"
        "    op.output(op.element('y', x * sympy.floor(beta * x)))\n",
        r"bad\.py:12: 'y': floor is not a function of the spec language \(its functions: exp, "
        r"log, .*\)"),
    "function of a row value outside the language": (
        "    x = op.input('x')\n    s = op.row_sum('s', x)\n"
        "    op.row('r', sympy.gamma(s))\n",
        r"bad\.py:12: 'r': gamma is not a function of the spec language"),
    "power outside the language": (
        "    x = op.input('x')\n    op.element('y', x ** sympy.Rational(1, 3))\n",
        r"bad\.py:11: 'y': the power x\*\*\(1/3\) is outside the spec language, which has "
        r"integer powers and powers of square roots .* exp\(exponent \* log\(base\)\)"),
    "power of a variable exponent": (
        "    x = op.input('x')\n    beta = op.scalar('beta')\n"
        "    op.element('y', 2 ** (beta * x))\n",
        r"bad\.py:12: 'y': the power 2\*\*\(beta\*x\) is outside the spec language"),
    "chained comparison": (
        "    x = op.input('x')\n    op.element('y', sympy.Piecewise((x, -1 < x < 1), (0, True)))\n",
        r"bad\.py:11: TypeError: cannot determine truth value of Relational.*a chained "
        r"comparison `a < x < b`.*sympy\.And\(a < x, x < b\)"),
    "complex number": ("    x = op.input('x')\n    op.element('y', x * sympy.I)\n",
                       r"bad\.py:11: 'y': the number I is not a real number or ±oo"),
    "division by zero": ("    x = op.input('x')\n    op.element('y', x / 0)\n",
                         r"bad\.py:11: 'y': the number zoo is not a real number or ±oo"),
    "condition as a value": (
        "    x = op.input('x')\n    op.element('y', x > 0)\n",
        r"bad\.py:11: 'y': x > 0 is a condition, not a value: a condition selects in a "
        r"Piecewise, as Piecewise\(\(1, x > 0\), \(0, True\)\)"),
    "residue of a value": ("    x = op.input('x')\n    op.element('y', sympy.Mod(x, 2))\n",
                           r"bad\.py:11: 'y': Mod\(x, 2\): Mod is of the column index by a "
                           r"positive integer"),
    "save of an expression": ("    x = op.input('x')\n    op.output(op.element('y', x**2))\n"
                              "    op.save(2 * x)\n",
                              r"bad\.py:12: save\(\) got 2\*x, which is not a value declared"),
    # y = 2x: the VJP 2 dy reads no x, whose saving would only hold memory
    "unread save": ("    x = op.input('x')\n    op.output(op.element('y', 2 * x))\n"
                    "    op.save(x)\n",
                    r"bad\.py:12: memory mode 'default' saves 'x', which its backward never "
                    r"reads"),
    "api scalar": ("    x = op.input('x')\n    eps = op.scalar('eps')\n"
                   "    op.output(op.element('y', x / (x**2 + eps)))\n    op.save(x)\n",
                   r"bad\.py:14: op\.api \(DimAPI\) does not match .*scalar 'eps' is set by no"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_errors_are_one_line_at_the_spec(case, tmp_path, capsys):
    body, message = CASES[case]
    (tmp_path / "bad.py").write_text(HEADER + body + FOOTER)
    assert main([str(tmp_path / "bad.py"), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("derive: error: "), error
    assert "Traceback" not in error
    assert re.search(message, error), error


def test_out_naming_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(HEADER + "    x = op.input('x')\n" + FOOTER)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad.py"), "--out", str(tmp_path / "file")])
    assert "--out names a directory" in capsys.readouterr().err


def test_max_and_abs_need_no_heaviside(tmp_path, capsys):
    """ReLU and |x| derive through Piecewise: the module is written, no Heaviside/sign error."""
    body = ("    x = op.input('x')\n"
            "    op.output(op.element('y', sympy.Max(x, 0) + sympy.Abs(x) * sympy.sin(x)))\n"
            "    op.save(x)\n")
    (tmp_path / "ok.py").write_text(HEADER.replace("'bad'", "'ok'") + body +
                                    FOOTER.replace("'bad'", "'ok'"))
    assert main([str(tmp_path / "ok.py"), "--out", str(tmp_path / "out")]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "out" / "ok.py").exists()


def test_show_lists_the_names(capsys):
    assert main(["--show"]) == 0
    assert "layernorm" in capsys.readouterr().out


PARTNER_HEADER = ("import sympy\n\nfrom derive.api import ElementwiseAPI, Option\n"
                  "from derive.spec import OpSpec\n\n\ndef spec():\n    op = OpSpec('bad')\n"
                  "    x = op.input('x')\n")


@pytest.mark.parametrize(("body", "api", "message"), [
    ("    p = op.scalar('p')\n    u = op.random('u')\n    r = op.partner('r', x)\n"
     "    op.output(op.element('y', x + u * r * p))\n    op.save(x)\n",
     "options=(Option('p', 0.1, check='probability'),), dropout='p'",
     r"bad\.py:12: the adjoint of the partner read 'r' holds random 'u', which cannot be read "
     r"at the partner column"),
    ("    r = op.input('r', absent=0)\n    p = op.partner('p', r)\n"
     "    op.output(op.element('y', x * p))\n    op.save(x, r)\n", "inputs=('input', 'r')",
     r"bad\.py:11: 'p': partner\(\) reads a tensor the caller always gives; input 'r' is "
     r"optional"),
])
def test_partner_reads_the_engine_cannot_derive(body, api, message, tmp_path, capsys):
    (tmp_path / "bad.py").write_text(
        PARTNER_HEADER + body + f"    op.api = ElementwiseAPI(function='bad', module='Bad', "
        f"torch_function='-', {api})\n    return op\n")
    assert main([str(tmp_path / "bad.py"), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("derive: error: ") and "Traceback" not in error, error
    assert re.search(message, error), error

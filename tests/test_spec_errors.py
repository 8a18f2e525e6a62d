"""Every malformed spec ends as `derive: error: file:line: ...`, never a traceback; refusals of
what is outside the language name the line that wrote it."""

from __future__ import annotations

import re

import pytest

from derive.__main__ import main

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

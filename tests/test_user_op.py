"""`derive path/to/my_op.py --out DIR` for a spec outside this repo: the DyT tutorial, and the
errors a malformed spec gets."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import randn

from derive.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial" / "dyt.py"


@pytest.fixture(scope="module")
def dyt(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("my_ops")
    assert main([str(TUTORIAL), "--out", str(out)]) == 0
    spec = importlib.util.spec_from_file_location("dyt", out / "dyt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return out, module


def test_writes_module_page_and_test(dyt):
    out, _ = dyt
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "dyt.md", "dyt.py", "test_dyt.py"]
    assert "sum_" in (out / "dyt.md").read_text(), "alpha's gradient is a derived row reduction"


def test_generated_finite_difference_test_passes(dyt):
    out, _ = dyt
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(out / "test_dyt.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dyt_matches_torch(dyt, device):
    _, module = dyt
    x = randn((6, 7), seed=1, device=device).requires_grad_()
    alpha = randn((), seed=2, device=device).requires_grad_()
    weight = randn((7,), seed=3, device=device).requires_grad_()
    bias = randn((7,), seed=4, device=device).requires_grad_()
    upstream = randn((6, 7), seed=5, device=device)
    got = module.dyt(x, (7,), alpha, weight, bias)
    want = weight * torch.tanh(alpha * x) + bias
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (x, alpha, weight, bias), upstream),
                    torch.autograd.grad(want, (x, alpha, weight, bias), upstream), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dyt_module(dyt):
    _, module = dyt
    norm = module.DyT(7, alpha_init=0.25)
    assert list(norm.state_dict()) == ["alpha", "weight", "bias"]
    assert norm.alpha.item() == 0.25
    with pytest.raises(ValueError, match="argument 'alpha' must hold one value"):
        module.dyt(torch.ones(2, 7), (7,), torch.ones(2))


BAD_SPECS = {
    "undeclared": ("x = op.input('x')\n    op.element('z', x + sympy.Symbol('q'))",
                   r"bad\.py:\d+: 'z': the expression .* uses q, not declared"),
    "unprintable": ("x = op.input('x')\n    op.output(op.element('y', sympy.atan(x)))\n"
                    "    op.save(x)",
                    r"bad\.py:10: cannot generate kernel code for .* no rule for atan.*"
                    r"docs/spec_language\.md"),
    "max that matters": ("x = op.input('x')\n    top = op.row_max('top', x)\n"
                         "    op.output(op.element('y', x * top))\n    op.save(x)",
                         r"bad\.py:\d+: 'top' is a row max whose adjoint does not vanish"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_malformed_spec_errors_point_to_the_line(case, tmp_path, capsys):
    body, message = BAD_SPECS[case]
    (tmp_path / "bad.py").write_text(
        "import sympy\n\nfrom derive.api import DimAPI\nfrom derive.spec import OpSpec\n\n\n"
        "def spec():\n    op = OpSpec('bad')\n    " + body + "\n"
        "    op.api = DimAPI(function='bad', module='Bad', torch_function='none')\n"
        "    return op\n")
    assert main([str(tmp_path / "bad.py"), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("derive: error: ")
    assert re.search(message, error), error

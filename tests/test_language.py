"""Every function, power and condition docs/spec_language.md lists derives, prints in both
dialects and computes torch's values and gradients: user specs derived with `derive SPEC --out
DIR`, called against torch in fp64 on both paths, their generated finite-difference tests run
(on inputs drawn from each op's domain)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
from reference import force_looped, randn

from codegen.driver.command import main

ROOT = Path(__file__).resolve().parent.parent
functional = torch.nn.functional

HEADER = ("import sympy\nfrom sympy import (Abs, And, Heaviside, Max, Min, Not, Or, Piecewise, "
          "Rational, Eq, Mod, cos, cosh, erf, exp, log, sign, sin, sinh, sqrt, tanh)\n\n"
          "from derive.api import ElementwiseAPI, NormalizedShapeAPI, Option, ReductionAPI\n"
          "from derive.spec import OpSpec\n\n\ndef spec():\n")


def _elementwise(name: str, expr: str, options: str = "", save: str = "x",
                 declare: str = "") -> str:
    return (f"    op = OpSpec('{name}')\n    x = op.input('x')\n{declare}"
            + "".join(f"    {o.split('=')[0]} = op.scalar('{o.split('=')[0]}')\n"
                      for o in options.split(",") if o)
            + f"    op.output(op.element('y', {expr}))\n    op.save({save})\n"
            f"    op.api = ElementwiseAPI(function='{name}', module='M_{name}', "
            "torch_function='-', options=("
            + "".join(f"Option('{o.split('=')[0]}', {o.split('=')[1]}), "
                      for o in options.split(",") if o)
            + "))\n    return op\n")


#: name -> (spec body, torch's function of x and the options, options of a second call)
SPECS = {
    # Min(Max(...)) of a Piecewise: SymPy writes the comparison of a selection as an ITE
    "relu6": (_elementwise("relu6", "Min(Max(x, 0), 6)"), lambda x: functional.relu6(x), {}),
    "hardswish": (_elementwise("hardswish", "x * Min(Max(x + 3, 0), 6) / 6"),
                  lambda x: functional.hardswish(x), {}),
    "clamp": (_elementwise("clamp", "Min(Max(x, lo), hi)", "lo=-0.5,hi=1.25"),
              lambda x, lo=-0.5, hi=1.25: torch.clamp(x, lo, hi), {"lo": -2.0, "hi": 0.25}),
    # the backward merges the branches of equal derivative into an Or
    "merged": (_elementwise("merged", "Piecewise((x, x < -1), (x + 3, x < 1), (x * x, True))"),
               lambda x: torch.where(x < -1, x, torch.where(x < 1, x + 3, x * x)), {}),
    "conditions": (_elementwise(
        "conditions", "Piecewise((x**2, And(x > -1, x < 1)), (Abs(x), True)) "
                      "+ Piecewise((x, Not(Or(x < -2, x > 2))), (0, True))"),
        lambda x: torch.where((x > -1) & (x < 1), x**2, x.abs())
        + torch.where(~((x < -2) | (x > 2)), x, 0.0), {}),
    "powers": (_elementwise(
        "powers", "x**6 + x**-3 + x**7 / 7 - (x*x + 1)**Rational(-5, 2) "
                  "+ sqrt(sqrt(x*x + 1)) + (x*x + 2)**0.5"),
        lambda x: x**6 + x**-3 + x**7 / 7 - (x * x + 1) ** -2.5 + (x * x + 1) ** 0.25
        + (x * x + 2) ** 0.5, {}),
    "functions": (_elementwise(
        "functions", "sinh(x) + cosh(x) * sin(x) + cos(x) + tanh(x) * erf(x) + exp(-x**2) "
                     "+ log(1 + x**2) + Heaviside(x) * x + sign(x) * x**2"),
        lambda x: torch.sinh(x) + torch.cosh(x) * torch.sin(x) + torch.cos(x)
        + torch.tanh(x) * torch.erf(x) + torch.exp(-x**2) + torch.log(1 + x**2)
        + torch.where(x > 0, 1.0, 0.0) * x + torch.sign(x) * x**2,
        {}),
    # the column index's parity; a backward that reads no saved value (op.save())
    "parity": (_elementwise("parity", "Piecewise((x, Eq(Mod(j, 2), 0)), (-x, True))",
                            save="", declare="    j = op.column_index('j')\n"),
               lambda x: x * (1 - 2 * (torch.arange(x.shape[-1], device=x.device) % 2)), {}),
    # its generated test draws x positive
    "log_domain": (_elementwise("log_domain", "log(x) * x + sqrt(x)"),
                   lambda x: torch.log(x) * x + torch.sqrt(x), {}),
}

#: torch.nn.functional.normalize: x / max(||x||, eps), spelled two ways, with memory modes
#: that keep the output and invert it
L2 = {
    "l2_inverse": ("    op = OpSpec('l2_inverse')\n    x = op.input('x')\n"
                   "    eps = op.scalar('eps', positive=True)\n"
                   "    norm = op.row('norm', sqrt(op.row_sum('squares', x**2)))\n"
                   "    inverse = op.row('inverse', 1 / Max(norm, eps))\n"
                   "    y = op.element('y', x * inverse)\n    op.output(y)\n    op.save(x)\n"
                   "    op.save(y, inverse, mode='output')\n"),
    "l2_quotient": ("    op = OpSpec('l2_quotient')\n    x = op.input('x')\n"
                    "    eps = op.scalar('eps', positive=True)\n"
                    "    norm = op.row('norm', sqrt(op.row_sum('squares', x**2)))\n"
                    "    y = op.element('y', x / Max(norm, eps))\n    op.output(y)\n"
                    "    op.save(x)\n    op.save(y, norm, mode='output')\n"),
}


#: a loss against the uniform target, mean_j(logsumexp(x) - x_j), from the gaps below the row
#: max (carried in the max's sweep of a looped row); its backward's 1 / N is a quotient of
#: integers alone
UNIFORM = ("    op = OpSpec('uniform_ce')\n    x = op.input('x')\n"
           "    m = op.row_max('m', x)\n"
           "    total = op.row_sum('total', exp(x - m), positive=True)\n"
           "    gap = op.row_mean('gap', m - x)\n"
           "    op.output(op.row('y', log(total) + gap))\n    op.save(x, m, total)\n"
           "    op.api = ReductionAPI(function='uniform_ce', module='UniformCE', "
           "torch_function='-')\n    return op\n")


def _l2_source(name: str) -> str:
    return (L2[name] + f"    op.api = NormalizedShapeAPI(function='{name}', module='M_{name}', "
            "torch_function='-', torch_module='-', params=(), eps=1e-12)\n    return op\n")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """Every spec here derived into one directory, and the outcomes of its generated tests:
    {test file: outcomes}, and under "derive" the exit status of `derive` for each spec."""
    out = tmp_path_factory.mktemp("language")
    sources = {name: HEADER + body for name, (body, _, _) in SPECS.items()}
    sources |= {name: HEADER + _l2_source(name) for name in L2}
    sources["uniform_ce"] = HEADER + UNIFORM
    statuses = []
    for name, source in sources.items():
        (out / f"{name}_spec.py").write_text(source)
        statuses.append(f"{name}: {main([str(out / f'{name}_spec.py'), '--out', str(out)])}")
    report = out / "report.xml"
    tests = [str(out / f"test_{name}.py") for name in sources
             if (out / f"test_{name}.py").exists()]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--continue-on-collection-errors", f"--junitxml={report}", *tests],
                            cwd=ROOT, capture_output=True, text=True)
    outcomes: dict[str, list[str]] = {"derive": statuses, "log": [result.stdout + result.stderr]}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        problems = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        name = case.get("classname", "").split(".")[-1]
        outcomes.setdefault(name, []).append(
            f"{case.get('name')}: {problems[0]}" if problems else "passed")
    return out, outcomes


@pytest.mark.parametrize("name", [*SPECS, *L2, "uniform_ce"])
def test_derives_and_its_generated_test_passes(name, derived):
    out, outcomes = derived
    assert f"{name}: 0" in outcomes["derive"]
    results = outcomes.get(f"test_{name}", [])
    # gradcheck on both paths for every memory mode, and the paths' agreement
    assert len(results) >= 3 and set(results) == {"passed"}, \
        f"{results}\n{outcomes['log'][0]}"


def _agree(got, want, x, seed):
    """got() of x against want() of a CPU copy of x: torch's fp64 ops on the CPU are the
    reference on every device (its CUDA hardswish multiplies by 1/6 rounded to float32)."""
    reference = x.detach().cpu().requires_grad_()
    result, expected = got(), want(reference)
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-10, atol=1e-10)
    upstream = randn(expected.shape, seed=seed)
    torch.testing.assert_close(torch.autograd.grad(result, x, upstream.to(x.device))[0].cpu(),
                               torch.autograd.grad(expected, reference, upstream)[0],
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_matches_torch(name, derived, device):
    module = _load(derived[0] / f"{name}.py")
    _, reference, options = SPECS[name]
    x = 3 * randn((4, 33), seed=1, device=device)
    if name == "log_domain":
        x = x.abs() + 0.1
    x.requires_grad_()
    function = getattr(module, name)
    _agree(lambda: function(x), reference, x, 2)
    if options:
        _agree(lambda: function(x, **options), lambda t: reference(t, **options), x, 3)


@pytest.mark.parametrize("memory", ["default", "output"])
@pytest.mark.parametrize("name", sorted(L2))
def test_l2_normalisation_matches_torch(name, memory, derived, device):
    module = _load(derived[0] / f"{name}.py")
    x = randn((4, 9), seed=1, device=device)
    x[2] = 0.0  # a zero row: the clamp takes its floor, the gradient is dy / eps
    x.requires_grad_()
    for eps in (1e-12, 0.5):
        _agree(lambda eps=eps: getattr(module, name)(x, (9,), eps=eps, memory=memory),
               lambda t, eps=eps: functional.normalize(t, dim=-1, eps=eps), x, 4)


def test_generated_tests_draw_from_the_domain(derived):
    out, _ = derived
    assert '"input": positive(ROWS, N)' in (out / "test_log_domain.py").read_text()
    assert '"input": randn(ROWS, N)' in (out / "test_functions.py").read_text()


@pytest.mark.parametrize("looped", [None, True, False], ids=["whole", "one-sweep", "two-pass"])
def test_uniform_loss_is_exact_in_fp64(derived, device, looped):
    """fp64 to a few ulps, loss and gradient, whether the row is whole or looped (the gaps
    carried with the running max, or a pass after it): the backward's 1 / N is computed at the
    accumulator's precision (Triton's 1.0 / N is fp32: 1e-9 relative off)."""
    module = _load(derived[0] / "uniform_ce.py")
    x = (randn((4, 300), seed=1, device=device) + 0.01 * torch.arange(300, device=device)
         + 1e3).requires_grad_()
    with (contextlib.nullcontext() if looped is None else force_looped(module, looped)):
        loss = module.uniform_ce(x)
        grad, = torch.autograd.grad(loss.sum(), x)
    reference = x.detach().cpu().requires_grad_()
    # shifted by the row max first, the reference's own sums round at the loss's scale, not
    # at the logits' 1e3
    shifted = reference - reference.detach().amax(-1, keepdim=True)
    expected = torch.logsumexp(shifted, -1) - shifted.mean(-1)
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad.cpu(), torch.autograd.grad(expected.sum(), reference)[0],
                               rtol=1e-13, atol=1e-15)

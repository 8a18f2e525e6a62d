"""`derive path/to/my_op.py --out DIR` for a spec outside this repo: every API kind gives a
module that imports and a generated finite-difference test that passes; the tutorials; the
errors a malformed spec, or an API that does not match its spec, gets."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
from reference import randn

from codegen.driver.build import layer_files, op_files
from codegen.driver.command import main
from derive.api import KINDS

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial"


def _source(body: str) -> str:
    """A spec file: `def spec():` with this body, importing the API classes it names."""
    names = [name for name in ("DimAPI", "ElementwiseAPI", "NormalizedShapeAPI", "Option",
                               "PositionEmbeddingAPI", "ReductionAPI", "RowLossAPI")
             if f"{name}(" in body]
    return (f"import sympy\n\nfrom derive.api import {', '.join(names)}\n"
            "from derive.spec import OpSpec\n\n\ndef spec():\n" + body)


#: one small spec of every API kind (a tutorial's where there is one): (spec, op name)
KIND_SPECS = {
    "normalized_shape": (TUTORIAL / "dyt.py", "dyt"),
    "normalized_shape, no parameters": ('''
    op = OpSpec("rms_scale", doc="x / sqrt(mean(x**2) + eps), no parameters.")
    x = op.input("x")
    eps = op.scalar("eps", positive=True)
    rstd = op.row("rstd", 1 / sympy.sqrt(op.row_mean("mean_square", x**2) + eps), positive=True)
    op.output(op.element("y", x * rstd))
    op.save(x, rstd)
    op.api = NormalizedShapeAPI(function="rms_scale", module="RMSScale", torch_function="-",
                                torch_module="RMSScale", params=(), eps=1e-5)
    return op
''', "rms_scale"),
    "dim": ('''
    op = OpSpec("log_softmax", doc="x - logsumexp(x) along one dim.")
    x = op.input("x")
    top = op.row_max("top", x)
    total = op.row_sum("total", sympy.exp(x - top), positive=True)
    op.output(op.element("y", x - top - sympy.log(total)))
    op.save(x, top, total)
    op.api = DimAPI(function="log_softmax", module="LogSoftmax",
                    torch_function="torch.log_softmax")
    return op
''', "log_softmax"),
    "elementwise": ('''
    op = OpSpec("gated", doc="(x + bias) * sigmoid(beta * gate).")
    x = op.input("x")
    gate = op.input("gate")
    bias = op.column_param("bias", absent=0)
    beta = op.scalar("beta")
    s = op.element("s", 1 / (1 + sympy.exp(-beta * gate)), positive=True)
    op.output(op.element("y", (x + bias) * s))
    op.save(x, gate)
    op.api = ElementwiseAPI(function="gated", module="Gated", torch_function="-",
                            inputs=("input", "gate"), call_params=("bias",),
                            options=(Option("beta", 1.5),))
    return op
''', "gated"),
    "row_loss": ('''
    op = OpSpec("nll", doc="logsumexp(x) - x[target], 0 where target == ignore_index.")
    x = op.input("x")
    target = op.row_input("target", integer=True)
    ignore_index = op.scalar("ignore_index")
    key = op.column_index("key")
    top = op.row_max("top", x)
    total = op.row_sum("total", sympy.exp(x - top), positive=True)
    picked = op.row_sum("picked", sympy.Piecewise((x, sympy.Eq(key, target)), (0, True)))
    op.output(op.row("loss", sympy.Piecewise((0, sympy.Eq(target, ignore_index)),
                                             (sympy.log(total) + top - picked, True))))
    op.save(x, target, top, total)
    op.api = RowLossAPI(function="nll", module="NLL", torch_function="-", target="target",
                        ignore="ignore_index",
                        options=(Option("ignore_index", -100, check="integer"),))
    return op
''', "nll"),
    "reduction": (TUTORIAL / "logsumexp.py", "logsumexp"),
    # GPT-J's interleaved rotary embedding: the partner of column j is j xor 1
    "position_embedding": ('''
    op = OpSpec("gptj_rotary", doc="x * cos + rotate_every_two(x) * sin (GPT-J).")
    x = op.input("x")
    cos = op.input("cos", grad=False, broadcast=True)
    sin = op.input("sin", grad=False, broadcast=True)
    j = op.column_index("j")
    pair = op.partner("pair", x, pairing="interleaved")
    sign = sympy.Piecewise((-1, sympy.Eq(sympy.Mod(j, 2), 0)), (1, True))
    op.output(op.element("y", x * cos + sign * pair * sin))
    op.save(cos, sin)
    op.api = PositionEmbeddingAPI(function="gptj_rotary", module="GPTJRotary",
                                  torch_function="-", inputs=("input", "cos", "sin"))
    return op
''', "gptj_rotary"),
}


def _spec_file(case: str, directory: Path) -> Path:
    spec, _ = KIND_SPECS[case]
    if isinstance(spec, Path):
        return spec
    path = directory / f"{KIND_SPECS[case][1]}_spec.py"
    path.write_text(_source(spec))
    return path


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """Every kind's spec derived into one directory, and the outcomes of its generated tests,
    run by one pytest (one start-up of torch and Triton for all): {test file: outcomes}, and
    under "derive" the exit status of `derive` for each kind."""
    out = tmp_path_factory.mktemp("my_ops")
    statuses = [f"{case}: {main([str(_spec_file(case, out)), '--out', str(out)])}"
                for case in KIND_SPECS]
    report = out / "report.xml"
    tests = [str(out / f"test_{name}.py") for _, name in KIND_SPECS.values()
             if (out / f"test_{name}.py").exists()]
    # each file on its own: one that does not import leaves the others to run
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


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_api_kind_has_a_spec_here():
    covered = set()
    for case in KIND_SPECS:
        covered.add(case.split(",")[0])
    assert covered == {kind.kind for kind in KINDS}


@pytest.mark.parametrize("case", sorted(KIND_SPECS))
def test_every_kind_writes_a_module_that_imports_and_a_test_that_passes(case, derived):
    out, outcomes = derived
    name = KIND_SPECS[case][1]
    assert f"{case}: 0" in outcomes["derive"]
    assert sorted(p.name for p in out.glob(f"*{name}.*")) == [f"{name}.md", f"{name}.py",
                                                             f"test_{name}.py"]
    module = _load(out / f"{name}.py")
    assert callable(module.__dict__[name])  # each spec here names its function after its op
    results = outcomes.get(f"test_{name}", [])
    # gradcheck on both paths for every memory mode, and the paths' agreement
    assert len(results) >= 3 and set(results) == {"passed"}, \
        f"{results}\n{outcomes['log'][0]}"


def test_dyt_matches_torch(derived, device):
    module = _load(derived[0] / "dyt.py")
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


def test_dyt_module(derived):
    module = _load(derived[0] / "dyt.py")
    norm = module.DyT(7, alpha_init=0.25)
    assert list(norm.state_dict()) == ["alpha", "weight", "bias"]
    assert norm.alpha.item() == 0.25
    with pytest.raises(ValueError, match="argument 'alpha' must hold one value"):
        module.dyt(torch.ones(2, 7), (7,), torch.ones(2))


def test_normalized_shape_without_parameters(derived):
    module = _load(derived[0] / "rms_scale.py")
    norm = module.RMSScale((2, 3))
    assert list(norm.state_dict()) == [] and not list(norm.parameters())
    norm.reset_parameters()
    x = randn((4, 2, 3), seed=1)
    want = x / torch.sqrt((x**2).mean(dim=(-2, -1), keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)
    assert repr(norm) == "RMSScale((2, 3), eps=1e-05, elementwise_affine=True)"


@pytest.mark.parametrize(("dim", "keepdim"), [(-1, False), (1, True), ((0, 2), False),
                                              ((2, 0), True), ((), False), (0, False)])
def test_reduction_matches_torch_logsumexp(derived, device, dim, keepdim):
    module = _load(derived[0] / "logsumexp.py")
    x = randn((2, 3, 4), seed=1, device=device).requires_grad_()
    got = module.logsumexp(x, dim, keepdim)
    # torch.logsumexp refuses an empty tuple of dims; torch.sum's rule is every dim
    want = torch.logsumexp(x, dim if dim != () else (0, 1, 2), keepdim)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    upstream = randn(want.shape, seed=2, device=device)
    torch.testing.assert_close(torch.autograd.grad(got, x, upstream)[0],
                               torch.autograd.grad(want, x, upstream)[0], rtol=1e-10, atol=1e-10)


def test_reduction_edges_as_torch(derived, device):
    module = _load(derived[0] / "logsumexp.py")
    scalar = torch.tensor(2.0, dtype=torch.float64, device=device)
    for dim in (0, -1):
        for keepdim in (False, True):
            got = module.logsumexp(scalar, dim, keepdim)
            want = torch.logsumexp(scalar, dim, keepdim)
            assert got.shape == want.shape and got.item() == want.item()
    empty_rows = torch.empty((0, 3), device=device)
    assert module.logsumexp(empty_rows).shape == (0,)
    no_columns = torch.empty((3, 0), device=device, requires_grad=True)
    got = module.logsumexp(no_columns)
    torch.testing.assert_close(got, torch.logsumexp(no_columns, -1))
    got.sum().backward()
    assert no_columns.grad.shape == (3, 0)
    half = randn((3, 33), seed=3, device=device, dtype=torch.float16)
    got = module.logsumexp(half, 0)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, torch.logsumexp(half.float(), 0).half())
    strided = randn((4, 6), seed=4, device=device)[:, ::2]
    torch.testing.assert_close(module.logsumexp(strided, 0), torch.logsumexp(strided, 0))
    module_form = module.LogSumExp(dim=0, keepdim=True)
    assert repr(module_form) == "LogSumExp(dim=0, keepdim=True)"
    assert module_form(strided).shape == (1, 3)


@pytest.mark.parametrize(("dim", "error", "message"), [
    (1.0, TypeError, r"logsumexp\(\): argument 'dim' must be an int or a tuple of ints, got "
                     r"float"),
    ((0, 1.0), TypeError, r"argument 'dim' must be an int or a tuple of ints, got a tuple "
                          r"holding a float"),
    (None, TypeError, r"argument 'dim' must be an int or a tuple of ints, got NoneType"),
    (3, IndexError, r"argument 'dim' must be in \[-3, 2\] for input of shape \[2, 3, 4\], "
                    r"got 3"),
    ((0, -3), RuntimeError, r"argument 'dim' must not name a dim twice, got \(0, -3\)"),
])
def test_reduction_dim_errors(derived, dim, error, message):
    module = _load(derived[0] / "logsumexp.py")
    with pytest.raises(error, match=message):
        module.logsumexp(torch.ones(2, 3, 4), dim)
    with pytest.raises(TypeError, match="argument 'keepdim' must be a bool, got int"):
        module.logsumexp(torch.ones(2, 3), -1, 1)


def test_user_page_names_where_the_module_was_written(derived):
    out, _ = derived
    page = (out / "logsumexp.md").read_text()
    assert f"Generated module: `{out / 'logsumexp.py'}`." in page
    assert "generated/" not in page and "](../" not in page  # no link into the docs site
    # the forward reads the row in one sweep: the max and the sum of exponentials fused
    assert ("| forward | 2 | 2 | 1: `row_max` (max); 2: `total` (sum) | 1 | 0 |\n"
            "| backward, mode `default` | 0 | 0 | none | 1 | 0 |\n") in page
    assert "sum_" in (out / "dyt.md").read_text(), "alpha's gradient is a derived row reduction"


def test_op_pages_record_their_reduction_count():
    for path in op_files():
        page = (ROOT / "docs" / "ops" / f"{path.stem}.md").read_text()
        assert "## Reduction count" in page, path.stem
        assert re.search(r"^\| forward \| \d+ \| \d+ \| .* \| \d+ \| \d+ \|$", page, re.M)
        assert re.search(r"^\| backward, mode `default` \| \d+ \| \d+ \|", page, re.M)
    layernorm = (ROOT / "docs" / "ops" / "layernorm.md").read_text()
    # mean and variance: two passes, one sweep of a looped row (Welford), then the epilogue
    assert "| forward | 2 | 2 | 1: `mean` (sum); 2: `var` (sum) | 2 | 0 |" in layernorm


def test_show_lists_every_op_and_layer(capsys):
    assert main(["--show"]) == 0
    listed = capsys.readouterr().out.strip().split(": ")[-1].split(", ")
    assert listed == [p.stem for p in op_files()] + [p.stem for p in layer_files()]
    assert main(["--show", "nosuch"]) == 2
    error = capsys.readouterr().err
    assert "no op or layer named 'nosuch'" in error and "layernorm, " in error


def test_show_prints_a_spec_file_and_writes_nothing(tmp_path, capsys):
    spec = tmp_path / "log_softmax.py"
    spec.write_text(_source(KIND_SPECS["dim"][0]))
    assert main(["--show", str(spec)]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!-- Generated by `derive` from log_softmax.py.")
    assert "## Reduction count" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log_softmax.py"]


BAD_SPECS = {
    "undeclared": ("x = op.input('x')\n    op.element('z', x + sympy.Symbol('q'))",
                   r"bad\.py:\d+: 'z': the expression .* uses q, not declared"),
    "outside the language": ("x = op.input('x')\n    op.output(op.element('y', sympy.atan(x)))\n"
                             "    op.save(x)",
                             r"bad\.py:10: 'y': atan is not a function of the spec language "
                             r"\(its functions: exp, log, .*docs/spec_language\.md\)"),
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


#: an API that does not match its spec: (the spec's body, its `op.api = ...` line, the
#: refusal after "op.api (<kind>) does not match spec 'bad': ")
API_MISMATCHES = {
    "dim API and an eps": (
        "x = op.input('x')\n    eps = op.scalar('eps', positive=True)\n"
        "    op.output(op.element('y', x / sympy.sqrt(op.row_mean('m', x**2) + eps)))\n"
        "    op.save(x)",
        "DimAPI(function='bad', module='Bad', torch_function='-')",
        "scalar 'eps' is set by no option of the API (options: none); add Option('eps', ...)"),
    "option named apart from its scalar": (
        "x = op.input('x')\n    beta = op.scalar('beta')\n"
        "    op.output(op.element('y', x * beta))\n    op.save(x)",
        "ElementwiseAPI(function='bad', module='Bad', torch_function='-', "
        "options=(Option('b', 1.0),))",
        "scalar 'beta' is set by no option of the API (options: b); add Option('beta', ...); "
        "option 'b' is not a scalar of the spec (scalars: beta)"),
    "norm API's eps without the scalar": (
        "x = op.input('x')\n    op.output(op.element('y', x * 2))\n    op.save(x)",
        "NormalizedShapeAPI(function='bad', module='Bad', torch_function='-', "
        "torch_module='Bad', params=(), eps=1e-5)",
        "the API sets eps=1e-05, but the spec declares no scalar 'eps' (use eps=None, or "
        "declare op.scalar('eps'))"),
    "reduction of an elementwise output": (
        "x = op.input('x')\n    op.output(op.element('y', x * 2))\n    op.save(x)",
        "ReductionAPI(function='bad', module='Bad', torch_function='-')",
        "the API returns one per-row output; the spec outputs 'y' (element)"),
    "option named as the API's own argument": (
        "x = op.input('x')\n    dim = op.scalar('dim')\n"
        "    op.output(op.row('y', op.row_sum('s', x) * dim))\n    op.save(x)",
        "ReductionAPI(function='bad', module='Bad', torch_function='-', "
        "options=(Option('dim', 1.0),))",
        "'dim' is an argument that a ReductionAPI takes for itself; choose another name (an "
        "option is named as its scalar)"),
    # fields of the wrong type, which would otherwise crash the checks or the generated code
    "parameters given as names": (
        "x = op.input('x')\n    w = op.column_param('w')\n"
        "    op.output(op.element('y', x * w))\n    op.save(x)",
        "NormalizedShapeAPI(function='bad', module='Bad', torch_function='-', "
        "torch_module='Bad', params=('w',), eps=None)",
        "NormalizedShapeAPI.params must be a tuple of Param, got ('w',)"),
    "one option not in a tuple": (
        "x = op.input('x')\n    beta = op.scalar('beta')\n"
        "    op.output(op.element('y', x * beta))\n    op.save(x)",
        "ElementwiseAPI(function='bad', module='Bad', torch_function='-', "
        "options=Option('beta', 1.0))",
        "ElementwiseAPI.options must be a tuple of Option, got Option(name='beta', "
        "default=1.0, module_only=False, check=None, doc='', keyword_only=False, "
        "choices=())"),
    "a layer's option": (
        "x = op.input('x')\n    beta = op.scalar('beta')\n"
        "    op.output(op.element('y', x * beta))\n    op.save(x)",
        "ElementwiseAPI(function='bad', module='Bad', torch_function='-', "
        "options=(Option('beta', 1.0, check='size', choices=('a',)),))",
        "option 'beta' has check='size'; an op's checks are None, 'probability', 'unit', "
        "'integer', 'positive', 'finite'; option 'beta' has choices, which only a layer's "
        "option takes (an op's str option is a Choice)"),
    "eps given as a str": (
        "x = op.input('x')\n    eps = op.scalar('eps', positive=True)\n"
        "    op.output(op.element('y', x / sympy.sqrt(op.row_mean('m', x**2) + eps)))\n"
        "    op.save(x)",
        "NormalizedShapeAPI(function='bad', module='Bad', torch_function='-', "
        "torch_module='Bad', params=(), eps='1e-5')",
        "NormalizedShapeAPI.eps must be a number or None, got '1e-5'"),
    "default that is not a finite number": (
        "x = op.input('x')\n    window = op.scalar('window')\n"
        "    op.output(op.element('y', x * window))\n    op.save(x)",
        "ElementwiseAPI(function='bad', module='Bad', torch_function='-', "
        "options=(Option('window', float('inf')),))",
        "option 'window' needs a finite number as its default, got inf"),
    "target of a loss that is not a row input": (
        "x = op.input('x')\n    op.output(op.row('y', op.row_sum('s', x)))\n    op.save(x)",
        "RowLossAPI(function='bad', module='Bad', torch_function='-', target='t', "
        "ignore='i')",
        "target 't' is not a row_input of the spec; ignore 'i' is not one of the API's "
        "options"),
    "random values without dropout": (
        "x = op.input('x')\n    u = op.random('u')\n"
        "    op.output(op.element('y', x * u))\n    op.save(x)",
        "ElementwiseAPI(function='bad', module='Bad', torch_function='-')",
        "random values are drawn from a seed, which only an ElementwiseAPI or a "
        "NormalizedShapeAPI with dropout=... takes"),
    "dropout before a norm without a residual": (
        "x = op.input('x')\n    p = op.scalar('p')\n    u = op.random('u')\n"
        "    op.output(op.element('y', x * u * p))\n    op.save(x)",
        "NormalizedShapeAPI(function='bad', module='Bad', torch_function='-', "
        "torch_module='-', params=(), eps=None, "
        "options=(Option('p', 0.1, check='probability'),), dropout='p')",
        "dropout 'p' must be one of the API's options, on an API with a residual (what is "
        "dropped is added to it)"),
    "position tables that are not broadcast": (
        "x = op.input('x')\n    c = op.input('c', grad=False)\n"
        "    op.output(op.element('y', x * c))\n    op.save(x, c)",
        "PositionEmbeddingAPI(function='bad', module='Bad', torch_function='-', "
        "inputs=('input', 'c'))",
        "a PositionEmbeddingAPI's tables (the inputs after the first) must be inputs of the "
        "spec declared broadcast=True"),
    "dropout op and a mask of its own": (
        "x = op.input('x')\n    r = op.input('r')\n    p = op.scalar('p')\n"
        "    u = op.random('u')\n    y = op.element('y', x * u * p + r)\n"
        "    op.output(y, op.element('s', x + r))\n    op.save(x)",
        "NormalizedShapeAPI(function='bad', module='Bad', torch_function='-', "
        "torch_module='-', params=(), eps=None, residual='r', "
        "options=(Option('p', 0.1, check='probability'),), dropout='p', dropout_op='other')",
        "dropout_op 'other' computes the calls with dropout on; this spec draws no random "
        "values and has no scalar 'p'"),
}


@pytest.mark.parametrize("case", sorted(API_MISMATCHES))
def test_api_that_does_not_match_the_spec_is_refused_at_its_line(case, tmp_path, capsys):
    body, api, refusal = API_MISMATCHES[case]
    spec = tmp_path / "bad.py"
    text = _source("    op = OpSpec('bad')\n    " + body + "\n    op.api = " + api +
                   "\n    return op\n")
    spec.write_text(text)
    line = text.splitlines().index("    op.api = " + api) + 1
    kind = api.split("(")[0]
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"derive: error: {spec}:{line}: op.api ({kind}) does "
                                       f"not match spec 'bad': {refusal}\n")
    assert not (tmp_path / "out").exists()


def _public(module) -> set[str]:
    """The functions and classes a generated module defines for its users."""
    return {name for name, value in vars(module).items() if not name.startswith("_")
            and callable(value) and getattr(value, "__module__", None) == module.__name__}


def _agree(got, want, inputs, seed):
    """got() and want() (fp64) equal, and so are their gradients w.r.t. `inputs` under one
    random upstream gradient."""
    for tensor in inputs:
        tensor.grad = None
    result, expected = got(), want()
    assert result.shape == expected.shape and result.dtype == expected.dtype
    torch.testing.assert_close(result, expected, rtol=1e-10, atol=1e-10)
    upstream = randn(expected.shape, seed=seed, device=expected.device)
    torch.testing.assert_close(torch.autograd.grad(result, inputs, upstream),
                               torch.autograd.grad(expected, inputs, upstream),
                               rtol=1e-10, atol=1e-10)


def _randomized(module, device):
    """A generated module with random parameters, on `device`."""
    module = module.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        for index, parameter in enumerate(module.parameters()):
            parameter.copy_(randn(parameter.shape, seed=50 + index, device=device))
    return module


def _call_normalized_shape(module, device):
    x = randn((4, 7), seed=1, device=device).requires_grad_()
    alpha = randn((), seed=2, device=device).requires_grad_()
    weight = randn((7,), seed=3, device=device).requires_grad_()
    bias = randn((7,), seed=4, device=device).requires_grad_()
    _agree(lambda: module.dyt(x, (7,), alpha, weight, bias),
           lambda: weight * torch.tanh(alpha * x) + bias, (x, alpha, weight, bias), 5)
    _agree(lambda: module.dyt(x, (7,), alpha), lambda: torch.tanh(alpha * x), (x, alpha), 6)
    norm = _randomized(module.DyT(7), device)
    _agree(lambda: norm(x), lambda: norm.weight * torch.tanh(norm.alpha * x) + norm.bias,
           (x, *norm.parameters()), 7)
    return {"dyt", "DyT"}


def _call_normalized_shape_without_parameters(module, device):
    x = randn((4, 2, 3), seed=1, device=device).requires_grad_()

    def want(eps):
        return lambda: x / torch.sqrt((x**2).mean(dim=(-2, -1), keepdim=True) + eps)

    _agree(lambda: module.rms_scale(x, (2, 3), eps=0.5), want(0.5), (x,), 2)
    _agree(lambda: module.RMSScale(3)(x), lambda: x / torch.sqrt(
        (x**2).mean(dim=-1, keepdim=True) + 1e-5), (x,), 3)
    return {"rms_scale", "RMSScale"}


def _call_dim(module, device):
    x = randn((3, 4, 5), seed=1, device=device).requires_grad_()
    for dim in (-1, 0, 1):
        _agree(lambda dim=dim: module.log_softmax(x, dim),
               lambda dim=dim: torch.log_softmax(x, dim), (x,), 2 + dim)
    _agree(lambda: module.LogSoftmax(dim=1)(x), lambda: torch.log_softmax(x, 1), (x,), 5)
    return {"log_softmax", "LogSoftmax"}


def _call_elementwise(module, device):
    x = randn((3, 6), seed=1, device=device).requires_grad_()
    gate = randn((3, 6), seed=2, device=device).requires_grad_()
    bias = randn((6,), seed=3, device=device).requires_grad_()
    _agree(lambda: module.gated(x, gate, bias=bias, beta=0.7),
           lambda: (x + bias) * torch.sigmoid(0.7 * gate), (x, gate, bias), 4)
    _agree(lambda: module.gated(x, gate), lambda: x * torch.sigmoid(1.5 * gate), (x, gate), 5)
    _agree(lambda: module.Gated(beta=-2.0)(x, gate, bias),
           lambda: (x + bias) * torch.sigmoid(-2.0 * gate), (x, gate, bias), 6)
    return {"gated", "Gated"}


def _call_row_loss(module, device):
    functional = torch.nn.functional
    x = randn((5, 7), seed=1, device=device).requires_grad_()
    target = torch.tensor([0, 6, -100, 3, 2], device=device)
    for reduction in ("mean", "sum", "none"):
        _agree(lambda r=reduction: module.nll(x, target, reduction=r),
               lambda r=reduction: functional.cross_entropy(x, target, reduction=r), (x,), 2)
    other = torch.tensor([0, 6, 3, 3, 2], device=device)
    _agree(lambda: module.NLL(ignore_index=3)(x, other),
           lambda: functional.cross_entropy(x, other, ignore_index=3), (x,), 3)
    # the loss of a linear layer's outputs, chunk by chunk: each chunk's logits a matmul
    hidden = randn((5, 4), seed=4, device=device).requires_grad_()
    weight = randn((7, 4), seed=5, device=device).requires_grad_()
    bias = randn((7,), seed=6, device=device).requires_grad_()
    for reduction in ("mean", "sum", "none"):
        _agree(lambda r=reduction: module.linear_nll(hidden, weight, target, bias,
                                                     reduction=r, chunk_size=2),
               lambda r=reduction: functional.cross_entropy(
                   functional.linear(hidden, weight, bias), target, reduction=r),
               (hidden, weight, bias), 7)
    _agree(lambda: module.LinearNLL(ignore_index=3)(hidden, weight, other),
           lambda: functional.cross_entropy(functional.linear(hidden, weight), other,
                                            ignore_index=3), (hidden, weight), 8)
    return {"nll", "NLL", "linear_nll", "LinearNLL"}


def _call_reduction(module, device):
    x = randn((2, 3, 4), seed=1, device=device).requires_grad_()
    _agree(lambda: module.logsumexp(x, (0, 2), True),
           lambda: torch.logsumexp(x, (0, 2), True), (x,), 2)
    _agree(lambda: module.LogSumExp(dim=1)(x), lambda: torch.logsumexp(x, 1), (x,), 3)
    return {"logsumexp", "LogSumExp"}


def _gptj(x, cos, sin):
    """GPT-J's rotary embedding: x * cos + rotate_every_two(x) * sin."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _call_position_embedding(module, device):
    x = randn((2, 3, 6), seed=1, device=device).requires_grad_()
    cos, sin = randn((3, 6), seed=2, device=device), randn((3, 6), seed=3, device=device)
    _agree(lambda: module.gptj_rotary(x, cos, sin), lambda: _gptj(x, cos, sin), (x,), 4)
    _agree(lambda: module.GPTJRotary()(x, cos, sin), lambda: _gptj(x, cos, sin), (x,), 5)
    # (batch, heads, positions, dim), tables (batch, positions, dim) unsqueezed over the heads
    q = randn((2, 4, 3, 6), seed=6, device=device).requires_grad_()
    k = randn((2, 2, 3, 6), seed=7, device=device).requires_grad_()
    tables = randn((2, 3, 6), seed=8, device=device), randn((2, 3, 6), seed=9, device=device)
    assert len(module.apply_rotary_pos_emb(q, k, *tables)) == 2
    for index, embedded in enumerate((q, k)):
        _agree(lambda i=index: module.apply_rotary_pos_emb(q, k, *tables)[i],
               lambda t=embedded: _gptj(t, tables[0][:, None], tables[1][:, None]),
               (embedded,), 10 + index)
    return {"gptj_rotary", "GPTJRotary", "apply_rotary_pos_emb"}


#: per case of KIND_SPECS, a call of every public function and module of its generated module
#: against torch's fp64 result and gradients; it returns the names it called
CALLS = {
    "normalized_shape": _call_normalized_shape,
    "normalized_shape, no parameters": _call_normalized_shape_without_parameters,
    "dim": _call_dim,
    "elementwise": _call_elementwise,
    "row_loss": _call_row_loss,
    "reduction": _call_reduction,
    "position_embedding": _call_position_embedding,
}


@pytest.mark.parametrize("case", sorted(KIND_SPECS))
def test_every_public_function_of_every_kind_matches_torch(case, derived, device):
    module = _load(derived[0] / f"{KIND_SPECS[case][1]}.py")
    called = CALLS[case](module, device)
    assert called == _public(module), "a public function of this kind is called by no test"

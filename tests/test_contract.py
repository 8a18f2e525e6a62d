"""The contract of docs/spec_language.md ("The gradient you get"), on user specs derived by
`derive SPEC --out DIR` and called on both paths, in fp64 and fp32:

- at a kink the gradient is torch's autograd of the same spelling written with torch's ops
  (Max and Min as torch.maximum / torch.minimum, Abs as torch.abs, Piecewise as torch.where):
  CELU and SELU spelled `Max(0, x) + Min(0, alpha·(exp(x/alpha) - 1))` at x = 0, ties between
  two inputs, three-way ties, Piecewise boundaries;
- where torch's autograd of the spelling overflows or takes a log of 0, the value is the stable
  one, the value of torch's own op: binary cross-entropy written with log∘sigmoid (torch's
  binary_cross_entropy_with_logits) for |x| up to 1e4, a KL divergence whose target holds 0
  (torch's kl_div, value and both gradients), x·log x at 0 (torch.xlogy), a log of a softmax
  in three spellings (torch.log_softmax), the entropy of a softmax and an expectation under
  one, for logits spread over 1e4, where exp(x - max) underflows; a log-sum-exp, a softmax and
  a log-softmax spelled with no max at all (torch.logsumexp, softmax, log_softmax), where
  exp(x) overflows."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from reference import randn
from torch_spelling import spelled

from codegen.driver.command import main as derive_main
from derive.engine import load_spec
from derive.spec import Kind

# overflow is what some of these are about: the interpreter's numpy warns of every one
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

HEADER = ("import sympy\n\n"
          "from derive.api import DimAPI, ElementwiseAPI, Option, ReductionAPI\n"
          "from derive.spec import OpSpec\n\n\n")


def elementwise(name: str, inputs: tuple[str, ...] = ("input",), options: str = "") -> str:
    return (f"ElementwiseAPI(function={name!r}, module='M', torch_function='-', "
            f"inputs={inputs!r}, options=({options}))")


#: name -> (the body of `def spec()` after `op = OpSpec(name)`, its API)
SPECS = {
    "celu": ("""
    x = op.input('x')
    alpha = op.scalar('alpha', positive=True)
    op.output(op.element('y', sympy.Max(0, x) + sympy.Min(0, alpha * (sympy.exp(x / alpha) - 1))))
    op.save(x)
""", elementwise("celu", options="Option('alpha', 1.0),")),
    "selu": ("""
    x = op.input('x')
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    op.output(op.element('y', scale * (sympy.Max(0, x) + sympy.Min(0, alpha * (sympy.exp(x) - 1)))))
    op.save(x)
""", elementwise("selu")),
    "kinks": ("""
    x = op.input('x')
    z = op.input('z')
    op.output(op.element('y', sympy.Max(x, z) - sympy.Min(x, 2 * z) + sympy.Abs(x - z)))
    op.save(x, z)
""", elementwise("kinks", ("input", "other"))),
    "max3": ("""
    x = op.input('x')
    z = op.input('z')
    op.output(op.element('y', sympy.Max(x, -x / 2, z) * (1 + z)))
    op.save(x, z)
""", elementwise("max3", ("input", "other"))),
    "selections": ("""
    x = op.input('x')
    c = op.scalar('c')
    op.output(op.element('y', sympy.Piecewise((x, x > c), (c * x / 2, True))
                         + x * sympy.sign(x) + x**2 * sympy.Heaviside(x)))
    op.save(x)
""", elementwise("selections", options="Option('c', 0.5),")),
    "bce": ("""
    x = op.input('x')
    t = op.input('t', grad=False)
    sigmoid = 1 / (1 + sympy.exp(-x))
    op.output(op.element('y', -(t * sympy.log(sigmoid) + (1 - t) * sympy.log(1 - sigmoid))))
    op.save(x, t)
""", elementwise("bce", ("input", "target"))),
    "softplus": ("""
    x = op.input('x')
    op.output(op.element('y', sympy.log(1 + sympy.exp(x))))
    op.save(x)
""", elementwise("softplus")),
    "xlogx": ("""
    x = op.input('x')
    op.output(op.element('y', x * sympy.log(x)))
    op.save(x)
""", elementwise("xlogx")),
    "kl": ("""
    x = op.input('x')
    t = op.input('t')
    top = op.row_max('top', x)
    total = op.row_sum('total', sympy.exp(x - top))
    log_softmax = x - top - sympy.log(total)
    op.output(op.element('y', t * (sympy.log(t) - log_softmax)))
    op.save(x, t)
""", elementwise("kl", ("input", "target"))),
    "log_of_softmax": ("""
    x = op.input('x')
    top = op.row_max('top', x)
    e = op.element('e', sympy.exp(x - top))
    p = op.element('p', e / op.row_sum('total', e))
    op.output(op.element('y', sympy.log(p)))
    op.save(x)
""", "DimAPI(function='log_of_softmax', module='M', torch_function='-')"),
    "entropy": ("""
    x = op.input('x')
    top = op.row_max('top', x)
    e = op.element('e', sympy.exp(x - top))
    p = op.element('p', e / op.row_sum('total', e))
    op.output(op.row('h', -op.row_sum('plogp', p * sympy.log(p))))
    op.save(x)
""", "ReductionAPI(function='entropy', module='M', torch_function='-')"),
    "logsumexp": ("""
    x = op.input('x')
    op.output(op.row('y', sympy.log(op.row_sum('total', sympy.exp(x)))))
    op.save(x)
""", "ReductionAPI(function='logsumexp', module='M', torch_function='-')"),
    "softmax": ("""
    x = op.input('x')
    e = op.element('e', sympy.exp(x))
    op.output(op.element('p', e / op.row_sum('total', e)))
    op.save(x)
""", "DimAPI(function='softmax', module='M', torch_function='-')"),
    "log_softmax": ("""
    x = op.input('x')
    op.output(op.element('y', sympy.log(sympy.exp(x) / op.row_sum('total', sympy.exp(x)))))
    op.save(x)
""", "DimAPI(function='log_softmax', module='M', torch_function='-')"),
    "expectation": ("""
    x = op.input('x')
    top = op.row_max('top', x)
    total = op.row_sum('total', sympy.exp(x - top))
    op.output(op.row('mean_x', op.row_sum('weighted', sympy.exp(x - top) / total * x)))
    op.save(x)
""", "ReductionAPI(function='expectation', module='M', torch_function='-')"),
}


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    """name -> (the generated function, the spec) of every spec, derived in-process."""
    directory = tmp_path_factory.mktemp("contract")
    found = {}
    for name, (body, api) in SPECS.items():
        path = directory / f"{name}_spec.py"
        path.write_text(HEADER + f"def spec():\n    op = OpSpec({name!r})" + body
                        + f"    op.api = {api}\n    return op\n")
        assert derive_main([str(path), "--out", str(directory / "out")]) == 0, name
        loaded = importlib.util.spec_from_file_location(name, directory / "out" / f"{name}.py")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        found[name] = (getattr(module, name), load_spec(path, path.name))
    return found


def run(function: Callable, inputs: list[torch.Tensor], grads: list[bool], upstream_seed: int,
        **options: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output, gradients of the inputs marked in `grads`) of one call, against a seeded
    upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, grads, strict=True)]
    out = function(*leaves, **options)
    upstream = randn(out.shape, seed=upstream_seed, dtype=out.dtype, device=out.device)
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    return out.detach(), list(torch.autograd.grad(out, wanted, upstream))


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | float = 1.0,
          what: str = "") -> None:
    """got == want within a few ulps of the dtype, relative to |want| + scale; non-finite
    values equal."""
    eps = torch.finfo(got.dtype).eps
    want = want.to(got.dtype)
    assert (got.isfinite() == want.isfinite()).all(), (what, got, want)
    finite = want.isfinite()
    bound = 16 * eps * (want.abs() + scale)
    error = (got - want).abs()
    assert (error[finite] <= bound[finite]).all(), (what, (error - bound).max(), got, want)


# ---------------------------------------------------------------------- ties
TIE_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -2.0, 1e-30, -1e-30, 3.0]


def tie_rows(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (10, 10) inputs pairing every tie value with every other: x == z, x == 0, x == c,
    x == -x/2 == z == 0, z == x/2 all occur."""
    values = torch.tensor(TIE_VALUES, dtype=dtype, device=device)
    return values[:, None].expand(10, 10).contiguous(), values[None, :].expand(10, 10).contiguous()


TIES = {
    "celu": (1, {"alpha": 1.0}),
    "selu": (1, {}),
    "kinks": (2, {}),
    "max3": (2, {}),
    "selections": (1, {"c": 0.5}),
    "softplus": (1, {}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(TIES))
def test_a_kink_takes_the_gradient_of_torchs_spelling(ops, device, name, dtype) -> None:
    function, spec = ops[name]
    count, options = TIES[name]
    x, z = tie_rows(dtype, device)
    inputs = [x, z][:count]
    out, grads = run(function, inputs, [True] * count, 7, **options)
    names = [n.name for n in spec.nodes if n.kind is Kind.INPUT]
    upstream = randn(out.shape, seed=7, dtype=dtype)
    want_out, want_grads = spelled(spec, dict(zip(names, (t.cpu() for t in inputs),
                                                  strict=True)), options, {"dy": upstream})
    close(out.cpu(), want_out["y"], what="y")
    for got, input_name in zip(grads, names, strict=True):
        close(got.cpu(), want_grads[input_name], scale=upstream.abs(), what=f"d{input_name}")


def test_celu_at_zero_is_torchs_celu(ops, device) -> None:
    """torch.maximum and torch.minimum halve the gradient at a tie: the two halves at x = 0
    add to CELU's derivative there, 1, as F.celu's."""
    function, _ = ops["celu"]
    x = torch.tensor([[0.0, -0.0, 1e-3, -1e-3]], dtype=torch.float64, device=device)
    for alpha in (1.0, 0.5, 2.0):
        out, (dx,) = run(function, [x], [True], 3, alpha=alpha)
        want, (want_dx,) = run(lambda t, alpha=alpha: F.celu(t, alpha), [x], [True], 3)
        close(out, want)
        close(dx, want_dx)


# ---------------------------------------------------------------------- stable forms
MAGNITUDES = (1.0, 16.0, 30.0, 100.0, 1e4)


def logits(magnitude: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(4, 9) values spread to `magnitude`, both signs, an exact 0 in the first row."""
    x = randn((4, 9), seed=11) * magnitude
    x[0, 0] = 0.0
    return x.to(dtype=dtype, device=device)


def probabilities(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(4, 9) rows of a distribution holding exact zeros."""
    t = torch.softmax(randn((4, 9), seed=12), -1)
    t[:, ::3] = 0.0
    t = t / t.sum(-1, keepdim=True)
    return t.to(dtype=dtype, device=device)


def kl_reference(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.kl_div(torch.log_softmax(x, -1), t, reduction="none")


def entropy_reference(x: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)


STABLE = {
    # name: (torch's op, the inputs that are differentiated, inputs(magnitude, dtype, device))
    "bce": (lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="none"),
            [True, False],
            lambda m, dtype, device: [logits(m, dtype, device),
                                      torch.rand((4, 9), generator=torch.Generator()
                                                 .manual_seed(3), dtype=torch.float64)
                                      .to(dtype=dtype, device=device)]),
    # F.softplus is x itself above 20, an ulp off; logaddexp(x, 0) is softplus to the last ulp
    "softplus": (lambda x: torch.logaddexp(x, torch.zeros_like(x)), [True],
                 lambda m, dtype, device: [logits(m, dtype, device)]),
    "kl": (kl_reference, [True, False],
           lambda m, dtype, device: [logits(m, dtype, device), probabilities(dtype, device)]),
    "log_of_softmax": (lambda x: torch.log_softmax(x, -1), [True],
                       lambda m, dtype, device: [logits(m, dtype, device)]),
    "entropy": (entropy_reference, [True], lambda m, dtype, device: [logits(m, dtype, device)]),
    # spelled without a max: log Σ exp(x), exp(x) / Σ exp(x), log(exp(x) / Σ exp(x))
    "logsumexp": (lambda x: torch.logsumexp(x, -1), [True],
                  lambda m, dtype, device: [logits(m, dtype, device)]),
    "softmax": (lambda x: torch.softmax(x, -1), [True],
                lambda m, dtype, device: [logits(m, dtype, device)]),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), [True],
                    lambda m, dtype, device: [logits(m, dtype, device)]),
    "expectation": (lambda x: (torch.softmax(x, -1) * x).sum(-1), [True],
                    lambda m, dtype, device: [logits(m, dtype, device)]),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(STABLE))
def test_overflowing_spellings_take_the_stable_value(ops, device, name, dtype) -> None:
    """Every magnitude: finite where torch's op is, and within a few ulps of it (computed in
    fp64), relative to the inputs' magnitude (the value's own scale)."""
    function, _ = ops[name]
    reference, grads, make = STABLE[name]
    for magnitude in MAGNITUDES:
        inputs = make(magnitude, dtype, device)
        out, got = run(function, inputs, grads, 5)
        want, want_grads = run(reference, [t.double().cpu() for t in inputs], grads, 5)
        close(out.cpu(), want, scale=magnitude, what=f"{name} at {magnitude:g}")
        for index, (mine, theirs) in enumerate(zip(got, want_grads, strict=True)):
            close(mine.cpu(), theirs, scale=magnitude, what=f"{name} grad {index} at {magnitude:g}")


def test_bce_spelled_with_sigmoid_overflows_in_torch_not_here(ops, device) -> None:
    """The contract's other half: torch's autograd of the same spelling is NaN or inf in fp32
    from |x| ~ 17 (1 - σ(x) rounds to 0), ours is binary_cross_entropy_with_logits."""
    function, spec = ops["bce"]
    x = torch.tensor([[17.0, 30.0, 100.0, -100.0]])
    t = torch.tensor([[0.0, 0.25, 0.0, 1.0]])
    spelled_out, spelled_grads = spelled(spec, {"x": x, "t": t}, {}, {"dy": torch.ones_like(x)})
    assert not spelled_out["y"].isfinite().all() or not spelled_grads["x"].isfinite().all()
    out, (dx,) = run(function, [x.to(device), t.to(device)], [True, False], 1)
    want, (want_dx,) = run(lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="none"),
                           [x.double(), t.double()], [True, False], 1)
    close(out.cpu(), want, scale=100.0)
    close(dx.cpu(), want_dx, scale=1.0)


def test_xlogx_is_xlogy_and_zero_at_zero(ops, device) -> None:
    """x·log x: torch.xlogy(x, x)'s value, 0 at x = 0; its derivative log x + 1, and at x = 0
    0 (torch.kl_div's gradient of its target there), where torch's spelled autograd is NaN."""
    function, _ = ops["xlogx"]
    for dtype in (torch.float64, torch.float32):
        x = torch.tensor([[0.0, 1e-30, 0.5, 1.0, 3.0, 1e30]], dtype=dtype, device=device)
        out, (dx,) = run(function, [x], [True], 2)
        upstream = randn(x.shape, seed=2, dtype=dtype).to(device)
        close(out.cpu(), torch.xlogy(x, x).cpu(), what="value")
        want = torch.where(x == 0, 0.0, upstream * (torch.log(x) + 1))
        close(dx.cpu(), want.cpu(), scale=upstream.abs().cpu(), what="derivative")


def test_kl_with_zero_targets_is_torchs_kl_div(ops, device) -> None:
    """t·(log t - log_softmax(x)) where t = 0 is 0, and so is its gradient there: torch's
    kl_div's value and its gradient of the logits, where the spelling as written is
    0·(-inf) = NaN; the target's gradient is kl_div's where t > 0, and 0 where t = 0 (torch's
    is NaN there: xlogy(t, t)'s derivative in its second argument, t / t)."""
    function, spec = ops["kl"]
    x = logits(3.0, torch.float64, device)
    t = probabilities(torch.float64, device)
    out, (dx, dt) = run(function, [x, t], [True, True], 4)
    want, (want_dx, want_dt) = run(kl_reference, [x, t], [True, True], 4)
    zero = t == 0
    assert zero.any() and (out[zero] == 0).all() and (dt[zero] == 0).all()
    close(out, want, scale=3.0)
    close(dx, want_dx, scale=3.0)
    close(dt[~zero], want_dt[~zero], scale=3.0)
    spelled_out, _ = spelled(spec, {"x": x.cpu(), "t": t.cpu()}, {},
                             {"dy": torch.ones_like(x).cpu()})
    assert spelled_out["y"][zero.cpu()].isnan().all()

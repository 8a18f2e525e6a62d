"""fp32 at the extremes: every activation, loss and norm, forward and backward, for inputs of
magnitude 1e-30 .. 1e30, ±inf and NaN, against torch's own fp32 error w.r.t. an fp64 reference;
and small user specs, derived in-process, whose forms overflow or divide by 0 as written.

The criterion, per element: where torch's fp32 value is finite, ours is finite and errs at most
twice torch's error plus a few ulps (RTOL) of the value's scale: for an elementwise op the
value itself (and for the gradient of the activation's argument the terms it is summed from,
the upstream gradient times the other inputs), its row for a row op (for a softmax's gradient
p·(dp − Σ dp·p) also the row's terms p·dp: where one entry dominates, the difference cancels
and the rounding of Σ, at most an ulp of its terms, is the error any order of summation
leaves), the whole tensor for a parameter's gradient. Where the
fp64 reference is inf or NaN, ours is the inf or NaN torch gives. Where only torch's fp32 value
is not finite (an intermediate overflowed: its layer_norm's variance at |x| = 1e30, its
gelu_tanh backward's x² there), torch has no error to be within: ours may be any value but a
non-finite one that torch does not give.

On a row holding +inf, the ops that stabilise with a row max shift by the +inf itself, as
torch's softmax and cross-entropy do, and give NaN in every entry as they do: their reference is
torch's own op there too (tests/test_inf_rows.py has the cases).

A memory mode that keeps the output instead of the input (invertible) recovers x_hat from
y = x_hat·w + b, which holds none of x_hat's digits below b's ulp: that is the mode's trade, not
a numerics fault, so only the default modes are swept here.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import randn

import generated.add_layernorm as add_layernorm
import generated.add_rmsnorm as add_rmsnorm
import generated.cross_entropy as cross_entropy
import generated.geglu as geglu
import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
import generated.layernorm as layernorm
import generated.masked_softmax as masked_softmax
import generated.rmsnorm as rmsnorm
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.driver.command import main as derive_main

# overflow is what these tests are about: the interpreter's numpy warns of every one
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

#: 1e18: x² is finite, 2e5·x² is not (a cleared denominator overflowing before torch does)
MAGNITUDES = (1e-30, 1.0, 30.0, 100.0, 300.0, 1e3, 1e7, 1e15, 1e18, 1e30, math.inf, math.nan)
ROWS, WIDTH = 3, 8
#: ulps of the value's scale allowed beyond twice torch's error
RTOL = 4 * torch.finfo(torch.float32).eps
#: fp32's smallest normal number: a denormal where the answer is 0 is not an error
ATOL = torch.finfo(torch.float32).tiny
TARGET = torch.tensor([2, 5, 0])
FP32_EPS = torch.finfo(torch.float32).eps


class Case:
    """One op: `ours` and `theirs` take the same tensors (fp32, or fp64 for the reference);
    `inputs(magnitude)` makes them, the first `differentiable` of them differentiated.
    `rowwise`: a row op (errors scale with the row), else an elementwise one. `terms(output,
    upstream)`, from the fp64 reference: the size of the terms the first input's gradient is
    the difference of, where it cancels (a softmax's p·dp − p·Σ dp·p), added to its scale."""

    def __init__(self, ours: Callable, theirs: Callable, inputs: Callable[[float], list],
                 differentiable: int = 1, rowwise: bool = True, terms: Callable | None = None):
        self.ours, self.theirs, self.inputs = ours, theirs, inputs
        self.differentiable = differentiable
        self.rowwise = rowwise
        self.terms = terms


def scaled(magnitude: float, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded values of the given magnitude (signs and spread of a normal draw), in fp32."""
    return (randn(shape, seed=seed) * magnitude).float()


def activation(magnitude: float) -> list:
    return [scaled(magnitude, (ROWS, WIDTH), 1)]


def glu(magnitude: float) -> list:
    return [scaled(magnitude, (ROWS, WIDTH), 1), randn((ROWS, WIDTH), seed=2).float()]


def norm(magnitude: float) -> list:
    return [scaled(magnitude, (ROWS, WIDTH), 1), (randn((WIDTH,), seed=3) + 1).float(),
            randn((WIDTH,), seed=4).float()]


def add_norm(magnitude: float) -> list:
    return [scaled(magnitude, (ROWS, WIDTH), 1), scaled(magnitude, (ROWS, WIDTH), 5),
            (randn((WIDTH,), seed=3) + 1).float(), randn((WIDTH,), seed=4).float()]


def shifted_logits(magnitude: float) -> list:
    """Logits magnitude + N(0, 1): the loss is O(1) where the logits' ulp is magnitude's."""
    return [(randn((ROWS, WIDTH), seed=1) + magnitude).float()]


def attention_scores(magnitude: float) -> list:
    return [scaled(magnitude, (2, ROWS, WIDTH), 1)]


def causal_softmax(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax of x / 2 with the keys after the query masked out (-inf whatever x holds
    there), a row with no live key 0 with a 0 gradient (torch gives NaN there; masked_softmax
    documents 0, as attention kernels do); a row holding +inf NaN throughout, as torch's."""
    future = torch.ones(ROWS, WIDTH, dtype=torch.bool, device=x.device).triu(1)
    z = (x * 0.5).masked_fill(future, -math.inf)
    dead = z.amax(-1, keepdim=True) == -math.inf
    return torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, z), -1))


def ce(smoothing: float) -> tuple[Callable, Callable]:
    def ours(x):
        return cross_entropy.cross_entropy(x, TARGET.to(x.device), label_smoothing=smoothing,
                                           reduction="none")

    def theirs(x):
        return F.cross_entropy(x, TARGET.to(x.device), label_smoothing=smoothing, reduction="none")

    return ours, theirs


class _AtPlusInfinity(torch.autograd.Function):
    """y, with +inf where x is +inf and y is NaN; the gradient passes to y unchanged."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.where((x == math.inf) & y.isnan(), math.inf, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def torch_gelu(x: torch.Tensor) -> torch.Tensor:
    """torch's gelu, whose value at +inf is the limit +inf as torch's CUDA kernel gives (torch
    2.11's vectorised CPU kernel gives NaN there, later CPU kernels +inf); its gradients are
    torch's."""
    return _AtPlusInfinity.apply(F.gelu(x), x)


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (WIDTH,), w, FP32_EPS)


CASES = {
    "gelu": Case(gelu.gelu, torch_gelu, activation, rowwise=False),
    "gelu_tanh": Case(gelu_tanh.gelu_tanh, lambda x: F.gelu(x, approximate="tanh"), activation,
                      rowwise=False),
    "swiglu": Case(swiglu.swiglu, lambda g, u: F.silu(g) * u, glu, 2, rowwise=False),
    "geglu": Case(geglu.geglu, lambda g, u: torch_gelu(g) * u, glu, 2, rowwise=False),
    "softmax": Case(softmax.softmax, lambda x: torch.softmax(x, -1), activation,
                    terms=lambda p, dp: p * dp),
    "masked_softmax": Case(lambda x: masked_softmax.masked_softmax(x, scale=0.5, causal=True),
                           causal_softmax, attention_scores, terms=lambda p, dp: 0.5 * p * dp),
    "cross_entropy": Case(*ce(0.0), activation),
    "cross_entropy_smoothed": Case(*ce(0.25), activation),
    "cross_entropy_shifted": Case(*ce(0.0), shifted_logits),
    "cross_entropy_shifted_smoothed": Case(*ce(0.25), shifted_logits),
    "layernorm": Case(lambda x, w, b: layernorm.layer_norm(x, (WIDTH,), w, b),
                      lambda x, w, b: F.layer_norm(x, (WIDTH,), w, b), norm, 3),
    "rmsnorm": Case(lambda x, w, b: rmsnorm.rms_norm(x, (WIDTH,), w),
                    lambda x, w, b: rms(x, w), norm, 2),
    "add_layernorm": Case(lambda x, r, w, b: add_layernorm.add_layer_norm(x, r, (WIDTH,), w, b),
                          lambda x, r, w, b: F.layer_norm(x + r, (WIDTH,), w, b), add_norm, 4),
    "add_rmsnorm": Case(lambda x, r, w, b: add_rmsnorm.add_rms_norm(x, r, (WIDTH,), w),
                        lambda x, r, w, b: rms(x + r, w), add_norm, 3),
}


def run(fn: Callable, tensors: list, differentiable: int) -> list[torch.Tensor]:
    """[output, upstream gradient, gradient of each differentiated input] of fn; the upstream
    gradient is a seeded normal draw in fp32 (so exact in fp64)."""
    leaves = [t.clone().requires_grad_(i < differentiable) for i, t in enumerate(tensors)]
    out = fn(*leaves)
    upstream = randn(out.shape, seed=7).float().to(out.device, out.dtype)
    return [out.detach(), upstream,
            *torch.autograd.grad(out, leaves[:differentiable], upstream)]


def scales(case: Case, tensors: list, exact: list[torch.Tensor]) -> list[torch.Tensor]:
    """The scale of each result's error (module doc), from the fp64 reference."""
    magnitudes = [e.abs().nan_to_num(0.0, 0.0, 0.0) for e in exact[:1] + exact[2:]]
    if not case.rowwise:
        # the activation's argument is the first input: its gradient sums terms of the size of
        # the upstream gradient times the other inputs (dy·up·(σ + g·σ(1 − σ)))
        others = [t.double().abs().nan_to_num(0.0, 0.0, 0.0) for t in tensors[1:]]
        magnitudes[1] = magnitudes[1] + exact[1].abs() * math.prod(
            others, start=torch.ones_like(exact[1]))
        return magnitudes
    if case.terms is not None:
        magnitudes[1] = magnitudes[1] + case.terms(exact[0], exact[1]).abs().nan_to_num(
            0.0, 0.0, 0.0)
    result = []
    for index, magnitude in enumerate(magnitudes):
        whole = index > 0 and tensors[index - 1].dim() == 1
        if whole:
            magnitude = magnitude.amax().expand_as(magnitude)
        elif magnitude.dim():
            magnitude = magnitude.amax(-1, keepdim=True).expand_as(magnitude)
        result.append(magnitude)
    return result


def violations(name: str, got: torch.Tensor, base: torch.Tensor, exact: torch.Tensor,
               scale: torch.Tensor) -> list[str]:
    """Elements of `got` (ours, fp32) that break the module doc's criterion."""
    got, base = got.double(), base.double()
    problems = []
    same = (got == base) | (got.isnan() & base.isnan())
    special = ~torch.isfinite(exact) & ~same
    if special.any():
        problems.append(f"{name}: {got[special].tolist()} where torch and fp64 give "
                        f"{base[special].tolist()}")
    bound = 2 * (base - exact).abs() + RTOL * scale + ATOL
    judged = torch.isfinite(exact) & torch.isfinite(base) & ~same
    wrong = judged & ~((got - exact).abs() <= bound)
    # where torch overflowed alone, ours may be anything but a non-finite value of its own
    wrong |= torch.isfinite(exact) & ~torch.isfinite(base) & ~torch.isfinite(got) & ~same
    if wrong.any():
        problems.append(f"{name}: ours {got[wrong].tolist()}, torch {base[wrong].tolist()}, "
                        f"fp64 {exact[wrong].tolist()}")
    return problems


def check(case: Case, magnitude: float, device: torch.device) -> list[str]:
    """The case at one magnitude, ours and torch's on `device` (torch's CUDA and CPU ops differ
    at the infinities: each path is held to torch's on its own device)."""
    tensors = [t.to(device) for t in case.inputs(magnitude)]
    mine, base, exact = ([t.cpu() for t in run(fn, inputs, case.differentiable)]
                         for fn, inputs in ((case.ours, tensors), (case.theirs, tensors),
                                            (case.theirs, [t.double() for t in tensors])))
    names = ["output"] + [f"gradient {i}" for i in range(case.differentiable)]
    results = [(r[0], *r[2:]) for r in (mine, base, exact)]
    tensors = [t.cpu() for t in tensors]
    problems = []
    for name, a, b, c, s in zip(names, *results, scales(case, tensors, exact), strict=True):
        problems += violations(name, a, b, c, s)
    return problems


def sweep(case: Case, device: torch.device) -> None:
    failures = {m: check(case, m, device) for m in MAGNITUDES}
    failures = {m: p for m, p in failures.items() if p}
    assert not failures, "\n".join(f"|x| = {m:g}: {'; '.join(p)}" for m, p in failures.items())


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_ops_at_extremes_within_torchs_fp32_error(device, name: str) -> None:
    sweep(CASES[name], device)


# ---------------------------------------------------------------------- user specs
HEADER = ("import sympy\n\n"
          "from derive.api import ElementwiseAPI, NormalizedShapeAPI, Option, Param\n"
          "from derive.spec import OpSpec\n\n\n")


def derived(directory: Path, name: str, body: str, api: str) -> object:
    """The generated module of a spec `def spec(): op = OpSpec(name); x = op.input('x'); <body>`
    written to `directory` and derived in-process."""
    spec = directory / f"{name}_spec.py"
    spec.write_text(HEADER + "def spec():\n"
                    f"    op = OpSpec({name!r})\n    x = op.input('x')\n" + body
                    + f"    op.api = {api}\n    return op\n")
    assert derive_main([str(spec), "--out", str(directory / "out")]) == 0
    loaded = importlib.util.spec_from_file_location(name, directory / "out" / f"{name}.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def elementwise(name: str) -> str:
    return f"ElementwiseAPI(function={name!r}, module='M', torch_function='-')"


#: exp(x) / (exp(x) + 1) and its relatives, each spelling and its torch counterpart
SIGMOIDS = {
    "sigmoid_inline": ("    y = sympy.exp(x) / (sympy.exp(x) + 1)\n", torch.sigmoid),
    "sigmoid_named": ("    e = op.element('e', sympy.exp(x))\n    y = e / (e + 1)\n",
                      torch.sigmoid),
    "silu_inline": ("    y = x * sympy.exp(x) / (sympy.exp(x) + 1)\n", F.silu),
    "softplus": ("    y = sympy.log(1 + sympy.exp(x))\n", F.softplus),
    "mish": ("    y = x * sympy.tanh(sympy.log(1 + sympy.exp(x)))\n", F.mish),
}


@pytest.fixture(scope="module")
def sigmoids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Callable]:
    directory = tmp_path_factory.mktemp("sigmoids")
    return {name: getattr(derived(directory, name, body + "    op.output(op.element('y', y))\n"
                                  "    op.save(x)\n", elementwise(name)), name)
            for name, (body, _) in SIGMOIDS.items()}


@pytest.mark.parametrize("name", sorted(SIGMOIDS))
def test_exponential_ratios_at_extremes(sigmoids, device, name: str) -> None:
    """inf / inf nowhere: the ratio is rewritten through exp(-x) whatever the spelling, and its
    derivative is σ(1 − σ) of the shared σ, never exp(-x)·σ² (inf · 0 at x = -89)."""
    sweep(Case(sigmoids[name], SIGMOIDS[name][1], activation, rowwise=False), device)


SCALED = ("    alpha = op.scalar_param('alpha')\n"
          "    t = op.element('t', sympy.tanh(x))\n"
          "    y = op.element('y', alpha * t)\n    op.output(y)\n"
          "    op.save(x)\n    op.save(y, mode='invertible')\n")
SCALED_API = ("NormalizedShapeAPI(function='scaled', module='Scaled', torch_function='-', "
              "torch_module='-', params=(Param('alpha', 'alpha_init', scalar=True),), eps=None, "
              "options=(Option('alpha_init', 0.5, module_only=True),))")


@pytest.fixture(scope="module")
def user_ops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("user_ops")
    return {"scaled": derived(directory, "scaled", SCALED, SCALED_API),
            "l2": derived(directory, "l2", L2, L2_API)}


def test_a_learnable_scalar_of_zero_gives_finite_gradients(user_ops, device) -> None:
    """y = alpha·tanh(x) at alpha = 0: no step divides by alpha. Keeping x, the gradients are
    torch's; keeping y (invertible), tanh(x) = y / alpha is unrecoverable and the division is
    guarded (|alpha| clamped below, as a zero weight of a norm): finite, dx still exact."""
    module = user_ops["scaled"]
    x = scaled(3.0, (ROWS, WIDTH), 1)
    upstream = randn((ROWS, WIDTH), seed=7).float()
    leaf, alpha = x.clone().requires_grad_(), torch.zeros((), requires_grad=True)
    torch.autograd.backward(alpha * torch.tanh(leaf), upstream)
    for memory in ("default", "invertible"):
        mine, weight = x.clone().requires_grad_(), torch.zeros((), requires_grad=True)
        torch.autograd.backward(module.scaled(mine, (WIDTH,), weight, memory=memory), upstream)
        assert mine.grad.isfinite().all() and weight.grad.isfinite().all(), memory
        torch.testing.assert_close(mine.grad, leaf.grad, msg=memory)
        if memory == "default":
            torch.testing.assert_close(weight.grad, alpha.grad)


L2 = ("    eps = op.scalar('eps', positive=True)\n"
      "    length = op.row('length', sympy.sqrt(op.row_sum('square', x**2)))\n"
      "    op.output(op.element('y', x / sympy.Max(length, eps)))\n    op.save(x)\n")
L2_API = ("ElementwiseAPI(function='l2', module='L2', torch_function='-', "
          "options=(Option('eps', 1e-12),))")


def test_a_clamp_at_its_floor_keeps_the_backward_finite(user_ops, device) -> None:
    """x / max(‖x‖, eps) on a zero row: the derivative through ‖x‖ lives in the clamp's other
    branch (1/‖x‖ · 0 = NaN as a product), so it is selected away, not multiplied by 0: the
    row's gradient is torch's dy / eps."""
    module = user_ops["l2"]
    x = randn((ROWS, WIDTH), seed=1).float()
    x[1] = 0.0
    upstream = randn((ROWS, WIDTH), seed=7).float()
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward(module.l2(mine, eps=1e-6), upstream)
    torch.autograd.backward(F.normalize(theirs, dim=-1, eps=1e-6), upstream)
    assert mine.grad.isfinite().all()
    torch.testing.assert_close(mine.grad, theirs.grad)

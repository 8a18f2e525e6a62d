"""Rows holding +inf, -inf, only -inf, or NaN, through every op whose spec stabilises its
exponentials with a row max (softmax, masked_softmax, cross_entropy and the tutorial's user op
logsumexp), on every path and schedule, in fp32 and fp64, outputs and gradients.

A stabilising max only shifts the exponentials; where it is infinite the kernels shift by a
finite value instead (the largest finite one for +inf, 0 for -inf), so the row's values are those
of torch.logsumexp: the log-sum-exp of a row holding +inf is +inf (its gradient NaN at the +inf,
0 elsewhere), of a row of -inf -inf. The normalised ops follow it: softmax = exp(x - logsumexp(x))
and the loss logsumexp(x) - x[target] (+ smoothing · mean(x[target] - x)), torch's own softmax
and cross-entropy on every row without a +inf. On a row with one, softmax is NaN at the +inf and
0 elsewhere, where torch's softmax, shifting by the +inf itself (inf - inf), is NaN throughout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reference import FP64_TOL, force_looped, force_split, randn, select_path, splits

import generated.cross_entropy as cross_entropy
import generated.masked_softmax as masked_softmax
import generated.softmax as softmax
from derive.__main__ import main as derive_main

# exp(inf - inf) and the like are the point here: the interpreter's numpy warns of each
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ROOT = Path(__file__).resolve().parent.parent
INF, NAN = math.inf, math.nan
#: three column blocks of the looped schedule (16 columns each in tests), the last partial
WIDTH = 37
#: (schedule, path): the torch path once, the Triton path's schedules
FORMS = [("persistent", "torch"), ("persistent", "triton"), ("one-sweep", "triton"),
         ("two-sweep", "triton")]
#: the looped rows with every other sweep run backwards: the sweeps after the max's, so a few
#: ops suffice (the interpreter is slow)
REVERSE = ("one-sweep-reverse", "triton")


def forms(module: object, reverse: bool = False) -> list[tuple[str, str]]:
    """FORMS, REVERSE if asked, and split rows where the module has kernels of a split form."""
    return FORMS + [REVERSE] * reverse + [("split", "triton")] * splits(module)


DTYPES = [torch.float32, torch.float64]


def rows() -> torch.Tensor:
    """Rows holding the non-finite values in different column blocks; one of values near 1000,
    whose exponentials overflow fp32 and fp64 unless shifted, with a +inf."""
    x = randn((11, WIDTH), seed=3)
    x[1, 20] = INF  # +inf in the second block, after finite ones
    x[2, 5], x[2, 30], x[2, 7] = INF, INF, -INF  # two +inf and a -inf
    x[3] = -INF  # only -inf
    x[4, :20] = -INF  # a leading block of -inf
    x[5, 33] = NAN
    x[6, 1], x[6, 34] = INF, NAN
    x[7, 36] = INF  # +inf in the last, partial block
    x[8] = -INF
    x[8, 18] = INF  # +inf among -inf
    x[9, 0] = INF  # +inf in the first column
    x[10] += 1000.0
    x[10, 25] = INF
    return x


TARGETS = {
    # the target on a +inf where the row has one
    "at the infinity": torch.tensor([3, 20, 5, 0, 25, 2, 1, 36, 18, 0, 25]),
    # the target on a finite logit (or a -inf one in the rows of -inf)
    "elsewhere": torch.tensor([3, 21, 6, 4, 2, 10, 2, 0, 17, 1, 4]),
}


@pytest.fixture(scope="module")
def logsumexp(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The tutorial's user op, derived as a user derives it (`derive spec --out DIR`)."""
    out = tmp_path_factory.mktemp("tutorial")
    assert derive_main([str(ROOT / "docs" / "tutorial" / "logsumexp.py"), "--out", str(out)]) == 0
    loaded = importlib.util.spec_from_file_location("logsumexp", out / "logsumexp.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


@contextlib.contextmanager
def form(module: object, layout: str, path: str, monkeypatch: pytest.MonkeyPatch):
    """`module`'s calls on `path` under the schedule `layout`; yields their tensors' device."""
    device = select_path(monkeypatch, path)
    with contextlib.ExitStack() as stack:
        if layout == "split":
            stack.enter_context(force_split(module))
        elif layout != "persistent":
            stack.enter_context(force_looped(module, one_sweep=layout != "two-sweep",
                                             reverse=layout.endswith("reverse")))
        yield device


def results(fn: Callable, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn's output and the gradient of x for a seeded upstream gradient."""
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    upstream = randn(out.shape, seed=11, dtype=out.dtype, device=out.device)
    (grad,) = torch.autograd.grad(out, leaf, upstream)
    return out.detach(), grad


def check(ours: Callable, reference: Callable, x: torch.Tensor) -> None:
    """ours in x's dtype against the reference evaluated in fp64 on the same values: outputs
    and gradients equal within the dtype's tolerance, NaN where the reference's is NaN, the
    same infinities."""
    got = results(ours, x)
    want = [t.to(x.dtype) for t in results(reference, x.double())]
    tolerance = FP64_TOL if x.dtype == torch.float64 else {}
    for name, a, b in zip(("output", "gradient"), got, want, strict=True):
        assert a.dtype == x.dtype, f"{name}: dtype {a.dtype}"
        torch.testing.assert_close(a.cpu(), b.cpu(), equal_nan=True, **tolerance,
                                   msg=lambda m, n=name: f"{n}: {m}")


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x - torch.logsumexp(x, -1, keepdim=True))


def masked_reference(x: torch.Tensor) -> torch.Tensor:
    """softmax_reference of 0.5·x; a row with no element above -inf gives 0 and a 0 gradient
    (masked_softmax's documented fully-masked row; its input is taken as 0 there, so no NaN of
    the unselected branch reaches the gradient)."""
    z = 0.5 * x
    dead = z.amax(-1, keepdim=True) == -INF
    return torch.where(dead, 0.0, softmax_reference(torch.where(dead, 0.0, z)))


def cross_entropy_reference(target: torch.Tensor, smoothing: float) -> Callable:
    def loss(x: torch.Tensor) -> torch.Tensor:
        picked = x.gather(-1, target[:, None].to(x.device))
        value = torch.logsumexp(x, -1) - picked[:, 0]
        if smoothing:
            value = value + smoothing * (picked - x).mean(-1)
        return value
    return loss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "path"), forms(softmax, reverse=True))
def test_softmax(monkeypatch, layout, path, dtype):
    with form(softmax, layout, path, monkeypatch) as device:
        check(lambda x: softmax.softmax(x, -1), softmax_reference, rows().to(device, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "path"), forms(masked_softmax))
def test_masked_softmax(monkeypatch, layout, path, dtype):
    with form(masked_softmax, layout, path, monkeypatch) as device:
        check(lambda x: masked_softmax.masked_softmax(x, scale=0.5), masked_reference,
              rows().to(device, dtype))


@pytest.mark.parametrize("smoothing", [0.0, 0.25])
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "path"), forms(cross_entropy))
def test_cross_entropy(monkeypatch, layout, path, dtype, target, smoothing):
    with form(cross_entropy, layout, path, monkeypatch) as device:
        labels = TARGETS[target].to(device)
        check(lambda x: cross_entropy.cross_entropy(x, labels, label_smoothing=smoothing,
                                                    reduction="none"),
              cross_entropy_reference(labels, smoothing), rows().to(device, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "path"), [*FORMS, REVERSE])
def test_tutorial_logsumexp(logsumexp, monkeypatch, layout, path, dtype):
    """torch.logsumexp itself is the reference: +inf for a row holding +inf (gradient NaN at
    the +inf, 0 elsewhere), -inf for a row of -inf."""
    with form(logsumexp, layout, path, monkeypatch) as device:
        x = rows().to(device, dtype)
        assert logsumexp.logsumexp(x, -1)[[1, 2, 7, 8, 9, 10]].eq(INF).all()
        check(lambda t: logsumexp.logsumexp(t, -1), lambda t: torch.logsumexp(t, -1), x)


@pytest.mark.parametrize(("layout", "path"), [*FORMS, REVERSE])
def test_running_sums_of_rows_that_start_with_minus_inf(logsumexp, monkeypatch, layout, path):
    """Where the rows loop in one sweep, the sum rescales to each step's shift: a row whose
    first block is -inf has every lane's sum 0 at shift 0 when values near -1000 arrive, and the
    sums must stay 0 (not 0 · exp(1000) = NaN); a row of values near 100 whose +inf comes in the
    second block has the +inf's lane inf and the others 0 (exp(x - the largest finite value)).
    The log-sum-exp and the loss of a finite target are torch's: finite, and +inf."""
    x = randn((2, WIDTH), seed=5, dtype=torch.float32)
    x[0] -= 1000.0
    x[0, :16] = -INF
    x[1] += 100.0
    x[1, 20] = INF
    target = torch.tensor([30, 1])
    for module, ours, theirs in (
            (logsumexp, lambda t: logsumexp.logsumexp(t, -1), lambda t: torch.logsumexp(t, -1)),
            (cross_entropy,
             lambda t: cross_entropy.cross_entropy(t, target.to(t.device), reduction="none"),
             cross_entropy_reference(target, 0.0))):
        with form(module, layout, path, monkeypatch) as device:
            got = ours(x.to(device)).cpu()
            torch.testing.assert_close(got, theirs(x.double()).float())
            assert got[0].isfinite() and got[1] == INF

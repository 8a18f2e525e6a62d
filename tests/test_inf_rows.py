"""Rows holding +inf, -inf, only -inf, or NaN, through every op whose spec stabilises its
exponentials with a row max (softmax, masked_softmax, cross_entropy and the tutorial's user op
logsumexp), on every path and schedule, in fp32 and fp64, outputs and gradients.

A stabilising max only shifts the exponentials. The kernels shift by the max itself where it is
finite or +inf, as torch.softmax and torch.nn.functional.cross_entropy do, and by 0 where it is
-inf (`helpers.stable_shift`). On a row holding +inf, exp(x - inf) is 0 at every finite x and
exp(inf - inf) NaN at the +inf, so the row's sum is NaN and so is everything read from it:
softmax is NaN throughout the row, as torch.softmax is, and the cross-entropy loss and its
gradient are NaN whatever the target, as F.cross_entropy's are. A row of only -inf shifts by 0:
its sum is 0, and softmax's 0 / 0 and the loss's -inf - x[target] are torch's NaN (masked_softmax
documents 0 and a 0 gradient for such a fully masked row). The references are therefore torch's
own ops evaluated in fp64. Only torch.logsumexp differs: it returns +inf on a row holding +inf,
where the tutorial's logsumexp, stabilised by the same rule, gives NaN (its output and the whole
row's gradient); on every other row it is torch.logsumexp.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import FP64_TOL, force_looped, force_split, randn, select_path, splits

import generated.cross_entropy as cross_entropy
import generated.masked_softmax as masked_softmax
import generated.softmax as softmax
from codegen.driver.command import main as derive_main

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
    """torch.softmax: NaN throughout a row holding +inf or of only -inf."""
    return torch.softmax(x, -1)


def masked_reference(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax of 0.5·x on the rows with an element above -inf (finite or +inf); a row
    with none gives 0 and a 0 gradient (masked_softmax's documented fully-masked row; its input
    is taken as 0 there, so no NaN of the unselected branch reaches the gradient)."""
    z = 0.5 * x
    dead = z.amax(-1, keepdim=True) == -INF
    return torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, z), -1))


def cross_entropy_reference(target: torch.Tensor, smoothing: float) -> Callable:
    """F.cross_entropy(reduction="none", label_smoothing=smoothing) of the given targets. With
    smoothing, a row holding a -inf has the loss +inf, as torch's: the spec
    (derive/ops/cross_entropy.py) takes the smoothing term from the gaps below the row max,
    each >= 0 and +inf at a -inf, never inf - inf."""
    def loss(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x, target.to(x.device), label_smoothing=smoothing,
                               reduction="none")
    return loss


def holding_plus_inf(x: torch.Tensor) -> torch.Tensor:
    """Which rows (the last dim) of x hold +inf."""
    return (x == INF).any(-1)


def logsumexp_reference(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp on the rows without +inf; on a row holding +inf, the log-sum-exp shifted
    by its max as torch.softmax shifts, the +inf itself: m + log(sum(exp(x - m))), NaN, and its
    gradient softmax(x), NaN throughout the row. Each branch sees the other's rows as 0, so no
    NaN of the branch not taken reaches the gradient."""
    hot = holding_plus_inf(x)
    plain = torch.logsumexp(torch.where(hot[:, None], 0.0, x), -1)
    z = torch.where(hot[:, None], x, 0.0)
    peak = z.amax(-1, keepdim=True).detach()
    shifted = peak[:, 0] + torch.log(torch.exp(z - peak).sum(-1))
    return torch.where(hot, shifted, plain)


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
    """torch.logsumexp on every row without +inf (-inf for a row of -inf, its gradient NaN as
    torch's); NaN on a row holding +inf, output and gradient of the whole row, where
    torch.logsumexp gives +inf (the rule of every op stabilised by a row max: module doc)."""
    with form(logsumexp, layout, path, monkeypatch) as device:
        x = rows().to(device, dtype)
        hot = holding_plus_inf(x)
        assert hot.nonzero()[:, 0].tolist() == [1, 2, 6, 7, 8, 9, 10]
        out, grad = results(lambda t: logsumexp.logsumexp(t, -1), x)
        assert out[hot].isnan().all() and grad[hot].isnan().all(), (out, grad)
        assert torch.logsumexp(x, -1)[hot & ~x.isnan().any(-1)].eq(INF).all()
        check(lambda t: logsumexp.logsumexp(t, -1), logsumexp_reference, x)


@pytest.mark.parametrize(("layout", "path"), [*FORMS, REVERSE])
def test_running_sums_of_rows_that_start_with_minus_inf(logsumexp, monkeypatch, layout, path):
    """Where the rows loop in one sweep, the sum rescales to each step's shift: a row whose
    first block is -inf has every lane's sum 0 at shift 0 when values near -1000 arrive, and the
    sums must stay 0 (not 0 · exp(1000) = NaN): its log-sum-exp and loss are torch's, finite. A
    row of values near 100 whose +inf comes in the second block shifts by the +inf from then on:
    the first block's sums rescale by exp(100 - inf) = 0, the +inf's lane takes
    exp(inf - inf) = NaN, so the row's log-sum-exp and its loss of a finite target are NaN, as
    F.cross_entropy's loss is (torch.logsumexp alone gives +inf there)."""
    x = randn((2, WIDTH), seed=5, dtype=torch.float32)
    x[0] -= 1000.0
    x[0, :16] = -INF
    x[1] += 100.0
    x[1, 20] = INF
    target = torch.tensor([30, 1])
    for module, ours, theirs in (
            (logsumexp, lambda t: logsumexp.logsumexp(t, -1), logsumexp_reference),
            (cross_entropy,
             lambda t: cross_entropy.cross_entropy(t, target.to(t.device), reduction="none"),
             cross_entropy_reference(target, 0.0))):
        with form(module, layout, path, monkeypatch) as device:
            got = ours(x.to(device)).cpu()
            torch.testing.assert_close(got, theirs(x.double()).float(), equal_nan=True)
            assert got[0].isfinite() and got[1].isnan()

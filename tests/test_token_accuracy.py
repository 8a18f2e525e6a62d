"""cross_entropy's token accuracy and predicted tokens (`return_token_accuracy`,
`return_predicted_tokens`), derived by the engine from a row min of column indices (the first
column where a row reaches its max): exact against torch.argmax, ties included, on every
schedule and both paths; and the spec-language piece they use (`row_min`)."""

import pytest
import sympy
import torch
from reference import FP64_TOL, force_looped, gradcheck, randn

from derive.api import Option, RowLossAPI
from derive.engine import derive
from derive.reverse import DerivationError
from derive.spec import N, OpSpec
from generated import cross_entropy as cross_entropy_module
from generated.cross_entropy import CrossEntropyLoss, cross_entropy

OP = cross_entropy_module  # for the `schedule` fixture
V = 37  # classes: three column blocks of the looped schedule (16 columns each)
IGNORE = -100


def logits(rows=10, *, device="cpu", dtype=torch.float64, seed=1):
    """Logits with ties of the row max: within one column block (row 0: 3 and 7), across
    blocks (row 1: 4, 20 and 36, the last in the masked tail block), a tie first seen after a
    larger max's block (row 2: 30 and 33 tie above the first block's max), a row of -inf
    (row 3), a row of one +inf (row 4), rows of equal logits (row 5: all 0, class 0)."""
    x = randn((rows, V), seed=seed) * 3
    x[0, [3, 7]] = 20.0
    x[1, [4, 20, 36]] = 20.0
    x[2, 1] = 10.0
    x[2, [30, 33]] = 11.0
    x[3] = float("-inf")
    x[4, 25] = float("inf")
    x[5] = 0.0
    return x.to(device=device, dtype=dtype)


def targets(rows=10, *, device="cpu", seed=5):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (rows,), generator=gen)
    # hits: row 0's first tied max, row 2's; a miss on row 1's second tied max; row 6 ignored
    target[[0, 1, 2, 6]] = torch.tensor([3, 20, 30, IGNORE])
    return target.to(device)


def argmax(x, target, dim=-1):
    """torch.argmax of each counted row, -1 in the ignored ones (Liger-Kernel's)."""
    return torch.where(target != IGNORE, torch.argmax(x, dim=dim), -1)


def reference(x, target, reduction):
    """(accuracy, predicted) as Liger-Kernel's: torch.argmax per counted row, the accuracy over
    the counted rows."""
    predicted = argmax(x, target)
    counted = target != IGNORE
    correct = ((predicted == target) & counted).to(torch.float64 if x.dtype == torch.float64
                                                   else torch.float32)
    if reduction == "none":
        return correct, predicted
    if reduction == "sum":
        return correct.sum(), predicted
    return correct.sum() / counted.sum(), predicted


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_matches_torch_argmax_on_every_schedule(device, schedule, reduction):
    x, target = logits(device=device), targets(device=device)
    # class weights, smoothing and the z-loss leave the prediction and the accuracy alone
    weight = randn((V,), seed=4, device=device).abs() + 0.5
    loss, accuracy, predicted = cross_entropy(
        x, target, weight, reduction=reduction, label_smoothing=0.25, lse_square_scale=0.125,
        return_token_accuracy=True, return_predicted_tokens=True)
    want_accuracy, want_predicted = reference(x, target, reduction)
    assert predicted.dtype == torch.int64 and predicted.shape == target.shape
    assert torch.equal(predicted, want_predicted)
    assert predicted[:7].tolist() == [3, 4, 30, 0, 25, 0, -1]  # the ties' first; ignored
    assert accuracy.dtype == want_accuracy.dtype and not accuracy.requires_grad
    assert torch.equal(accuracy, want_accuracy)
    if reduction == "none":
        assert accuracy[6] == 0  # the ignored row
        assert accuracy[[0, 1, 2]].tolist() == [1.0, 0.0, 1.0]


def test_two_sweeps_of_a_looped_row(device, overrides):
    # the looped rows' other form: the argmax in the sweep after the max's
    overrides.enter_context(force_looped(cross_entropy_module, one_sweep=False))
    x, target = logits(device=device), targets(device=device)
    accuracy, predicted = cross_entropy(x, target, reduction="none", return_token_accuracy=True,
                                        return_predicted_tokens=True)[1:]
    want_accuracy, want_predicted = reference(x, target, "none")
    assert torch.equal(predicted, want_predicted) and torch.equal(accuracy, want_accuracy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_low_precision_logits_tie_often(device, schedule, dtype):
    # 16-bit logits of few distinct values: many tied maxima, each resolved as torch.argmax
    x = (randn((24, V), seed=2, device=device) * 2).round().to(dtype)
    target = torch.argmax(x, -1)
    target[::3] = (target[::3] + 1) % V
    target[5] = IGNORE
    loss, accuracy, predicted = cross_entropy(x, target, return_token_accuracy=True,
                                              return_predicted_tokens=True)
    assert torch.equal(predicted, argmax(x, target))
    assert accuracy.dtype == torch.float32
    assert accuracy.item() == pytest.approx(15 / 23)  # every third row missed, one ignored


def test_softcap_returns_the_capped_logits_argmax(device, schedule):
    # capping keeps the order (tanh increases), except where it rounds the largest logits to
    # one value: softcap 1 makes 100 and 200 both 1.0 in fp32, and the first of them is taken
    x = randn((4, V), seed=3, device=device, dtype=torch.float32)
    x[0, [9, 29]] = torch.tensor([100.0, 200.0], device=device)
    x[1, [2, 31]] = torch.tensor([300.0, 90.0], device=device)
    target = torch.tensor([9, 2, 0, 1], device=device)
    predicted = cross_entropy(x, target, softcap=1.0, return_predicted_tokens=True)[1]
    capped = 1.0 * torch.tanh(x / 1.0)
    assert torch.equal(predicted, argmax(capped, target))
    assert predicted[:2].tolist() == [9, 2]  # 9: tied once capped, though 29's input is larger
    # a cap far above the logits leaves every maximum unique: the input's argmax
    predicted = cross_entropy(x[2:], target[2:], softcap=1e4, return_predicted_tokens=True)[1]
    assert torch.equal(predicted, argmax(x[2:], target[2:]))


def test_returning_them_changes_nothing_else(device):
    x = (randn((10, V), seed=1, device=device) * 3).requires_grad_()
    target = targets(device=device)
    options = dict(lse_square_scale=0.125, softcap=4.0, label_smoothing=0.1)
    loss, z_loss, accuracy, predicted = cross_entropy(
        x, target, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
        **options)
    want = cross_entropy(x, target, **options)
    assert torch.equal(loss, want)
    got_grad, = torch.autograd.grad(loss, x)
    want_grad, = torch.autograd.grad(want, x)
    assert torch.equal(got_grad, want_grad)
    assert not (z_loss.requires_grad or accuracy.requires_grad or predicted.requires_grad)
    # one flag alone returns (loss, it); under no_grad the same values
    with torch.no_grad():
        alone = cross_entropy(x, target, return_predicted_tokens=True, **options)
    assert len(alone) == 2 and torch.equal(alone[1], predicted)


def test_gradients_with_the_flags_on(device):
    # fp64 finite differences of the loss while the argmax is computed and stored beside it
    target = torch.tensor([4, IGNORE, 0], device=device)
    gradcheck(lambda x: cross_entropy(x, target, label_smoothing=0.25, lse_square_scale=0.125,
                                      softcap=2.5, return_token_accuracy=True,
                                      return_predicted_tokens=True)[0],
              [randn((3, 5), seed=1, device=device) * 3], fast=False)


def test_all_rows_ignored(device):
    x = randn((3, V), seed=1, device=device)
    target = torch.full((3,), IGNORE, device=device)
    accuracy, predicted = cross_entropy(x, target, return_token_accuracy=True,
                                        return_predicted_tokens=True)[1:]
    assert accuracy.isnan()  # a mean over no rows, as the loss's
    assert (predicted == -1).all()  # no counted row
    total = cross_entropy(x, target, reduction="sum", return_token_accuracy=True)[1]
    assert total.item() == 0.0


def test_torch_layout_and_module(device):
    # classes along dim 1 of (B, C, d): predictions in the target's shape
    x = randn((2, V, 3), seed=2, device=device) * 3
    target = torch.argmax(x, 1)
    target[0, 1] = IGNORE
    target[1, 2] = (target[1, 2] + 1) % V
    module = CrossEntropyLoss(return_token_accuracy=True, return_predicted_tokens=True)
    assert module.extra_repr() == "return_token_accuracy=True, return_predicted_tokens=True"
    loss, accuracy, predicted = module(x, target)
    assert torch.equal(predicted, argmax(x, target, dim=1))
    assert accuracy.item() == pytest.approx(4 / 5)


BAD = {
    "accuracy_int": ({"return_token_accuracy": 1}, TypeError,
                     "argument 'return_token_accuracy' must be a bool, got int"),
    "predicted_none": ({"return_predicted_tokens": None}, TypeError,
                       "argument 'return_predicted_tokens' must be a bool, got NoneType"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_flags_are_refused(case):
    options, error, match = BAD[case]
    x, target = randn((2, 5)), torch.tensor([0, 1])
    with pytest.raises(error, match=f"cross_entropy\\(\\): {match}"):
        cross_entropy(x, target, **options)
    with pytest.raises(error, match=f"CrossEntropyLoss\\(\\): {match}"):
        CrossEntropyLoss(**options)


def argmax_spec(*, differentiated):
    op = OpSpec("toy_argmax")
    x = op.input("x")
    op.row_input("target", integer=True)
    op.scalar("ignore_index")
    key = op.column_index("key")
    peak = op.row_max("peak", x)
    e = op.element("e", sympy.exp(x - peak))
    total = op.row_sum("total", e)
    first = op.row_min("first", sympy.Piecewise((key, x >= peak), (N, True)))
    loss = op.row("loss", sympy.log(total) + peak + (first if differentiated else 0))
    index = op.row("index", first)
    op.output(loss)
    op.output(index, grad=False)
    op.save(x)
    op.api = RowLossAPI(function="toy", module="Toy", torch_function="toy", target="target",
                        ignore="ignore_index",
                        options=(Option("ignore_index", -100, check="integer"),),
                        returns=("index",), returns_as=(("index", "index"),))
    return op


def test_a_row_min_is_never_differentiated():
    derive(argmax_spec(differentiated=False))
    with pytest.raises(DerivationError, match="'first' is a row min, which is never "
                                              "differentiated"):
        derive(argmax_spec(differentiated=True))


def test_returns_as_is_checked():
    from derive.api import api_mismatches

    op = argmax_spec(differentiated=False)
    assert api_mismatches(op) == []
    op.api = RowLossAPI(function="toy", module="Toy", torch_function="toy", target="target",
                        ignore="ignore_index",
                        options=(Option("ignore_index", -100, check="integer"),),
                        returns=("index",), returns_as=(("index", "argmax"),))
    assert any("returns_as ('index', 'argmax')" in p for p in api_mismatches(op))


def test_fp64_accuracy_mean_is_exact(device):
    x, target = logits(device=device), targets(device=device)
    accuracy = cross_entropy(x, target, return_token_accuracy=True)[1]
    torch.testing.assert_close(accuracy, reference(x, target, "mean")[0], **FP64_TOL)


def test_not_asked_for_nothing_is_computed_for_them(monkeypatch):
    # the torch path prints the kernels' IR: without the flags, no row min is taken (the
    # kernels' STORE_ constexprs leave the argmax out the same way), and the loss is the same
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path
    x, target = randn((10, V), seed=1), targets()
    want = cross_entropy(x, target, label_smoothing=0.1)
    amin = torch.Tensor.amin
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return amin(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "amin", counted)
    assert torch.equal(cross_entropy(x, target, label_smoothing=0.1), want)
    assert calls == []
    cross_entropy(x, target, label_smoothing=0.1, return_token_accuracy=True)
    assert calls == [x.shape]


def test_generated_kernels_gate_the_argmax():
    # every line of the Triton kernels that computes the argmax runs under the flags of the
    # stores that read it
    source = open(cross_entropy_module.__file__).read()
    kernels = source[:source.index("def _cross_entropy_fwd_torch")]
    lines = kernels.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("first_max", "predicted_tokens =")) and "tl." in line:
            indent = len(line) - len(line.lstrip())
            gate = next(previous for previous in reversed(lines[:i])
                        if len(previous) - len(previous.lstrip()) < indent)
            assert gate.strip() == "if STORE_PREDICTED_TOKENS or STORE_TOKEN_ACCURACY:", line

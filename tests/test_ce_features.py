"""Cross-entropy's large-vocabulary options (z-loss, logit softcapping, return_z_loss), each
derived by the engine, against a plain-torch reference; and the spec-language pieces they
use: scalars that may be off (compiled out), outputs never differentiated."""

import pytest
import sympy
import torch
import torch.nn.functional as F
from reference import FP64_TOL, assert_low_precision_ok, assert_matches_torch, gradcheck, randn

from codegen.printers import TORCH, KernelPrinter
from codegen.runtime.checks import OptionError
from derive.api import Option, RowLossAPI
from derive.spec import OpSpec, SpecError
from generated import cross_entropy as cross_entropy_module
from generated.cross_entropy import CrossEntropyLoss, cross_entropy

OP = cross_entropy_module  # for the `schedule` fixture
V = 37  # classes: three column blocks of the looped schedule
IGNORE = -100
# (label_smoothing, lse_square_scale, softcap, class weights): each option alone and all of
# them; values exact in fp32 (the kernels read scalars as fp32 pairs: fp64 tolerance holds)
OPTIONS = [(0.0, 0.125, None, False), (0.0, 0.0, 2.5, True), (0.25, 0.0625, 4.0, True)]


def targets(rows, device, *, ignored=(2,), seed=5):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (rows,), generator=gen)
    target[list(ignored)] = IGNORE
    return target.to(device)


def reference(x, target, weight=None, reduction="mean", label_smoothing=0.0,
              lse_square_scale=0.0, softcap=None):
    """(loss, z_loss) in plain torch: torch's cross-entropy of the capped logits plus the
    z-loss of each counted row, reduced as torch's (a weighted mean divides by the counted
    rows' weight sum)."""
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(z, target, weight, ignore_index=IGNORE, reduction="none",
                           label_smoothing=label_smoothing)
    counted = target != IGNORE
    z_loss = torch.where(counted, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return loss + z_loss, z_loss
    if reduction == "sum":
        return (loss + z_loss).sum(), z_loss.sum()
    kept = counted.sum() if weight is None else weight[target.clamp(min=0)][counted].sum()
    return (loss + z_loss).sum() / kept, z_loss.sum() / kept


@pytest.mark.parametrize("options", OPTIONS, ids=["z_loss", "softcap_weighted", "all_weighted"])
@pytest.mark.parametrize("reduction", ["none", "mean"])  # "sum": test_torch_layout_and_module
def test_matches_the_torch_reference(device, schedule, reduction, options):
    smoothing, scale, softcap, weighted = options
    target = targets(6, device)
    weight = randn((V,), seed=4, device=device).abs() + 0.5 if weighted else None
    kwargs = dict(reduction=reduction, label_smoothing=smoothing, lse_square_scale=scale,
                  softcap=softcap)
    x = randn((6, V), seed=1, device=device) * 4
    assert_matches_torch(lambda x: cross_entropy(x, target, weight, **kwargs),
                         lambda x: reference(x, target, weight, **kwargs)[0], [x])
    loss, z_loss = cross_entropy(x, target, weight, return_z_loss=True, **kwargs)
    want_loss, want_z = reference(x, target, weight, **kwargs)
    torch.testing.assert_close(loss, want_loss, **FP64_TOL)
    torch.testing.assert_close(z_loss, want_z, **FP64_TOL)


def liger_reference(x, target, weight, reduction, label_smoothing, lse_square_scale):
    """(loss, z_loss) as Liger-Kernel's tests define them (CrossEntropyWithZLoss): torch's
    cross-entropy, reduced as torch's, plus the z-loss of the counted rows, whose mean divides
    by their count whatever the class weights."""
    loss = F.cross_entropy(x, target, weight, ignore_index=IGNORE, reduction=reduction,
                           label_smoothing=label_smoothing)
    counted = target != IGNORE
    z_loss = torch.where(counted, lse_square_scale * torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "mean":
        z_loss = z_loss.sum() / counted.sum()
    elif reduction == "sum":
        z_loss = z_loss.sum()
    return loss + z_loss, z_loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.25])
def test_z_loss_mean_row_count_is_liger_definition(device, reduction, smoothing):
    # z_loss_mean="row_count": the loss, its z-loss and the gradient as Liger-Kernel's
    # reference formula gives them, with class weights; "weight_sum" (the default) differs
    # there, and the two agree without weights
    from generated.cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy

    target = targets(6, device, ignored=(2, 4))
    weight = randn((V,), seed=4, device=device).abs() + 0.5
    x = (randn((6, V), seed=1, device=device) * 4).requires_grad_()
    options = dict(reduction=reduction, label_smoothing=smoothing, lse_square_scale=0.125)
    got = cross_entropy(x, target, weight, z_loss_mean="row_count", return_z_loss=True,
                        **options)
    want = liger_reference(x, target, weight, **options)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **FP64_TOL)
    upstream = randn(want[0].shape, seed=9, device=device)
    grad, = torch.autograd.grad(got[0], x, upstream)
    torch.testing.assert_close(grad, torch.autograd.grad(want[0], x, upstream)[0], **FP64_TOL)
    default = cross_entropy(x, target, weight, **options)
    assert torch.equal(default, got[0]) != (reduction == "mean")
    unweighted = dict(options, reduction="mean")
    torch.testing.assert_close(cross_entropy(x, target, z_loss_mean="row_count", **unweighted),
                               cross_entropy(x, target, **unweighted), rtol=0, atol=0)
    # the fused linear loss and the modules take it alike
    hidden = randn((6, 8), seed=2, device=device).requires_grad_()
    lm_head = randn((V, 8), seed=3, device=device)
    linear = linear_cross_entropy(hidden, lm_head, target, class_weight=weight,
                                  z_loss_mean="row_count", return_z_loss=True, **options)
    logits = torch.nn.functional.linear(hidden, lm_head)
    want = liger_reference(logits, target, weight, **options)
    for g, w in zip(linear, want, strict=True):
        torch.testing.assert_close(g, w, **FP64_TOL)
    torch.testing.assert_close(torch.autograd.grad(linear[0], hidden, upstream)[0],
                               torch.autograd.grad(want[0], hidden, upstream)[0], **FP64_TOL)
    module = CrossEntropyLoss(weight, z_loss_mean="row_count", **options)
    assert "z_loss_mean='row_count'" in module.extra_repr()
    torch.testing.assert_close(module(x, target), got[0], rtol=0, atol=0)
    linear_module = LinearCrossEntropyLoss(class_weight=weight, z_loss_mean="row_count",
                                           **options)
    assert "z_loss_mean='row_count'" in linear_module.extra_repr()
    torch.testing.assert_close(linear_module(hidden, lm_head, target), linear[0], rtol=0,
                               atol=0)


def token_scaled_reference(x, target, weight, reduction, softcap, lse_square_scale, power):
    """(loss, z_loss) of Liger-Kernel's token scaling (use_token_scaling=True at power 1):
    each row's loss and z-loss times its target's predicted probability (softmax of the
    capped logits) raised to `power`, detached; reduced as the loss."""
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    counted = target != IGNORE
    probability = torch.softmax(z, -1).gather(-1, target.clamp(min=0)[:, None])[:, 0]
    scale = probability.detach() ** power
    loss = F.cross_entropy(z, target, weight, ignore_index=IGNORE, reduction="none")
    z_loss = torch.where(counted, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    rows, z_rows = (loss + z_loss) * scale, z_loss * scale
    if reduction == "none":
        return rows, z_rows
    if reduction == "sum":
        return rows.sum(), z_rows.sum()
    kept = counted.sum() if weight is None else weight[target.clamp(min=0)][counted].sum()
    return rows.sum() / kept, z_rows.sum() / kept


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [(1.0, None, 0.0, False), (1.0, 4.0, 0.125, True),
                                     (0.5, None, 0.0625, False)],
                         ids=["liger", "capped_z_weighted", "half_power"])
def test_token_scaling_detaches_the_probability(device, reduction, options):
    # token_scaling=1.0 is Liger-Kernel's use_token_scaling: the loss, the z-loss and the
    # gradient as its formula gives them, the probability's own derivative dropped (the
    # engine's `Detached`), in reverse and forward mode alike
    from generated.cross_entropy import linear_cross_entropy

    power, softcap, scale, weighted = options
    target = targets(6, device, ignored=(2,))
    weight = randn((V,), seed=4, device=device).abs() + 0.5 if weighted else None
    x = (randn((6, V), seed=1, device=device) * 2).requires_grad_()
    kwargs = dict(reduction=reduction, softcap=softcap, lse_square_scale=scale)
    got = cross_entropy(x, target, weight, token_scaling=power, return_z_loss=True, **kwargs)
    want = token_scaled_reference(x, target, weight, power=power, **kwargs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **FP64_TOL)
    upstream = randn(want[0].shape, seed=9, device=device)
    grad, = torch.autograd.grad(got[0], x, upstream)
    torch.testing.assert_close(grad, torch.autograd.grad(want[0], x, upstream)[0], **FP64_TOL)
    tangent = randn(x.shape, seed=11, device=device)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), tangent)
        ours = cross_entropy(dual, target, weight, token_scaling=power, **kwargs)
        ref = token_scaled_reference(dual, target, weight, power=power, **kwargs)[0]
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(ours).tangent,
                                   torch.autograd.forward_ad.unpack_dual(ref).tangent,
                                   **FP64_TOL)
    # the fused linear loss takes it alike
    hidden = randn((6, 8), seed=2, device=device).requires_grad_()
    lm_head = randn((V, 8), seed=3, device=device)
    linear = linear_cross_entropy(hidden, lm_head, target, class_weight=weight,
                                  token_scaling=power, **kwargs)
    want = token_scaled_reference(torch.nn.functional.linear(hidden, lm_head), target, weight,
                                  power=power, **kwargs)[0]
    torch.testing.assert_close(linear, want, **FP64_TOL)
    torch.testing.assert_close(torch.autograd.grad(linear, hidden, upstream)[0],
                               torch.autograd.grad(want, hidden, upstream)[0], **FP64_TOL)


def test_token_scaling_double_backward(device):
    # the recorded backward (create_graph=True) keeps the probability constant too: a
    # Hessian-vector product as torch's of the detached reference
    target = targets(6, device)
    x = (randn((6, V), seed=1, device=device) * 2).requires_grad_()
    v = randn((6, V), seed=3, device=device)
    kwargs = dict(reduction="mean", softcap=4.0, lse_square_scale=0.125)
    products = []
    for loss in (cross_entropy(x, target, token_scaling=1.0, **kwargs),
                 token_scaled_reference(x, target, None, power=1.0, **kwargs)[0]):
        grad, = torch.autograd.grad(loss, x, create_graph=True)
        products.append(torch.autograd.grad((grad * v).sum(), x)[0])
    torch.testing.assert_close(*products, **FP64_TOL)


def test_detached_in_the_spec_language():
    # Detached(e) is e's value with derivative 0; the torch printer detaches it (a backward
    # autograd records differentiates the torch path), Triton's prints the value
    from codegen.printers import TRITON, KernelPrinter
    from derive.spec import Detached

    x = sympy.Symbol("x", real=True)
    assert sympy.diff(Detached(x**2) * x, x) == Detached(x**2)
    assert Detached(sympy.Integer(3)) == 3
    varies = {"x"}.__contains__
    assert KernelPrinter(TORCH, varies)(Detached(2 * x)) == "(2.0 * x).detach()"
    assert KernelPrinter(TRITON, varies)(Detached(2 * x) + 1) == "1.0 + 2.0 * x"


def test_torch_layout_and_module(device):
    # classes along dim 1 of (N, C, d): the options apply along the class dim, as the loss
    x = randn((2, V, 3), seed=2, device=device) * 3
    target = targets(6, device).reshape(2, 3)
    options = dict(label_smoothing=0.25, lse_square_scale=0.125, softcap=4.0)
    module = CrossEntropyLoss(reduction="sum", return_z_loss=True, **options)
    assert module.extra_repr() == ("label_smoothing=0.25, lse_square_scale=0.125, "
                                   "softcap=4.0, reduction='sum', return_z_loss=True")
    loss, z_loss = module(x, target)
    rows = x.movedim(1, -1).reshape(-1, V)
    want_loss, want_z = reference(rows, target.reshape(-1), reduction="sum", **options)
    torch.testing.assert_close(loss, want_loss, **FP64_TOL)
    torch.testing.assert_close(z_loss, want_z, **FP64_TOL)
    assert CrossEntropyLoss().extra_repr() == ""


def test_gradcheck(device):
    # finite differences of the derived backward, every option on (5 classes: 15 columns of
    # the Jacobian, each a call)
    target = torch.tensor([4, IGNORE, 0], device=device)
    weight = randn((5,), seed=4, device=device).abs() + 0.5
    gradcheck(lambda x: cross_entropy(x, target, weight, label_smoothing=0.25,
                                      lse_square_scale=0.125, softcap=2.5),
              [randn((3, 5), seed=1, device=device) * 3], fast=False)


def test_double_backward_through_the_derived_backward():
    # the backward autograd records (create_graph=True), the torch path
    target = torch.tensor([4, IGNORE, 0])
    x = (randn((3, 5), seed=1) * 3).requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda x: cross_entropy(x, target, lse_square_scale=0.125, softcap=2.5), (x,))


def test_z_loss_is_returned_undifferentiated(device):
    target = targets(6, device)
    x = (randn((6, V), seed=1, device=device) * 3).requires_grad_()
    options = dict(lse_square_scale=0.125, softcap=4.0)
    loss, z_loss = cross_entropy(x, target, return_z_loss=True, **options)
    assert not z_loss.requires_grad
    got, = torch.autograd.grad(loss, x)
    want, = torch.autograd.grad(cross_entropy(x, target, **options), x)
    assert torch.equal(got, want)  # return_z_loss changes nothing in the loss or its gradient
    # the z-loss of the rows, 0 in the ignored one; with the scale 0: zeros
    rows = cross_entropy(x, target, reduction="none", return_z_loss=True, **options)[1]
    assert rows[2] == 0 and (rows[[0, 1, 3, 4, 5]] > 0).all()
    off = cross_entropy(x, target, reduction="none", return_z_loss=True)[1]
    assert torch.equal(off, torch.zeros_like(off))
    with torch.no_grad():
        assert torch.equal(cross_entropy(x, target, return_z_loss=True, **options)[1], z_loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision(device, dtype):
    target = targets(16, device, ignored=[3])
    options = dict(label_smoothing=0.25, lse_square_scale=0.125, softcap=4.0)
    assert_low_precision_ok(lambda x: cross_entropy(x, target, reduction="none", **options),
                            lambda x: reference(x, target, reduction="none", **options)[0],
                            [randn((16, V), seed=1, device=device) * 6], dtype)


def test_large_logits_saturate_under_the_cap(device):
    # logits far beyond the cap: tanh saturates to ±1, the loss and gradient stay finite
    target = targets(4, device, ignored=())
    x = randn((4, V), seed=3, device=device) * 1e4
    options = dict(softcap=30.0, lse_square_scale=0.0625)
    assert_matches_torch(lambda x: cross_entropy(x, target, **options),
                         lambda x: reference(x, target, **options)[0], [x])


def test_options_off_compute_nothing_for_them(monkeypatch):
    # the torch path prints the same kernel IR: with softcap off no tanh is evaluated, on any
    # element, forward or backward (the kernels' HAS_SOFTCAP constexpr picks the same branch)
    target = targets(4, "cpu")
    x = (randn((4, V), seed=1) * 3).requires_grad_()
    want = cross_entropy(x, target, label_smoothing=0.25)
    want_grad, = torch.autograd.grad(want, x)

    def refused(*args, **kwargs):
        raise AssertionError("tanh evaluated with softcap off")

    monkeypatch.setattr(torch, "tanh", refused)
    got = cross_entropy(x, target, label_smoothing=0.25, lse_square_scale=0.0, softcap=None)
    got_grad, = torch.autograd.grad(got, x)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_generated_kernels_specialise_on_the_switches():
    # every kernel takes a constexpr per switched scalar, and reads it nowhere per element
    # with the switch off: its per-element lines pick a branch with the flag, not tl.where
    source = open(cross_entropy_module.__file__).read()
    for flag in ("HAS_SOFTCAP: tl.constexpr", "HAS_LSE_SQUARE_SCALE: tl.constexpr"):
        assert source.count(flag) == 4  # fwd and bwd, persistent and looped
    assert "(softcap == 0.0)" not in source and "(lse_square_scale == 0.0)" not in source


def test_printer_chooses_switched_branches_at_compile_time():
    x, s = sympy.Symbol("x", real=True), sympy.Symbol("s", real=True)
    expr = 1 + x * sympy.Piecewise((1, sympy.Eq(s, 0)), (sympy.tanh(x / s), True))
    printer = KernelPrinter(TORCH, lambda name: name == "x", {("s", sympy.Integer(0)): "HAS_S"})
    # off: the expression without the term (1 + x), not 1 + x * where(s == 0, 1, ...)
    assert printer(expr) == "(1.0 + x * torch.tanh((x) / (s)) if HAS_S else 1.0 + x)"
    plain = KernelPrinter(TORCH, lambda name: name == "x")
    assert "torch.where((s == 0.0)" in plain(expr)


BAD_OPTIONS = {
    "softcap_zero": ({"softcap": 0.0}, OptionError, "argument 'softcap' must be a finite "
                                                    r"number > 0 or None, got 0.0"),
    "softcap_negative": ({"softcap": -2.0}, OptionError, "argument 'softcap' must be"),
    "softcap_nan": ({"softcap": float("nan")}, OptionError, "argument 'softcap' must be"),
    "softcap_inf": ({"softcap": float("inf")}, OptionError, "argument 'softcap' must be"),
    "softcap_str": ({"softcap": "30"}, TypeError, "argument 'softcap' must be a real number"),
    "scale_nan": ({"lse_square_scale": float("nan")}, OptionError,
                  "argument 'lse_square_scale' must be finite, got nan"),
    "scale_inf": ({"lse_square_scale": float("-inf")}, OptionError,
                  "argument 'lse_square_scale' must be finite"),
    "scale_none": ({"lse_square_scale": None}, TypeError,
                   "argument 'lse_square_scale' must be a real number, got NoneType"),
    "return_z_loss_int": ({"return_z_loss": 1}, TypeError,
                          "argument 'return_z_loss' must be a bool, got int"),
    "z_loss_mean_unknown": ({"z_loss_mean": "rows"}, ValueError,
                            "argument 'z_loss_mean' must be one of 'weight_sum', 'row_count', "
                            "got 'rows'"),
    "z_loss_mean_none": ({"z_loss_mean": None}, TypeError,
                         "argument 'z_loss_mean' must be a str \\(one of 'weight_sum', "
                         "'row_count'\\), got NoneType"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_options_are_refused(case):
    options, error, match = BAD_OPTIONS[case]
    x, target = randn((2, 5)), torch.tensor([0, 1])
    with pytest.raises(error, match=match):
        cross_entropy(x, target, **options)
    with pytest.raises(error, match=match.replace("cross_entropy", "CrossEntropyLoss")):
        CrossEntropyLoss(**options)


def loss_spec(*, absent=0, undifferentiated_first=False, returns=("aux",), default=None):
    op = OpSpec("toy_loss")
    x = op.input("x")
    op.row_input("target", integer=True)
    op.scalar("ignore_index")
    cap = op.scalar("cap", absent=absent)
    total = op.row_sum("total", sympy.Piecewise((x, sympy.Eq(cap, 0)), (cap * x, True)))
    aux = op.row("aux", total * total)
    if undifferentiated_first:
        op.output(aux, grad=False)
    op.output(total)
    op.output(aux, grad=False)
    op.save(x)
    op.api = RowLossAPI(function="toy", module="Toy", torch_function="toy", target="target",
                        ignore="ignore_index",
                        options=(Option("ignore_index", -100, check="integer"),
                                 Option("cap", default, check="positive")),
                        returns=returns)
    return op


def test_spec_errors():
    from derive.api import api_mismatches

    assert api_mismatches(loss_spec()) == []
    with pytest.raises(SpecError, match="the first output is the op's result"):
        loss_spec(undifferentiated_first=True)
    assert any("defaults to None (off), which needs" in p
               for p in api_mismatches(loss_spec(absent=None)))
    assert any("output 'aux' (grad=False) is not in the API's returns" in p
               for p in api_mismatches(loss_spec(returns=())))
    with pytest.raises(SpecError, match="absent must be a finite number"):
        OpSpec("bad").scalar("s", absent=float("inf"))
    with pytest.raises(SpecError, match="declared positive, so it cannot take its absent value"):
        OpSpec("bad").scalar("s", positive=True, absent=0)

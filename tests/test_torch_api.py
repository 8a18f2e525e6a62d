"""torch's signatures where the generated functions claim them: the same arguments, defaults,
results and, for a bad argument, an error of the type torch raises for it."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import HAS_CUDA, assert_matches_torch, randn

import generated.add_layernorm as add_layernorm
import generated.bias_dropout_add as bias_dropout_add
import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
import generated.layernorm as layernorm
import generated.masked_softmax as masked_softmax
import generated.rmsnorm as rmsnorm
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.driver.command import main
from codegen.runtime import checks
from generated.cross_entropy import CrossEntropyLoss, cross_entropy

N = 7


def torch_error(call):
    """The exception torch raises for `call`, which must raise."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - whatever torch raises is the point
        call()
    return caught.value


def assert_raises_like_torch(ours, theirs, match=None):
    """`ours` raises an instance of the type `theirs` (torch on the same bad input) raises."""
    expected = type(torch_error(theirs))
    with pytest.raises(expected, match=match):
        ours()


# gelu(input, approximate="none")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_approximate_matches_torch(device, approximate):
    x = randn((3, N), seed=1, device=device) * 3
    bias = randn((N,), seed=2, device=device)
    assert_matches_torch(lambda x: gelu.gelu(x, approximate=approximate),
                         lambda x: F.gelu(x, approximate=approximate), [x])
    assert_matches_torch(lambda x, b: gelu.gelu(x, approximate=approximate, bias=b),
                         lambda x, b: F.gelu(x + b, approximate=approximate), [x, bias])


def test_gelu_tanh_runs_the_tanh_kernels(device):
    # "tanh" is the gelu_tanh op's call itself, bit for bit; gelu_tanh keeps its own name
    x = randn((2, 3, N), seed=1, device=device).requires_grad_()
    bias = randn((N,), seed=2, device=device).requires_grad_()
    ours = gelu.gelu(x, approximate="tanh", bias=bias)
    grads = torch.autograd.grad(ours.sum(), (x, bias))
    theirs = gelu_tanh.gelu_tanh(x, bias=bias)
    assert torch.equal(ours, theirs)
    for got, want in zip(grads, torch.autograd.grad(theirs.sum(), (x, bias)), strict=True):
        assert torch.equal(got, want)
    exact = gelu.gelu(x.detach())
    assert not torch.equal(exact, gelu.gelu(x.detach(), approximate="tanh"))


@pytest.mark.parametrize("approximate", ["foo", "Tanh", "", None, 1])
def test_gelu_bad_approximate_raises_like_torch(approximate):
    x = torch.randn(2, N, dtype=torch.float64)
    assert_raises_like_torch(lambda: gelu.gelu(x, approximate=approximate),
                             lambda: F.gelu(x, approximate=approximate), match="approximate")


def test_gelu_approximate_is_keyword_only_as_torch():
    x = torch.randn(2, N, dtype=torch.float64)
    assert_raises_like_torch(lambda: gelu.gelu(x, "tanh"), lambda: F.gelu(x, "tanh"))
    parameter = inspect.signature(gelu.gelu).parameters["approximate"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default == "none"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_module_like_torch(approximate):
    x = torch.randn(2, N, dtype=torch.float64)
    ours, theirs = gelu.GELU(approximate), torch.nn.GELU(approximate)
    assert repr(ours) == repr(theirs)
    assert ours.approximate == theirs.approximate
    torch.testing.assert_close(ours(x), theirs(x))
    assert repr(gelu.GELU()) == repr(torch.nn.GELU()) == "GELU(approximate='none')"
    assert repr(gelu.GELU(approximate=approximate)) == repr(torch.nn.GELU(approximate))


def test_gelu_module_checks_approximate_at_the_call_as_torch():
    x = torch.randn(2, N, dtype=torch.float64)
    ours, theirs = gelu.GELU("foo"), torch.nn.GELU("foo")  # both construct
    assert repr(ours) == repr(theirs)
    assert_raises_like_torch(lambda: ours(x), lambda: theirs(x), match="approximate")


VARIANT_SPEC = """
import sympy
from derive.api import ElementwiseAPI, Variant
from derive.spec import OpSpec


def spec():
    op = OpSpec("{name}")
    x = op.input("x")
    op.output(op.element("y", sympy.tanh(x)))
    op.save(x)
    op.api = ElementwiseAPI(function="{name}", module="M", torch_function="torch.tanh",
                            {extra}variant=Variant("kind", {ops}))
    return op
"""


@pytest.mark.parametrize("ops, extra, message", [
    ('(("a", "gelu_tanh"), ("b", None))', "", r"first value \(the default\) must select"),
    ('(("a", None), ("b", "no_such_op"))', "", r"'no_such_op', which is not an op of derive"),
    ('(("a", None), ("b", "gelu_tanh"))', "", r"whose call_params \('bias',\) differ"),
    ('(("a", None), ("a", "gelu_tanh"))', "", "value 'a' is listed twice"),
    ('(("a", None), ("b\\"", "gelu_tanh"))', "", "without quotes"),
])
def test_variant_refusals_name_the_spec(tmp_path, capsys, ops, extra, message):
    (tmp_path / "v.py").write_text(VARIANT_SPEC.format(name="v", ops=ops, extra=extra))
    assert main([str(tmp_path / "v.py"), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert re.match(r"derive: error: \S*v\.py:\d+: .*Variant\('kind'\)", error), error
    assert len(error.strip().splitlines()) == 1, error
    assert re.search(message, error), error


# cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
# reduction="mean", label_smoothing=0.0)

C = 5  # classes
LAYOUTS = {  # input shape (the classes along dim 1, or dim 0 of a 1-d input)
    "(N, C)": (4, C),
    "(C,)": (C,),
    "(N, C, d1)": (2, C, 3),
    "(N, C, d1, d2)": (2, C, 2, 2),
}
REDUCTIONS = ("none", "mean", "sum")


def class_targets(shape, seed=5, ignored=()):
    """Class indices for logits of `shape` (torch's layout), ignore_index at flat `ignored`."""
    rows = shape[:1] + shape[2:] if len(shape) > 1 else ()
    target = torch.randint(0, C, rows, generator=torch.Generator().manual_seed(seed))
    target.view(-1)[list(ignored)] = -100
    return target


def class_weights(seed=3):
    return torch.rand(C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.2


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weight"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_entropy_layouts_and_weights_match_torch(device, layout, weighted):
    # fp64, every reduction, with and without smoothing: torch's formula, including the
    # weighted smoothing term and the weighted mean's denominator (sum of weight[target] over
    # the counted rows), and a row of ignore_index where there are several
    shape = LAYOUTS[layout]
    x = randn(shape, seed=1, device=device) * 3
    target = class_targets(shape, ignored=[1] if len(shape) > 1 else ()).to(device)
    weight = class_weights().to(device) if weighted else None
    for reduction in REDUCTIONS:
        for label_smoothing in (0.0, 0.25):
            options = {"weight": weight, "reduction": reduction,
                       "label_smoothing": label_smoothing}
            assert_matches_torch(lambda x, o=options: cross_entropy(x, target, **o),
                                 lambda x, o=options: F.cross_entropy(x, target, **o), [x])


def test_cross_entropy_class_dim_last_is_torch_on_the_moved_dim(device):
    x = randn((2, 3, C), seed=1, device=device)
    target = class_targets((2, C, 3)).to(device)
    weight = class_weights().to(device)
    for reduction in REDUCTIONS:
        assert_matches_torch(
            lambda x, r=reduction: cross_entropy(x, target, weight, reduction=r, class_dim=-1,
                                                 label_smoothing=0.25),
            lambda x, r=reduction: F.cross_entropy(x.movedim(-1, 1), target, weight, reduction=r,
                                                   label_smoothing=0.25), [x])


def test_cross_entropy_one_element_target_of_a_1d_input_as_torch():
    x = torch.randn(C, dtype=torch.float64)
    for target in (torch.tensor(2), torch.tensor([2])):
        for reduction in REDUCTIONS:
            got = cross_entropy(x, target, reduction=reduction)
            want = F.cross_entropy(x, target, reduction=reduction)
            assert got.shape == want.shape == ()
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
def test_cross_entropy_weighted_mean_edges_as_torch(device, label_smoothing):
    # the counted rows' weights sum to 0: a NaN mean with NaN gradients; every row ignored: a
    # NaN mean with zero gradients (torch's rules for both)
    x = randn((3, C), seed=1, device=device)
    weight = torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0], dtype=torch.float64, device=device)
    for target in (torch.tensor([0, 1, 2]), torch.tensor([-100, -100, -100])):
        target = target.to(device)
        assert_matches_torch(
            lambda x, t=target: cross_entropy(x, t, weight, label_smoothing=label_smoothing),
            lambda x, t=target: F.cross_entropy(x, t, weight, label_smoothing=label_smoothing),
            [x])


def test_cross_entropy_weight_is_not_differentiated_as_torch():
    x = torch.randn(3, C, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 1, 2])
    weight = class_weights().requires_grad_()
    assert_raises_like_torch(lambda: cross_entropy(x, target, weight),
                             lambda: F.cross_entropy(x, target, weight), match="'weight'")
    assert_raises_like_torch(lambda: cross_entropy(x.detach(), target, weight),
                             lambda: F.cross_entropy(x.detach(), target, weight))
    with torch.no_grad():  # autograd records nothing: torch takes it, so do we
        torch.testing.assert_close(cross_entropy(x, target, weight),
                                   F.cross_entropy(x, target, weight))


BAD_CROSS_ENTROPY = {
    "weight of the wrong length": lambda x, t: {"weight": torch.ones(C + 1, dtype=x.dtype)},
    "2-d weight": lambda x, t: {"weight": torch.ones(1, C, dtype=x.dtype)},
    "integer weight": lambda x, t: {"weight": torch.ones(C, dtype=torch.int64)},
    "weight not a tensor": lambda x, t: {"weight": [1.0] * C},
    "target of another batch": lambda x, t: {"target": t[:-1]},
    "target with a dim too many": lambda x, t: {"target": t[:, None]},
    "target of another nd shape": lambda x, t: {"input": x[:, :, None].expand(4, C, 3),
                                                "target": torch.zeros(4, 2, dtype=torch.int64)},
    "bool target": lambda x, t: {"target": t.bool()},
    "float target of another shape": lambda x, t: {"target": t.double()},
    "target not a tensor": lambda x, t: {"target": t.tolist()},
    "class too large": lambda x, t: {"target": t + C},
    "class negative": lambda x, t: {"target": t - C},
    "input not a tensor": lambda x, t: {"input": x.tolist()},
    "label_smoothing above 1": lambda x, t: {"label_smoothing": 1.5},
    "label_smoothing a str": lambda x, t: {"label_smoothing": "0.1"},
    "ignore_index a fraction": lambda x, t: {"ignore_index": 1.5},
    "reduction": lambda x, t: {"reduction": "avg"},
}


@pytest.mark.parametrize("case", BAD_CROSS_ENTROPY)
def test_cross_entropy_errors_are_torch_s_types(case):
    x = torch.randn(4, C, dtype=torch.float64)
    arguments = {"input": x, "target": torch.tensor([0, 1, 2, 3])}
    arguments.update(BAD_CROSS_ENTROPY[case](x, arguments["target"]))
    assert_raises_like_torch(lambda: cross_entropy(**arguments),
                             lambda: F.cross_entropy(**arguments))


def test_cross_entropy_class_probabilities_are_refused_naming_target():
    x = torch.randn(4, C, dtype=torch.float64)
    probabilities = torch.softmax(torch.randn(4, C, dtype=torch.float64), -1)
    F.cross_entropy(x, probabilities)  # torch takes them; we say we do not
    with pytest.raises(NotImplementedError, match="argument 'target' holds class probabilities"):
        cross_entropy(x, probabilities)


def test_cross_entropy_class_dim_is_checked():
    x = torch.randn(4, C, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 3])
    with pytest.raises(IndexError, match=r"argument 'class_dim' must be in \[-2, 1\].* got 2"):
        cross_entropy(x, target, class_dim=2)
    with pytest.raises(TypeError, match="argument 'class_dim' must be an int or None"):
        cross_entropy(x, target, class_dim=1.0)
    torch.testing.assert_close(cross_entropy(x.T, target, class_dim=0), F.cross_entropy(x, target))


LEGACY = [(None, False), (False, None), (False, True), (True, False), (True, None), (None, True)]


@pytest.mark.parametrize("size_average, reduce", LEGACY)
def test_cross_entropy_legacy_arguments_as_torch(size_average, reduce):
    x = torch.randn(4, C, dtype=torch.float64)
    target = torch.tensor([0, 1, -100, 3])
    with pytest.warns(UserWarning) as theirs:
        want = F.cross_entropy(x, target, size_average=size_average, reduce=reduce,
                               reduction="sum")
    with pytest.warns(UserWarning) as ours:
        got = cross_entropy(x, target, size_average=size_average, reduce=reduce,
                            reduction="sum")
    torch.testing.assert_close(got, want)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    with pytest.warns(UserWarning):
        module = CrossEntropyLoss(size_average=size_average, reduce=reduce)
    with pytest.warns(UserWarning):
        assert module.reduction == torch.nn.CrossEntropyLoss(size_average=size_average,
                                                             reduce=reduce).reduction


def test_cross_entropy_signatures_are_torch_s():
    def parameters(function, skip=()):
        return [(p.name, p.default, p.kind) for p in inspect.signature(function).parameters.values()
                if p.name not in skip]

    extras = {"lse_square_scale": 0.0, "token_scaling": None, "softcap": None,
              "z_loss_mean": "weight_sum", "return_z_loss": False,
              "return_token_accuracy": False, "return_predicted_tokens": False,
              "class_dim": None}
    assert parameters(cross_entropy, extras) == parameters(F.cross_entropy)
    assert parameters(CrossEntropyLoss.__init__, extras) == parameters(
        torch.nn.CrossEntropyLoss.__init__)
    for function in (cross_entropy, CrossEntropyLoss.__init__):
        for name, default in extras.items():
            extra = inspect.signature(function).parameters[name]
            assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default == default


def test_cross_entropy_module_holds_weight_as_torch():
    weight = class_weights()
    ours, theirs = CrossEntropyLoss(weight, label_smoothing=0.1), torch.nn.CrossEntropyLoss(
        weight, label_smoothing=0.1)
    assert dict(ours.named_buffers()).keys() == dict(theirs.named_buffers()).keys() == {"weight"}
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    assert list(ours.parameters()) == []
    assert CrossEntropyLoss().weight is None and not CrossEntropyLoss().state_dict()
    assert repr(CrossEntropyLoss(weight)) == repr(torch.nn.CrossEntropyLoss(weight))
    x = torch.randn(2, C, 3, dtype=torch.float64, requires_grad=True)
    target = class_targets((2, C, 3), ignored=[2])
    assert_matches_torch(lambda x: ours(x, target), lambda x: theirs(x, target), [x])
    fresh = CrossEntropyLoss(torch.ones(C, dtype=torch.float64), label_smoothing=0.1)
    fresh.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(fresh(x, target), theirs(x, target))
    assert ours.float().weight.dtype == torch.float32  # moved and cast with the module


def test_cross_entropy_with_weight_compiles_without_graph_breaks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    x = torch.randn(3, C, 2, dtype=torch.float64, requires_grad=True)
    target = class_targets((3, C, 2), ignored=[1])
    weight = class_weights()

    def loss(x):
        return cross_entropy(x, target, weight, label_smoothing=0.25)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.cross_entropy(x, target, weight,
                                                            label_smoothing=0.25))
    got, = torch.autograd.grad(compiled(x), x)
    want, = torch.autograd.grad(F.cross_entropy(x, target, weight, label_smoothing=0.25), x)
    torch.testing.assert_close(got, want)


# Errors of torch's types: each bad call is made to torch's counterpart too, and ours must
# raise an instance of the type torch raised (a ValueError or TypeError as well, as before)

X = torch.randn(3, 4, dtype=torch.float64)
W = torch.ones(4, dtype=torch.float64)
BAD_CALLS = {
    "layer_norm integer input": (lambda: layernorm.layer_norm(X.long(), (4,)),
                                 lambda: F.layer_norm(X.long(), (4,))),
    "layer_norm weight shape": (lambda: layernorm.layer_norm(X, (4,), torch.ones(5)),
                                lambda: F.layer_norm(X, (4,), torch.ones(5))),
    "layer_norm integer weight": (lambda: layernorm.layer_norm(X, (4,), W.long()),
                                  lambda: F.layer_norm(X, (4,), W.long())),
    "layer_norm weight not a tensor": (lambda: layernorm.layer_norm(X, (4,), [1.0] * 4),
                                       lambda: F.layer_norm(X, (4,), [1.0] * 4)),
    "layer_norm normalized_shape mismatch": (lambda: layernorm.layer_norm(X, (5,)),
                                             lambda: F.layer_norm(X, (5,))),
    "layer_norm empty normalized_shape": (lambda: layernorm.layer_norm(X, ()),
                                          lambda: F.layer_norm(X, ())),
    "layer_norm normalized_shape a str": (lambda: layernorm.layer_norm(X, "4"),
                                          lambda: F.layer_norm(X, "4")),
    "layer_norm eps a str": (lambda: layernorm.layer_norm(X, (4,), eps="1"),
                             lambda: F.layer_norm(X, (4,), eps="1")),
    "rms_norm integer input": (lambda: rmsnorm.rms_norm(X.long(), (4,)),
                               lambda: F.rms_norm(X.long(), (4,))),
    "rms_norm weight shape": (lambda: rmsnorm.rms_norm(X, (4,), torch.ones(5)),
                              lambda: F.rms_norm(X, (4,), torch.ones(5))),
    "rms_norm normalized_shape mismatch": (lambda: rmsnorm.rms_norm(X, (5,)),
                                           lambda: F.rms_norm(X, (5,))),
    "add_layer_norm residual shape": (
        lambda: add_layernorm.add_layer_norm(X, X[:, :2], (4,)),
        lambda: F.layer_norm(X + X[:, :2], (4,))),
    "softmax integer input": (lambda: softmax.softmax(X.long(), -1),
                              lambda: torch.softmax(X.long(), -1)),
    "softmax dim out of range": (lambda: softmax.softmax(X, 5), lambda: torch.softmax(X, 5)),
    "softmax dim a float": (lambda: softmax.softmax(X, 1.0), lambda: torch.softmax(X, 1.0)),
    "softmax integer dtype": (lambda: softmax.softmax(X, -1, dtype=torch.long),
                              lambda: torch.softmax(X, -1, dtype=torch.long)),
    "softmax dtype a str": (lambda: softmax.softmax(X, -1, dtype="float"),
                            lambda: torch.softmax(X, -1, dtype="float")),
    "gelu integer input": (lambda: gelu.gelu(X.long()), lambda: F.gelu(X.long())),
    "gelu bias shape": (lambda: gelu.gelu(X, bias=torch.ones(5, dtype=X.dtype)),
                        lambda: F.gelu(X + torch.ones(5, dtype=X.dtype))),
    "swiglu up shape": (lambda: swiglu.swiglu(X, X[:, :2]), lambda: F.silu(X) * X[:, :2]),
    "masked_softmax mask shape": (
        lambda: masked_softmax.masked_softmax(X, torch.zeros(2, 4, dtype=X.dtype)),
        lambda: torch.softmax(X + torch.zeros(2, 4, dtype=X.dtype), -1)),
    "bias_dropout_add p above 1": (
        lambda: bias_dropout_add.bias_dropout_add(X, X, p=1.5),
        lambda: X + F.dropout(X, 1.5)),
    "bias_dropout_add residual shape": (
        lambda: bias_dropout_add.bias_dropout_add(X, X[:, :2], p=0.0),
        lambda: X[:, :2] + F.dropout(X, 0.0)),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_errors_are_instances_of_torch_s_types(case):
    ours, theirs = BAD_CALLS[case]
    expected = type(torch_error(theirs))
    with pytest.raises(expected) as caught:
        ours()
    # and of what the checks raised before, where torch's type is RuntimeError or IndexError
    if issubclass(expected, (RuntimeError, IndexError)):
        assert isinstance(caught.value, (ValueError, TypeError)), caught.value


def test_error_classes_carry_both_types():
    assert issubclass(checks.ShapeError, ValueError) and issubclass(checks.ShapeError, RuntimeError)
    assert issubclass(checks.DeviceError, ValueError) and issubclass(checks.DeviceError,
                                                                      RuntimeError)
    assert issubclass(checks.DtypeError, TypeError) and issubclass(checks.DtypeError,
                                                                   NotImplementedError)
    assert issubclass(checks.DimError, ValueError) and issubclass(checks.DimError, IndexError)
    assert issubclass(checks.OptionError, ValueError) and issubclass(checks.OptionError,
                                                                     RuntimeError)
    assert issubclass(checks.ClassIndexError, ValueError) and issubclass(checks.ClassIndexError,
                                                                         IndexError)


# The interpreter's lanes past a row's end


@pytest.mark.skipif(HAS_CUDA, reason="the kernels were compiled for the GPU, not the interpreter")
def test_interpreted_kernels_compute_their_discarded_lanes_quietly(monkeypatch):
    # Triton's interpreter evaluates masked lanes too (a row block past the last row: log of an
    # empty sum, 1/0; a select's other branch: 0/0 in tanh at 0), as the GPU does, silently
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = randn((5, N), seed=1, dtype=torch.float32) * 3
    target = torch.tensor([0, 1, 2, 3, -100])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.testing.assert_close(cross_entropy(x, target, reduction="none"),
                                   F.cross_entropy(x, target, reduction="none"))
        torch.testing.assert_close(softmax.softmax(x, -1), torch.softmax(x, -1))
        torch.testing.assert_close(gelu.gelu(x, approximate="tanh"), F.gelu(x, approximate="tanh"))

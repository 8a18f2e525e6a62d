"""torch's signatures where the generated functions claim them: the same arguments, defaults,
results and, for a bad argument, an error of the type torch raises for it."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from reference import assert_matches_torch, randn

import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
from derive.__main__ import main

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

"""bias + GELU (exact and tanh), against torch.nn.functional.gelu(x + bias)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import (
    assert_low_precision_ok,
    assert_matches_torch,
    gradcheck,
    randn,
)

import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh

N = 37
OP = (gelu, gelu_tanh)  # the conftest's schedule fixture forces these looped
VARIANTS = {
    "erf": (gelu.gelu, lambda x, b=None: F.gelu(x if b is None else x + b)),
    "tanh": (gelu_tanh.gelu_tanh,
             lambda x, b=None: F.gelu(x if b is None else x + b, approximate="tanh")),
}



@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_torch(device, schedule, variant):
    ours, theirs = VARIANTS[variant]
    x = randn((4, 3, N), seed=1, device=device) * 3
    bias = randn((N,), seed=2, device=device)
    assert_matches_torch(lambda x, b: ours(x, bias=b), theirs, [x, bias])
    assert_matches_torch(lambda x: ours(x), theirs, [x])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradcheck(device, variant):
    ours, _ = VARIANTS[variant]
    gradcheck(lambda x, b: ours(x, bias=b),
              [randn((3, 5), seed=1, device=device), randn((5,), seed=2, device=device)],
              fast=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision(device, variant, dtype):
    ours, theirs = VARIANTS[variant]
    inputs = [randn((64, N), seed=1, device=device) * 2, randn((N,), seed=2, device=device)]
    assert_low_precision_ok(lambda x, b: ours(x, bias=b), theirs, inputs, dtype)


def test_any_shape_and_non_contiguous(device):
    x = randn((5, 6, 7), seed=1, device=device).transpose(0, 2)
    torch.testing.assert_close(gelu.gelu(x), F.gelu(x))
    scalar = randn((), seed=3, device=device)
    torch.testing.assert_close(gelu_tanh.gelu_tanh(scalar), F.gelu(scalar, approximate="tanh"))


def test_bad_bias_is_rejected(device):
    x = randn((2, N), device=device)
    with pytest.raises(ValueError, match="argument 'bias' must have shape"):
        gelu.gelu(x, bias=randn((N + 1,), device=device))
    with pytest.raises(TypeError, match="argument 'input' must have dtype"):
        gelu.gelu(torch.ones(2, 3, dtype=torch.int64, device=device))

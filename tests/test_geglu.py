"""geglu(approximate="tanh"): the tanh GELU's GeGLU (Gemma's MLP activation), selected as torch's
gelu selects its tanh form, against torch.nn.functional.gelu(gate, approximate="tanh") * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import assert_low_precision_ok, assert_matches_torch, gradcheck, randn

import generated.geglu as geglu
import generated.geglu_tanh as geglu_tanh

N = 37
OP = (geglu, geglu_tanh)  # the conftest's schedule fixture forces these looped


def ours(gate, up):
    return geglu.geglu(gate, up, approximate="tanh")


def theirs(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def test_tanh_matches_torch(device, schedule):
    inputs = [randn((4, 3, N), seed=1, device=device) * 3, randn((4, 3, N), seed=2, device=device)]
    assert_matches_torch(ours, theirs, inputs)
    # not the exact GELU's values: the tanh form is computed, not the erf one
    gate, up = inputs
    assert not torch.allclose(ours(gate, up), F.gelu(gate) * up, rtol=1e-9, atol=0)


def test_tanh_gradcheck(device):
    gradcheck(ours, [randn((3, 5), seed=1, device=device) * 2,
                     randn((3, 5), seed=2, device=device)], fast=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tanh_low_precision(device, dtype):
    inputs = [randn((64, N), seed=1, device=device) * 2, randn((64, N), seed=2, device=device)]
    assert_low_precision_ok(ours, theirs, inputs, dtype)


def test_approximate_values_as_torch(device):
    gate, up = randn((2, N), seed=1, device=device), randn((2, N), seed=2, device=device)
    torch.testing.assert_close(geglu.geglu(gate, up, approximate="none"), F.gelu(gate) * up)
    torch.testing.assert_close(geglu.geglu(gate, up, approximate="tanh"),
                               geglu_tanh.geglu_tanh(gate, up), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="argument 'approximate' must be one of 'none', "
                                           "'tanh', got 'erf'"):
        geglu.geglu(gate, up, approximate="erf")
    with pytest.raises(TypeError, match="argument 'approximate' must be str, not NoneType"):
        geglu.geglu(gate, up, approximate=None)
    with pytest.raises(TypeError):  # keyword-only, as torch's gelu
        geglu.geglu(gate, up, "tanh")


def test_module_takes_approximate():
    module = geglu.GeGLU(approximate="tanh")
    assert repr(module) == "GeGLU(approximate='tanh')"
    gate, up = randn((2, N), seed=1), randn((2, N), seed=2)
    torch.testing.assert_close(module(gate, up), theirs(gate, up))
    assert repr(geglu.GeGLU()) == "GeGLU(approximate='none')"

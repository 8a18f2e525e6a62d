"""swiglu's gate and down multipliers (Falcon-H1's MLP: up * silu(gate * gate_multiplier),
times down_multiplier), folded into the derived kernels, against torch's composition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import assert_low_precision_ok, assert_matches_torch, gradcheck, randn

import generated.swiglu as swiglu

N = 37
OP = swiglu  # the conftest's schedule fixture forces it looped
GATE, DOWN = 0.35, 1.75  # neither a power of two: a multiplier cannot hide in the rounding


def ours(gate, up):
    return swiglu.swiglu(gate, up, gate_multiplier=GATE, down_multiplier=DOWN)


def theirs(gate, up):
    return up * F.silu(gate * GATE) * DOWN


def test_multipliers_match_torch(device, schedule):
    inputs = [randn((4, 3, N), seed=1, device=device) * 3, randn((4, 3, N), seed=2, device=device)]
    assert_matches_torch(ours, theirs, inputs)


def test_multipliers_gradcheck(device):
    gradcheck(ours, [randn((3, 5), seed=1, device=device) * 2,
                     randn((3, 5), seed=2, device=device)], fast=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_multipliers_low_precision(device, dtype):
    inputs = [randn((64, N), seed=1, device=device) * 2, randn((64, N), seed=2, device=device)]
    assert_low_precision_ok(ours, theirs, inputs, dtype)


def test_each_multiplier_is_used(device):
    gate, up = randn((2, N), seed=1, device=device) * 2, randn((2, N), seed=2, device=device)
    torch.testing.assert_close(swiglu.swiglu(gate, up, gate_multiplier=GATE),
                               F.silu(gate * GATE) * up)
    torch.testing.assert_close(swiglu.swiglu(gate, up, down_multiplier=DOWN),
                               F.silu(gate) * up * DOWN)
    # the defaults change nothing: bit for bit the plain SwiGLU
    assert torch.equal(swiglu.swiglu(gate, up, gate_multiplier=1, down_multiplier=1.0),
                       swiglu.swiglu(gate, up))


def test_multiplier_arguments_are_checked(device):
    gate, up = randn((2, N), seed=1, device=device), randn((2, N), seed=2, device=device)
    with pytest.raises(TypeError, match="argument 'gate_multiplier' must be a real number, "
                                        "got str"):
        swiglu.swiglu(gate, up, gate_multiplier="2")
    with pytest.raises(TypeError, match="argument 'down_multiplier' must be a real number, "
                                        "got bool"):
        swiglu.swiglu(gate, up, down_multiplier=True)
    with pytest.raises(TypeError):  # keyword-only
        swiglu.swiglu(gate, up, GATE)


def test_module_holds_the_multipliers():
    module = swiglu.SwiGLU(gate_multiplier=GATE, down_multiplier=DOWN)
    assert repr(module) == f"SwiGLU(gate_multiplier={GATE}, down_multiplier={DOWN})"
    gate, up = randn((2, N), seed=1), randn((2, N), seed=2)
    torch.testing.assert_close(module(gate, up), theirs(gate, up))

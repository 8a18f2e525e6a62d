"""SwiGLU and GeGLU against torch compositions; finite far out on the sigmoid's tails."""

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

import generated.geglu as geglu
import generated.swiglu as swiglu
from codegen.runtime import launch

N = 37
OP = (swiglu, geglu)  # the conftest's schedule fixture forces these looped
VARIANTS = {
    "swiglu": (swiglu.swiglu, lambda gate, up: F.silu(gate) * up),
    "geglu": (geglu.geglu, lambda gate, up: F.gelu(gate) * up),
}



@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_torch(device, schedule, variant):
    ours, theirs = VARIANTS[variant]
    inputs = [randn((4, 3, N), seed=1, device=device) * 3, randn((4, 3, N), seed=2, device=device)]
    assert_matches_torch(ours, theirs, inputs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradcheck(device, variant):
    ours, _ = VARIANTS[variant]
    gradcheck(ours, [randn((3, 5), seed=1, device=device), randn((3, 5), seed=2, device=device)],
              fast=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision(device, variant, dtype):
    ours, theirs = VARIANTS[variant]
    inputs = [randn((64, N), seed=1, device=device) * 2, randn((64, N), seed=2, device=device)]
    assert_low_precision_ok(ours, theirs, inputs, dtype)


def test_swiglu_gradient_is_finite_on_the_tails(device):
    gate = torch.tensor([[-1000.0, -100.0, 0.0, 100.0, 1000.0]], dtype=torch.float32,
                        device=device, requires_grad=True)
    up = torch.ones_like(gate, requires_grad=True)
    y = swiglu.swiglu(gate, up)
    grads = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
    assert all(bool(g.isfinite().all()) for g in grads)
    expected = torch.autograd.grad(F.silu(gate) * up, (gate, up), torch.ones_like(y))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_inputs_must_match(device):
    gate = randn((2, N), device=device)
    with pytest.raises(ValueError, match="argument 'up' must have the shape of 'gate'"):
        swiglu.swiglu(gate, randn((2, N + 1), device=device))
    with pytest.raises(TypeError, match="argument 'up' must be a torch.Tensor, got NoneType"):
        geglu.geglu(gate, None)
    with pytest.raises(TypeError, match="argument 'gate' must have dtype"):
        swiglu.swiglu(torch.ones(2, 3, dtype=torch.int32, device=device), gate)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_fold_into_rows_of_the_fold_width(device, variant):
    """Elementwise-only launchers read contiguous rows whose width is not a multiple of
    fold_block_n as rows of fold_block_n (where the tensor tiles into them): the same values
    bit for bit, forward and backward; rows with a stride of their own are not folded."""
    module = swiglu if variant == "swiglu" else geglu
    forward = getattr(module, f"_{variant}_fwd")
    backward = getattr(module, f"_{variant}_bwd_default")
    gate, up, dy = (randn((6, 96), seed=seed, device=device) * 2 for seed in (1, 2, 3))
    # swiglu's launchers take its gate and down multipliers too
    scalars = (1.0, 1.0) if variant == "swiglu" else ()
    wide = randn((6, 128), seed=4, device=device)
    strided = wide[:, :96]  # rows 128 apart: no fold
    widths = []
    seam = module.SCHEDULES

    def recorded(M, N, *args):
        # the rule's schedule, with the row width each launch asked for kept
        widths.append(N)
        return seam.rule(M, N, *args)

    def run(fold):
        widths.clear()
        results = []
        with seam.override(fold_block_n=fold, choose=recorded):
            for launcher, args in ((forward, (gate, up, *scalars)),
                                   (backward, (dy, gate, up, *scalars)),
                                   (forward, (strided, up, *scalars))):
                seam.forget()  # each launch chooses: none takes an earlier one's schedule
                results += launcher(*args)
        return results, list(widths)

    unfolded, unfolded_widths = run(0)
    folded, folded_widths = run(64)  # 6 x 96 = 9 rows of 64
    if device.type == "cpu" and not launch.use_triton(gate):
        assert unfolded_widths == folded_widths == []  # the torch path: no kernels
    else:
        assert unfolded_widths == [96, 96, 96]
        assert folded_widths == [64, 64, 96]
    for got, want in zip(folded, unfolded, strict=True):
        assert got.shape == want.shape == (6, 96)
        assert torch.equal(got, want)
    expected = VARIANTS[variant][1](gate, up)
    torch.testing.assert_close(folded[0], expected)

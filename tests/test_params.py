"""Parameters as torch takes them: a 1-D weight or bias may be any strided view."""

import pytest
import torch
import torch.nn.functional as F
from reference import FP64_TOL, assert_matches_torch, randn

from generated import add_layernorm, bias_dropout_add, gelu, layernorm, rmsnorm

STRIDED_PARAM_CASES = {
    # op: (ours, torch's, how many 1-D parameters follow the input)
    "layer_norm": (lambda x, w, b: layernorm.layer_norm(x, (37,), w, b),
                   lambda x, w, b: F.layer_norm(x, (37,), w, b), 2),
    "rms_norm": (lambda x, w: rmsnorm.rms_norm(x, (37,), w, 1e-6),
                 lambda x, w: F.rms_norm(x, (37,), w, 1e-6), 1),
    "add_layer_norm": (
        lambda x, w, b: add_layernorm.add_layer_norm(x, x.flip(0), (37,), w, b),
        lambda x, w, b: F.layer_norm(x + x.flip(0), (37,), w, b), 2),
    "gelu": (lambda x, b: gelu.gelu(x, bias=b), lambda x, b: F.gelu(x + b), 1),
    "bias_dropout_add": (
        lambda x, b: bias_dropout_add.bias_dropout_add(x, x.flip(0), bias=b, training=False),
        lambda x, b: x + b + x.flip(0), 1),
}


@pytest.mark.parametrize("name", sorted(STRIDED_PARAM_CASES))
def test_strided_parameters(device, name):
    """A 1-D parameter that is a strided view (w[::2], a column of a matrix) reads its own
    elements: the kernels read parameters one element apart, so a strided one must be copied
    (before, layer_norm with weight[::2] was off by up to 5.4 on the CPU interpreter), and its
    gradient reaches the strided view's base."""
    ours, theirs, count = STRIDED_PARAM_CASES[name]
    x = randn((5, 37), seed=1, device=device)
    bases = [randn((37, 3), seed=2 + i, device=device) for i in range(count)]
    params = [base[:, 1] for base in bases]  # stride 3
    assert not any(p.is_contiguous() for p in params)
    assert_matches_torch(ours, theirs, [x, *params])
    dy = randn((5, 37), seed=9, device=device)
    grads = []
    for fn in (ours, theirs):
        leaves = [base.clone().requires_grad_() for base in bases]
        (fn(x, *[leaf[:, 1] for leaf in leaves]) * dy).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL)

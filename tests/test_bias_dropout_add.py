"""bias + dropout + residual add, against residual + torch.nn.functional.dropout(input + bias).

torch draws its dropout mask from its own generator, so every comparison with dropout on uses
the op's own keep mask (read off a call on ones with the same shape, p and seed) in the
reference; the keep mask itself is judged by its keep rate, its seeds and its two paths.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from reference import (
    HAS_CUDA,
    LOW_PRECISION_DTYPES,
    NON_CONTIGUOUS,
    assert_low_precision_ok,
    assert_matches_torch,
    assert_unseeded_calls_replay,
    force_looped,
    gradcheck,
    randn,
    select_path,
)

from generated import bias_dropout_add as bda_module
from generated.bias_dropout_add import BiasDropoutAdd, bias_dropout_add

OP = bda_module  # for the `schedule` fixture
N = 37  # three column blocks of the looped schedule
SEED = 1234
# 1/(1 - p) is exact in fp32 (scalar options reach the kernels as fp32), so fp64 comparisons
# with torch hold to fp64 tolerance.
EXACT_P = 0.5
BINOMIAL_SIGMAS = 5


def keep_mask(shape, p, seed, device):
    """The op's keep mask for a call of this shape, p and seed: the elements of ones it keeps."""
    ones = torch.ones(shape, dtype=torch.float64, device=device)
    return bias_dropout_add(ones, p=p, seed=seed) != 0


def pair(p=0.0, keep=None, training=True, seed=SEED):
    """(ours, theirs) of (input, residual, bias); theirs drops the elements off `keep`."""

    def ours(x, residual=None, bias=None):
        return bias_dropout_add(x, residual, bias=bias, p=p, training=training, seed=seed)

    def theirs(x, residual=None, bias=None):
        z = x if bias is None else x + bias
        if keep is not None:
            z = torch.where(keep, z / (1 - p), 0.0)
        return z if residual is None else residual + z

    return ours, theirs


def inputs(shape, device, *, residual=True, bias=True):
    return [
        randn(shape, seed=1, device=device),
        randn(shape, seed=2, device=device) if residual else None,
        randn(shape[-1:], seed=3, device=device) if bias else None,
    ]


def dropout_pair(shape, device, p=EXACT_P, seed=SEED):
    return pair(p, keep_mask(shape, p, seed, device), seed=seed)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("p", [0.0, EXACT_P])
def test_matches_torch(device, schedule, p, residual, bias):
    shape = (2, 3, N)
    ours, theirs = dropout_pair(shape, device, p) if p else pair()
    x, res, b = inputs(shape, device, residual=residual, bias=bias)
    assert_matches_torch(ours, theirs, [x, res, b])


@pytest.mark.parametrize("shape", [(N,), (3, N), (2, 3, 5), (2, 2, 3, 5)], ids=str)
def test_shapes(device, shape):
    assert_matches_torch(*dropout_pair(shape, device), inputs(shape, device))


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input_and_residual(device, schedule, view):
    x, residual, bias = inputs((5, N), device)
    to_view = NON_CONTIGUOUS[view]
    assert not to_view(x).is_contiguous()
    ours, theirs = dropout_pair((5, N), device)
    assert_matches_torch(
        lambda x, r, b: ours(to_view(x), to_view(r), b),
        lambda x, r, b: theirs(to_view(x), to_view(r), b),
        [x, residual, bias],
    )


def test_empty_input(device):
    x, _, _ = inputs((0, 8), device, residual=False, bias=False)
    assert_matches_torch(*dropout_pair(x.shape, device), [x])


def test_empty_input_with_residual_and_bias(device):
    # Like torch: the residual gets an empty gradient and the bias a zero one (an expert of a
    # mixture that got no tokens still has a bias gradient).
    x, residual, bias = (t.requires_grad_() for t in inputs((0, 8), device))
    out = bias_dropout_add(x, residual, bias=bias, p=0.5, seed=SEED)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8), "no gradient for 'input'"
    assert residual.grad is not None and residual.grad.shape == (0, 8), "no gradient for 'residual'"
    assert bias.grad is not None and torch.equal(bias.grad, torch.zeros_like(bias)), (
        f"gradient for 'bias': expected zeros, got {bias.grad}"
    )


def test_gradcheck(device):
    ours, _ = pair(EXACT_P)  # a fixed seed: the same mask on every evaluation
    gradcheck(ours, inputs((3, 5), device), fast=False)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, EXACT_P])
def test_low_precision(device, p, dtype):
    shape = (16, N)
    ours, theirs = dropout_pair(shape, device, p) if p else pair()
    assert_low_precision_ok(ours, theirs, inputs(shape, device), dtype)


def test_eval_low_precision(device):
    assert_low_precision_ok(pair(EXACT_P, training=False)[0], pair()[1],
                            inputs((16, N), device), torch.float16)


# Dropout off


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("off", ["p_zero", "eval"])
def test_no_dropout_is_exact_identity(device, off, dtype):
    x, residual, bias = (t.to(dtype) for t in inputs((6, N), device))
    ours = pair(0.0)[0] if off == "p_zero" else pair(EXACT_P, training=False)[0]
    # Computed in fp32 (fp64 for fp64) and rounded once.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (residual.to(acc) + (x.to(acc) + bias.to(acc))).to(dtype)
    assert torch.equal(ours(x, residual, bias), expected)


def test_eval_ignores_seed(device):
    x, residual, bias = inputs((3, N), device)
    first = bias_dropout_add(x, residual, bias=bias, p=0.5, training=False, seed=1)
    second = bias_dropout_add(x, residual, bias=bias, p=0.5, training=False)
    assert torch.equal(first, second)
    assert torch.equal(first, residual + (x + bias))


# The keep mask


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_binomial_bound(device, p):
    ones = torch.ones(64, 256, device=device)
    out = bias_dropout_add(ones, p=p, seed=SEED)
    kept = out != 0
    n = kept.numel()
    expected, sigma = n * (1 - p), math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - expected) <= BINOMIAL_SIGMAS * sigma
    # Every kept element is scaled by 1/(1 - p); p reaches the kernels as fp32.
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    assert not (kept == kept[0]).all(), "every row got the same mask"
    assert not (kept == kept[:, :1]).all(), "every column got the same mask"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_backward_uses_the_forward_mask(device, schedule, p, dtype):
    # y = residual + D(x + bias) with D linear, so d(input) = D(dy) bit for bit: the same keep
    # mask and the same scale 1/(1 - p) as the forward's.
    x, residual, bias = (t.to(dtype).requires_grad_() for t in inputs((5, N), device))
    out = bias_dropout_add(x, residual, bias=bias, p=p, seed=SEED)
    dy = randn(out.shape, seed=9, device=device, dtype=dtype)
    out.backward(dy)
    forward_of_dy = bias_dropout_add(dy, p=p, seed=SEED)
    ratio = (x.grad / forward_of_dy)[forward_of_dy != 0]
    assert torch.equal(x.grad, forward_of_dy), (
        f"d(input) / D(dy) spans [{ratio.min().item()!r}, {ratio.max().item()!r}], expected 1"
    )
    assert torch.equal(residual.grad, dy)
    torch.testing.assert_close(bias.grad, forward_of_dy.sum(0))
    kept = (out - residual).detach() != 0
    assert torch.equal(kept, x.grad != 0)


def test_nothing_is_saved_for_backward(device):
    x, residual, bias = (t.requires_grad_() for t in inputs((5, N), device))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bias_dropout_add(x, residual, bias=bias, p=0.5, seed=SEED)
    assert all(t.numel() < x.numel() for t in saved), [tuple(t.shape) for t in saved]


def test_same_seed_same_mask_other_seed_other_mask(device):
    shape = (8, N)
    assert torch.equal(keep_mask(shape, 0.5, 7, device), keep_mask(shape, 0.5, 7, device))
    assert not torch.equal(keep_mask(shape, 0.5, 7, device), keep_mask(shape, 0.5, 8, device))
    seed_tensor = torch.tensor(7, dtype=torch.int64)
    assert torch.equal(keep_mask(shape, 0.5, seed_tensor, device), keep_mask(shape, 0.5, 7, device))


def test_unseeded_call_draws_from_torch_generator(device):
    shape = (8, N)
    assert_unseeded_calls_replay(lambda: keep_mask(shape, 0.5, None, device), device)


def test_unseeded_backward_uses_its_forward_mask(device):
    x = torch.ones(8, N, device=device, requires_grad=True)
    out = bias_dropout_add(x, p=0.5)
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, out.detach())


def test_mask_does_not_depend_on_schedule(device, overrides):
    persistent = keep_mask((3, 40), 0.5, SEED, device)
    overrides.enter_context(force_looped(bda_module))
    assert torch.equal(keep_mask((3, 40), 0.5, SEED, device), persistent)


# The interpreter computes in the torch path's fp32; a GPU may round 1/(1 - p) differently.
PATH_TOL = {} if HAS_CUDA else {"rtol": 0.0, "atol": 0.0}


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_path_equals_torch_path(monkeypatch, schedule, p):
    results = {}
    for path in ("triton", "torch"):
        device = select_path(monkeypatch, path)
        x, residual, bias = (t.float().requires_grad_() for t in inputs((4, 3, N), device))
        out = bias_dropout_add(x, residual, bias=bias, p=p, seed=SEED)
        out.backward(randn(out.shape, seed=9, device=device, dtype=out.dtype))
        results[path] = [t.detach().cpu() for t in (out, x.grad, bias.grad)]
    (out, dx, dbias), (want_out, want_dx, want_dbias) = results["triton"], results["torch"]
    assert torch.equal(dx != 0, want_dx != 0), "the two paths drew different keep masks"
    torch.testing.assert_close(out, want_out, **PATH_TOL)
    torch.testing.assert_close(dx, want_dx, **PATH_TOL)
    torch.testing.assert_close(dbias, want_dbias)


# NaN


def test_nan_passes_through_without_dropout(device):
    x, residual, bias = inputs((3, N), device)
    x[1, 4] = float("nan")
    out = bias_dropout_add(x, residual, bias=bias, p=0.0)
    assert torch.equal(out.isnan(), (x + bias).isnan())


def test_nan_stays_nan_under_dropout_like_torch(device):
    # torch's dropout multiplies by its mask, so a dropped NaN stays NaN.
    x, residual, bias = inputs((3, N), device)
    x[1] = float("nan")
    out = bias_dropout_add(x, residual, bias=bias, p=0.5, seed=SEED)
    torch_out = residual + F.dropout(x + bias, 0.5)
    assert torch.equal(torch_out.isnan(), x.isnan())
    assert torch.equal(out.isnan(), torch_out.isnan()), f"row 1 of out: {out[1]}"


# Module


def test_module(device):
    x, residual, bias = inputs((4, N), device)
    module = BiasDropoutAdd(p=0.5)
    assert module.extra_repr() == "p=0.5"
    assert list(module.parameters()) == []
    assert torch.equal(module(x, residual, bias, seed=SEED),
                       bias_dropout_add(x, residual, bias=bias, p=0.5, seed=SEED))
    module.eval()
    assert torch.equal(module(x, residual, bias), residual + (x + bias))


# Bad input


BAD_CALLS = {
    "integer_input": (lambda x, r, b: bias_dropout_add(x.long()),
                      TypeError, "argument 'input' must have dtype"),
    "p_one": (lambda x, r, b: bias_dropout_add(x, p=1.0),
              ValueError, r"argument 'p' must be a probability in \[0, 1\), got 1.0"),
    "p_negative": (lambda x, r, b: bias_dropout_add(x, p=-0.1),
                   ValueError, "argument 'p' must be a probability"),
    "p_nan": (lambda x, r, b: bias_dropout_add(x, p=float("nan")),
              ValueError, "argument 'p' must be a probability"),
    "p_string": (lambda x, r, b: bias_dropout_add(x, p="0.1"),
                 TypeError, "argument 'p' must be a real number"),
    "residual_shape": (lambda x, r, b: bias_dropout_add(x, r[:, :-1]),
                       ValueError, "argument 'residual' must have the shape of 'input'"),
    "residual_dtype": (lambda x, r, b: bias_dropout_add(x, r.long()),
                       TypeError, "argument 'residual' must have dtype"),
    "bias_shape": (lambda x, r, b: bias_dropout_add(x, bias=b[:-1]),
                   ValueError, "argument 'bias' must have shape"),
    "bias_dtype": (lambda x, r, b: bias_dropout_add(x, bias=b.long()),
                   TypeError, "argument 'bias' must have dtype"),
    "training": (lambda x, r, b: bias_dropout_add(x, training=1),
                 TypeError, "argument 'training' must be a bool"),
    "seed_negative": (lambda x, r, b: bias_dropout_add(x, seed=-1),
                      ValueError, "argument 'seed' must be in"),
    "seed_float": (lambda x, r, b: bias_dropout_add(x, seed=1.5),
                   TypeError, "argument 'seed' must be an int or None"),
    "module_p": (lambda x, r, b: BiasDropoutAdd(p=1.5),
                 ValueError, "argument 'p' must be a probability"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    call, error, match = BAD_CALLS[case]
    x, residual, bias = inputs((4, 8), device)
    with pytest.raises(error, match=match):
        call(x, residual, bias)

"""Scaled masked softmax with dropout, against torch.softmax(scale * input + mask, -1).

A bool mask means keep (True); `causal` is torch's top-left aligned tril (is_causal). torch
gives NaN for a fully masked row, ours 0 with a 0 gradient, so those rows are judged apart.
Dropout is judged against torch with the op's own keep mask (read off a call on zeros).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from reference import (
    FP64_TOL,
    LOW_PRECISION_DTYPES,
    NON_CONTIGUOUS,
    assert_low_precision_ok,
    assert_matches_torch,
    assert_nan_stays_in_its_row,
    assert_unseeded_calls_replay,
    forward_backward,
    gradcheck,
    randn,
    select_path,
)

from generated import masked_softmax as masked_softmax_module
from generated.masked_softmax import MaskedSoftmax, masked_softmax

OP = masked_softmax_module  # for the `schedule` fixture
K = 37  # keys: three column blocks of the looped schedule
SEED = 1234
# Scalar options reach the kernels as fp32: scale 0.5 and dropout 0.5 (scale 1/(1 - p) = 2)
# are exact there, so fp64 comparisons with torch hold to fp64 tolerance.
SCALE = 0.5
EXACT_P = 0.5
BINOMIAL_SIGMAS = 5


def additive(mask, dtype):
    """A bool keep mask as 0 / -inf; a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def causal_mask(x):
    """torch's is_causal mask for x's last two dims (top-left aligned), True = keep; a 1-D x
    is one query."""
    queries = x.shape[-2] if x.dim() > 1 else 1
    mask = torch.ones(queries, x.shape[-1], dtype=torch.bool, device=x.device).tril()
    return mask if x.dim() > 1 else mask[0]


def keep_mask(shape, p, seed, device):
    """The op's dropout keep mask for a call of this shape, p and seed."""
    zeros = torch.zeros(shape, dtype=torch.float64, device=device)
    return masked_softmax(zeros, dropout_p=p, seed=seed) != 0


def pair(scale=SCALE, causal=False, p=0.0, keep=None, seed=SEED):
    """(ours, theirs) of (input, mask); theirs drops the probabilities off `keep`."""

    def ours(x, mask=None):
        return masked_softmax(x, mask, scale=scale, dropout_p=p, causal=causal, seed=seed)

    def theirs(x, mask=None):
        z = scale * x
        if mask is not None:
            z = z + additive(mask, x.dtype)
        if causal:
            z = z.masked_fill(~causal_mask(x), -math.inf)
        probs = torch.softmax(z, -1)
        return probs if keep is None else torch.where(keep, probs / (1 - p), 0.0)

    return ours, theirs


def dropout_pair(shape, device, causal=False, p=EXACT_P):
    return pair(causal=causal, p=p, keep=keep_mask(shape, p, SEED, device))


def check(ours, theirs, x, mask=None):
    """assert_matches_torch for the input's gradient (a mask is never differentiated)."""
    assert_matches_torch(ours, theirs, [x, mask], wrt=[0])


MASKS = {
    "none": None,
    "batch": (2, 1, 1, K),
    "heads_queries": (1, 3, 4, K),
    "queries_keys": (4, K),
    "keys": (K,),
    "full": (2, 3, 4, K),
    "broadcast_keys": (2, 1, 4, 1),
}


@pytest.mark.parametrize("mask_shape", MASKS)
def test_matches_torch(device, mask_shape):
    x = randn((2, 3, 4, K), seed=1, device=device) * 3
    shape = MASKS[mask_shape]
    mask = None if shape is None else randn(shape, seed=2, device=device)
    check(*pair(), x, mask)


@pytest.mark.parametrize("scale", [1.0, 0.125, -2.0])
def test_scale(device, scale):
    check(*pair(scale=scale), randn((3, 4, K), seed=1, device=device))


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, K), (4, K)], ids=str)
def test_bool_mask(device, mask_shape):
    x = randn((2, 3, 4, K), seed=1, device=device)
    mask = randn(mask_shape, seed=2, device=device) > -0.5
    assert mask.any(-1).all() and not mask.all()
    check(*pair(), x, mask)


def test_minus_inf_entries(device):
    x = randn((3, 4, K), seed=1, device=device)
    mask = randn((4, K), seed=2, device=device)
    mask[0, :20] = -math.inf
    mask[1, ::3] = -math.inf
    x[2, 2, 1:] = -math.inf  # a single live key, masked through the input
    x[:, 3, 5] = -math.inf
    check(*pair(), x, mask)


QK = [(5, 5), (3, K), (K, 3)]


@pytest.mark.parametrize("queries_keys", QK, ids=str)
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "mask"])
def test_causal(device, queries_keys, with_mask):
    queries, keys = queries_keys
    x = randn((2, queries, keys), seed=1, device=device)
    mask = randn((keys,), seed=2, device=device) if with_mask else None
    check(*pair(causal=True), x, mask)


@pytest.mark.parametrize("queries_keys", [(4, 6), (6, 4), (5, 5)], ids=str)
def test_causal_probabilities_match_sdpa(device, queries_keys):
    queries, keys = queries_keys
    q = randn((2, 3, queries, 8), seed=1, device=device)
    k = randn((2, 3, keys, 8), seed=2, device=device)
    # Values = identity: attention's output is its probabilities.
    v = torch.eye(keys, dtype=q.dtype, device=device).expand(2, 3, keys, keys)
    probs = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    torch.testing.assert_close(masked_softmax(q @ k.mT, scale=SCALE, causal=True), probs,
                               **FP64_TOL)


def kill_rows(x, mask, how):
    """(x, mask, dead): rows (0, 1) and (1, 0) of a (2, Q, K) x fully masked, by the mask
    ("additive" -inf or "bool" False) or by the input itself (-inf)."""
    dead = torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    dead[0, 1] = dead[1, 0] = True
    if how == "bool":
        mask = torch.ones(mask.shape, dtype=torch.bool, device=x.device)
    target = x if how == "input" else mask
    target[dead] = False if how == "bool" else -math.inf
    return x, mask, dead


def assert_dead_rows_zero(x, mask, dead, p=0.0):
    """Dead rows give 0 and a 0 gradient; live rows match torch (whose dead rows are NaN)."""
    ours, theirs = dropout_pair(x.shape, x.device, p=p) if p else pair()
    out, dx, _ = forward_backward(ours, [x, mask], wrt=[0])
    assert torch.equal(out[dead], torch.zeros_like(out[dead])), out[dead]
    assert torch.equal(dx[dead], torch.zeros_like(dx[dead])), dx[dead]
    # Rows are independent: torch's NaN rows do not reach the live ones.
    want_out, want_dx, _ = forward_backward(theirs, [x, mask], wrt=[0])
    torch.testing.assert_close(out[~dead], want_out[~dead], **FP64_TOL)
    torch.testing.assert_close(dx[~dead], want_dx[~dead], **FP64_TOL)


@pytest.mark.parametrize("p", [0.0, EXACT_P])
@pytest.mark.parametrize("how", ["additive", "bool", "input"])
def test_fully_masked_rows_give_zero_and_zero_grad(device, how, p):
    x, mask, dead = kill_rows(randn((2, 4, K), seed=1, device=device),
                              randn((2, 4, K), seed=2, device=device), how)
    assert_dead_rows_zero(x, mask, dead, p)


def test_all_rows_masked(device):
    x = randn((3, 4, K), seed=1, device=device).requires_grad_()
    out = masked_softmax(x, torch.zeros(K, dtype=torch.bool, device=device))
    out.backward(torch.ones_like(out))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(x.grad, torch.zeros_like(x))


# Both schedules, on few rows: the interpreter runs a looped row block by block.


def schedule_case(case, device):
    """(ours, theirs, x, mask) of a (2, 2, K) input for test_schedules."""
    x, mask = randn((2, 2, K), seed=1, device=device) * 3, randn((2, 1, K), seed=2, device=device)
    if case == "broadcast_mask":
        return (*pair(), x, mask)
    if case == "bool_mask":
        return (*pair(), x, mask > -0.5)
    if case == "minus_inf":
        mask[0, 0, :20] = -math.inf  # a whole leading block of the looped schedule
        x[1, 1, 1:] = -math.inf  # a single live key, masked through the input
        return (*pair(), x, mask)
    if case == "causal":
        return (*pair(causal=True), x, mask)
    if case == "dropout":
        return (*dropout_pair(x.shape, device, causal=True), x, mask)
    view = NON_CONTIGUOUS["row_stride_2n"]
    ours, theirs = pair(causal=True)
    return (lambda x, m: ours(view(x), view(m)), lambda x, m: theirs(view(x), view(m)),
            x, randn((2, K), seed=2, device=device))


@pytest.mark.parametrize(
    "case", ["broadcast_mask", "bool_mask", "minus_inf", "causal", "dropout", "strided_rows"])
def test_schedules(device, schedule, case):
    ours, theirs, x, mask = schedule_case(case, device)
    check(ours, theirs, x, mask)


def test_schedules_fully_masked_rows(device, schedule):
    x, mask, dead = kill_rows(randn((2, 2, K), seed=1, device=device),
                              randn((2, 2, K), seed=2, device=device), "additive")
    assert_dead_rows_zero(x, mask, dead, EXACT_P)


def test_schedules_low_precision(device, schedule):
    mask = randn((K,), seed=2, device=device, dtype=torch.bfloat16)
    _, theirs = pair()
    assert_low_precision_ok(lambda x: masked_softmax(x, mask, scale=SCALE),
                            lambda x: theirs(x, mask),
                            [randn((3, K), seed=1, device=device) * 6], torch.bfloat16)


# Dropout


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_torch_with_the_ops_mask(device, causal):
    x = randn((2, 3, K), seed=1, device=device)
    check(*dropout_pair(x.shape, device, causal=causal), x, randn((K,), seed=2, device=device))


def test_backward_uses_saved_probabilities_only(device):
    x = randn((2, 3, K), seed=1, device=device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        masked_softmax(x, scale=SCALE, dropout_p=EXACT_P, seed=SEED)
    (probs,) = [t for t in saved if t.numel() == x.numel()]
    assert torch.equal(probs.reshape(x.shape), masked_softmax(x.detach(), scale=SCALE))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_binomial_bound(device, p):
    zeros = torch.zeros(64, 256, device=device)
    out = masked_softmax(zeros, dropout_p=p, seed=SEED)
    kept = out != 0
    n = kept.numel()
    expected, sigma = n * (1 - p), math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - expected) <= BINOMIAL_SIGMAS * sigma
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 256 / (1 - p)))
    assert not (kept == kept[0]).all(), "every row got the same mask"


def test_dropout_off_is_exact(device):
    x, mask = randn((3, 4, K), seed=1, device=device), randn((K,), seed=2, device=device)
    plain = masked_softmax(x, mask, causal=True)
    assert torch.equal(masked_softmax(x, mask, causal=True, dropout_p=0.5, training=False), plain)
    assert torch.equal(masked_softmax(x, mask, causal=True, dropout_p=0.0, seed=3), plain)


def test_seeds(device):
    shape = (8, K)
    assert torch.equal(keep_mask(shape, 0.5, 7, device), keep_mask(shape, 0.5, 7, device))
    assert not torch.equal(keep_mask(shape, 0.5, 7, device), keep_mask(shape, 0.5, 8, device))
    assert_unseeded_calls_replay(lambda: keep_mask(shape, 0.5, None, device), device)


def test_unseeded_backward_uses_its_forward_mask(device):
    x = torch.zeros(8, K, dtype=torch.float64, device=device, requires_grad=True)
    out = masked_softmax(x, dropout_p=EXACT_P)
    dy = randn(out.shape, seed=9, device=device)
    out.backward(dy)
    # softmax's backward at uniform probabilities 1/K: dx = (D(dy) - mean(D(dy))) / K.
    dropped_dy = torch.where(out.detach() != 0, dy / (1 - EXACT_P), 0.0)
    expected = (dropped_dy - dropped_dy.mean(-1, keepdim=True)) / K
    torch.testing.assert_close(x.grad, expected, **FP64_TOL)


def test_triton_path_draws_the_torch_paths_mask(monkeypatch, schedule):
    results = {}
    for path in ("triton", "torch"):
        device = select_path(monkeypatch, path)
        x = randn((2, 3, K), seed=1, device=device, dtype=torch.float32).requires_grad_()
        out = masked_softmax(x, scale=SCALE, dropout_p=0.1, causal=True, seed=SEED)
        out.backward(randn(out.shape, seed=9, device=device, dtype=out.dtype))
        results[path] = [t.detach().cpu() for t in (out, x.grad)]
    (out, dx), (want_out, want_dx) = results["triton"], results["torch"]
    assert torch.equal(out != 0, want_out != 0), "the two paths drew different keep masks"
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(dx, want_dx)


# Gradients, precision, layouts


def test_gradcheck(device):
    mask = randn((3, 4), seed=2, device=device)
    ours, _ = pair(causal=True, p=EXACT_P)  # a fixed seed: the same mask on every evaluation
    gradcheck(lambda x: ours(x, mask), [randn((2, 3, 4), seed=1, device=device)], fast=False)


LOW_PRECISION_CASES = {
    "mask": {},
    "causal": {"causal": True},
    "eval_dropout": {"p": EXACT_P, "training": False},
}
# Not causal in bf16: rows of two or three keys have probabilities near 1/2, which the Triton
# interpreter's bf16 store (truncation, see reference.py) of the saved probabilities errs by up
# to 2^-8; the torch baseline, rounded only at the end, does not model that (emulating the
# truncation in torch gives the same error, 2.6e-3, and the torch path's error is 5e-4).
LOW_PRECISION_PARAMS = [
    (case, dtype) for case in LOW_PRECISION_CASES for dtype in LOW_PRECISION_DTYPES
    if (case, dtype) != ("causal", torch.bfloat16)
]


@pytest.mark.parametrize(("case", "dtype"), LOW_PRECISION_PARAMS, ids=str)
def test_low_precision(device, case, dtype):
    options = LOW_PRECISION_CASES[case]
    mask = randn((K,), seed=2, device=device, dtype=dtype)
    mask[3] = -math.inf
    _, theirs = pair(causal=options.get("causal", False))

    def ours(x):
        return masked_softmax(x, mask, scale=SCALE, causal=options.get("causal", False),
                              dropout_p=options.get("p", 0.0),
                              training=options.get("training", True), seed=SEED)

    assert_low_precision_ok(ours, lambda x: theirs(x, mask),
                            [randn((8, K), seed=1, device=device) * 6], dtype)


SHAPES = {
    "1d": ((K,), (K,)),
    "2d": ((4, K), (4, 1)),
    "3d": ((2, 4, 5), (4, 5)),
    "4d": ((2, 3, 4, 5), (2, 1, 4, 5)),
    "5d_merged_leading": ((2, 2, 3, 4, 5), (2, 1, 3, 1, 5)),
    "5d_broadcast_leading": ((2, 2, 3, 4, 5), (1, 2, 1, 4, 5)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(device, shape, causal):
    x_shape, mask_shape = SHAPES[shape]
    x, mask = randn(x_shape, seed=1, device=device), randn(mask_shape, seed=2, device=device)
    check(*pair(causal=causal), x, mask)


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input_and_mask(device, view):
    x, mask = randn((2, 5, K), seed=1, device=device), randn((5, K), seed=2, device=device)
    to_view = NON_CONTIGUOUS[view]
    assert not to_view(x).is_contiguous() and not to_view(mask).is_contiguous()
    ours, theirs = pair()
    check(lambda x, m: ours(to_view(x), to_view(m)), lambda x, m: theirs(to_view(x), to_view(m)),
          x, mask)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (2, 3, 0)], ids=str)
def test_empty_input(device, shape):
    mask = randn(shape[-1:], seed=2, device=device)
    check(*pair(causal=True), randn(shape, seed=1, device=device), mask)


def test_nan_stays_in_its_row(device, schedule):
    mask = randn((K,), seed=2, device=device)
    ours, theirs = pair()
    assert_nan_stays_in_its_row(lambda x: ours(x, mask), lambda x: theirs(x, mask),
                                [randn((3, K), seed=1, device=device)], (1, 30))


# Module


def test_module(device):
    x, mask = randn((2, 4, K), seed=1, device=device), randn((K,), seed=2, device=device)
    module = MaskedSoftmax(scale=SCALE, dropout_p=EXACT_P, causal=True)
    assert module.extra_repr() == "scale=0.5, dropout_p=0.5, causal=True"
    assert list(module.parameters()) == []
    options = {"scale": SCALE, "causal": True}
    assert torch.equal(module(x, mask, seed=SEED),
                       masked_softmax(x, mask, dropout_p=EXACT_P, seed=SEED, **options))
    module.eval()
    assert torch.equal(module(x, mask), masked_softmax(x, mask, **options))


# Bad input


def grad_mask(x):
    return torch.zeros(x.shape[-1:], dtype=x.dtype, device=x.device, requires_grad=True)


BAD_CALLS = {
    "integer_input": (lambda x: masked_softmax(x.long()),
                      TypeError, "argument 'input' must have dtype"),
    "dropout_one": (lambda x: masked_softmax(x, dropout_p=1.0),
                    ValueError, r"argument 'dropout_p' must be a probability in \[0, 1\)"),
    "dropout_negative": (lambda x: masked_softmax(x, dropout_p=-0.5),
                         ValueError, "argument 'dropout_p' must be a probability"),
    "mask_wrong_keys": (lambda x: masked_softmax(x, torch.zeros(9, device=x.device)), ValueError,
                        "argument 'mask' must be broadcastable to the shape of 'input'"),
    "mask_wrong_queries": (lambda x: masked_softmax(x, torch.zeros(3, 8, device=x.device)),
                           ValueError, "argument 'mask' must be broadcastable"),
    "mask_more_dims": (lambda x: masked_softmax(x, torch.zeros(2, 1, 4, 8, device=x.device)),
                       ValueError, "argument 'mask' must be broadcastable"),
    "mask_requires_grad": (lambda x: masked_softmax(x, grad_mask(x)),
                           ValueError, "argument 'mask' is not differentiated here"),
    "mask_integer": (lambda x: masked_softmax(x, torch.zeros(8, device=x.device).long()),
                     TypeError, "argument 'mask' must have dtype .* or bool, got torch.int64"),
    "mask_not_tensor": (lambda x: masked_softmax(x, [0.0] * 8),
                        TypeError, "argument 'mask' must be a torch.Tensor or None"),
    "causal": (lambda x: masked_softmax(x, causal=1),
               TypeError, "argument 'causal' must be a bool"),
    "training": (lambda x: masked_softmax(x, training="yes"),
                 TypeError, "argument 'training' must be a bool"),
    "scale": (lambda x: masked_softmax(x, scale="1"),
              TypeError, "argument 'scale' must be a real number"),
    "module_dropout": (lambda x: MaskedSoftmax(dropout_p=2.0),
                       ValueError, "argument 'dropout_p' must be a probability"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    call, error, match = BAD_CALLS[case]
    with pytest.raises(error, match=match):
        call(randn((2, 4, 8), device=device))

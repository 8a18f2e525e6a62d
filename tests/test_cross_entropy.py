"""Cross-entropy over the last dim (class_dim=-1), against torch.nn.functional.cross_entropy on
the rows; torch's own layouts and arguments are tested in test_torch_api.py."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import (
    FP64_TOL,
    HAS_CUDA,
    LOW_PRECISION_DTYPES,
    NON_CONTIGUOUS,
    assert_low_precision_ok,
    assert_matches_torch,
    gradcheck,
    randn,
)

from codegen.runtime import losses
from generated import cross_entropy as cross_entropy_module
from generated.cross_entropy import CrossEntropyLoss, cross_entropy

OP = cross_entropy_module  # for the `schedule` fixture
V = 37  # classes: three column blocks of the looped schedule
IGNORE = -100
# label_smoothing reaches the kernels as fp32: 0.25 is exact there, so fp64 comparisons with
# torch hold to fp64 tolerance.
SMOOTHING = 0.25
REDUCTIONS = ("none", "mean", "sum")


def targets(shape, classes, device, *, ignored=(), ignore_index=IGNORE, seed=5):
    """Seeded class indices of `shape`, with ignore_index at the flat positions `ignored`."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, tuple(shape), generator=gen)
    target.view(-1)[list(ignored)] = ignore_index
    return target.to(device)


def pair(target, view=lambda x: x, **options):
    """(ours, theirs): the cross-entropy of view(input) against `target`; theirs flattens
    the rows and runs torch's (rows, classes) form."""

    def ours(x):
        return cross_entropy(view(x), target, class_dim=-1, **options)

    def theirs(x):
        x = view(x)
        loss = F.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1).long(), **options)
        return loss.reshape(target.shape) if options.get("reduction") == "none" else loss

    return ours, theirs


@pytest.mark.parametrize("label_smoothing", [0.0, SMOOTHING])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_torch(device, schedule, reduction, label_smoothing):
    x = randn((4, V), seed=1, device=device) * 3
    target = targets((4,), V, device, ignored=[2])
    ours, theirs = pair(target, reduction=reduction, label_smoothing=label_smoothing)
    assert_matches_torch(ours, theirs, [x])


@pytest.mark.parametrize("shape", [(V,), (4, V), (2, 3, V), (2, 2, 3, 5)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shapes(device, shape, reduction):
    x = randn(shape, seed=1, device=device)
    target = targets(shape[:-1], shape[-1], device)
    assert_matches_torch(*pair(target, reduction=reduction, label_smoothing=SMOOTHING), [x])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_3d_equals_torch_on_the_class_dim(device, reduction):
    # (B, T, V) logits are torch's (B, V, T) input with its class dim moved last.
    x = randn((2, 3, V), seed=1, device=device)
    target = targets((2, 3), V, device, ignored=[4])

    def theirs(x):
        return F.cross_entropy(x.transpose(1, 2), target, reduction=reduction)

    assert_matches_torch(lambda x: cross_entropy(x, target, reduction=reduction, class_dim=-1),
                         theirs, [x])


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input(device, schedule, view):
    x = randn((5, V), seed=1, device=device)
    assert not NON_CONTIGUOUS[view](x).is_contiguous()
    target = targets((5,), V, device, ignored=[1])
    assert_matches_torch(*pair(target, view=NON_CONTIGUOUS[view], label_smoothing=SMOOTHING), [x])


def test_large_vocab_takes_the_looped_kernel(device):
    rows, classes = 3, 40000
    schedule = cross_entropy_module.SCHEDULES.choose(rows, classes, False, "fwd", 1, 4, device)
    assert schedule.looped, "the vocabulary no longer forces the looped kernel"
    x = randn((rows, classes), seed=1, device=device) * 3
    target = torch.tensor([0, classes - 1, 12345], device=device)
    assert_matches_torch(*pair(target, label_smoothing=SMOOTHING), [x])


# ignore_index


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_index(device, reduction):
    # A class index may be ignored too; its rows give 0 and do not count in the mean.
    x = randn((6, V), seed=1, device=device)
    target = targets((6,), V, device, ignored=[0, 3], ignore_index=3)
    options = {"ignore_index": 3, "label_smoothing": SMOOTHING, "reduction": reduction}
    assert_matches_torch(*pair(target, **options), [x])
    x = x.clone().requires_grad_()
    losses = cross_entropy(x, target, **{**options, "reduction": "none"})
    losses.sum().backward()
    ignored = target == 3
    assert torch.equal(losses[ignored], torch.zeros_like(losses[ignored]))
    assert torch.equal(x.grad[ignored], torch.zeros_like(x.grad[ignored]))
    if reduction == "mean":
        mean = cross_entropy(x.detach(), target, **options)
        torch.testing.assert_close(mean, losses.detach().sum() / 4, **FP64_TOL)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored_like_torch(device, reduction):
    # torch: the mean is 0/0 = NaN, the sum 0, and every gradient 0.
    x = randn((3, V), seed=1, device=device)
    target = torch.full((3,), IGNORE, device=device)
    assert_matches_torch(*pair(target, reduction=reduction), [x])


def test_int32_target(device):
    x = randn((4, V), seed=1, device=device)
    target = targets((4,), V, device, ignored=[1])
    for reduction in REDUCTIONS:
        want = cross_entropy(x, target, reduction=reduction)
        assert torch.equal(cross_entropy(x, target.int(), reduction=reduction), want)


def test_gradcheck(device):
    target = targets((3,), 5, device, ignored=[1])
    ours, _ = pair(target, label_smoothing=SMOOTHING)
    gradcheck(ours, [randn((3, 5), seed=1, device=device)], fast=False)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_low_precision(device, reduction, dtype):
    target = targets((16,), V, device, ignored=[3])
    ours, theirs = pair(target, reduction=reduction, label_smoothing=SMOOTHING)
    assert_low_precision_ok(ours, theirs, [randn((16, V), seed=1, device=device) * 3], dtype)


def test_low_precision_looped(device, schedule):
    target = targets((4,), V, device)
    ours, theirs = pair(target, reduction="none")
    assert_low_precision_ok(ours, theirs, [randn((4, V), seed=1, device=device) * 3],
                            torch.bfloat16)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_input(device, reduction):
    x = randn((0, V), seed=1, device=device)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    assert_matches_torch(*pair(target, reduction=reduction), [x])


# Non-finite logits


def test_nan_gives_nan_in_its_row(device, schedule):
    x = randn((3, V), seed=1, device=device)
    x[1, 30] = math.nan
    target = targets((3,), V, device)
    losses = cross_entropy(x, target, reduction="none")
    assert losses[1].isnan() and losses[[0, 2]].isfinite().all(), losses
    assert cross_entropy(x, target).isnan()
    assert_matches_torch(*pair(target, reduction="none"), [x])


@pytest.mark.parametrize("label_smoothing", [0.0, SMOOTHING])
def test_minus_inf_logit_like_torch(device, label_smoothing):
    # A class masked out with -inf (e.g. padded vocabulary entries): without smoothing torch's
    # loss stays finite; with smoothing its mean over classes is -inf and the loss +inf.
    x = randn((3, V), seed=1, device=device)
    x[:, 20:] = -math.inf
    target = targets((3,), 20, device)
    ours, theirs = pair(target, reduction="none", label_smoothing=label_smoothing)
    assert theirs(x).isfinite().all() == (label_smoothing == 0)
    assert_matches_torch(ours, theirs, [x])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_in_an_ignored_row_like_torch(device, reduction):
    # torch selects, never multiplies, the ignored rows: NaN logits there do not reach the loss.
    x = randn((3, V), seed=1, device=device)
    x[1] = math.nan
    target = targets((3,), V, device, ignored=[1])
    ours, theirs = pair(target, reduction=reduction)
    assert theirs(x).isfinite().all()
    torch.testing.assert_close(ours(x), theirs(x), equal_nan=True, **FP64_TOL)


# Module


def test_module_matches_torch(device):
    x = randn((6, V), seed=1, device=device)
    target = targets((6,), V, device, ignored=[2], ignore_index=3)
    options = {"ignore_index": 3, "label_smoothing": SMOOTHING, "reduction": "sum"}
    module = CrossEntropyLoss(**options)
    assert module.extra_repr() == "ignore_index=3, label_smoothing=0.25, reduction='sum'"
    assert list(module.parameters()) == []
    assert_matches_torch(lambda x: module(x, target),
                         lambda x: torch.nn.CrossEntropyLoss(**options)(x, target), [x])


# Bad input


def target_of(x):
    return torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device)


BAD_CALLS = {
    "integer_input": (lambda x: cross_entropy(x.long(), target_of(x)),
                      TypeError, "argument 'input' must have dtype"),
    "zero_dim_input": (lambda x: cross_entropy(x[0, 0], target_of(x)[0]),
                       ValueError, "argument 'input' must have at least 1 dim"),
    "float_target": (lambda x: cross_entropy(x, target_of(x).float()),
                     TypeError, "argument 'target' must hold integer class indices"),
    "bool_target": (lambda x: cross_entropy(x, target_of(x).bool()),
                    TypeError, "argument 'target' must hold integer class indices"),
    "target_shape": (lambda x: cross_entropy(x, target_of(x)[:-1]),
                     ValueError, r"argument 'target' must have shape input.shape without its "
                                 r"class dim 1 = \[4\], got \[3\]"),
    "target_of_2d_logits_shape": (lambda x: cross_entropy(x, target_of(x)[:, None]),
                                  ValueError, "argument 'target' must have shape"),
    "target_not_tensor": (lambda x: cross_entropy(x, [0, 1, 2, 3]),
                          TypeError, "argument 'target' must be a torch.Tensor"),
    "reduction": (lambda x: cross_entropy(x, target_of(x), reduction="avg"), ValueError,
                  "argument 'reduction' must be one of 'none', 'mean', 'sum', got 'avg'"),
    "label_smoothing_large": (lambda x: cross_entropy(x, target_of(x), label_smoothing=1.5),
                              ValueError, r"argument 'label_smoothing' must be in \[0, 1\]"),
    "label_smoothing_negative": (lambda x: cross_entropy(x, target_of(x), label_smoothing=-0.1),
                                 ValueError, "argument 'label_smoothing' must be in"),
    "ignore_index_fraction": (lambda x: cross_entropy(x, target_of(x), ignore_index=1.5),
                              TypeError, "argument 'ignore_index' must be an int"),
    "module_reduction": (lambda x: CrossEntropyLoss(reduction="batchmean"),
                         ValueError, "argument 'reduction' must be one of"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    call, error, match = BAD_CALLS[case]
    with pytest.raises(error, match=match):
        call(randn((4, 8), device=device))


# class indices out of range: CPU tensors raise at once; on CUDA the check runs on the device
# (no host sync), as torch's own CUDA loss does, and fails the next synchronising call
BAD_CLASSES = {
    "target_too_large": (8, r"argument 'target' must hold class indices in \[0, 8\)"
                            r" or ignore_index \(-100\), got 8"),
    "target_negative": (-1, "argument 'target' must hold class indices .* got -1"),
}


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("case", BAD_CLASSES)
def test_class_out_of_range_is_rejected_on_cpu(monkeypatch, case, interpret):
    # checked by the torch path, or (interpret) by the Triton kernel that CUDA tensors take
    if interpret and HAS_CUDA:
        pytest.skip("the kernels were compiled for the GPU, not the interpreter")
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    shift, match = BAD_CLASSES[case]
    x = randn((4, 8), device=torch.device("cpu"))
    with pytest.raises(ValueError, match=match):
        cross_entropy(x, target_of(x) + shift)


def test_targets_are_counted_and_checked_over_several_steps(device, monkeypatch):
    # the target statistics and the mean kernels step over 4 rows at a time here: a mean over
    # rows in three steps (and its gradient), and a class out of range in the last one only
    # (the runtime's public step sizes: `check_target` and `CountedMean` take no other)
    monkeypatch.setattr(losses, "TARGET_STATS_BLOCK", 4)
    monkeypatch.setattr(losses, "COUNTED_MEAN_BLOCK", 4)
    x = randn((11, V), device=device).requires_grad_()
    target = targets((11,), V, device, ignored=[0, 5, 10])
    loss = cross_entropy(x, target)
    expected = F.cross_entropy(x, target, ignore_index=IGNORE)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0],
                               torch.autograd.grad(expected, x)[0])
    target[9] = V
    if device.type == "cpu":
        with pytest.raises(ValueError, match=f"got {V}"):
            cross_entropy(x, target)


@pytest.mark.skipif(not HAS_CUDA, reason="the device-side check needs a CUDA device")
@pytest.mark.parametrize("case", BAD_CLASSES)
def test_class_out_of_range_fails_on_cuda(case):
    # a device-side assert leaves the CUDA context unusable: run it in a process of its own
    shift = BAD_CLASSES[case][0]
    script = (
        "import torch\n"
        "from generated.cross_entropy import cross_entropy\n"
        "x = torch.randn(4, 8, device='cuda')\n"
        f"target = torch.tensor([0, 1, 2, 3], device='cuda') + {shift}\n"
        "loss = cross_entropy(x, target)\n"
        "torch.cuda.synchronize()\n"
        "print('no error')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout
    assert "device-side assert" in result.stderr, result.stderr[-2000:]

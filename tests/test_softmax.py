"""Numerics of generated.softmax against torch.softmax."""

import pytest
import torch
from reference import (
    BAD_INPUT,
    LOW_PRECISION_DTYPES,
    NON_CONTIGUOUS,
    BadCall,
    assert_bad_call_rejected,
    assert_low_precision_ok,
    assert_matches_torch,
    assert_nan_stays_in_its_row,
    force_looped,
    gradcheck,
    randn,
)

from generated import softmax

OP = softmax  # for the `schedule` fixture


def pair(dim=-1, view=lambda x: x):
    """(ours, theirs): softmax of view(input) over `dim`."""

    def ours(x):
        return softmax.softmax(view(x), dim)

    def theirs(x):
        return torch.softmax(view(x), dim)

    return ours, theirs


def inputs(shape, device):
    return [randn(shape, device=device)]


@pytest.mark.parametrize("n", [1, 5, 37, 128])
def test_matches_torch(device, n):
    assert_matches_torch(*pair(), inputs((3, n), device))


@pytest.mark.parametrize("n", [16, 17, 32, 37, 100])
def test_looped_schedule_matches_torch(device, overrides, n):
    overrides.enter_context(force_looped(softmax))
    assert_matches_torch(*pair(), inputs((3, n), device))


def test_dim_defaults_to_last(device):
    assert_matches_torch(softmax.softmax, pair(-1)[1], inputs((2, 3, 37), device))


def test_many_row_blocks(device):
    # Persistent rows, many per program, in more row blocks than grid-stride programs.
    assert_matches_torch(*pair(), inputs((600, 100), device))


def test_zero_dim_input(device):
    assert_matches_torch(*pair(0), inputs((), device))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_dim_of_3d_input(device, schedule, dim):
    # Rows of 17 and 18 elements: the looped schedule runs them in two blocks.
    assert_matches_torch(*pair(dim), inputs((17, 18, 2), device))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_result_is_contiguous_as_torch_s(device, dim):
    # whatever `dim` and the input's strides: a caller may .view() it as torch's
    x = torch.randn(5, 6, 4, device=device, dtype=torch.float64).permute(2, 1, 0)
    got, want = softmax.softmax(x, dim), torch.softmax(x, dim)
    assert got.is_contiguous() and got.stride() == want.stride()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input(device, schedule, view):
    (x,) = inputs((5, 37), device)
    assert not NON_CONTIGUOUS[view](x).is_contiguous()
    assert_matches_torch(*pair(view=NON_CONTIGUOUS[view]), [x])


def test_gradcheck_fast(device, schedule):
    gradcheck(pair()[0], inputs((4, 37), device), fast=True)


def test_gradcheck_full(device):
    gradcheck(pair()[0], inputs((2, 3), device), fast=False)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
def test_low_precision_against_fp64(device, schedule, dtype):
    # Scaled up so that rows are peaked and exp spans a wide range.
    (x,) = inputs((24, 100), device)
    assert_low_precision_ok(*pair(), [3 * x], dtype)


@pytest.mark.parametrize("trend", [40.0, -40.0])
def test_looped_rows_whose_max_moves_between_blocks_in_fp32(device, overrides, trend):
    # The looped forward keeps a running max and rescales its sum when the max grows
    # (codegen/fuse.py): rows that climb (or fall) by `trend` per column block, far beyond
    # exp's fp32 range over the row
    overrides.enter_context(force_looped(softmax))
    (x,) = inputs((4, 70), device)
    steps = torch.arange(70, device=device, dtype=x.dtype) // 16 * trend
    assert_low_precision_ok(*pair(), [x + steps + 300.0], torch.float32)


def test_nan_stays_in_its_row(device, schedule):
    assert_nan_stays_in_its_row(*pair(), inputs((3, 37), device), (1, 30))


def test_empty_batch(device):
    assert_matches_torch(*pair(), inputs((0, 8), device))


def test_partially_masked_rows(device, schedule):
    (x,) = inputs((4, 37), device)
    x[0, :20] = float("-inf")  # a whole leading block of the looped schedule
    x[1, ::3] = float("-inf")
    x[2, 1:] = float("-inf")  # a single live entry
    assert_matches_torch(*pair(), [x])


def test_fully_masked_row_is_nan_like_torch(device, schedule):
    (x,) = inputs((3, 37), device)
    x[1] = float("-inf")
    out = pair()[0](x)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert_matches_torch(*pair(), [x])


# torch raises IndexError for a dim out of range; accept it beside the contract's types.
DIM_ERRORS = (*BAD_INPUT, IndexError)
BAD_CALLS = {
    "integer_input": BadCall(lambda x, w: softmax.softmax(x.long(), -1), ("input", "int64")),
    "dim_too_large": BadCall(lambda x, w: softmax.softmax(x, 2), ("dim", "2"), DIM_ERRORS),
    "dim_too_small": BadCall(lambda x, w: softmax.softmax(x, -3), ("dim", "-3"), DIM_ERRORS),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    assert_bad_call_rejected(BAD_CALLS[case], device)

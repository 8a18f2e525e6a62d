"""Numerics of generated.layernorm against torch.nn.functional.layer_norm."""

import pytest
import torch
import torch.nn.functional as F
from reference import (
    DETERMINISM_ROWS,
    LOW_PRECISION_DTYPES,
    NON_CONTIGUOUS,
    BadCall,
    assert_bad_call_rejected,
    assert_built_like_torch,
    assert_deterministic_grads,
    assert_loads_torch_state_dict,
    assert_low_precision_ok,
    assert_matches_torch,
    assert_nan_stays_in_its_row,
    assert_reset_like_torch,
    force_looped,
    gradcheck,
    norm_inputs,
)

from generated import layernorm

OP = layernorm  # for the `schedule` fixture
SHIFT = 1.5  # rows have a nonzero mean, so centring matters
AFFINE = {
    "plain": (False, False),
    "weight": (True, False),
    "bias": (False, True),
    "affine": (True, True),
}


def pair(normalized_shape, eps=1e-5, view=lambda x: x):
    """(ours, theirs): layer norms of view(input) with optional weight and bias."""

    def ours(x, w, b):
        return layernorm.layer_norm(view(x), normalized_shape, w, b, eps)

    def theirs(x, w, b):
        return F.layer_norm(view(x), normalized_shape, w, b, eps)

    return ours, theirs


def inputs(shape, device, param_ndim=1, affine="affine"):
    weight, bias = AFFINE[affine]
    return norm_inputs(shape, param_ndim, device, weight=weight, bias=bias, shift=SHIFT)


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("n", [1, 5, 37, 128])
def test_matches_torch(device, n, affine):
    assert_matches_torch(*pair((n,)), inputs((3, n), device, affine=affine))


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("n", [16, 17, 32, 37, 100])
def test_looped_schedule_matches_torch(device, overrides, n, affine):
    overrides.enter_context(force_looped(layernorm))
    assert_matches_torch(*pair((n,)), inputs((3, n), device, affine=affine))


@pytest.mark.parametrize("offset", [1e3, -3e3])
def test_looped_rows_far_from_zero_in_fp32(device, overrides, offset):
    # The looped forward carries the variance with the mean in one sweep (codegen/fuse.py):
    # a sum of squares would cancel here (mean^2 / var ~ 1e6..1e7 against fp32's 1e-7)
    overrides.enter_context(force_looped(layernorm))
    x, w, b = inputs((6, 100), device)
    assert_low_precision_ok(*pair((100,)), [x + offset, w, b], torch.float32)


def test_many_row_blocks(device):
    # Persistent rows, many per program, in more row blocks than grid-stride programs.
    assert_matches_torch(*pair((100,)), inputs((600, 100), device))


@pytest.mark.parametrize("wrt", [(0,), (1, 2)], ids=["input_only", "params_only"])
def test_grad_of_some_arguments_only(device, schedule, wrt):
    assert_matches_torch(*pair((37,)), inputs((5, 37), device), wrt=wrt)


@pytest.mark.parametrize(
    ("shape", "param_ndim"), [((2, 3, 37), 1), ((2, 3, 7), 2), ((4, 2, 3, 5), 3)]
)
def test_batch_dims_and_multi_dim_normalized_shape(device, schedule, shape, param_ndim):
    normalized_shape = shape[len(shape) - param_ndim :]
    assert_matches_torch(*pair(normalized_shape), inputs(shape, device, param_ndim))


def test_int_normalized_shape(device):
    # torch's functional layer_norm wants a tuple; ours takes an int like the module.
    assert_matches_torch(pair(37)[0], pair((37,))[1], inputs((2, 3, 37), device))


def test_eps_is_used(device):
    x, w, b = inputs((3, 20), device)
    assert_matches_torch(*pair((20,), eps=0.25), [x * 0.01, w, b])


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input(device, schedule, view):
    x, w, b = inputs((5, 37), device)
    assert not NON_CONTIGUOUS[view](x).is_contiguous()
    assert_matches_torch(*pair((37,), view=NON_CONTIGUOUS[view]), [x, w, b])


def test_gradcheck_fast(device, schedule):
    gradcheck(pair((37,))[0], inputs((4, 37), device), fast=True)


def test_gradcheck_full(device):
    gradcheck(pair((3,))[0], inputs((2, 3), device), fast=False)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
def test_low_precision_against_fp64(device, schedule, dtype):
    assert_low_precision_ok(*pair((100,)), inputs((24, 100), device), dtype)


def test_nan_stays_in_its_row(device, schedule):
    assert_nan_stays_in_its_row(*pair((37,)), inputs((3, 37), device), (1, 30))


def test_empty_batch(device):
    assert_matches_torch(*pair((8,)), inputs((0, 8), device))


def test_backward_is_deterministic(device, schedule):
    assert_deterministic_grads(pair((100,))[0], inputs((DETERMINISM_ROWS, 100), device))


_ln = layernorm.layer_norm
BAD_CALLS = {
    "weight_shape": BadCall(lambda x, w: _ln(x, (8,), w[:7]), ("weight", "7")),
    "bias_shape": BadCall(lambda x, w: _ln(x, (8,), w, w[:7]), ("bias", "7")),
    "weight_dtype": BadCall(lambda x, w: _ln(x, (8,), w.double()), ("weight", "float64")),
    "bias_dtype": BadCall(lambda x, w: _ln(x, (8,), w, w.double()), ("bias", "float64")),
    "weight_device": BadCall(lambda x, w: _ln(x, (8,), w.to("meta")), ("weight", "meta")),
    "bias_device": BadCall(lambda x, w: _ln(x, (8,), w, w.to("meta")), ("bias", "meta")),
    "integer_input": BadCall(lambda x, w: _ln(x.long(), (8,)), ("input", "int64")),
    "normalized_shape": BadCall(lambda x, w: _ln(x, (6,)), ("normalized_shape", "6")),
    "normalized_shape_rank": BadCall(lambda x, w: _ln(x, (3, 4, 8)), ("normalized_shape", "3")),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    assert_bad_call_rejected(BAD_CALLS[case], device)


# name -> (normalized_shape, constructor kwargs)
MODULE_CONFIGS = {
    "default": ((8,), {}),
    "int_shape_eps": (8, {"eps": 1e-3}),
    "two_dims": ((3, 5), {}),
    "no_bias": ((8,), {"bias": False}),
    "no_affine": ((8,), {"elementwise_affine": False}),
    "no_affine_no_bias": ((8,), {"elementwise_affine": False, "bias": False}),
    "fp16": ((8,), {"dtype": torch.float16}),
    "meta": ((8,), {"device": "meta", "dtype": torch.float64}),
}


@pytest.mark.parametrize("config", MODULE_CONFIGS)
def test_module_is_built_like_torch(config):
    shape, kwargs = MODULE_CONFIGS[config]
    assert_built_like_torch(layernorm.LayerNorm, torch.nn.LayerNorm, shape, **kwargs)


def test_module_device_kwarg(device):
    kwargs = {"device": device, "dtype": torch.float64}
    assert_built_like_torch(layernorm.LayerNorm, torch.nn.LayerNorm, 8, **kwargs)


def test_module_reset_parameters():
    assert_reset_like_torch(layernorm.LayerNorm, torch.nn.LayerNorm, (3, 5))


@pytest.mark.parametrize("config", ["default", "no_bias", "no_affine", "two_dims"])
def test_module_loads_torch_state_dict(device, config):
    shape, kwargs = MODULE_CONFIGS[config]
    assert_loads_torch_state_dict(layernorm.LayerNorm, torch.nn.LayerNorm, shape, device, **kwargs)


@pytest.mark.parametrize("memory", list(layernorm._MODES))
@pytest.mark.parametrize("affine", ["weight", "affine", "plain"])
def test_weight_offset_scales_by_one_plus_weight(device, memory, affine):
    """weight_offset=1: the scale is 1 + weight (VideoPrism's, Moonshine's LayerNorm), in every
    memory mode; without a weight the offset is ignored, as it belongs to the weight."""

    def ours(x, w, b):
        return layernorm.layer_norm(x, (37,), w, b, weight_offset=1.0, memory=memory)

    def theirs(x, w, b):
        return F.layer_norm(x, (37,), None if w is None else 1.0 + w, b)

    assert_matches_torch(ours, theirs, inputs((3, 5, 37), device, affine=affine))


def test_weight_offset_module_keeps_torch_s_state_dict_keys():
    module = layernorm.LayerNorm(8, weight_offset=1.0, dtype=torch.float64)
    assert list(module.state_dict()) == ["weight", "bias"]
    # the effective scale 1 + weight starts at 1
    torch.testing.assert_close(module.weight + 1.0, torch.ones(8, dtype=torch.float64))
    assert "weight_offset=1.0" in repr(module)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(module(x), F.layer_norm(x, (8,)))


def test_a_one_plus_weight_layer_norm_is_patched_with_its_offset():
    """VideoPrism's LayerNorm scales by weight + 1: patch_model finds the offset by behaviour
    and swaps in LayerNorm(weight_offset=1.0), with the same outputs."""
    import copy

    from transformers.models.videoprism.modeling_videoprism import VideoPrismLayerNorm

    from generated.patch import patch_model

    original = VideoPrismLayerNorm(16, eps=1e-6)
    with torch.no_grad():
        original.weight.copy_(torch.linspace(-0.5, 0.5, 16))
        original.bias.copy_(torch.linspace(-1.0, 1.0, 16))
    model = torch.nn.Sequential(copy.deepcopy(original))
    report = patch_model(model)
    new = model[0]
    assert isinstance(new, layernorm.LayerNorm) and new.weight_offset == 1.0, report
    assert report.swapped == [("0", "VideoPrismLayerNorm", "LayerNorm(weight_offset=1.0)")]
    x = torch.randn(3, 5, 16) * 4.0 + 2.0
    torch.testing.assert_close(new(x), original(x), rtol=1e-5, atol=1e-6)

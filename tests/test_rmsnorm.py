"""Numerics of generated.rmsnorm against torch.nn.functional.rms_norm."""

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
    randn,
)

from codegen.runtime import launch
from generated import add_rmsnorm, rmsnorm

OP = rmsnorm  # for the `schedule` fixture


def pair(normalized_shape, eps=None, view=lambda x: x):
    """(ours, theirs): RMS norms of view(input) with an optional weight."""

    def ours(x, w):
        return rmsnorm.rms_norm(view(x), normalized_shape, w, eps)

    def theirs(x, w):
        return F.rms_norm(view(x), normalized_shape, w, eps)

    return ours, theirs


def inputs(shape, device, param_ndim=1, weight=True):
    return norm_inputs(shape, param_ndim, device, weight=weight)[:2]


@pytest.mark.parametrize("weight", [False, True], ids=["plain", "weight"])
@pytest.mark.parametrize("n", [1, 5, 37, 128])
def test_matches_torch(device, n, weight):
    assert_matches_torch(*pair((n,)), inputs((3, n), device, weight=weight))


@pytest.mark.parametrize("weight", [False, True], ids=["plain", "weight"])
@pytest.mark.parametrize("n", [16, 17, 32, 37, 100])
def test_looped_schedule_matches_torch(device, overrides, n, weight):
    overrides.enter_context(force_looped(rmsnorm))
    assert_matches_torch(*pair((n,)), inputs((3, n), device, weight=weight))


def test_many_row_blocks(device):
    # Persistent rows, many per program, in more row blocks than grid-stride programs.
    assert_matches_torch(*pair((100,)), inputs((600, 100), device))


@pytest.mark.parametrize("wrt", [(0,), (1,)], ids=["input_only", "weight_only"])
def test_grad_of_some_arguments_only(device, schedule, wrt):
    assert_matches_torch(*pair((37,)), inputs((5, 37), device), wrt=wrt)


@pytest.mark.parametrize(
    ("shape", "param_ndim"), [((2, 3, 37), 1), ((2, 3, 7), 2), ((4, 2, 3, 5), 3)]
)
def test_batch_dims_and_multi_dim_normalized_shape(device, schedule, shape, param_ndim):
    normalized_shape = shape[len(shape) - param_ndim :]
    assert_matches_torch(*pair(normalized_shape), inputs(shape, device, param_ndim))


def test_int_normalized_shape(device):
    # torch's functional rms_norm wants a tuple; ours takes an int like the module.
    assert_matches_torch(pair(37)[0], pair((37,))[1], inputs((2, 3, 37), device))


def test_eps_is_used(device):
    x, w = inputs((3, 20), device)
    assert_matches_torch(*pair((20,), eps=0.25), [x * 0.01, w])


def tiny_inputs(dtype, device):
    """Inputs whose mean square is far below finfo(dtype).eps, so eps decides rstd."""
    x, w = inputs((24, 37), device)
    return [x * 0.03 * torch.finfo(dtype).eps ** 0.5, w]


def test_default_eps_is_finfo_eps(device):
    assert_matches_torch(*pair((37,)), tiny_inputs(torch.float64, device))


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
def test_default_eps_is_finfo_eps_of_computing_dtype(device, dtype):
    # torch takes the eps of the type it computes in: float32 for float16 and bfloat16 inputs.
    # The fp64 reference would use fp64's eps for eps=None: give it that one.
    eps = torch.finfo(torch.float32).eps
    ours, theirs = pair((37,))[0], pair((37,), eps=eps)[1]
    assert_low_precision_ok(ours, theirs, tiny_inputs(dtype, device), dtype)


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
def test_non_contiguous_input(device, schedule, view):
    x, w = inputs((5, 37), device)
    assert not NON_CONTIGUOUS[view](x).is_contiguous()
    assert_matches_torch(*pair((37,), view=NON_CONTIGUOUS[view]), [x, w])


def test_gradcheck_fast(device, schedule):
    gradcheck(pair((37,))[0], inputs((4, 37), device), fast=True)


def test_gradcheck_full(device):
    gradcheck(pair((3,))[0], inputs((2, 3), device), fast=False)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=str)
def test_low_precision_against_fp64(device, schedule, dtype):
    assert_low_precision_ok(*pair((100,), eps=1e-6), inputs((24, 100), device), dtype)


def test_nan_stays_in_its_row(device, schedule):
    assert_nan_stays_in_its_row(*pair((37,)), inputs((3, 37), device), (1, 30))


def test_empty_batch(device):
    assert_matches_torch(*pair((8,)), inputs((0, 8), device))


def test_backward_is_deterministic(device, schedule):
    assert_deterministic_grads(pair((100,))[0], inputs((DETERMINISM_ROWS, 100), device))


_rms = rmsnorm.rms_norm
BAD_CALLS = {
    "weight_shape": BadCall(lambda x, w: _rms(x, (8,), w[:7]), ("weight", "7")),
    # torch's rms_norm takes a weight of any real dtype (tests/test_edges.py)
    "weight_dtype": BadCall(lambda x, w: _rms(x, (8,), w.to(torch.complex128)),
                            ("weight", "complex128")),
    "weight_device": BadCall(lambda x, w: _rms(x, (8,), w.to("meta")), ("weight", "meta")),
    "integer_input": BadCall(lambda x, w: _rms(x.long(), (8,)), ("input", "int64")),
    "normalized_shape": BadCall(lambda x, w: _rms(x, (6,)), ("normalized_shape", "6")),
    "normalized_shape_rank": BadCall(lambda x, w: _rms(x, (3, 4, 8)), ("normalized_shape", "3")),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_rejected(device, case):
    assert_bad_call_rejected(BAD_CALLS[case], device)


# name -> (normalized_shape, constructor kwargs)
MODULE_CONFIGS = {
    "default": ((8,), {}),
    "int_shape_eps": (8, {"eps": 1e-3}),
    "two_dims": ((3, 5), {}),
    "no_affine": ((8,), {"elementwise_affine": False}),
    "fp16": ((8,), {"dtype": torch.float16}),
    "meta": ((8,), {"device": "meta", "dtype": torch.float64}),
}


@pytest.mark.parametrize("config", MODULE_CONFIGS)
def test_module_is_built_like_torch(config):
    shape, kwargs = MODULE_CONFIGS[config]
    assert_built_like_torch(rmsnorm.RMSNorm, torch.nn.RMSNorm, shape, **kwargs)


def test_module_device_kwarg(device):
    kwargs = {"device": device, "dtype": torch.float64}
    assert_built_like_torch(rmsnorm.RMSNorm, torch.nn.RMSNorm, 8, **kwargs)


def test_module_reset_parameters():
    assert_reset_like_torch(rmsnorm.RMSNorm, torch.nn.RMSNorm, (3, 5))


@pytest.mark.parametrize("config", ["default", "int_shape_eps", "no_affine", "two_dims"])
def test_module_loads_torch_state_dict(device, config):
    shape, kwargs = MODULE_CONFIGS[config]
    assert_loads_torch_state_dict(rmsnorm.RMSNorm, torch.nn.RMSNorm, shape, device, **kwargs)


def in_place_grads(device, memory, build_loss, in_place):
    """The gradients of x, weight and r (a residual) of build_loss(y, r), y = rms_norm(x), and
    the address of y's gradient, recorded by a hook."""
    x, w = (t.detach().requires_grad_() for t in inputs((6, 37), device))
    r = randn((6, 37), seed=5, device=device).requires_grad_()
    # made before y: autograd reaches its backward after y's
    r = r * 3
    y = rmsnorm.rms_norm(x, (37,), w, memory=memory, in_place=in_place)
    addresses = []
    y.register_hook(lambda g: addresses.append(g.data_ptr()))
    r.retain_grad()
    build_loss(y, r).backward()
    return [x.grad, w.grad, r.grad], addresses[0]


UPSTREAMS = {
    # a gradient of its own (a product's): overwritten
    "own": (lambda y, r: (y * randn(y.shape, seed=7, device=y.device)).sum() + (r * r).sum(),
            True),
    # y + r: the add hands one gradient to both branches, and r's backward runs after y's
    "shared": (lambda y, r: ((y + r) * randn(y.shape, seed=7, device=y.device)).sum(), False),
    # sum(): an expanded gradient of stride 0
    "expanded": (lambda y, r: y.sum() + r.sum(), False),
}


@pytest.mark.parametrize("memory", ["default", "invertible"])
@pytest.mark.parametrize("upstream", sorted(UPSTREAMS))
def test_in_place_backward_writes_dx_where_safe(device, memory, upstream):
    build_loss, overwritten = UPSTREAMS[upstream]
    expected, _ = in_place_grads(device, memory, build_loss, False)
    got, address = in_place_grads(device, memory, build_loss, True)
    for g, e in zip(got, expected, strict=True):
        assert g is not None and torch.equal(g, e)
    # the kernels write dx where dy was (x's leaf gradient takes that tensor) where autograd
    # hands the gradient over alone, whatever the engine's own references (counted against a
    # probe's, launch._calibrated); the torch path allocates
    in_place = overwritten and launch.use_triton(got[0])
    assert (got[0].data_ptr() == address) == in_place


def test_in_place_survives_a_frame_evaluator_left_installed(device):
    """A torch.compile(fullgraph=True) that fails leaves torch's frame evaluator installed
    (torch 2.13): each Python call then holds its arguments twice. The counts that decide
    in-place writes are taken again for that interpreter state, so the kernels keep writing
    dx where dy was, and never where another holder reads dy."""
    import sys

    def untraceable(t):
        return t * sys.getrefcount(t)

    for attempt in range(2):
        for upstream in ("own", "shared"):
            build_loss, overwritten = UPSTREAMS[upstream]
            got, address = in_place_grads(device, "default", build_loss, True)
            in_place = overwritten and launch.use_triton(got[0])
            assert (got[0].data_ptr() == address) == in_place, (attempt, upstream)
        if attempt == 0:
            with pytest.raises(torch._dynamo.exc.Unsupported):
                torch.compile(untraceable, fullgraph=True, backend="eager")(torch.ones(2))
            torch._dynamo.reset()


def test_in_place_keeps_a_gradient_the_caller_holds(device):
    x, w = (t.detach().requires_grad_() for t in inputs((6, 37), device))
    y = rmsnorm.rms_norm(x, (37,), w, in_place=True)
    upstream = randn((6, 37), seed=7, device=device)
    kept = upstream.clone()
    dx, dw = torch.autograd.grad(y, (x, w), upstream)
    assert torch.equal(upstream, kept)
    expected = torch.autograd.grad(rmsnorm.rms_norm(x, (37,), w), (x, w), upstream)
    assert torch.equal(dx, expected[0]) and torch.equal(dw, expected[1])


@pytest.mark.parametrize("reader", ["retain_grad", "post_hook"])
def test_in_place_keeps_a_gradient_autograd_reads_afterwards(device, reader):
    # a retained .grad and a post hook of the node read y's gradient after this backward:
    # each reads it as it was (the hook's is the tensor handed over, which the kernels then
    # leave alone; the retained .grad is a tensor of its own)
    x, w = (t.detach().requires_grad_() for t in inputs((6, 37), device))
    y = rmsnorm.rms_norm(x, (37,), w, in_place=True)
    seen = []
    if reader == "retain_grad":
        y.retain_grad()
    else:
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_outputs[0]))
    upstream = randn((6, 37), seed=7, device=device)
    (y * upstream).sum().backward()
    read = y.grad if reader == "retain_grad" else seen[0]
    assert torch.equal(read, upstream)
    expected = torch.autograd.grad(rmsnorm.rms_norm(x, (37,), w), x, upstream)[0]
    assert torch.equal(x.grad, expected)


def test_in_place_argument():
    with pytest.raises(TypeError, match=r"rms_norm\(\): argument 'in_place' must be bool, got int"):
        rmsnorm.rms_norm(randn((2, 8)), (8,), in_place=1)
    with pytest.raises(TypeError, match=r"RMSNorm\(\): argument 'in_place' must be bool"):
        rmsnorm.RMSNorm(8, in_place="yes")
    module = rmsnorm.RMSNorm(8, in_place=True)
    assert module.in_place and repr(module) == "RMSNorm((8,), eps=None, elementwise_affine=True, " \
                                               "in_place=True)"


@pytest.mark.parametrize("prenorm", [False, True])
def test_add_rms_norm_in_place(device, prenorm):
    def run(in_place):
        x, w = (t.detach().requires_grad_() for t in inputs((6, 37), device))
        residual = randn((6, 37), seed=5, device=device).requires_grad_()
        out = add_rmsnorm.add_rms_norm(x, residual, (37,), w, prenorm=prenorm,
                                       in_place=in_place)
        y, stream = out if prenorm else (out, None)
        addresses = []
        y.register_hook(lambda g: addresses.append(g.data_ptr()))
        loss = (y * randn(y.shape, seed=7, device=device)).sum()
        if prenorm:
            loss = loss + (stream * randn(y.shape, seed=8, device=device)).sum()
        loss.backward()
        return [x.grad, residual.grad, w.grad], addresses[0]

    expected, _ = run(False)
    got, address = run(True)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    # x's and residual's gradient is one tensor, which the kernels wrote where y's was: one
    # of the leaves takes it. Only that direction is provable by addresses: where it is not
    # taken, the leaf that gets a copy may be allocated after y's gradient is freed, at the
    # same address.
    if launch.use_triton(got[0]):
        assert address in (got[0].data_ptr(), got[1].data_ptr())

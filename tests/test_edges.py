"""Edges where every public function must do as torch does: operands and gradients broadcast
over the rows (row stride 0), the default eps of 16-bit inputs, mixed-dtype promotion, module
reprs, and rows holding inf or NaN.

Each test runs on both dispatch paths (`device`): on a CUDA machine the Triton path runs on
the GPU, so the fast-math forms (`FIXED_N`: approximate rsqrt, fast exp) are checked there."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from reference import (
    FP64_TOL,
    GRAD_SEED,
    LOW_PRECISION_ATOL,
    bf16_toward_zero,
    force_looped,
    generated_torch_path,
    max_abs_error,
    randn,
)

import generated.add_layernorm as add_layernorm
import generated.add_rmsnorm as add_rmsnorm
import generated.bias_dropout_add as bias_dropout_add
import generated.cross_entropy as cross_entropy
import generated.geglu as geglu
import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
import generated.layernorm as layernorm
import generated.masked_softmax as masked_softmax
import generated.rmsnorm as rmsnorm
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.runtime import checks
from generated.patch import patch_model

M, N = 4, 40
RMS_EPS = 1e-6
EPS32 = torch.finfo(torch.float32).eps


def forced(module: object, form: str) -> contextlib.AbstractContextManager:
    """Within it, `module`'s kernels take `form`: whole rows ("persistent", the rules' choice),
    whole rows compiled for their width ("fixed": FIXED_N, the form the measured table picks
    for the common widths on a GPU) or looped rows ("looped")."""
    if form == "fixed":
        return module.SCHEDULES.override(form_bits=16)
    if form == "looped":
        return force_looped(module)
    return contextlib.nullcontext()


# Row-broadcast operands and gradients (row stride 0)


class Case(NamedTuple):
    """A public function and torch's composition of it over `rows` operands of shape (M, N)
    followed by `params` per-column tensors of shape (N,); each returns `outputs` tensors."""

    module: object
    ours: Callable
    theirs: Callable
    rows: int
    params: int = 0
    outputs: int = 1


MASK = randn((N,), seed=40)
TARGET = torch.tensor([0, 7, 39, 12])

CASES = {
    "layer_norm": Case(
        layernorm, lambda x, w, b: layernorm.layer_norm(x, (N,), w, b),
        lambda x, w, b: F.layer_norm(x, (N,), w, b), 1, 2),
    "rms_norm": Case(
        rmsnorm, lambda x, w: rmsnorm.rms_norm(x, (N,), w, RMS_EPS),
        lambda x, w: F.rms_norm(x, (N,), w, RMS_EPS), 1, 1),
    "add_layer_norm": Case(
        add_layernorm,
        lambda x, r, w, b: add_layernorm.add_layer_norm(x, r, (N,), w, b, prenorm=True),
        lambda x, r, w, b: (F.layer_norm(x + r, (N,), w, b), x + r), 2, 2, 2),
    "add_rms_norm": Case(
        add_rmsnorm,
        lambda x, r, w: add_rmsnorm.add_rms_norm(x, r, (N,), w, RMS_EPS, prenorm=True),
        lambda x, r, w: (F.rms_norm(x + r, (N,), w, RMS_EPS), x + r), 2, 1, 2),
    "bias_dropout_add": Case(
        bias_dropout_add,
        lambda x, r, b: bias_dropout_add.bias_dropout_add(x, r, bias=b, p=0.0),
        lambda x, r, b: r + (x + b), 2, 1),
    "swiglu": Case(swiglu, swiglu.swiglu, lambda g, u: F.silu(g) * u, 2),
    "geglu": Case(geglu, geglu.geglu, lambda g, u: F.gelu(g) * u, 2),
    "gelu": Case(gelu, lambda x, b: gelu.gelu(x, bias=b), lambda x, b: F.gelu(x + b), 1, 1),
    "gelu_tanh": Case(
        gelu_tanh, lambda x, b: gelu_tanh.gelu_tanh(x, bias=b),
        lambda x, b: F.gelu(x + b, approximate="tanh"), 1, 1),
    "masked_softmax": Case(
        masked_softmax, lambda x: masked_softmax.masked_softmax(x, MASK.to(x.device)),
        lambda x: torch.softmax(x + MASK.to(x.device), -1), 1),
    "softmax": Case(softmax, softmax.softmax, lambda x: torch.softmax(x, -1), 1),
    "cross_entropy": Case(
        cross_entropy,
        lambda x: cross_entropy.cross_entropy(x, TARGET.to(x.device), reduction="none"),
        lambda x: F.cross_entropy(x, TARGET.to(x.device), reduction="none"), 1),
}
# what is broadcast over the rows: an operand ("input i") or the gradient flowing into an
# output ("grad k"; a per-row loss has no row to broadcast)
BROADCASTS = [
    (name, f"{kind} {i}")
    for name, case in CASES.items()
    for kind, count in (("input", case.rows), ("grad", case.outputs * (name != "cross_entropy")))
    for i in range(count)
]


def broadcast_run(fn: Callable, case: Case, broadcast: str, device: torch.device) -> list:
    """[outputs..., gradient of each leaf] of fn, the broadcast operand given as a (N,) leaf
    expanded to (M, N), so its gradient is summed over the rows as torch's."""
    kind, index = broadcast.split()
    leaves = [randn((M, N), seed=i, device=device) for i in range(case.rows)]
    leaves += [randn((N,), seed=10 + i, device=device, shift=1.0) for i in range(case.params)]
    if kind == "input":
        leaves[int(index)] = randn((N,), seed=20, device=device)
    leaves = [leaf.requires_grad_() for leaf in leaves]
    arguments = [
        leaf.expand(M, N) if kind == "input" and i == int(index) else leaf
        for i, leaf in enumerate(leaves)
    ]
    outputs = fn(*arguments)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    upstream = [randn(out.shape, seed=GRAD_SEED + k, device=device)
                for k, out in enumerate(outputs)]
    if kind == "grad":
        upstream[int(index)] = randn((N,), seed=GRAD_SEED, device=device).expand(M, N)
    torch.autograd.backward(list(outputs), upstream)
    return [out.detach() for out in outputs] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("form", ["fixed", "looped"])
@pytest.mark.parametrize(("name", "broadcast"), BROADCASTS)
def test_row_broadcast_operands_and_gradients(device, overrides, form, name, broadcast):
    """An operand or an upstream gradient of row stride 0 (`t.expand(M, N)`) reads as the
    tensor it views, in every kernel form, and the broadcast operand's gradient is the sum
    over its rows, as torch's."""
    case = CASES[name]
    overrides.enter_context(forced(case.module, form))
    got = broadcast_run(case.ours, case, broadcast, device)
    want = broadcast_run(case.theirs, case, broadcast, device)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(mine, theirs, msg=lambda m, i=index: f"result {i}: {m}",
                                   **FP64_TOL)


# The default eps of rms_norm


def patched_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    model = torch.nn.Sequential(torch.nn.RMSNorm(N, device=x.device, dtype=w.dtype))
    with torch.no_grad():
        model[0].weight.copy_(w)
    assert patch_model(model) == {"RMSNorm": 1}
    return model(x)


def rms_module(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    module = rmsnorm.RMSNorm(N, device=x.device, dtype=w.dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    return module(x)


DEFAULT_EPS_CALLERS = {
    "rms_norm": lambda x, w: rmsnorm.rms_norm(x, (N,), w),
    "RMSNorm": rms_module,
    "add_rms_norm": lambda x, w: add_rmsnorm.add_rms_norm(x, torch.zeros_like(x), (N,), w),
    "AddRMSNorm": lambda x, w: add_rmsnorm.AddRMSNorm(N, device=x.device, dtype=x.dtype)(x),
    "patch_model": patched_rms_norm,
}


# Permuted rows: attention's (B, T, H, D) buffers seen as (B, H, T, D)

#: every case whose results torch lays out as this test checks (add + norm's prenorm sum keeps
#: the inputs' layout, as torch's x + r, its normalized output is contiguous)
PERMUTED = [name for name in CASES if name != "cross_entropy"]


def _permuted_run(fn: Callable, case: Case, device: torch.device, transposed: bool) -> list:
    """[outputs..., gradient of each leaf] of fn over (B, H, T, N) operands: views of
    (B, T, H, N) buffers (transposed), or contiguous tensors of the same values."""
    leaves = [randn((2, 3, 4, N), seed=i, device=device) for i in range(case.rows)]
    leaves += [randn((N,), seed=10 + i, device=device, shift=1.0) for i in range(case.params)]
    leaves = [leaf.requires_grad_() for leaf in leaves]
    operands = [leaf.transpose(1, 2) if i < case.rows else leaf for i, leaf in enumerate(leaves)]
    if not transposed:
        operands = [op.contiguous() if i < case.rows else op for i, op in enumerate(operands)]
    outputs = fn(*operands)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    upstream = [randn(out.shape, seed=GRAD_SEED + k, device=device)
                for k, out in enumerate(outputs)]
    torch.autograd.backward(list(outputs), upstream)
    return [*outputs, *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("name", PERMUTED)
def test_permuted_rows_compute_in_place_and_keep_torchs_layout(device, name):
    """Rows whose leading dims are permuted in memory give the values and gradients of the
    same rows made contiguous, and results laid out as torch's: an elementwise op's keeps the
    input's layout (torch's elementwise ops do; attention's output then needs no copy before
    its projection), a row reduction's is contiguous (as torch's softmax and norms)."""
    case = CASES[name]
    got = _permuted_run(case.ours, case, device, transposed=True)
    want = _permuted_run(case.ours, case, device, transposed=False)
    rowwise = len(got) - case.params  # outputs and operand gradients: each row's own values
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if index < rowwise:
            assert torch.equal(a.detach(), b.detach()), f"{name}: result {index} differs"
        else:  # a parameter's gradient: the same rows summed in another order
            torch.testing.assert_close(a, b, **FP64_TOL)
    for grad in (False, True):  # the Function's results and those of the no-grad path
        with torch.set_grad_enabled(grad):
            operands = [randn((2, 3, 4, N), seed=i, device=device).transpose(1, 2)
                        .requires_grad_(grad) for i in range(case.rows)]
            operands += [randn((N,), seed=10 + i, device=device) for i in range(case.params)]
            ours, theirs = case.ours(*operands), case.theirs(*operands)
        ours = ours if isinstance(ours, tuple) else (ours,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        assert [o.stride() for o in ours] == [t.stride() for t in theirs], f"grad={grad}"


#: the ops whose Functions take the caller's tensors and shape their results (a layout)
SHAPED = [name for name in CASES if name not in ("cross_entropy", "softmax")]


@pytest.mark.parametrize("name", SHAPED)
def test_results_are_the_ops_own_node_and_take_in_place_ops(device, name):
    """A call over permuted (B, H, T, N) operands adds one node to autograd's graph, the op's
    own, right over the caller's tensors: the rows are made inside (a view node around it
    costs host time when recorded and again when run backward). Its result may be modified
    in place where torch's may, and the gradients are then those of what was computed."""
    case = CASES[name]
    runs = []
    for fn in (case.ours, case.theirs):
        leaves = [randn((2, 3, 4, N), seed=i, device=device) for i in range(case.rows)]
        leaves += [randn((N,), seed=10 + i, device=device, shift=1.0)
                   for i in range(case.params)]
        leaves = [leaf.requires_grad_() for leaf in leaves]
        operands = [leaf.transpose(1, 2) if i < case.rows else leaf
                    for i, leaf in enumerate(leaves)]
        outputs = fn(*operands)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if fn is case.ours:
            for out in outputs:
                assert "Function" in out.grad_fn.name(), out.grad_fn.name()
                given = [edge[0] for edge in out.grad_fn.next_functions[:case.rows]]
                assert [node.name() if node else None for node in given] == (
                    [op.grad_fn.name() for op in operands[:case.rows]])
        if name != "masked_softmax":  # torch's softmax saves its result: in place raises
            outputs[0].mul_(1.5)  # (an add + norm's sum is saved by both: the output alone)
        upstream = [randn(out.shape, seed=GRAD_SEED + k, device=device)
                    for k, out in enumerate(outputs)]
        torch.autograd.backward(list(outputs), upstream)
        runs.append([*(out.detach() for out in outputs), *(leaf.grad for leaf in leaves)])
    for index, (a, b) in enumerate(zip(*runs, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, i=index: f"result {i}: {m}", **FP64_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("caller", DEFAULT_EPS_CALLERS)
def test_default_eps_of_16_bit_input_is_float32s(device, caller, dtype):
    """eps=None is torch.finfo(float32).eps for float16 and bfloat16 input: torch takes the
    machine epsilon of the type it computes in. Inputs whose mean square is near float32's
    eps, far below float16's and bfloat16's, so the eps decides the result."""
    x = randn((M, N), seed=1, device=device) * 3e-4
    w = torch.ones(N, dtype=torch.float64, device=device) if caller == "AddRMSNorm" else (
        randn((N,), seed=2, device=device, shift=1.0))
    low = [x.to(dtype), w.to(dtype)]
    exact = F.rms_norm(low[0].double(), (N,), low[1].double(), EPS32)
    torch_own = F.rms_norm(low[0], (N,), low[1])
    with torch.no_grad():
        ours = DEFAULT_EPS_CALLERS[caller](*low)
    assert ours.dtype == dtype
    error, torch_error = max_abs_error(ours, exact), max_abs_error(torch_own, exact)
    assert error <= 2 * torch_error + LOW_PRECISION_ATOL[dtype], (
        f"max abs error {error:.3g} > 2 * torch's {torch_error:.3g} + {LOW_PRECISION_ATOL[dtype]}")


# Mixed dtypes


def interpreted(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def mixed_run(fn: Callable, inputs: list, grad_dtype: torch.dtype | None = None) -> list:
    """[output, gradient of each input] of fn on leaf copies of `inputs` (None kept); the
    upstream gradient is seeded noise rounded to `grad_dtype` (default: the output's)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grad = randn(out.shape, seed=GRAD_SEED, device=out.device, dtype=grad_dtype or out.dtype)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(None if t is None else t.grad for t in leaves)]


def assert_promotes_like_torch(ours: Callable, theirs: Callable, inputs: list) -> None:
    """The output and every gradient have torch's dtype, and a max abs error against torch's
    composition in fp64 of at most twice torch's own plus the atol of that dtype."""
    try:
        want = mixed_run(theirs, inputs)
    except RuntimeError as error:
        # torch's CUDA layer norm (2.11) refuses 16-bit input with fp32 parameters, which
        # its CPU one takes: the behaviour to match is then torch's on the CPU
        if inputs[0].device.type == "cpu" or "expected scalar type" not in str(error):
            raise
        want = [None if t is None else t.to(inputs[0].device)
                for t in mixed_run(theirs, [None if t is None else t.cpu() for t in inputs])]
    got = mixed_run(ours, inputs)
    exact = mixed_run(theirs, [None if t is None else t.double() for t in inputs],
                      grad_dtype=want[0].dtype)
    if interpreted(inputs[0].device) and want[0].dtype == torch.bfloat16:
        # the interpreter stores bf16 by truncation (tests/reference.py): torch's error on
        # that footing is that of its fp32 results truncated
        upcast = [t.float() if t is not None and t.dtype == torch.bfloat16 else t
                  for t in inputs]
        truncated = mixed_run(theirs, upcast, grad_dtype=want[0].dtype)
        want = [w if w is None or w.dtype != torch.bfloat16 else bf16_toward_zero(t)
                for w, t in zip(want, truncated, strict=True)]
    for index, (mine, theirs_, ref) in enumerate(zip(got, want, exact, strict=True)):
        if ref is None:
            continue
        assert mine.dtype == theirs_.dtype, f"result {index}: {mine.dtype}, torch {theirs_.dtype}"
        atol = LOW_PRECISION_ATOL.get(mine.dtype, FP64_TOL["atol"]) * math.sqrt(M)
        error, torch_error = max_abs_error(mine, ref), max_abs_error(theirs_, ref)
        assert error <= 2 * torch_error + atol, (
            f"result {index} in {mine.dtype}: max abs error {error:.3g} > 2 * torch's "
            f"{torch_error:.3g} + {atol:g}")


H, B, S, D = torch.float16, torch.bfloat16, torch.float32, torch.float64

#: (function, torch's composition, the dtype of each (M, N) operand then each (N,) tensor)
MIXED = {
    "swiglu fp16 fp32": (swiglu.swiglu, lambda g, u: F.silu(g) * u, (H, S), ()),
    "swiglu fp32 fp16": (swiglu.swiglu, lambda g, u: F.silu(g) * u, (S, H), ()),
    "geglu fp32 fp64": (geglu.geglu, lambda g, u: F.gelu(g) * u, (S, D), ()),
    "bias_dropout_add fp16 fp32": (
        lambda x, r: bias_dropout_add.bias_dropout_add(x, r, p=0.0), lambda x, r: r + x,
        (H, S), ()),
    "bias_dropout_add bias fp32": (
        lambda x, r, b: bias_dropout_add.bias_dropout_add(x, r, bias=b, p=0.0),
        lambda x, r, b: r + (x + b), (H, H), (S,)),
    "gelu bias fp32": (lambda x, b: gelu.gelu(x, bias=b), lambda x, b: F.gelu(x + b), (B,), (S,)),
    "gelu_tanh bias fp64": (
        lambda x, b: gelu_tanh.gelu_tanh(x, bias=b),
        lambda x, b: F.gelu(x + b, approximate="tanh"), (S,), (D,)),
    "masked_softmax mask fp32": (
        lambda x: masked_softmax.masked_softmax(x, MASK.to(x.device, S)),
        lambda x: torch.softmax(x + MASK.to(x.device, S), -1), (H,), ()),
    "softmax dtype fp32": (
        lambda x: softmax.softmax(x, -1, dtype=S), lambda x: torch.softmax(x, -1, dtype=S),
        (H,), ()),
    "add_layer_norm residual fp32": (
        lambda x, r: add_layernorm.add_layer_norm(x, r, (N,)),
        lambda x, r: F.layer_norm(x + r, (N,)), (B, S), ()),
    "add_rms_norm input_bias fp32": (
        lambda x, r, b: add_rmsnorm.add_rms_norm(x, r, (N,), None, RMS_EPS, input_bias=b),
        lambda x, r, b: F.rms_norm(x + b + r, (N,), None, RMS_EPS), (H, H), (S,)),
    # 16-bit activations, float32 norm parameters: the output keeps the input's dtype
    "layer_norm fp16 weight bias fp32": (
        lambda x, w, b: layernorm.layer_norm(x, (N,), w, b),
        lambda x, w, b: F.layer_norm(x, (N,), w, b), (H,), (S, S)),
    "layer_norm bf16 weight bias fp32": (
        lambda x, w, b: layernorm.layer_norm(x, (N,), w, b),
        lambda x, w, b: F.layer_norm(x, (N,), w, b), (B,), (S, S)),
    "rms_norm bf16 weight fp32": (
        lambda x, w: rmsnorm.rms_norm(x, (N,), w, RMS_EPS),
        lambda x, w: F.rms_norm(x, (N,), w, RMS_EPS), (B,), (S,)),
    "add_layer_norm fp16 weight bias fp32": (
        lambda x, r, w, b: add_layernorm.add_layer_norm(x, r, (N,), w, b),
        lambda x, r, w, b: F.layer_norm(x + r, (N,), w, b), (H, H), (S, S)),
    "add_rms_norm bf16 weight fp32": (
        lambda x, r, w: add_rmsnorm.add_rms_norm(x, r, (N,), w, RMS_EPS),
        lambda x, r, w: F.rms_norm(x + r, (N,), w, RMS_EPS), (B, B), (S,)),
}


@pytest.mark.parametrize("name", MIXED)
def test_mixed_dtypes_promote_like_torch(device, name):
    ours, theirs, rows, columns = MIXED[name]
    inputs = [randn((M, N), seed=i, device=device, dtype=dtype) for i, dtype in enumerate(rows)]
    inputs += [randn((N,), seed=10 + i, device=device, dtype=dtype, shift=1.0)
               for i, dtype in enumerate(columns)]
    assert_promotes_like_torch(ours, theirs, inputs)


def test_promotion_follows_torch_result_type():
    """Dimensioned tensors decide the dtype, 0-d ones only among 0-d ones; None is kept and a
    call of one dtype returns its tensors as they are."""
    half, single = torch.ones(3, dtype=H), torch.ones(3, dtype=S)
    scalar = torch.ones((), dtype=D)
    for tensors in [(half, single), (half, scalar), (scalar, half), (scalar, scalar.half())]:
        promoted = checks.promote(*tensors, None)
        assert promoted[-1] is None
        assert {t.dtype for t in promoted[:-1]} == {torch.result_type(*tensors)}
    assert checks.promote(half, None, half)[2] is half
    with pytest.raises(TypeError, match="argument 'bias' must have dtype .* got torch.int64"):
        checks.check_param("f", "bias", torch.ones(3, dtype=torch.int64), (3,), half,
                           promotes=True)
    assert checks.check_param("f", "bias", scalar.expand(3), (3,), half, promotes=True).dtype == D


def test_norm_parameters_follow_the_promoted_input(device):
    """The sum of a float16 input and a float64 residual is float64: a float32 weight is then
    refused as torch's layer_norm refuses it, the error naming the dtype it needs."""
    x = randn((M, N), device=device, dtype=H)
    with pytest.raises(TypeError, match="'weight'.*float64.*float32"):
        add_layernorm.add_layer_norm(x, x.double(), (N,), torch.ones(N, device=device))


# Parameter dtypes of the norms


FLOATS = (H, B, S, D)


def norm_tolerance(dtype: torch.dtype) -> dict:
    """A few units in the last place of `dtype` (fp64 at the accumulator's own precision)."""
    return FP64_TOL if dtype == D else {"rtol": 4 * torch.finfo(dtype).eps,
                                        "atol": 4 * torch.finfo(dtype).eps}


@pytest.mark.parametrize("weight_dtype", [*FLOATS, torch.int64, torch.bool])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_takes_every_weight_dtype_torch_takes(device, dtype, weight_dtype):
    """torch's rms_norm takes a weight of any real dtype, multiplies the normalised input by it
    at its accumulator's precision and returns the input's dtype; the weight's gradient has the
    weight's dtype. Ours (rms_norm and add_rms_norm) too, with torch's values."""
    x = randn((M, N), seed=1, dtype=dtype)
    weight = (randn((N,), seed=2, shift=1.0) * 3).to(weight_dtype)
    grads = weight_dtype.is_floating_point
    upstream = randn((M, N), seed=GRAD_SEED, dtype=dtype)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_(grads)]
    want = F.rms_norm(leaves[0], (N,), leaves[1], RMS_EPS)
    want_grads = torch.autograd.grad(want, leaves[:1 + grads], upstream)
    for ours in (lambda x, w: rmsnorm.rms_norm(x, (N,), w, RMS_EPS),
                 lambda x, w: add_rmsnorm.add_rms_norm(x, None, (N,), w, RMS_EPS)):
        leaves = [t.detach().to(device).requires_grad_(i == 0 or grads)
                  for i, t in enumerate((x, weight))]
        got = ours(*leaves)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.cpu(), want, **norm_tolerance(dtype))
        got_grads = torch.autograd.grad(got, leaves[:1 + grads], upstream.to(device))
        for mine, theirs in zip(got_grads, want_grads, strict=True):
            assert mine.dtype == theirs.dtype
            torch.testing.assert_close(mine.cpu(), theirs,
                                       **norm_tolerance(max(dtype, theirs.dtype,
                                                            key=lambda t: torch.finfo(t).eps)))


def test_rms_norm_refuses_a_complex_weight():
    x = randn((M, N), dtype=S)
    with pytest.raises(TypeError, match="argument 'weight' must have a real dtype, got "
                                        "torch.complex64"):
        rmsnorm.rms_norm(x, (N,), torch.ones(N, dtype=torch.complex64))


def test_layer_norm_takes_the_parameter_dtypes_torch_takes(monkeypatch):
    """torch's layer_norm takes weight and bias of the input's dtype, or float32 for a 16-bit
    input, and of one dtype when both are given; ours (layer_norm and add_layer_norm) take the
    same combinations, with torch's result, and refuse the others naming the argument."""
    select_torch_path(monkeypatch)
    for dtype, weight_dtype, bias_dtype in itertools.product(FLOATS, (*FLOATS, None),
                                                             (*FLOATS, None)):
        x = randn((2, 8), seed=1, dtype=dtype)
        weight = None if weight_dtype is None else randn((8,), seed=2, dtype=weight_dtype)
        bias = None if bias_dtype is None else randn((8,), seed=3, dtype=bias_dtype)
        combination = f"input {dtype}, weight {weight_dtype}, bias {bias_dtype}"
        try:
            want = F.layer_norm(x, (8,), weight, bias)
        except RuntimeError:
            want = None
        for ours in (lambda x, w, b: layernorm.layer_norm(x, (8,), w, b),
                     lambda x, w, b: add_layernorm.add_layer_norm(x, None, (8,), w, b)):
            if want is None:
                with pytest.raises(TypeError, match="argument '(weight|bias)' must have the "
                                                    "dtype of"):
                    ours(x, weight, bias)
                continue
            got = ours(x, weight, bias)
            assert got.dtype == want.dtype, combination
            torch.testing.assert_close(got, want, **norm_tolerance(dtype), msg=combination)


def select_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls on CPU tensors take the torch path (argument checks are the same on both)."""
    generated_torch_path(monkeypatch)


# Module reprs


NON_DEFAULT = {
    "AddLayerNorm": (add_layernorm.AddLayerNorm,
                     {"prenorm": True, "residual_in_fp32": True, "memory": "invertible",
                      "bias": False, "eps": 1e-6}),
    "AddRMSNorm": (add_rmsnorm.AddRMSNorm,
                   {"prenorm": True, "residual_in_fp32": True, "memory": "invertible",
                    "weight_offset": 1.0, "eps": 1e-6}),
    "LayerNorm": (layernorm.LayerNorm,
                  {"memory": "recompute_mean", "bias": False, "elementwise_affine": False}),
    "RMSNorm": (rmsnorm.RMSNorm, {"memory": "invertible", "weight_offset": 1.0, "eps": 0.5}),
}


#: each module's torch twin, and the constructor arguments the twin takes (beyond
#: normalized_shape) with values to try
TWINS = {
    "LayerNorm": (layernorm.LayerNorm, torch.nn.LayerNorm),
    "AddLayerNorm": (add_layernorm.AddLayerNorm, torch.nn.LayerNorm),
    "RMSNorm": (rmsnorm.RMSNorm, torch.nn.RMSNorm),
    "AddRMSNorm": (add_rmsnorm.AddRMSNorm, torch.nn.RMSNorm),
}
TWIN_ARGUMENTS = {
    torch.nn.LayerNorm: {"eps": (1e-5, 1e-6), "elementwise_affine": (True, False),
                         "bias": (True, False)},
    torch.nn.RMSNorm: {"eps": (None, 1e-6), "elementwise_affine": (True, False)},
}


def twin_constructions(twin: type) -> list[dict]:
    """Every combination of the twin's constructor arguments (TWIN_ARGUMENTS)."""
    arguments = TWIN_ARGUMENTS[twin]
    return [dict(zip(arguments, values, strict=True))
            for values in itertools.product(*arguments.values())]


@pytest.mark.parametrize("name", NON_DEFAULT)
def test_repr_shows_every_option_that_differs_from_its_default(name):
    """torch's own repr of the twin built with the arguments it takes, then ours that differ."""
    cls, options = NON_DEFAULT[name]
    twin = TWINS[name][1]
    text = cls(N, **options).extra_repr()
    theirs = {k: v for k, v in options.items() if k in TWIN_ARGUMENTS[twin]}
    assert text.startswith(twin(N, **theirs).extra_repr()), text
    for option, value in options.items():
        if option not in theirs:
            assert f"{option}={value!r}" in text, f"{option}={value!r} missing from {text}"


@pytest.mark.parametrize("name", TWINS)
def test_repr_is_torchs_for_every_constructor_combination(name):
    ours, twin = TWINS[name]
    for shape in (N, (2, 3)):
        for arguments in twin_constructions(twin):
            assert ours(shape, **arguments).extra_repr() == \
                twin(shape, **arguments).extra_repr(), arguments


#: what other torch versions may show: bias only when off, or not at all; eps only when set
OTHER_TORCH_REPRS = {
    (torch.nn.LayerNorm, "bias only when off"): lambda self: (
        "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__) + (", bias=False" if self.bias is None else "")),
    (torch.nn.LayerNorm, "no bias"): lambda self: (
        "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__)),
    (torch.nn.RMSNorm, "eps only when set"): lambda self: (
        f"{self.normalized_shape}" + (f", eps={self.eps}" if self.eps is not None else "")
        + f", elementwise_affine={self.elementwise_affine}"),
}


@pytest.mark.parametrize(("name", "variant"), [
    (name, variant) for name, (_, twin) in TWINS.items()
    for other, variant in OTHER_TORCH_REPRS if other is twin])
def test_repr_follows_what_the_installed_torch_shows(monkeypatch, name, variant):
    """With torch's extra_repr replaced by another version's, ours shows what that one does."""
    ours, twin = TWINS[name]
    monkeypatch.setattr(twin, "extra_repr", OTHER_TORCH_REPRS[twin, variant])
    for arguments in twin_constructions(twin):
        assert ours(N, **arguments).extra_repr() == twin(N, **arguments).extra_repr(), arguments


@pytest.mark.parametrize("options", [{}, {"ignore_index": 3}, {"reduction": "sum"},
                                     {"label_smoothing": 0.1, "reduction": "none"}])
def test_cross_entropy_loss_prints_like_torch(options):
    ours, theirs = cross_entropy.CrossEntropyLoss(**options), torch.nn.CrossEntropyLoss(**options)
    shown = ", ".join(f"{name}={value!r}" for name, value in options.items())
    assert repr(ours) == f"CrossEntropyLoss({shown})"
    if not options:
        assert repr(ours) == repr(theirs)
    assert type(ours.ignore_index) is type(theirs.ignore_index) is int
    assert (ours.ignore_index, ours.reduction) == (theirs.ignore_index, theirs.reduction)


# Rows holding inf and NaN


SPECIAL_TARGET = torch.tensor([0, 5, 7, 20, 36])
SPECIAL = {
    "rms_norm": (rmsnorm, lambda x, w: rmsnorm.rms_norm(x, (37,), w, RMS_EPS),
                 lambda x, w: F.rms_norm(x, (37,), w, RMS_EPS), True),
    "rms_norm invertible": (
        rmsnorm, lambda x, w: rmsnorm.rms_norm(x, (37,), w, RMS_EPS, memory="invertible"),
        lambda x, w: F.rms_norm(x, (37,), w, RMS_EPS), True),
    "rms_norm weight_offset": (
        rmsnorm, lambda x, w: rmsnorm.rms_norm(x, (37,), w, RMS_EPS, weight_offset=1.0),
        lambda x, w: F.rms_norm(x, (37,), w + 1.0, RMS_EPS), True),
    "add_rms_norm": (
        add_rmsnorm, lambda x, w: add_rmsnorm.add_rms_norm(x, x.detach() * 0.5, (37,), w, RMS_EPS),
        lambda x, w: F.rms_norm(x + x.detach() * 0.5, (37,), w, RMS_EPS), True),
    "add_rms_norm invertible": (
        add_rmsnorm,
        lambda x, w: add_rmsnorm.add_rms_norm(x, None, (37,), w, RMS_EPS, memory="invertible"),
        lambda x, w: F.rms_norm(x, (37,), w, RMS_EPS), True),
    "add_rms_norm weight_offset": (
        add_rmsnorm,
        lambda x, w: add_rmsnorm.add_rms_norm(x, None, (37,), w, RMS_EPS, weight_offset=1.0),
        lambda x, w: F.rms_norm(x, (37,), w + 1.0, RMS_EPS), True),
    **{f"layer_norm {memory}": (
        layernorm, lambda x, w, m=memory: layernorm.layer_norm(x, (37,), w, memory=m),
        lambda x, w: F.layer_norm(x, (37,), w), True)
       for memory in ("default", "recompute_mean", "invertible")},
    # a row holding +inf: NaN throughout, as torch's own (tests/test_inf_rows.py)
    "softmax": (softmax, lambda x: softmax.softmax(x, -1), lambda x: torch.softmax(x, -1), False),
    "cross_entropy": (
        cross_entropy,
        lambda x: cross_entropy.cross_entropy(x, SPECIAL_TARGET.to(x.device), reduction="none"),
        lambda x: F.cross_entropy(x, SPECIAL_TARGET.to(x.device), reduction="none"),
        False),
}


def special_inputs(weighted: bool) -> list[torch.Tensor]:
    """fp32 rows of 37: row 1 holds +inf, row 2 -inf (at row 2's target class), row 3 NaN;
    rows 0 and 4 are finite."""
    x = randn((5, 37), seed=3, dtype=torch.float32)
    x[1, 3], x[2, 7], x[3, 11] = math.inf, -math.inf, math.nan
    return [x, randn((37,), seed=4, dtype=torch.float32, shift=1.5)] if weighted else [x]


def special_run(fn: Callable, inputs: list, device: torch.device) -> list:
    leaves = [t.detach().to(device).clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(randn(out.shape, seed=GRAD_SEED, device=device, dtype=out.dtype))
    return [out.detach().cpu(), *(leaf.grad.cpu() for leaf in leaves)]


@pytest.mark.parametrize("form", ["persistent", "fixed", "looped"])
@pytest.mark.parametrize("name", SPECIAL)
def test_special_values_stay_in_their_row_like_torch(device, overrides, form, name):
    """inf, -inf and NaN give torch's values in their row (NaN where torch's are NaN, inf where
    they are inf) and leave the other rows finite and within torch's own fp32 error.

    torch's reference is its CPU kernel on every device: its CUDA RMSNorm (rows whose width is
    no multiple of 4) accumulates the mean square by Welford's update, which turns a row holding
    ±inf into NaN throughout, where its CPU and vectorised CUDA kernels give the IEEE result
    that rms_norm's definition gives (rstd = 0: NaN at the inf only, 0 elsewhere)."""
    module, ours, theirs, weighted = SPECIAL[name]
    overrides.enter_context(forced(module, form))
    inputs = special_inputs(weighted)
    got = special_run(ours, inputs, device)
    exact = special_run(theirs, [t.double() for t in inputs], torch.device("cpu"))
    torch_own = special_run(theirs, inputs, torch.device("cpu"))
    for index, (mine, ref, base) in enumerate(zip(got, exact, torch_own, strict=True)):
        assert torch.equal(mine.isnan(), ref.isnan()), f"result {index}: NaN at {mine.isnan()}"
        special = ref.isinf()
        assert torch.equal(mine[special], ref[special].float()), f"result {index}: inf differs"
        finite = ref.isfinite()
        rows = 1 if index < 2 else 5  # a parameter's gradient sums the rows
        atol = LOW_PRECISION_ATOL[torch.float32] * math.sqrt(rows)
        error = max_abs_error(mine[finite], ref[finite])
        torch_error = max_abs_error(base[finite], ref[finite])
        assert error <= 2 * torch_error + atol, (
            f"result {index}: max abs error {error:.3g} > 2 * torch's {torch_error:.3g}")
    output, dinput = got[0], got[1]
    assert output[[0, 4]].isfinite().all() and dinput[[0, 4]].isfinite().all()

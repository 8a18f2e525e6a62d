"""Shared helpers for the numerics tests of the generated modules.

Every check compares a generated function ("ours") with its torch counterpart
("theirs"): callables taking the tensors of an input list (``None`` for an
absent weight or bias) and returning one tensor.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pytest
import torch

from codegen.runtime import dispatch

HAS_CUDA = torch.cuda.is_available()
PATHS = ("triton", "torch")
FP64_TOL = {"rtol": 1e-12, "atol": 1e-12}
LOW_PRECISION_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5}
LOW_PRECISION_DTYPES = tuple(LOW_PRECISION_ATOL)
BAD_INPUT = (TypeError, ValueError, RuntimeError)
LOOPED_BLOCK_N = 16
# Enough rows that a racy column reduction would show on a GPU; few for the interpreter.
DETERMINISM_ROWS = 4096 if HAS_CUDA else 40
NAMES = ("output", "dinput", "dweight", "dbias")
GRAD_SEED = 1234

Fn = Callable[..., torch.Tensor]
Inputs = Sequence[torch.Tensor | None]
Results = list[torch.Tensor | None]


# Paths and schedules


def generated_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU calls take the generated torch path: no interpreter, and the dispatch forced to the
    kernels, which off the interpreter means that path (otherwise a CPU call runs torch's
    expression of the op, and a swap without one the model's own code:
    codegen/runtime/dispatch.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "FORCED", "kernels")


def select_path(monkeypatch: pytest.MonkeyPatch, path: str) -> torch.device:
    """Route calls to `path` ("triton" or "torch"); return the device for its tensors.

    On a CUDA machine the Triton path means CUDA tensors and the torch path CPU
    tensors. Without CUDA both use CPU tensors and the generated dispatch picks
    the path from TRITON_INTERPRET at call time.
    """
    if path == "torch":
        generated_torch_path(monkeypatch)
    elif not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cuda" if HAS_CUDA and path == "triton" else "cpu")


def force_looped(module: object, one_sweep: bool = True, reverse: bool = False):
    """A context manager (the module's `SCHEDULES.override`) within which rows wider than
    LOOPED_BLOCK_N take the looped-row schedule, with two dependent reductions in one sweep
    (codegen/fuse.py) or, `one_sweep=False`, in a pass each; `reverse`: with every other sweep
    run backwards (the form's bit 4, REVERSE). Tests enter it with `with` or through the
    `overrides` fixture (tests/conftest.py)."""
    return module.SCHEDULES.override(
        persistent_max_block_n=LOOPED_BLOCK_N,
        persistent_max_bwd_row_bytes=0,  # backwards too
        persistent_max_fwd_row_bytes=0,
        one_sweep_min_n=0 if one_sweep else 1 << 62,
        split_min_n=0,  # rows wide enough to split loop instead
        split_other_min_row_bytes=0,
        form_bits=4 if reverse else 0,
    )


#: columns of a slab where tests split rows: on a GPU most test rows then span several
#: programs (the interpreter runs one program a row: `Schedules.split_rows`)
SPLIT_BLOCK_N = 64


def splits(module: object) -> bool:
    """Whether a generated module has kernels with a split form (`<kernel>_split`)."""
    return any(name.endswith("_split") for name in vars(module))


def force_split(module: object):
    """A context manager (the module's `SCHEDULES.override`) within which every kernel with a
    split form splits its rows, over slabs of SPLIT_BLOCK_N columns."""
    return module.SCHEDULES.override(split_min_n=1, split_min_row_bytes=0, split_max_row_bytes=0,
                                     split_other_min_row_bytes=1, split_block_n=SPLIT_BLOCK_N)


# Inputs


def randn(
    shape: Sequence[int],
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
    shift: float = 0.0,
) -> torch.Tensor:
    """Seeded standard normal values (drawn in fp64 on CPU) plus `shift`."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) + shift
    return values.to(device=device, dtype=dtype)


def norm_inputs(
    shape: Sequence[int],
    param_ndim: int,
    device: torch.device | str,
    *,
    weight: bool = True,
    bias: bool = False,
    shift: float = 0.0,
) -> list[torch.Tensor | None]:
    """[input, weight, bias] for a norm over the last `param_ndim` dims of `shape`."""
    param_shape = tuple(shape)[len(shape) - param_ndim :]
    return [
        randn(shape, device=device, shift=shift),
        randn(param_shape, seed=1, device=device, shift=1.0) if weight else None,
        randn(param_shape, seed=2, device=device) if bias else None,
    ]


def cast(inputs: Inputs, dtype: torch.dtype) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(dtype) for t in inputs]


NON_CONTIGUOUS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # Each gives x's values and shape in another layout.
    "transposed": lambda x: x.mT.contiguous().mT,
    "element_stride_2": lambda x: torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0],
    "row_stride_2n": lambda x: torch.cat([x, torch.zeros_like(x)], dim=-1)[..., : x.shape[-1]],
}


# Running and judging


def forward_backward(
    fn: Fn,
    inputs: Inputs,
    grad_dtype: torch.dtype | None = None,
    wrt: Sequence[int] | None = None,
) -> Results:
    """[output, grad of each input] of fn on fresh leaf copies of `inputs`.

    Only the inputs at indices `wrt` (default: all) require grad. The output
    gradient is seeded noise rounded to `grad_dtype` (default: the output's
    dtype), so runs in different dtypes can share it.
    """
    leaves = [
        None if t is None else t.detach().clone().requires_grad_(wrt is None or i in wrt)
        for i, t in enumerate(inputs)
    ]
    out = fn(*leaves)
    grad = randn(out.shape, seed=GRAD_SEED, device=out.device, dtype=grad_dtype or out.dtype)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(None if t is None else t.grad for t in leaves)]


def assert_matches_torch(
    ours: Fn, theirs: Fn, inputs: Inputs, wrt: Sequence[int] | None = None
) -> None:
    """Output (with and without autograd) and input gradients equal torch's to fp64 tolerance."""
    with torch.no_grad():
        torch.testing.assert_close(
            ours(*inputs),
            theirs(*inputs),
            equal_nan=True,
            msg=lambda m: f"no-grad output: {m}",
            **FP64_TOL,
        )
    mine, want = forward_backward(ours, inputs, wrt=wrt), forward_backward(theirs, inputs, wrt=wrt)
    for name, got, expected in zip(NAMES, mine, want, strict=False):
        if expected is None:
            assert got is None, f"{name}: expected None, got a tensor"
            continue
        assert got is not None, f"{name}: missing"
        torch.testing.assert_close(
            got, expected, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}", **FP64_TOL
        )


def max_abs_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    assert got.shape == exact.shape, f"shape {tuple(got.shape)} != {tuple(exact.shape)}"
    if got.numel() == 0:
        return 0.0
    return (got.double() - exact).abs().max().item()


def interpreter_rounds_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a call on x runs Triton's interpreter and stores bf16.

    The interpreter (triton 3.9) converts fp32 -> bf16 by truncation; GPUs and
    torch round to nearest even, with half the error.
    """
    interpreted = x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted and dtype == torch.bfloat16


def bf16_toward_zero(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 toward zero: the low 16 bits of its fp32 form dropped."""
    return (t.float().view(torch.int32) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)


def torch_baseline(theirs: Fn, low: Inputs, dtype: torch.dtype) -> Results:
    """torch's own [output, grads] in `dtype`, rounded the way the path under test rounds."""
    if not interpreter_rounds_toward_zero(low[0], dtype):
        return forward_backward(theirs, low)
    results = forward_backward(theirs, cast(low, torch.float32), grad_dtype=dtype)
    return [None if t is None else bf16_toward_zero(t) for t in results]


def assert_low_precision_ok(ours: Fn, theirs: Fn, inputs64: Inputs, dtype: torch.dtype) -> None:
    """Judge ours in `dtype` against an fp64 reference on the same rounded inputs.

    The output and each input gradient must have its tensor's dtype and a max
    abs error at most twice torch's own same-dtype error plus a small atol;
    a parameter gradient sums over rows, so its atol grows with sqrt(rows).
    """
    low = cast(inputs64, dtype)
    exact = forward_backward(theirs, cast(low, torch.float64), grad_dtype=dtype)
    baseline = torch_baseline(theirs, low, dtype)
    mine = forward_backward(ours, low)
    x = low[0]
    for name, tensor, got, base, ref in zip(NAMES, [x, *low], mine, baseline, exact, strict=False):
        if ref is None:
            continue
        assert got is not None, f"{name}: missing"
        assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
        rows = max(1, x.numel() // max(1, tensor.numel()))
        atol = LOW_PRECISION_ATOL[dtype] * math.sqrt(rows)
        err, torch_err = max_abs_error(got, ref), max_abs_error(base, ref)
        assert err <= 2 * torch_err + atol, (
            f"{name} in {dtype}: max abs error {err:.3g} > 2 * torch's {torch_err:.3g} + {atol:g}"
        )


def gradcheck(fn: Fn, inputs: Inputs, *, fast: bool) -> None:
    """torch.autograd.gradcheck of fn (fp64) w.r.t. every tensor in `inputs`."""
    present = [i for i, t in enumerate(inputs) if t is not None]
    leaves = tuple(inputs[i].detach().clone().requires_grad_() for i in present)

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        args: list[torch.Tensor | None] = [None] * len(inputs)
        for i, t in zip(present, tensors, strict=True):
            args[i] = t
        return fn(*args)

    assert torch.autograd.gradcheck(call, leaves, fast_mode=fast)


def assert_nan_stays_in_its_row(
    ours: Fn, theirs: Fn, inputs: Inputs, index: tuple[int, int]
) -> None:
    """A NaN put in the 2-D input at `index` makes that whole row NaN, and no other."""
    x = inputs[0].clone()
    x[index] = float("nan")
    out = ours(x, *inputs[1:])
    row = index[0]
    assert out[row].isnan().all(), f"row {row} should be all NaN: {out[row]}"
    others = torch.cat([out[:row], out[row + 1 :]])
    assert others.isfinite().all(), "NaN leaked into other rows"
    torch.testing.assert_close(out, theirs(x, *inputs[1:]), equal_nan=True)


def assert_deterministic_grads(fn: Fn, inputs: Inputs) -> None:
    """Two backward runs give bitwise identical gradients of every input."""
    first, second = forward_backward(fn, inputs), forward_backward(fn, inputs)
    for name, t, a, b in zip(NAMES[1:], inputs, first[1:], second[1:], strict=False):
        if t is not None:
            assert a is not None and torch.equal(a, b), f"{name} differs between two identical runs"


# Bad input


class BadCall(NamedTuple):
    """A call given a (4, 8) fp32 input x and (8,) fp32 weight w, and what its error names."""

    call: Callable[[torch.Tensor, torch.Tensor], object]
    words: tuple[str, ...]
    errors: tuple[type[Exception], ...] = BAD_INPUT


def assert_bad_call_rejected(case: BadCall, device: torch.device) -> None:
    """The call raises one of case.errors whose message contains every word."""
    x = randn((4, 8), device=device, dtype=torch.float32)
    with pytest.raises(case.errors) as info:
        case.call(x, torch.ones(8, device=device))
    message = str(info.value)
    missing = [w for w in case.words if w not in message]
    assert not missing, f"error message {message!r} does not name {missing}"


# Modules


def randomize_parameters(module: torch.nn.Module, seed: int = 3) -> None:
    with torch.no_grad():
        for i, param in enumerate(module.parameters()):
            param.copy_(randn(param.shape, seed=seed + i, device=param.device, dtype=param.dtype))


def assert_module_like_torch(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Same state_dict keys, parameters (name, dtype, device, value) and extra_repr."""
    assert list(ours.state_dict()) == list(theirs.state_dict())
    mine, want = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(mine) == list(want)
    for name, param in want.items():
        got = mine[name]
        assert (got.dtype, got.device, got.shape) == (param.dtype, param.device, param.shape)
        if param.device.type != "meta":
            assert torch.equal(got, param), f"{name} differs from torch's"
    for name in ("weight", "bias"):
        if hasattr(theirs, name):
            assert (getattr(ours, name, "missing") is None) == (getattr(theirs, name) is None), name
    mine_repr, torch_repr = ours.extra_repr(), theirs.extra_repr()
    assert mine_repr == torch_repr, f"extra_repr {mine_repr!r} != torch's {torch_repr!r}"


def assert_built_like_torch(
    ours_cls: type, torch_cls: type, shape: object, **kwargs: object
) -> None:
    """Both classes built with the same arguments give the same module."""
    assert_module_like_torch(ours_cls(shape, **kwargs), torch_cls(shape, **kwargs))


def assert_reset_like_torch(ours_cls: type, torch_cls: type, shape: object) -> None:
    """reset_parameters() restores torch's initial parameters."""
    module = ours_cls(shape)
    randomize_parameters(module)
    module.reset_parameters()
    assert_module_like_torch(module, torch_cls(shape))


def assert_loads_torch_state_dict(
    ours_cls: type, torch_cls: type, shape: object, device: torch.device, **kwargs: object
) -> None:
    """Ours, loaded with a torch module's random state_dict, matches it in fp64."""
    kwargs = {**kwargs, "device": device, "dtype": torch.float64}
    theirs = torch_cls(shape, **kwargs)
    randomize_parameters(theirs)
    ours = ours_cls(shape, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    x = randn((4, *theirs.normalized_shape), device=device, shift=1.5)
    assert_matches_torch(ours, theirs, [x])


def assert_unseeded_calls_replay(draw, device):
    """`draw()` (a call with seed=None) takes its seed from torch's generator: reseeding
    replays the first draw, and a second draw differs from it."""
    def reseed():
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.manual_seed(0)

    reseed()
    first, second = draw(), draw()
    reseed()
    assert torch.equal(draw(), first)
    assert not torch.equal(first, second)


def pickled(patched, original):
    """`patched` through a pickle round trip, where the unpatched `original` pickles. Where it
    does not (kernels before 0.17 holds transformers' rotary function in a module of a local
    class, so no such model pickles), `patched` must fail alike, and comes back as it is."""
    try:
        pickle.dumps(original)
    except (AttributeError, TypeError, pickle.PicklingError) as error:
        try:
            pickle.dumps(patched)
        except type(error):
            return patched
        raise AssertionError("the patched model pickles where the original does not") from error
    return pickle.loads(pickle.dumps(patched))

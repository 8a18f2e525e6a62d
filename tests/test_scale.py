"""Scale: every op at rows of 262144 columns, and on tensors of more than 2^31 elements.

Element offsets past 2^31 overflow int32, so the kernels compute them in int64 (row offsets,
broadcast-mask offsets, dropout counters). The big tensors (4+ GiB each in bf16) only fit a
GPU: those tests need CUDA. They judge the rows on both sides of element 2^31 and the last
rows against an fp64 reference of those rows (every op is row-wise), and the parameter
gradients (sums over every row) against an fp64 sum taken chunk by chunk, each within twice
torch's own bf16 error on the same tensors plus a small atol, as the low-precision tests do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from reference import HAS_CUDA, LOW_PRECISION_ATOL, max_abs_error

from codegen.runtime import triton_helpers
from generated import (
    add_layernorm,
    add_rmsnorm,
    bias_dropout_add,
    cross_entropy,
    geglu,
    gelu,
    gelu_tanh,
    layernorm,
    masked_softmax,
    rmsnorm,
    softmax,
    swiglu,
)

WIDEST = 262144
BIG = 2**31
MASK_ROWS = 64  # rows of the (MASK_ROWS, N) mask that masked_softmax broadcasts over its batch
NEEDS_BIG_GPU = pytest.mark.skipif(
    not HAS_CUDA, reason="tensors of 2^31+ elements (4+ GiB each in bf16) need a CUDA GPU"
)


class Case(NamedTuple):
    """An op over an (M, N) row space. `kinds` says what each input is: "x" a row tensor that
    takes a gradient, "p" an (N,) parameter that takes one, "t" one int64 target per row,
    "m" a bool (MASK_ROWS, N) mask broadcast over the rows."""

    ours: Callable[..., torch.Tensor]
    theirs: Callable[..., torch.Tensor]
    kinds: str
    big_n: int  # the row width of the more-than-2^31-element test


def _masked(x, m):
    return torch.where(m, 0.125 * x, float("-inf"))


CASES = {
    "layernorm": Case(
        lambda x, w, b: layernorm.layer_norm(x, (x.shape[-1],), w, b),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        "xpp",
        8192,
    ),
    "rmsnorm": Case(
        lambda x, w: rmsnorm.rms_norm(x, (x.shape[-1],), w, 1e-6),
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "xp",
        8192,
    ),
    "add_layernorm": Case(
        lambda x, r, w, b, c: add_layernorm.add_layer_norm(
            x, r, (x.shape[-1],), w, b, input_bias=c
        ),
        lambda x, r, w, b, c: F.layer_norm(x + c + r, (x.shape[-1],), w, b),
        "xxppp",
        4096,
    ),
    "add_rmsnorm": Case(
        lambda x, r, w, c: add_rmsnorm.add_rms_norm(x, r, (x.shape[-1],), w, 1e-6, input_bias=c),
        lambda x, r, w, c: F.rms_norm(x + c + r, (x.shape[-1],), w, 1e-6),
        "xxpp",
        4096,
    ),
    "softmax": Case(
        lambda x: softmax.softmax(x, -1),
        lambda x: torch.softmax(x, -1),
        "x",
        WIDEST,
    ),
    "masked_softmax": Case(
        lambda x, m: masked_softmax.masked_softmax(x, m, scale=0.125),
        lambda x, m: torch.softmax(_masked(x, m), -1),
        "xm",
        4096,
    ),
    "bias_dropout_add": Case(
        lambda x, r, b: bias_dropout_add.bias_dropout_add(x, r, bias=b, p=0.0),
        lambda x, r, b: r + (x + b),
        "xxp",
        4096,
    ),
    "gelu": Case(
        lambda x, b: gelu.gelu(x, bias=b),
        lambda x, b: F.gelu(x + b),
        "xp",
        4096,
    ),
    "gelu_tanh": Case(
        lambda x, b: gelu_tanh.gelu_tanh(x, bias=b),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
        "xp",
        4096,
    ),
    "swiglu": Case(swiglu.swiglu, lambda g, u: F.silu(g) * u, "xx", 8192),
    "geglu": Case(geglu.geglu, lambda g, u: F.gelu(g) * u, "xx", 8192),
    "cross_entropy": Case(
        lambda x, t: cross_entropy.cross_entropy(x, t, reduction="none"),
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        "xt",
        128256,
    ),
}


def make_inputs(case: Case, M: int, N: int, device, dtype, mask_rows: int) -> list[torch.Tensor]:
    """The case's inputs for M rows of N columns, drawn on `device` in `dtype`; a mask has
    `mask_rows` rows and the input comes as (M // mask_rows, mask_rows, N) to broadcast it."""
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = []
    for i, kind in enumerate(case.kinds):
        if kind == "x":
            shape = (M // mask_rows, mask_rows, N) if "m" in case.kinds else (M, N)
            inputs.append(torch.randn(shape, generator=gen, device=device, dtype=dtype))
        elif kind == "p":
            shift = 1.0 if i == case.kinds.index("p") else 0.0  # a weight near 1
            inputs.append(torch.randn(N, generator=gen, device=device, dtype=dtype) + shift)
        elif kind == "t":
            target = torch.randint(0, N, (M,), generator=gen, device=device)
            inputs.append(torch.where(torch.arange(M, device=device) % 7 == 3, -100, target))
        else:
            inputs.append(torch.rand((mask_rows, N), generator=gen, device=device) < 0.9)
    return inputs


def select_rows(case: Case, inputs: list[torch.Tensor], rows: torch.Tensor) -> list[torch.Tensor]:
    """The inputs of `rows` alone, as a (len(rows), N) problem: parameters stay whole."""
    picked = []
    for kind, t in zip(case.kinds, inputs, strict=True):
        if kind == "x":
            picked.append(t.reshape(-1, t.shape[-1])[rows])
        elif kind == "t":
            picked.append(t[rows])
        elif kind == "m":
            picked.append(t[rows % t.shape[0]])
        else:
            picked.append(t)
    return picked


def run(fn, case: Case, inputs, dy, dtype=None):
    """(output, gradients of the "x" and "p" inputs) of fn, inputs cast to `dtype` if given."""
    leaves = []
    for kind, t in zip(case.kinds, inputs, strict=True):
        if kind in "xp":
            t = (t if dtype is None else t.to(dtype)).detach().requires_grad_()
        leaves.append(t)
    out = fn(*leaves)
    out.backward(dy.reshape(out.shape).to(out.dtype))
    return out.detach(), [
        t.grad for kind, t in zip(case.kinds, leaves, strict=True) if kind in "xp"
    ]


def check_scale(
    name: str, M: int, N: int, rows: list[int], device: str, dtype: torch.dtype, mask_rows: int
) -> None:
    """ours in `dtype` on an (M, N) problem: the output and row gradients of `rows`, and the
    parameter gradients, within twice torch's same-dtype error plus an atol of an fp64
    reference (the rows alone; the parameter gradients summed chunk by chunk)."""
    case = CASES[name]
    rows = torch.tensor(rows, device=device)
    inputs = make_inputs(case, M, N, device, dtype, mask_rows)
    dy = torch.randn(
        (M,) if "t" in case.kinds else (M, N),
        generator=torch.Generator(device=device).manual_seed(1),
        device=device,
        dtype=dtype,
    )
    params = [i for i, kind in enumerate(k for k in case.kinds if k in "xp") if kind == "p"]

    def judged(out, grads):
        return [out.reshape(M, -1)[rows].double()] + [
            g.double() if i in params else g.reshape(M, -1)[rows].double()
            for i, g in enumerate(grads)
        ]

    mine = judged(*run(case.ours, case, inputs, dy))
    base = judged(*run(case.theirs, case, inputs, dy))
    if device == "cuda":
        torch.cuda.empty_cache()
    exact_out, exact_grads = run(
        case.theirs, case, select_rows(case, inputs, rows), dy.reshape(M, -1)[rows], torch.float64
    )
    exact = [exact_out.reshape(len(rows), -1)] + [
        g if i in params else g.reshape(len(rows), -1) for i, g in enumerate(exact_grads)
    ]
    for i in params:
        exact[1 + i] = torch.zeros_like(exact[1 + i])
    chunk = max(1, 2**26 // N)
    for start in range(0, M, chunk) if params else ():
        span = torch.arange(start, min(M, start + chunk), device=device)
        _, chunk_grads = run(
            case.theirs,
            case,
            select_rows(case, inputs, span),
            dy.reshape(M, -1)[span],
            torch.float64,
        )
        for i in params:
            exact[1 + i] += chunk_grads[i]

    for k, (got, want, torch_got) in enumerate(zip(mine, exact, base, strict=True)):
        summed = k - 1 in params
        what = (
            "output"
            if k == 0
            else f"gradient of input {k - 1}" + (" (summed over rows)" if summed else "")
        )
        atol = LOW_PRECISION_ATOL[dtype] * (math.sqrt(M) if summed else 1.0)
        err, torch_err = max_abs_error(got, want), max_abs_error(torch_got, want)
        assert err <= 2 * torch_err + atol, (
            f"{name} {M}x{N} {dtype}: {what}, rows {rows.tolist()}: max abs error {err:.3g} > "
            f"2 * torch's {torch_err:.3g} + {atol:.3g}"
        )


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_of_262144_columns(name):
    # the widest rows the issue asks for, in fp32, on any device (the interpreter on a CPU)
    device = "cuda" if HAS_CUDA else "cpu"
    check_scale(name, 2, WIDEST, [0, 1], device, torch.float32, mask_rows=2)


@NEEDS_BIG_GPU
@pytest.mark.parametrize("name", sorted(CASES))
def test_more_than_2_to_the_31_elements(name):
    N = CASES[name].big_n
    M = (BIG // N + 3 + MASK_ROWS - 1) // MASK_ROWS * MASK_ROWS  # past 2^31 elements
    first_past = BIG // N  # the first row with an element offset >= 2^31
    assert M * N > BIG and first_past < M - 2
    rows = [0, 1, first_past - 1, first_past, first_past + 1, M - 2, M - 1]
    check_scale(name, M, N, rows, "cuda", torch.bfloat16, mask_rows=MASK_ROWS)


@NEEDS_BIG_GPU
@pytest.mark.parametrize("name", ["bias_dropout_add", "masked_softmax"])
def test_dropout_mask_past_2_to_the_31_elements(name):
    # the keep mask of an element comes from its int64 index: past 2^31 the kernels must draw
    # exactly what the torch path draws for the same index
    N, seed, p = 4096, 5, 0.1
    M = (BIG // N + 3 + MASK_ROWS - 1) // MASK_ROWS * MASK_ROWS
    first_past = BIG // N
    rows = [0, first_past - 1, first_past, first_past + 1, M - 1]
    gen = torch.Generator("cuda").manual_seed(0)
    if name == "bias_dropout_add":
        x = torch.randn((M, N), generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
        y = bias_dropout_add.bias_dropout_add(x, p=p, seed=seed)
        allowed = torch.ones(len(rows), N, dtype=torch.bool)
    else:
        x = torch.randn(
            (M // MASK_ROWS, MASK_ROWS, N), generator=gen, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        mask = torch.rand((MASK_ROWS, N), generator=gen, device="cuda") < 0.9
        y = masked_softmax.masked_softmax(x, mask, dropout_p=p, seed=seed)
        allowed = mask[torch.tensor(rows, device="cuda") % MASK_ROWS].cpu()
    dy = torch.randn(y.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    y.backward(dy)
    for k, r in enumerate(rows):
        keep = triton_helpers.uniform_torch(seed, 1, N, first_row=r)[0] >= p
        kept = y.detach().reshape(M, N)[r].cpu() != 0
        assert torch.equal(kept, keep & allowed[k]), f"{name}: forward keep mask of row {r} differs"
        if name == "bias_dropout_add":
            assert torch.equal(x.grad.reshape(M, N)[r].cpu() != 0, keep), (
                f"{name}: backward keep mask of row {r} differs"
            )

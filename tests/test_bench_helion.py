"""The Helion peer (benchmarks/helion_ops.py): each Helion forward kernel and the backward
``helion.experimental.backward`` derives from it, against torch, on the CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), fp32, small shapes; and the
backward reduction counts the provider's description states. Skipped where helion does not
import (it is not a dependency of vjpforge: benchmarks/README.md says how the grid gets it)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

try:
    import helion  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any import failure means helion is absent
    pytest.skip(f"helion is not importable ({type(exc).__name__}: {exc}); the Helion peer "
                "is tested where it is installed", allow_module_level=True)

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

# Helion's default config, no autotuning: the interpreter cannot autotune, and the test checks
# values, not speed (read when benchmarks.helion_ops is first imported)
os.environ["VJPFORGE_HELION_EFFORT"] = "none"

from benchmarks import helion_ops  # noqa: E402 - after the skip
from benchmarks.providers import HELION_BACKWARD_REDUCTIONS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, N = 16, 64

CASES = {
    "rmsnorm": (lambda x, w: helion_ops.rms_norm(x, (N,), w, 1e-6),
                lambda x, w: F.rms_norm(x, (N,), w, 1e-6), 1),
    "layernorm": (lambda x, w, b: helion_ops.layer_norm(x, (N,), w, b, 1e-5),
                  lambda x, w, b: F.layer_norm(x, (N,), w, b, 1e-5), 2),
    "softmax": (lambda x: helion_ops.softmax(x, -1), lambda x: torch.softmax(x, -1), 0),
    "swiglu": (helion_ops.swiglu, lambda g, u: F.silu(g) * u, "glu"),
    "geglu": (helion_ops.geglu, lambda g, u: F.gelu(g) * u, "glu"),
}


@pytest.fixture(autouse=True)
def libdevice_in_interpreter():
    """Helion's code calls libdevice functions the interpreter stubs out (see helion_ops)."""
    if DEVICE == "cpu":
        with helion_ops.interpreter_libdevice():
            yield
    else:
        yield


def _inputs(params: int | str, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE)

    if params == "glu":
        return [randn(M, N) * 3, randn(M, N)]
    return [randn(M, N) * 2 + 0.5, *(randn(N) * 0.1 + (1.0 - i) for i in range(params))]


@pytest.mark.parametrize("op", sorted(CASES))
def test_forward_and_derived_backward_match_torch(op: str) -> None:
    ours, reference, params = CASES[op]
    # two calls: the first derives (through helion.experimental.backward), the second runs
    # the derived kernel directly, as the benchmark's later iterations do
    for seed in (0, 1):
        inputs = _inputs(params, seed)
        mine = [t.clone().requires_grad_() for t in inputs]
        theirs = [t.clone().requires_grad_() for t in inputs]
        y, y_ref = ours(*mine), reference(*theirs)
        dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 7))
        dy = dy.to(DEVICE)
        grads = torch.autograd.grad(y, mine, dy)
        grads_ref = torch.autograd.grad(y_ref, theirs, dy)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        for grad, grad_ref in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-5)
    if helion_ops.DIRECT_BACKWARD:
        assert any(kernel is not None for kernel in helion_ops._direct.values())


def test_public_backward_matches_direct_call() -> None:
    x, w = _inputs(1, 3)
    y = helion_ops.rms_norm_fwd(x, w, 1e-6)
    dy = torch.randn_like(y)
    public = helion.experimental.backward(helion_ops.rms_norm_fwd, dy, x, w, 1e-6)
    direct = helion_ops.derived_backward(helion_ops.rms_norm_fwd, dy, (x, w), (1e-6,))
    direct = helion_ops.derived_backward(helion_ops.rms_norm_fwd, dy, (x, w), (1e-6,))
    for a, b in zip(public, direct, strict=True):
        torch.testing.assert_close(a, b)


EXPECTED = {
    "rmsnorm": {"row": 2, "column": 1, "host": 1},
    "layernorm": {"row": 4, "column": 2, "host": 2},
    "softmax": {"row": 5, "column": 0, "host": 0},
    "swiglu": {"row": 0, "column": 0, "host": 0},
    "geglu": {"row": 0, "column": 0, "host": 0},
}


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_backward_reduction_counts(op: str) -> None:
    _source, triton_code = helion_ops.backward_code(op, device=DEVICE)
    counts = helion_ops.count_reductions(triton_code)
    assert counts == EXPECTED[op], triton_code
    if op in HELION_BACKWARD_REDUCTIONS:
        stated = HELION_BACKWARD_REDUCTIONS[op]
        column = f" + {counts['column']} column" if counts["column"] else ""
        assert stated.startswith(f"{counts['row']} row{column} "), stated

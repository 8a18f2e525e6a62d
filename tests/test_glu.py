"""SwiGLU and GeGLU against torch compositions; finite far out on the sigmoid's tails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import (
    assert_low_precision_ok,
    assert_matches_torch,
    gradcheck,
    randn,
)

import generated.geglu as geglu
import generated.swiglu as swiglu
from codegen.runtime import launch

N = 37
OP = (swiglu, geglu)  # the conftest's schedule fixture forces these looped
VARIANTS = {
    "swiglu": (swiglu.swiglu, lambda gate, up: F.silu(gate) * up),
    "geglu": (geglu.geglu, lambda gate, up: F.gelu(gate) * up),
}



@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_torch(device, schedule, variant):
    ours, theirs = VARIANTS[variant]
    inputs = [randn((4, 3, N), seed=1, device=device) * 3, randn((4, 3, N), seed=2, device=device)]
    assert_matches_torch(ours, theirs, inputs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradcheck(device, variant):
    ours, _ = VARIANTS[variant]
    gradcheck(ours, [randn((3, 5), seed=1, device=device), randn((3, 5), seed=2, device=device)],
              fast=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision(device, variant, dtype):
    ours, theirs = VARIANTS[variant]
    inputs = [randn((64, N), seed=1, device=device) * 2, randn((64, N), seed=2, device=device)]
    assert_low_precision_ok(ours, theirs, inputs, dtype)


def test_swiglu_gradient_is_finite_on_the_tails(device):
    gate = torch.tensor([[-1000.0, -100.0, 0.0, 100.0, 1000.0]], dtype=torch.float32,
                        device=device, requires_grad=True)
    up = torch.ones_like(gate, requires_grad=True)
    y = swiglu.swiglu(gate, up)
    grads = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
    assert all(bool(g.isfinite().all()) for g in grads)
    expected = torch.autograd.grad(F.silu(gate) * up, (gate, up), torch.ones_like(y))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_inputs_must_match(device):
    gate = randn((2, N), device=device)
    with pytest.raises(ValueError, match="argument 'up' must have the shape of 'gate'"):
        swiglu.swiglu(gate, randn((2, N + 1), device=device))
    with pytest.raises(TypeError, match="argument 'up' must be a torch.Tensor, got NoneType"):
        geglu.geglu(gate, None)
    with pytest.raises(TypeError, match="argument 'gate' must have dtype"):
        swiglu.swiglu(torch.ones(2, 3, dtype=torch.int32, device=device), gate)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_fold_into_rows_of_the_fold_width(device, variant):
    """Elementwise-only launchers read contiguous rows whose width is not a multiple of
    fold_block_n as rows of fold_block_n (where the tensor tiles into them): the same values
    bit for bit, forward and backward; rows with a stride of their own are not folded."""
    module = swiglu if variant == "swiglu" else geglu
    forward = getattr(module, f"_{variant}_fwd")
    backward = getattr(module, f"_{variant}_bwd_default")
    gate, up, dy = (randn((6, 96), seed=seed, device=device) * 2 for seed in (1, 2, 3))
    # swiglu's launchers take its gate and down multipliers too
    scalars = (1.0, 1.0) if variant == "swiglu" else ()
    wide = randn((6, 128), seed=4, device=device)
    strided = wide[:, :96]  # rows 128 apart: no fold
    widths = []
    seam = module.SCHEDULES

    def recorded(M, N, *args):
        # the rule's schedule, with the row width each launch asked for kept
        widths.append(N)
        return seam.rule(M, N, *args)

    def run(fold):
        widths.clear()
        results = []
        with seam.override(fold_block_n=fold, choose=recorded):
            for launcher, args in ((forward, (gate, up, *scalars)),
                                   (backward, (dy, gate, up, *scalars)),
                                   (forward, (strided, up, *scalars))):
                seam.forget()  # each launch chooses: none takes an earlier one's schedule
                results += launcher(*args)
        return results, list(widths)

    unfolded, unfolded_widths = run(0)
    folded, folded_widths = run(64)  # 6 x 96 = 9 rows of 64
    if device.type == "cpu" and not launch.use_triton(gate):
        assert unfolded_widths == folded_widths == []  # the torch path: no kernels
    else:
        assert unfolded_widths == [96, 96, 96]
        assert folded_widths == [64, 64, 96]
    for got, want in zip(folded, unfolded, strict=True):
        assert got.shape == want.shape == (6, 96)
        assert torch.equal(got, want)
    expected = VARIANTS[variant][1](gate, up)
    torch.testing.assert_close(folded[0], expected)


def glu_grads(variant, device, scenario, monkeypatch=None):
    """The gradients of x, w_gate and w_up through variant(x @ w_gate, x @ w_up), taken in
    `scenario` (how else gate and up are held; what is kept is checked unchanged by the
    backward), whether gate's and up's gradients are at
    gate's and up's addresses (seen by hooks), and the memory the backward gave its launcher
    for them (whether it gave any, per input)."""
    answers = []
    if monkeypatch is not None:
        # the launcher the Function's backward runs (its mode's, `_BACKWARDS`)
        backwards = (swiglu if variant == "swiglu" else geglu)._BACKWARDS
        launcher = backwards.default

        def recorded(*args, into=None):
            # after the backward decided: the spy's frame counts as no holder
            answers.extend([t is not None for t in into] if into is not None else [False] * 2)
            return launcher(*args, into=into)

        monkeypatch.setattr(backwards, "default", recorded)
    ours, _ = VARIANTS[variant]
    x = randn((6, 16), seed=1, device=device, dtype=torch.float32).requires_grad_()
    w_gate, w_up = (randn((16, 96), seed=s, device=device, dtype=torch.float32).requires_grad_()
                    for s in (2, 3))
    seen = {}
    gate, up = x @ w_gate, x @ w_up
    addresses = gate.data_ptr(), up.data_ptr()
    if scenario == "same":
        up = gate
    def seen_at(name):
        return lambda g: seen.setdefault(name, g.data_ptr()) and None

    gate.register_hook(seen_at("gate"))
    up.register_hook(seen_at("up"))
    # what the scenario keeps besides the Function's saved values
    kept = {"free": (), "same": (), "retain_graph": (), "create_graph": (),
            "held": (gate,), "view": (gate[1:], up[:, 2:]),
            "alias": (gate.detach(), up.detach()),
            "saved_elsewhere": (gate * up,)}[scenario]
    y = ours(gate, up)
    loss = (y * randn(y.shape, seed=4, device=device, dtype=torch.float32)).sum()
    if kept and scenario == "saved_elsewhere":
        loss = loss + kept[0].sum()  # the product saved gate and up for its own backward
    del gate, up
    # what the caller kept must read as before the backward: no gradient written over it
    before = [t.detach().clone() for t in kept]
    inputs = (x, w_gate, w_up)
    retain = scenario in ("retain_graph", "create_graph")
    grads = torch.autograd.grad(loss, inputs, retain_graph=retain, allow_unused=True,
                                create_graph=scenario == "create_graph")
    grads = [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs, strict=True)]
    if retain:  # the saved inputs are intact for a second backward
        again = torch.autograd.grad(loss, inputs, allow_unused=True)
        # (create_graph's backward is torch's ops, the second the kernels: close, not equal)
        for g, a in zip(grads, again, strict=True):
            torch.testing.assert_close(g.detach(), torch.zeros_like(g) if a is None else a)
    for now, then in zip(kept, before, strict=True):
        assert torch.equal(now.detach(), then)
    at_inputs = seen["gate"] == addresses[0], seen["up"] == addresses[1]
    return [g.detach() for g in grads], at_inputs, answers


SCENARIOS = ["free", "held", "view", "alias", "same", "saved_elsewhere", "retain_graph",
             "create_graph"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_backward_writes_gradients_over_inputs_only_autograd_holds(device, variant, scenario,
                                                                   monkeypatch):
    """Where autograd frees gate and up after the backward and nothing else holds them (a
    Python reference, a view, a detached alias, the same tensor as both, another node's saved
    value, a kept graph), each one's gradient is written over its memory; elsewhere the
    backward allocates, and what the caller kept reads as before. The gradients are the same
    either way."""
    expected, *_ = glu_grads(variant, device, "alias")
    got, at_inputs, answers = glu_grads(variant, device, scenario, monkeypatch)
    if scenario in ("same", "saved_elsewhere", "create_graph"):
        # gate's gradient sums two branches, or the backward is torch's ops: checked against
        # torch's expression
        ours, theirs = VARIANTS[variant]
        VARIANTS[variant] = theirs, theirs
        try:
            expected, *_ = glu_grads(variant, device, scenario)
        finally:
            VARIANTS[variant] = ours, theirs
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)
    else:
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)
    # held: gate alone is kept, up is free. The torch path (no kernels) allocates: the answers
    # are the same, the addresses not
    free = {"free": [True, True], "held": [False, True]}.get(scenario, [False, False])
    if scenario == "create_graph":
        # the recorded backward's torch ops allocate, and never call the launcher; what the
        # second backward reuses depends on which inputs the recorded graph saved
        assert len(answers) == 2
    else:
        # a kept graph: the second backward, which frees it, reuses
        assert answers == {"retain_graph": [False, False, True, True]}.get(scenario, free)
    if launch.use_triton(got[0]) and scenario in ("free", "held"):
        assert list(at_inputs) == free


def test_the_probe_counts_once_and_reuse_needs_the_graph_released(device):
    """The holders of an input nothing else holds are counted once a process (and number of
    references a call adds), by a probe Function on the CPU; nothing is reused while a
    backward keeps the graph."""
    references = launch._call_references()
    assert launch._calibrated(references).keys() == {"saved", "upstream"}
    assert launch._calibrated(references) is launch._calibrated(references)
    x = randn((4, 8), device=device, dtype=torch.float32).requires_grad_()
    assert not launch.reusable(x * 2, (4, 8), torch.float32)  # grad mode on: a forward

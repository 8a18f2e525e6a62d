"""Forward-mode AD through every generated op and memory mode: the derived JVP (derive/tangent.py)
against finite differences (gradcheck's forward-AD check) and against the tangent torch's forward
mode gives its own composite, in fp64, on every path; with inputs that require grad (the
autograd Function) and with inputs that carry only a tangent."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from layer_reference import ReferenceLayer
from reference import FP64_TOL, randn
from test_double_backward import CASES, INVERTIBLE, LAYERS, SEED, SHAPE, Case, N, P, keep, leaves

import generated.dropout_add_layernorm as dropout_add_layernorm
import generated.dropout_add_rmsnorm as dropout_add_rmsnorm
import generated.geglu_tanh as geglu_tanh


def _dropped(x, ib, r):
    return (x + ib) * keep(SHAPE, P).to(x.device) / (1 - P) + r


#: the ops with dropout fused before a norm, and the last activation, beside the double-backward
#: cases; every mode of each
MORE = {
    **{f"dropout_add_layer_norm-{mode}": Case(
        lambda x, r, ib, w, b, mode=mode: dropout_add_layernorm.dropout_add_layer_norm(
            x, r, (N,), w, b, input_bias=ib, prenorm=True, dropout_p=P, seed=SEED, memory=mode),
        lambda x, r, ib, w, b: (F.layer_norm(_dropped(x, ib, r), (N,), w, b), _dropped(x, ib, r)),
        (SHAPE, SHAPE, (N,), (N,), (N,))) for mode in ("default", "recompute_mean", "invertible")},
    **{f"dropout_add_rms_norm-{mode}": Case(
        lambda x, r, ib, w, mode=mode: dropout_add_rmsnorm.dropout_add_rms_norm(
            x, r, (N,), w, 1e-6, input_bias=ib, prenorm=True, dropout_p=P, seed=SEED,
            memory=mode),
        lambda x, r, ib, w: (F.rms_norm(_dropped(x, ib, r), (N,), w, 1e-6), _dropped(x, ib, r)),
        (SHAPE, SHAPE, (N,), (N,))) for mode in ("default", "invertible")},
    "geglu_tanh": Case(geglu_tanh.geglu_tanh, lambda g, u: F.gelu(g, approximate="tanh") * u,
                       (SHAPE, SHAPE)),
}
ALL = {**CASES, **INVERTIBLE, **MORE}


def tangents(case: Case) -> list[torch.Tensor]:
    return [randn(shape, seed=60 + i) for i, shape in enumerate(case.shapes)]


def forward_tangents(fn, primals: list[torch.Tensor], directions: list[torch.Tensor]
                     ) -> list[torch.Tensor]:
    """The tangent of each output of fn along `directions`, by torch's forward mode."""
    with fwAD.dual_level():
        outputs = fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, directions, strict=True)))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return [fwAD.unpack_dual(o).tangent for o in outputs]


@pytest.mark.parametrize("name", sorted(ALL))
def test_forward_ad_gradcheck(name, device):
    """The JVP against finite differences, through the autograd Function."""
    case = ALL[name]
    inputs = [t.detach().to(device).requires_grad_() for t in leaves(case)]
    assert torch.autograd.gradcheck(case.ours, inputs, check_forward_ad=True,
                                    check_backward_ad=False, check_undefined_grad=False)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["tangent-only", "requires-grad"])
@pytest.mark.parametrize("name", sorted(ALL))
def test_tangent_matches_torch(name, requires_grad, device):
    """Each input's tangent alone, then all at once: what torch's forward mode gives its own
    composite; never a missing tangent (which autograd reads as zero)."""
    case = ALL[name]
    primals = [t.detach() for t in leaves(case)]
    directions = tangents(case)
    ones = [[d if i == k else torch.zeros_like(d) for i, d in enumerate(directions)]
            for k in range(len(directions))]
    for chosen in [*ones, directions]:
        ours = forward_tangents(
            case.ours, [p.to(device).requires_grad_(requires_grad) for p in primals],
            [d.to(device) for d in chosen])
        theirs = forward_tangents(case.theirs, primals, chosen)
        assert len(ours) == len(theirs)
        for index, (got, want) in enumerate(zip(ours, theirs, strict=True)):
            assert got is not None, f"output {index} lost its tangent"
            torch.testing.assert_close(got.cpu(), want, msg=lambda m, i=index: f"output {i}: {m}",
                                       **FP64_TOL)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_tangent_matches_reference(kind, device):
    """Through a whole layer: the tangent of its output along the hidden states' tangent and
    every parameter's, against the reference layer of torch's ops."""
    cls, options = LAYERS[kind]
    layer = cls(8, 2, 12, 0.0, 0.0, dtype=torch.float64, attention="materialized", **options)
    with torch.no_grad():
        for index, param in enumerate(layer.parameters()):
            param.copy_(1 + 0.2 * randn(param.shape, seed=40 + index))
    reference = ReferenceLayer.like(layer)
    mask = torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    results = []
    for module in (layer.to(device), reference):
        params = dict(module.named_parameters())
        directions = {name: randn(p.shape, seed=70 + i) for i, (name, p) in
                      enumerate(sorted(params.items()))}
        x = randn((1, 3, 8), seed=50)
        with fwAD.dual_level():
            duals = {name: fwAD.make_dual(p.detach().to(p.device), directions[name].to(p.device))
                     for name, p in params.items()}
            hidden = fwAD.make_dual(x.to(next(iter(params.values())).device),
                                    randn((1, 3, 8), seed=51).to(x.device if module is reference
                                                                 else device))
            output = torch.func.functional_call(module, duals, (hidden, mask.to(hidden.device)))
            results.append(fwAD.unpack_dual(output).tangent.cpu())
    torch.testing.assert_close(results[0], results[1], **FP64_TOL)


def test_linear_cross_entropy_refuses_forward_mode(device):
    """The chunked linear loss names the op and the transform, never a missing tangent."""
    from generated.cross_entropy import linear_cross_entropy

    x, weight = randn((3, 4), device=device), randn((5, 4), device=device)
    target = torch.tensor([1, 2, 0], device=device)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="linear_cross_entropy: forward-mode"):
        linear_cross_entropy(fwAD.make_dual(x, torch.ones_like(x)), weight, target)

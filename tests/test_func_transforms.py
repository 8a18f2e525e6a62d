"""torch.func transforms through every generated op and memory mode: grad, jacrev, jacfwd,
vmap, per-sample gradients (vmap of grad), Hessians (jacfwd of jacrev) and functional_call of the
modules, against torch's own composites in fp64, on every path."""

from __future__ import annotations

import pytest
import torch
from reference import FP64_TOL, randn
from test_double_backward import SHAPE, Case, N, leaves, unrecordable  # noqa: F401, F811
from test_forward_ad import ALL
from torch.func import functional_call, grad, jacfwd, jacrev, vmap

import generated.add_layernorm as add_layernorm
import generated.add_rmsnorm as add_rmsnorm
import generated.layernorm as layernorm
import generated.rmsnorm as rmsnorm


def total(fn):
    """A scalar of every output, each weighted differently."""
    def scalar(*args):
        outputs = fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((o * (index + 1.5)).sum() for index, o in enumerate(outputs))
    return scalar


def batched(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """The first input stacked twice (a batch of two samples), and vmap's in_dims."""
    return torch.stack([inputs[0], 2 * inputs[0]]), (0,) + (None,) * (len(inputs) - 1)


TRANSFORMS = {
    "grad": lambda fn, xs: grad(total(fn), argnums=tuple(range(len(xs))))(*xs),
    "jacrev": lambda fn, xs: jacrev(fn, argnums=tuple(range(len(xs))))(*xs),
    "jacfwd": lambda fn, xs: jacfwd(fn, argnums=tuple(range(len(xs))))(*xs),
    "vmap": lambda fn, xs: vmap(fn, in_dims=batched(xs)[1])(batched(xs)[0], *xs[1:]),
    "per_sample_grad": lambda fn, xs: vmap(grad(total(fn), argnums=tuple(range(len(xs)))),
                                           in_dims=batched(xs)[1])(batched(xs)[0], *xs[1:]),
    "hessian": lambda fn, xs: jacfwd(jacrev(total(fn)))(*xs),
}


#: the fused adds + norms returning the norm alone: a memory mode's backward reads the sum that
#: the op then does not return, which the forward keeps under the transforms
WITHOUT_SUM = {
    **{f"add_layer_norm-unsummed-{mode}": Case(
        lambda x, r, w, b, mode=mode: add_layernorm.add_layer_norm(x, r, (N,), w, b, memory=mode),
        lambda x, r, w, b: torch.nn.functional.layer_norm(x + r, (N,), w, b),
        (SHAPE, SHAPE, (N,), (N,))) for mode in layernorm._MODES},
    **{f"add_rms_norm-unsummed-{mode}": Case(
        lambda x, r, w, mode=mode: add_rmsnorm.add_rms_norm(x, r, (N,), w, 1e-6, memory=mode),
        lambda x, r, w: torch.nn.functional.rms_norm(x + r, (N,), w, 1e-6),
        (SHAPE, SHAPE, (N,))) for mode in rmsnorm._MODES},
}
CASES = {**ALL, **WITHOUT_SUM}
assert len(CASES) == len(ALL) + len(WITHOUT_SUM)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_transform_matches_torch(name, transform, device):
    case = CASES[name]
    primals = [t.detach() for t in leaves(case)]
    ours = TRANSFORMS[transform](case.ours, [p.to(device) for p in primals])
    theirs = TRANSFORMS[transform](case.theirs, primals)
    got, want = torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.cpu(), b, msg=lambda m, i=index: f"result {i}: {m}",
                                   **FP64_TOL)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_functional_call_per_sample_weight_grads(kind, device):
    """Per-sample gradients of a module's parameters with functional_call, as torch's module."""
    ours = (layernorm.LayerNorm(6, dtype=torch.float64) if kind == "layer_norm"
            else rmsnorm.RMSNorm(6, dtype=torch.float64)).to(device)
    theirs = (torch.nn.LayerNorm(6, dtype=torch.float64) if kind == "layer_norm"
              else torch.nn.RMSNorm(6, dtype=torch.float64))
    with torch.no_grad():
        for index, (a, b) in enumerate(zip(ours.parameters(), theirs.parameters(), strict=True)):
            b.copy_(1 + 0.3 * randn(b.shape, seed=index))
            a.copy_(b)
    x = randn((4, 3, 6), seed=9)

    def per_sample(module, x):
        params = {k: v.detach() for k, v in module.named_parameters()}

        def loss(params, sample):
            return (functional_call(module, params, (sample,)) ** 2).sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    got, want = per_sample(ours, x.to(device)), per_sample(theirs, x)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key].cpu(), want[key], **FP64_TOL)


def test_op_without_recordable_backward(unrecordable, device):  # noqa: F811
    """An op whose backward autograd cannot record still batches under vmap and gives its
    derived JVP under jacfwd; grad says what it lacks, naming the op and the transform."""
    x = randn((3, 5), seed=3)
    op = unrecordable.shifted_exp_softmax
    torch.testing.assert_close(vmap(lambda r: op(r, -1))(x.to(device)).cpu(),
                               torch.softmax(x, -1), **FP64_TOL)
    torch.testing.assert_close(jacfwd(lambda r: op(r, -1))(x.to(device)).cpu(),
                               jacfwd(lambda r: torch.softmax(r, -1))(x), **FP64_TOL)
    with pytest.raises(RuntimeError, match=r"shifted_exp_softmax: reverse mode under torch.func "
                       r"transforms \(grad, vjp, jacrev\) is not supported: it saves e"):
        grad(lambda r: op(r, -1).square().sum())(x.to(device))


def test_one_backward_and_jvp_per_op():
    """`_Functional` runs `_Function`'s derived backward and JVP (the backward as the branch
    autograd records), not copies of them."""
    import importlib
    import inspect
    import pkgutil

    import generated

    modules = [importlib.import_module(f"generated.{info.name}")
               for info in pkgutil.iter_modules(generated.__path__)]
    modules = [m for m in modules if hasattr(m, "_Functional")]
    assert len(modules) >= 15
    for module in modules:
        functional, function = vars(module._Functional), vars(module._Function)
        assert functional["jvp"].__func__ is function["jvp"].__func__, module.__name__
        assert "_Function.backward(ctx, *grads, backwards=None)" in inspect.getsource(
            functional["backward"].__func__), module.__name__

"""Dispatch to torch's expression of an op (codegen/runtime/dispatch.py): the expression each
spec names gives the generated op's outputs and gradients, it runs only for the calls it
computes exactly, only where the measurements (or an override) say so, and under
torch.compile it leaves no opaque custom op in the graph when the op measured faster that way."""

from __future__ import annotations

import pytest
import torch
from reference import randn

import generated.add_layernorm as add_layernorm
import generated.add_rmsnorm as add_rmsnorm
import generated.bias_dropout_add as bias_dropout_add
import generated.dropout_add_layernorm as dropout_add_layernorm
import generated.dropout_add_rmsnorm as dropout_add_rmsnorm
import generated.geglu as geglu
import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
import generated.layernorm as layernorm
import generated.rmsnorm as rmsnorm
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.runtime import dispatch

N = 24
SHAPE = (2, 3, N)


def leaf(shape, seed, dtype):
    return randn(shape, seed=seed, dtype=dtype).requires_grad_()


def calls(dtype):
    """(name, module, function of fresh leaves -> output, leaves)."""
    x, r = leaf(SHAPE, 1, dtype), leaf(SHAPE, 2, dtype)
    w = (randn((N,), seed=3, dtype=dtype) + 2).requires_grad_()
    b, ib = leaf((N,), 4, dtype), leaf((N,), 5, dtype)
    return [
        ("layer_norm", layernorm,
         lambda x, w, b: layernorm.layer_norm(x, (N,), w, b), (x, w, b)),
        ("layer_norm no params", layernorm,
         lambda x: layernorm.layer_norm(x, (3, N), eps=1e-3), (x,)),
        ("rms_norm", rmsnorm, lambda x, w: rmsnorm.rms_norm(x, (N,), w), (x, w)),
        ("add_layer_norm", add_layernorm,
         lambda x, r, w, b, ib: add_layernorm.add_layer_norm(x, r, (N,), w, b, input_bias=ib),
         (x, r, w, b, ib)),
        ("add_layer_norm prenorm", add_layernorm,
         lambda x, r, w: torch.cat(add_layernorm.add_layer_norm(x, r, (N,), w, prenorm=True)),
         (x, r, w)),
        ("add_rms_norm prenorm", add_rmsnorm,
         lambda x, r, w, ib: torch.cat(
             add_rmsnorm.add_rms_norm(x, r, (N,), w, 1e-5, input_bias=ib, prenorm=True)),
         (x, r, w, ib)),
        ("add_rms_norm no residual", add_rmsnorm,
         lambda x, w: add_rmsnorm.add_rms_norm(x, None, (N,), w), (x, w)),
        ("softmax", softmax, lambda x: softmax.softmax(x, 1), (x,)),
        ("gelu", gelu, lambda x, b: gelu.gelu(x, bias=b), (x, b)),
        ("gelu no bias", gelu, lambda x: gelu.gelu(x), (x,)),
        ("gelu_tanh", gelu_tanh, lambda x, b: gelu_tanh.gelu_tanh(x, bias=b), (x, b)),
        ("swiglu", swiglu, lambda x, r: swiglu.swiglu(x, r), (x, r)),
        ("geglu", geglu, lambda x, r: geglu.geglu(x, r), (x, r)),
        ("bias_dropout_add eval", bias_dropout_add,
         lambda x, r, b: bias_dropout_add.bias_dropout_add(x, r, bias=b, training=False),
         (x, r, b)),
        ("bias_dropout_add seeded p=0", bias_dropout_add,
         lambda x: bias_dropout_add.bias_dropout_add(x, None, p=0.0, seed=3), (x,)),
        ("dropout_add_layer_norm eval", dropout_add_layernorm,
         lambda x, r, w, b, ib: dropout_add_layernorm.dropout_add_layer_norm(
             x, r, (N,), w, b, input_bias=ib, dropout_p=0.5, training=False), (x, r, w, b, ib)),
        ("dropout_add_rms_norm seeded p=0", dropout_add_rmsnorm,
         lambda x, r, w: dropout_add_rmsnorm.dropout_add_rms_norm(x, r, (N,), w, seed=3),
         (x, r, w)),
    ]


NAMES = [c[0] for c in calls(torch.float64)]


def run(case, mode):
    _, module, fn, leaves = case
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    with module.DISPATCH.override(mode):
        out = fn(*leaves)
        upstream = randn(out.shape, seed=9, dtype=out.dtype)
        grads = torch.autograd.grad(out, leaves, upstream)
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_torch_expression_matches_the_kernels(index, dtype):
    case = calls(dtype)[index]
    out, grads = run(case, "torch")
    want, want_grads = run(case, "kernels")
    assert out.dtype == want.dtype and out.shape == want.shape
    # bf16: both round the same fp32 values once, but torch's composite forms (rms_norm, x +
    # residual, silu(gate) * up) round intermediate values to bf16 too
    tol = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-5),
           torch.bfloat16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(out, want, rtol=tol[0], atol=tol[1])
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=tol[0], atol=tol[1] * 4)


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_torch_expression_runs_when_forced_and_only_then(index, monkeypatch):
    """Forced "torch", the op's torch expression runs (no generated Function is applied);
    forced "kernels", the generated code runs."""
    _, module, fn, leaves = calls(torch.float64)[index]
    applied = []
    real = module._Function.apply
    monkeypatch.setattr(module._Function, "apply", lambda *a: applied.append(a) or real(*a))
    with module.DISPATCH.override("torch"):
        fn(*leaves)
    assert applied == []
    with module.DISPATCH.override("kernels"):
        fn(*leaves)
    assert applied


CALLS = [
    (layernorm, lambda x, r, w: layernorm.layer_norm(x, (N,), w, memory="invertible")),
    (layernorm, lambda x, r, w: layernorm.layer_norm(x, (N,), w, memory="recompute_mean")),
    (rmsnorm, lambda x, r, w: rmsnorm.rms_norm(x, (N,), w, weight_offset=1.0)),
    (add_layernorm, lambda x, r, w: add_layernorm.add_layer_norm(x, r, (N,), w,
                                                                 residual_in_fp32=True)),
    (add_rmsnorm, lambda x, r, w: add_rmsnorm.add_rms_norm(x, r, (N,), w, weight_offset=1.0)),
    (bias_dropout_add, lambda x, r, w: bias_dropout_add.bias_dropout_add(x, r, p=0.5, seed=1)),
    (dropout_add_layernorm, lambda x, r, w: dropout_add_layernorm.dropout_add_layer_norm(
        x, r, (N,), w, dropout_p=0.5, seed=1)),
    (layernorm, lambda x, r, w: layernorm.layer_norm(x.half(), (N,), w)),
    (add_layernorm, lambda x, r, w: add_layernorm.add_layer_norm(x.half(), r.half(), (N,), w)),
]


@pytest.mark.parametrize(("module", "call"), CALLS, ids=["invertible", "recompute_mean",
                         "offset", "residual_in_fp32", "add offset", "dropout",
                         "seeded dropout before a norm",
                         "16-bit input, fp32 weight", "add, 16-bit input, fp32 weight"])
def test_options_torch_cannot_express_run_the_kernels(module, call, monkeypatch):
    applied = []
    real = module._Function.apply
    monkeypatch.setattr(module._Function, "apply", lambda *a: applied.append(1) or real(*a))
    x, r = leaf(SHAPE, 1, torch.float32), leaf(SHAPE, 2, torch.float32)
    w = leaf((N,), 3, torch.float32)
    with module.DISPATCH.override("torch"):
        call(x, r, w).sum().backward()
    assert applied


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the dispatch reads nothing else."""

    @property
    def is_cuda(self):
        return True


def fake(shape):
    return torch.empty(shape).as_subclass(FakeCuda)


def test_unseeded_dropout_runs_torchs_dropout():
    x, r = leaf(SHAPE, 1, torch.float64), leaf(SHAPE, 2, torch.float64)
    b = leaf((N,), 3, torch.float64)
    with bias_dropout_add.DISPATCH.override("torch"):
        out = bias_dropout_add.bias_dropout_add(x, r, bias=b, p=0.5)
    kept = (out - r).detach()
    dropped = kept == 0
    assert 0.2 < dropped.double().mean() < 0.8
    torch.testing.assert_close(kept[~dropped], 2 * (x + b).detach()[~dropped])
    out.sum().backward()
    torch.testing.assert_close(x.grad, (~dropped).double() * 2)
    torch.testing.assert_close(r.grad, torch.ones_like(r))


NORMS = {
    "dropout_add_layer_norm": (dropout_add_layernorm, torch.nn.functional.layer_norm,
                               dropout_add_layernorm.dropout_add_layer_norm),
    "dropout_add_rms_norm": (dropout_add_rmsnorm, torch.nn.functional.rms_norm,
                             dropout_add_rmsnorm.dropout_add_rms_norm),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_unseeded_dropout_before_a_norm_runs_torchs_dropout(name, monkeypatch):
    """With no seed any mask will do: torch's expression drops with torch's dropout (its p and
    training mode), adds the residual and normalizes; its gradients are torch's."""
    module, norm, function = NORMS[name]
    x, r = leaf(SHAPE, 1, torch.float64), leaf(SHAPE, 2, torch.float64)
    ib = leaf((N,), 3, torch.float64)
    dropped = []
    real = torch.nn.functional.dropout

    def recorded(input, p, training):
        dropped.append((p, training, real(input, p, training)))
        return dropped[-1][2]

    monkeypatch.setattr(torch.nn.functional, "dropout", recorded)
    with module.DISPATCH.override("torch"):
        out = function(x, r, (N,), input_bias=ib, dropout_p=0.5)
    (p, training, kept), = dropped
    assert (p, training) == (0.5, True)
    zeros = kept == 0
    assert 0.2 < zeros.double().mean() < 0.8
    torch.testing.assert_close(kept[~zeros], 2 * (x + ib)[~zeros])
    torch.testing.assert_close(out, norm(kept + r, (N,)))
    grads = torch.autograd.grad(out, (x, r), randn(out.shape, seed=9), retain_graph=True)
    want = torch.autograd.grad(norm(kept + r, (N,)), (x, r), randn(out.shape, seed=9))
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected)


def test_measured_work_decides_for_cuda_tensors_only(monkeypatch):
    monkeypatch.setattr(dispatch, "FORCED", None)  # tests/conftest.py forces the kernels
    d = dispatch.Dispatch("op", eager_below=1000)
    assert d.to_torch(fake((3, 10)))
    assert not d.to_torch(fake((10, 10)))  # rows x width^2 = 1000
    assert d.to_torch(fake((20, 5)))  # as many elements, half the work
    assert not d.to_torch(torch.ones(3, 10))  # a CPU tensor
    assert not d.to_torch(fake(()))  # 0-d
    assert not d.to_torch([1.0])  # not a tensor: the kernels' path checks it
    assert not dispatch.Dispatch("op").to_torch(fake((1, 1)))


def test_calls_autograd_does_not_record_use_the_forward_only_crossover(monkeypatch):
    monkeypatch.setattr(dispatch, "FORCED", None)  # tests/conftest.py forces the kernels
    d = dispatch.Dispatch("op", eager_below=1000, infer_below=100)
    assert d.to_torch(fake((9, 10)))  # 900 < 1000: a training call
    for recording_off in (torch.no_grad, torch.inference_mode):
        with recording_off():
            assert not d.to_torch(fake((9, 10)))  # 900 >= 100: a forward alone
            assert d.to_torch(fake((9, 3)))  # 81 < 100
    # unmeasured: the forward+backward crossover decides forward-only calls too
    unmeasured = dispatch.Dispatch("op", eager_below=1000)
    with torch.no_grad():
        assert unmeasured.to_torch(fake((9, 10))) and unmeasured.infer_below is None
    with d.override(infer_below=1):
        with torch.no_grad():
            assert not d.to_torch(fake((1, 1)))
    assert d.infer_below == 100 and "infer_below=100" in repr(d)


def test_override_restores_and_checks(monkeypatch):
    d = dispatch.Dispatch("op", eager_below=10, compiled="torch")
    monkeypatch.setattr(dispatch, "FORCED", None)
    with d.override(eager_below=0, compiled="kernels"):
        assert not d.to_torch(fake((1, 1))) and d.compiled == "kernels"
        with d.override("torch"):
            assert d.to_torch(torch.ones(1))
    assert (d.eager_below, d.compiled, d.forced) == (10, "torch", None)
    with pytest.raises(ValueError, match="mode must be one of"):
        with d.override("triton"):
            pass
    with pytest.raises(ValueError, match="compiled must be one of"):
        dispatch.Dispatch("op", compiled="inductor")
    monkeypatch.setattr(dispatch, "FORCED", "torch")
    assert d.to_torch(torch.ones(1))
    monkeypatch.setattr(dispatch, "FORCED", "kernels")
    assert not d.to_torch(fake((1, 1)))


def test_forcing_sets_the_process_choice_for_a_block():
    d = dispatch.Dispatch("op")
    with dispatch.forcing("torch"):
        assert d.to_torch(torch.ones(1))
        with dispatch.forcing(None):
            assert not d.to_torch(torch.ones(1))
    assert dispatch.FORCED == "kernels"  # tests/conftest.py
    with pytest.raises(ValueError, match="mode must be one of"):
        with dispatch.forcing("eager"):
            pass


def test_patch_probes_prove_the_kernels(monkeypatch):
    """patch_model's probe runs the kernels even where small calls run torch's expression."""
    from generated.patch import patch_model

    ran = []
    real = layernorm._layernorm_fwd
    monkeypatch.setattr(layernorm, "_layernorm_fwd",
                        lambda *a, **k: ran.append(1) or real(*a, **k))
    monkeypatch.setattr(dispatch, "FORCED", "torch")
    model = torch.nn.Sequential(torch.nn.Linear(N, N), torch.nn.LayerNorm(N))
    patch_model(model)
    assert isinstance(model[1], layernorm.LayerNorm)
    assert ran and dispatch.FORCED == "torch"
    probed = len(ran)
    with torch.no_grad():
        model(torch.ones(2, N))
    assert len(ran) == probed  # after the patch, torch's expression as forced


def test_environment_variable_is_checked(monkeypatch):
    monkeypatch.setenv("VJPFORGE_DISPATCH", "torch")
    assert dispatch._mode() == "torch"
    monkeypatch.setenv("VJPFORGE_DISPATCH", "fast")
    with pytest.raises(ValueError, match="VJPFORGE_DISPATCH must be one of kernels, torch"):
        dispatch._mode()


def test_added_returns_a_new_tensor():
    x = torch.ones(3)
    assert dispatch.added(x, None) is not x
    torch.testing.assert_close(dispatch.added(x, None, x * 2), torch.full((3,), 3.0))


def vjpforge_ops(graph_module):
    return [n for n in graph_module.graph.nodes
            if n.op == "call_function" and "vjpforge" in str(n.target)]


@pytest.mark.parametrize("compiled", ["torch", "kernels"])
def test_compiled_choice_decides_what_the_graph_holds(compiled, monkeypatch):
    monkeypatch.setattr(dispatch, "FORCED", None)
    torch._dynamo.reset()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def block(x, w, b):
        return gelu.gelu(layernorm.layer_norm(x, (N,), w, b) * 2)

    x, w, b = leaf(SHAPE, 1, torch.float32), leaf((N,), 3, torch.float32), leaf((N,), 4,
                                                                              torch.float32)
    with layernorm.DISPATCH.override(compiled=compiled), gelu.DISPATCH.override(compiled=compiled):
        got = torch.compile(block, fullgraph=True, backend=backend)(x, w, b)
    torch.testing.assert_close(got, block(x, w, b))
    found = [n for g in graphs for n in vjpforge_ops(g)]
    assert (found == []) == (compiled == "torch")

"""torch.library registration: opcheck on every generated op, and torch.compile(fullgraph=True)
(zero graph breaks) giving eager's outputs and gradients."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from reference import randn

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
from codegen.runtime import dispatch

N = 16


def leaf(shape, seed, dtype=torch.float64):
    return randn(shape, seed=seed, dtype=dtype).requires_grad_()


def op_cases():
    x, residual = leaf((4, N), 1), leaf((4, N), 2)
    weight, bias, input_bias = leaf((N,), 3) + 2, leaf((N,), 4), leaf((N,), 5)
    weight = weight.detach().requires_grad_()
    cases = []
    for mode in ("default", "recompute_mean", "invertible"):
        cases.append((f"layernorm-{mode}", torch.ops.vjpforge.layernorm.default,
                      (x, weight, bias, 1e-5, 0.0, mode)))
        # weight_offset=1: the (1 + weight) scale
        cases.append((f"layernorm-offset-{mode}", torch.ops.vjpforge.layernorm.default,
                      (x, weight, bias, 1e-5, 1.0, mode)))
        cases.append((f"add_layernorm-{mode}", torch.ops.vjpforge.add_layernorm.default,
                      (x, residual, input_bias, weight, bias, 1e-5, mode, True, False)))
    for mode in ("default", "invertible"):
        cases.append((f"rmsnorm-{mode}", torch.ops.vjpforge.rmsnorm.default,
                      (x, weight, 1e-6, 1.0, 0.0, 0.0, mode)))
        # casting_mode="llama": x_hat rounded to the input's dtype
        cases.append((f"rmsnorm-llama-{mode}", torch.ops.vjpforge.rmsnorm.default,
                      (x, weight, 1e-6, 0.0, 1.0, 0.0, mode)))
        # casting_mode="none": every step rounded
        cases.append((f"rmsnorm-none-{mode}", torch.ops.vjpforge.rmsnorm.default,
                      (x, weight, 1e-6, 0.0, 1.0, 1.0, mode)))
        cases.append((f"add_rmsnorm-{mode}", torch.ops.vjpforge.add_rmsnorm.default,
                      (x, None, None, weight, 1e-6, 0.0, 0.0, 0.0, mode, False, False)))
    cases.append(("softmax", torch.ops.vjpforge.softmax.default, (x, "default")))
    cases.append(("gelu", torch.ops.vjpforge.gelu.default, (x, input_bias, "default")))
    cases.append(("gelu_tanh", torch.ops.vjpforge.gelu_tanh.default, (x, None, "default")))
    cases.append(("swiglu", torch.ops.vjpforge.swiglu.default,
                  (x, residual, 0.5, 1.5, "default")))
    cases.append(("geglu", torch.ops.vjpforge.geglu.default, (x, residual, "default")))
    seed = torch.tensor(7)
    cases.append(("bias_dropout_add", torch.ops.vjpforge.bias_dropout_add.default,
                  (x, residual, input_bias, 0.3, seed, "default")))
    mask = randn((1, 1, 1, N), seed=6).expand(1, 1, 4, N)  # read through zero strides
    cases.append(("masked_softmax", torch.ops.vjpforge.masked_softmax.default,
                  (x, mask, 0.5, 0.0, 0.2, seed, [1, 1, 4], "default")))
    target = torch.tensor([3, -100, 0, N - 1])
    cases.append(("cross_entropy", torch.ops.vjpforge.cross_entropy.default,
                  (x, None, target, -100.0, 0.1, 0.0, 0.0, 0.0, "default", False, False, False)))
    class_weight = (randn((N,), seed=7) + 2).detach()  # class weights: never differentiated
    cases.append(("cross_entropy-weight", torch.ops.vjpforge.cross_entropy.default,
                  (x, class_weight, target, -100.0, 0.1, 0.0, 0.0, 0.0, "default", False, False,
                   False)))
    # z-loss and softcap on, the z-loss returned too
    cases.append(("cross_entropy-z_loss-softcap", torch.ops.vjpforge.cross_entropy.default,
                  (x, class_weight, target, -100.0, 0.1, 0.125, 3.0, 0.0, "default", True, False,
                   False)))
    # token scaling on: a factor the gradient does not flow through
    cases.append(("cross_entropy-token_scaling", torch.ops.vjpforge.cross_entropy.default,
                  (x, class_weight, target, -100.0, 0.1, 0.125, 0.0, 1.0, "default", True,
                   False, False)))
    # the token accuracy and predicted tokens returned too (the argmax computed)
    cases.append(("cross_entropy-accuracy", torch.ops.vjpforge.cross_entropy.default,
                  (x, None, target, -100.0, 0.0, 0.0, 0.0, 0.0, "default", False, True, True)))
    return cases


@pytest.mark.parametrize(("name", "op", "args"), op_cases(), ids=[c[0] for c in op_cases()])
def test_opcheck(device, name, op, args):
    args = tuple(a.detach().to(device).requires_grad_(a.requires_grad)
                 if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(op, args)


def model(x, residual, weight, bias):
    hidden, stream = add_layernorm.add_layer_norm(x, residual, (N,), weight, bias, prenorm=True)
    hidden = layernorm.layer_norm(hidden, (N,), weight, bias, memory="invertible")
    hidden = add_rmsnorm.add_rms_norm(hidden, stream, (N,), weight, 1e-6)
    hidden = rmsnorm.rms_norm(hidden, (N,), weight, weight_offset=1.0)
    hidden = gelu.gelu(hidden, bias=bias) + gelu_tanh.gelu_tanh(hidden)
    hidden = swiglu.swiglu(hidden, stream) + geglu.geglu(stream, hidden)
    hidden = bias_dropout_add.bias_dropout_add(hidden, stream, bias=bias, p=0.25, seed=3)
    scores = hidden.reshape(2, 2, N)
    probabilities = masked_softmax.masked_softmax(scores, (bias > 0)[None, None, :], scale=0.5,
                                                  causal=True, dropout_p=0.25, seed=4)
    hidden = probabilities.reshape(4, N) * hidden
    target = torch.arange(4, device=x.device) * 3
    loss = cross_entropy.cross_entropy(hidden, target, label_smoothing=0.25)
    return softmax.softmax(hidden, dim=0) * loss


@pytest.fixture
def interpreter_safe_threads(device):
    """Triton's CPU interpreter inside an Inductor-compiled CPU graph gave wrong gradients with
    several OpenMP threads (2 cores, triton 3.9, torch 2.13) and exact ones with one thread;
    the torch path under Inductor and the interpreter under aot_eager are exact either way.
    Real kernels (CUDA) never run the interpreter, so this pins one thread for that case only."""
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    threads = torch.get_num_threads()
    if interpreted:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODULES = (add_layernorm, add_rmsnorm, bias_dropout_add, geglu, gelu, gelu_tanh, layernorm,
           rmsnorm, softmax, swiglu)


@pytest.mark.parametrize("compiled", ["kernels", "torch"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(device, backend, compiled, interpreter_safe_threads,
                                         monkeypatch):
    """Each op as one opaque custom op, or traced as torch's expression of it (what the
    dispatch chooses per op from measurements)."""
    monkeypatch.setattr(dispatch, "FORCED", None)
    with contextlib.ExitStack() as stack:
        for module in MODULES:
            stack.enter_context(module.DISPATCH.override(compiled=compiled))
        compare_compiled(device, backend)


def compare_compiled(device, backend):
    torch._dynamo.reset()
    inputs = [leaf((4, N), 1), leaf((4, N), 2), leaf((N,), 3), leaf((N,), 4)]
    inputs = [t.detach().to(device).requires_grad_() for t in inputs]
    upstream = randn((4, N), seed=9, device=device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs, upstream)
    want = model(*inputs)
    want_grads = torch.autograd.grad(want, inputs, upstream)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_scalars_stay_in_the_input_dtype(device):
    # A Python float (eps) must not turn the math into fp64 (Liger #1350, #1358).
    torch._dynamo.reset()
    x = randn((8, N), seed=1, device=device, dtype=torch.float32)

    def norm(x, eps):
        return layernorm.layer_norm(x, (N,), eps=eps)

    compiled = torch.compile(norm, fullgraph=True, backend="inductor")
    for eps in (1e-5, 1e-3):
        got = compiled(x, eps)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.layer_norm(x, (N,), eps=eps))


def test_compiled_returns_and_casting_mode(device):
    # the flags of cross_entropy's returned values and rms_norm's casting_mode under
    # torch.compile(fullgraph=True): the custom ops take them, no graph break
    torch._dynamo.reset()
    x = randn((4, N), seed=1, device=device, dtype=torch.float32).to(torch.bfloat16)
    weight = (randn((N,), seed=2, device=device) + 1).to(torch.bfloat16)
    target = torch.tensor([3, -100, 0, N - 1], device=device)

    def step(x, weight):
        hidden = rmsnorm.rms_norm(x, (N,), weight, 1e-6, casting_mode="llama")
        return cross_entropy.cross_entropy(hidden.float(), target, return_token_accuracy=True,
                                           return_predicted_tokens=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, weight), step(x, weight)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])

"""CUDA graphs: every op's forward and backward captured in one graph replay what eager calls
compute, bit for bit, on new inputs copied into the captured ones. Graphs are how small shapes
stop being launch-bound (the host launches nothing on replay; docs/benchmarks.md, "Scale and
host time"); torch.compile(mode="reduce-overhead") captures the registered ops the same way.

A dropout drawn from torch's generator (seed=None) draws a new mask on each replay (the graph
advances the generator's Philox offset), and the backward of each replay regenerates that
replay's mask. CUDA only: the module is skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from reference import HAS_CUDA

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

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")

#: the issue's launch-bound shape, and few wide rows (looped rows, column partials summed by a
#: second kernel)
SHAPES = ((4096, 1024), (64, 65536))
NAMES = ("layer_norm", "layer_norm-invertible", "rms_norm", "add_layer_norm-prenorm",
         "add_rms_norm", "softmax", "masked_softmax-dropout", "gelu", "gelu_tanh", "swiglu",
         "geglu", "bias_dropout_add", "cross_entropy")


def _tensor(shape, generator, dtype=torch.bfloat16, grad=True):
    value = torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32)
    return value.to(dtype).requires_grad_(grad)


def _cases(M, N, generator):
    """name -> (function of the inputs, inputs: tensors whose data changes between replays)."""
    w, b = _tensor((N,), generator), _tensor((N,), generator)
    seed = torch.tensor(1234, device="cuda")
    target = torch.randint(0, N, (M,), generator=generator, device="cuda")
    target[::7] = -100
    mask = torch.rand((1, N), generator=generator, device="cuda") < 0.9

    def x():
        return _tensor((M, N), generator)

    return {
        "layer_norm": (lambda a: layernorm.layer_norm(a, (N,), w, b), [x()]),
        "layer_norm-invertible": (
            lambda a: layernorm.layer_norm(a, (N,), w, b, memory="invertible"), [x()]),
        "rms_norm": (lambda a: rmsnorm.rms_norm(a, (N,), w), [x()]),
        "add_layer_norm-prenorm": (
            lambda a, r: add_layernorm.add_layer_norm(a, r, (N,), w, b, input_bias=b,
                                                      prenorm=True), [x(), x()]),
        "add_rms_norm": (lambda a, r: add_rmsnorm.add_rms_norm(a, r, (N,), w), [x(), x()]),
        "softmax": (softmax.softmax, [x()]),
        "masked_softmax-dropout": (
            lambda a: masked_softmax.masked_softmax(a, mask, scale=0.5, dropout_p=0.1,
                                                    seed=seed), [x()]),
        "gelu": (lambda a: gelu.gelu(a, bias=b), [x()]),
        "gelu_tanh": (gelu_tanh.gelu_tanh, [x()]),
        "swiglu": (swiglu.swiglu, [x(), x()]),
        "geglu": (geglu.geglu, [x(), x()]),
        "bias_dropout_add": (
            lambda a, r: bias_dropout_add.bias_dropout_add(a, r, bias=b, p=0.1, seed=seed),
            [x(), x()]),
        "cross_entropy": (lambda a: cross_entropy.cross_entropy(a, target, label_smoothing=0.1),
                          [x()]),
    }, [w, b]


def _step(fn, inputs, params, grads):
    """One forward and backward: the outputs and every gradient (in input, then param order)."""
    for tensor in (*inputs, *params):
        tensor.grad = None
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grads[:len(outputs)])
    return outputs, [tensor.grad for tensor in (*inputs, *params)]


def _capture(fn, inputs, params, grads):
    """A graph of one step (compiled and warmed up on a side stream first, as torch's docs ask)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _step(fn, inputs, params, grads)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs, gradients = _step(fn, inputs, params, grads)
    return graph, outputs, gradients


def _copied(tensors):
    return [None if t is None else t.detach().clone() for t in tensors]


@pytest.mark.parametrize("M,N", SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_replay_matches_eager(name, M, N):
    generator = torch.Generator("cuda").manual_seed(0)
    cases, params = _cases(M, N, generator)
    assert sorted(cases) == sorted(NAMES)
    fn, inputs = cases[name]
    with torch.no_grad():  # the outputs' shapes; no autograd graph kept alive on this stream
        outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    graph, static_outputs, static_grads = _capture(fn, inputs, params, grads)
    for _ in range(2):
        # new data in the captured inputs and output gradients, then replay and run eagerly
        with torch.no_grad():
            for tensor in (*inputs, *grads):
                tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda"))
        graph.replay()
        replayed = _copied(static_outputs), _copied(static_grads)
        eager_outputs, eager_grads = _step(fn, inputs, params, grads)
        eager = _copied(eager_outputs), _copied(eager_grads)
        for got, want in zip((*replayed[0], *replayed[1]), (*eager[0], *eager[1]), strict=True):
            assert (got is None) == (want is None), name
            if got is not None:
                assert torch.equal(got, want), f"{name}: replay differs from eager"


@pytest.mark.parametrize("op", ["bias_dropout_add", "masked_softmax"])
def test_replay_draws_new_masks(op):
    """seed=None under a graph: each replay a new mask, its backward the same mask."""
    generator = torch.Generator("cuda").manual_seed(1)
    M, N, p = 256, 1024, 0.25
    x = _tensor((M, N), generator, torch.float32)
    if op == "bias_dropout_add":
        residual = torch.zeros((M, N), device="cuda")  # y != 0 exactly where kept

        def fn(a):
            return bias_dropout_add.bias_dropout_add(a, residual, p=p)

        def kept(y, a):
            return (y - residual) != 0
    else:
        def fn(a):
            return masked_softmax.masked_softmax(a, dropout_p=p)

        def kept(y, a):
            return y != 0
    dy = torch.randn((M, N), generator=generator, device="cuda")
    graph, (y,), (dx,) = _capture(fn, [x], [], [dy])
    masks = []
    for _ in range(3):
        graph.replay()
        keep = kept(y, x)
        masks.append(keep.clone())
        fraction = keep.float().mean().item()
        assert abs(fraction - (1 - p)) < 0.01, f"{op}: kept {fraction}"
        if op == "bias_dropout_add":
            # d/dx of residual + mask * x / (1 - p): the replay's own mask
            assert torch.allclose(dx, dy * keep / (1 - p), rtol=1e-6, atol=1e-6)
        else:
            # softmax, then the replay's mask; the backward through the same mask
            s = torch.softmax(x.detach(), -1)
            assert torch.allclose(y, s * keep / (1 - p), rtol=1e-5, atol=1e-7)
            g = dy * keep / (1 - p)
            want = s * (g - (g * s).sum(-1, keepdim=True))
            assert torch.allclose(dx, want, rtol=1e-4, atol=1e-6)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_compile_reduce_overhead_layer_norm():
    """torch.compile(mode="reduce-overhead") (CUDA graph trees) over a block with the ops."""
    generator = torch.Generator("cuda").manual_seed(2)
    model = torch.nn.Sequential(
        layernorm.LayerNorm(1024, device="cuda", dtype=torch.bfloat16),
        torch.nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16),
        gelu.GELU(),
    )
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)  # the graphs' gradients: read before the next replay
        x = _tensor((512, 1024), generator)
        out = compiled(x)
        got = out.detach().clone()  # the graph's output memory is reused by the next replay
        out.float().sum().backward()
        got_grads = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        x.grad = None
        want = model(x)
        want.float().sum().backward()
        torch.testing.assert_close(got, want)
        for got_grad, want_grad in zip(
                got_grads, [x.grad, *(p.grad for p in model.parameters())], strict=True):
            torch.testing.assert_close(got_grad, want_grad)

"""Double backward (create_graph=True) of every generated op and memory mode: gradcheck and
gradgradcheck of the autograd Functions and of the torch.library ops, gradient penalties against
torch's own ops, the fused first derivative unchanged, and the error of a mode autograd cannot
differentiate."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from layer_reference import ReferenceLayer
from reference import FP64_TOL, generated_torch_path, randn

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
import generated.rotary as rotary
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.driver.command import main as derive_main
from codegen.runtime import triton_helpers
from generated.bert_layer import BertLayer
from generated.gpt_layer import GPTLayer

N = 4
SHAPE = (3, N)
SEED = 11
P = 0.3
TARGET = torch.tensor([1, -100, 3])  # one ignored row


class Case(NamedTuple):
    ours: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    theirs: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    shapes: tuple[tuple[int, ...], ...]  # of the differentiated inputs, in argument order


def keep(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep mask a seeded op draws (`triton_helpers.uniform`) over rows of the last dim."""
    rows = torch.Size(shape[:-1]).numel()
    return (triton_helpers.uniform_torch(SEED, rows, shape[-1]) >= p).double().reshape(shape)


def attention_reference(x: torch.Tensor) -> torch.Tensor:
    scores = 0.7 * x + MASK.to(x.device)
    causal = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
    probabilities = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    return probabilities * keep(x.shape, P).to(x.device) / (1 - P)


MASK = randn((N,), seed=9)
COS, SIN = randn((1, 3, N), seed=12), randn((1, 3, N), seed=13)


def rotary_reference(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin."""
    cos, sin = COS.unsqueeze(1).to(q.device), SIN.unsqueeze(1).to(q.device)
    return tuple(x * cos + torch.cat((-x[..., N // 2:], x[..., :N // 2]), -1) * sin
                 for x in (q, k))


def _norm_cases(modes: tuple[str, ...]) -> dict[str, Case]:
    cases = {}
    for mode in modes:
        cases[f"layer_norm-{mode}"] = Case(
            lambda x, w, b, mode=mode: layernorm.layer_norm(x, (N,), w, b, memory=mode),
            lambda x, w, b: F.layer_norm(x, (N,), w, b),
            (SHAPE, (N,), (N,)))
        cases[f"add_layer_norm-{mode}"] = Case(
            lambda x, r, ib, w, b, mode=mode: add_layernorm.add_layer_norm(
                x, r, (N,), w, b, input_bias=ib, prenorm=True, memory=mode),
            lambda x, r, ib, w, b: (F.layer_norm(x + ib + r, (N,), w, b), x + ib + r),
            (SHAPE, SHAPE, (N,), (N,), (N,)))
    for mode in modes:
        if mode == "recompute_mean":  # the mean of an RMS norm is never saved
            continue
        cases[f"rms_norm-{mode}"] = Case(
            lambda x, w, mode=mode: rmsnorm.rms_norm(x, (N,), w, 1e-6, memory=mode),
            lambda x, w: F.rms_norm(x, (N,), w, 1e-6),
            (SHAPE, (N,)))
        cases[f"add_rms_norm-{mode}"] = Case(
            lambda x, r, ib, w, mode=mode: add_rmsnorm.add_rms_norm(
                x, r, (N,), w, 1e-6, input_bias=ib, prenorm=True, memory=mode),
            lambda x, r, ib, w: (F.rms_norm(x + ib + r, (N,), w, 1e-6), x + ib + r),
            (SHAPE, SHAPE, (N,), (N,)))
    return cases


CASES = {
    **_norm_cases(("default", "recompute_mean")),
    "softmax": Case(lambda x: softmax.softmax(x, 0), lambda x: torch.softmax(x, 0), (SHAPE,)),
    "masked_softmax": Case(
        lambda x: masked_softmax.masked_softmax(x, MASK.to(x.device), scale=0.7, dropout_p=P,
                                                causal=True, seed=SEED),
        attention_reference, ((1, 3, N),)),
    "cross_entropy": Case(
        lambda x: cross_entropy.cross_entropy(x, TARGET.to(x.device), label_smoothing=0.2),
        lambda x: F.cross_entropy(x, TARGET.to(x.device), label_smoothing=0.2), (SHAPE,)),
    "gelu": Case(lambda x, b: gelu.gelu(x, bias=b), lambda x, b: F.gelu(x + b), (SHAPE, (N,))),
    "gelu_tanh": Case(lambda x, b: gelu_tanh.gelu_tanh(x, bias=b),
                      lambda x, b: F.gelu(x + b, approximate="tanh"), (SHAPE, (N,))),
    "swiglu": Case(swiglu.swiglu, lambda g, u: F.silu(g) * u, (SHAPE, SHAPE)),
    "geglu": Case(geglu.geglu, lambda g, u: F.gelu(g) * u, (SHAPE, SHAPE)),
    # grouped-query: two query heads, one key head
    "rotary": Case(lambda q, k: rotary.apply_rotary_pos_emb(q, k, COS.to(q.device),
                                                            SIN.to(q.device)),
                   rotary_reference, ((1, 2, 3, N), (1, 1, 3, N))),
    "bias_dropout_add": Case(
        lambda x, r, b: bias_dropout_add.bias_dropout_add(x, r, bias=b, p=P, seed=SEED),
        lambda x, r, b: r + (x + b) * keep(SHAPE, P) / (1 - P), (SHAPE, SHAPE, (N,))),
}


#: modes that keep the output instead of the input: autograd cannot differentiate their backward
INVERTIBLE = _norm_cases(("invertible",))


def leaves(case: Case) -> list[torch.Tensor]:
    """fp64 inputs requiring grad; parameters around 1, so that no inverted weight is tiny."""
    return [randn(shape, seed=i, shift=1.0 if len(shape) == 1 and i else 0.0).requires_grad_()
            for i, shape in enumerate(case.shapes)]


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU calls take the generated torch path (no interpreter): fast in fp64."""
    generated_torch_path(monkeypatch)


@pytest.fixture(params=["function", "library"])
def dispatch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The autograd Function, or the torch.library op (with its registered autograd) that the
    functions call under torch.compile."""
    if request.param == "library":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    yield request.param
    monkeypatch.undo()
    # dynamo resolves torch.compiler.is_compiling by name into a cached map of what it traces:
    # one built while the stand-in was set no longer knows the real function, and every later
    # torch.compile of a generated function would break its graph there
    torch._dynamo.trace_rules.clear_lru_cache()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradgradcheck(name, torch_path, dispatch):
    case = CASES[name]
    inputs = leaves(case)
    assert torch.autograd.gradcheck(case.ours, inputs)
    assert torch.autograd.gradgradcheck(case.ours, inputs)


def penalty(fn: Callable, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A gradient penalty: the squared norm of the gradient of <fn(inputs), v> (v fixed noise),
    then its own gradient with respect to every input, and the first gradient."""
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o * randn(o.shape, seed=20 + i, device=o.device)).sum()
                for i, o in enumerate(outputs))
    first = torch.autograd.grad(total, inputs, create_graph=True)
    squares = sum(g.square().sum() for g in first)
    if not squares.requires_grad:  # a linear op: no gradient depends on an input
        return *(g.detach() for g in first), *(torch.zeros_like(t) for t in inputs)
    # a bias's gradient need not depend on any input, nor the penalty on the bias
    second = torch.autograd.grad(squares, inputs, allow_unused=True, materialize_grads=True)
    return *(g.detach() for g in first), *second


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_penalty_matches_torch(name, device):
    case = CASES[name]
    ours = penalty(case.ours, [t.detach().to(device).requires_grad_() for t in leaves(case)])
    theirs = penalty(case.theirs, leaves(case))
    for index, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(got.cpu(), want, msg=lambda m, i=index: f"gradient {i}: {m}",
                                   **FP64_TOL)


@pytest.mark.parametrize("name", ["masked_softmax", "bias_dropout_add", "add_layer_norm-default"])
def test_recorded_first_derivative_is_the_fused_one(name, device):
    """The backward autograd records gives the fused kernels' first derivative, bit for bit where
    it draws the forward's dropout mask again."""
    case = CASES[name]
    inputs = [t.detach().to(device).requires_grad_() for t in leaves(case)]
    output = case.ours(*inputs)
    output = output[0] if isinstance(output, tuple) else output
    upstream = randn(output.shape, seed=30, device=device)
    fused = torch.autograd.grad(output, inputs, upstream, retain_graph=True)
    recorded = torch.autograd.grad(output, inputs, upstream, create_graph=True)
    for got, want in zip(recorded, fused, strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL)


@pytest.mark.parametrize("name", ["masked_softmax", "layer_norm-recompute_mean",
                                  "add_layer_norm-default"])
def test_plain_backward_takes_the_fused_kernels(name, torch_path, dispatch, monkeypatch):
    """create_graph=False never runs the recorded backward (and so stays as fast as before)."""
    module = {"masked_softmax": masked_softmax, "layer_norm-recompute_mean": layernorm,
              "add_layer_norm-default": add_layernorm}[name]
    recorded = [key for key in vars(module) if key.endswith("_recorded_torch")]
    assert recorded
    for key in recorded:
        monkeypatch.setattr(module, key, lambda *args, **kwargs: pytest.fail("recorded backward"))
    case = CASES[name]
    inputs = leaves(case)
    outputs = case.ours(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.sum() for o in outputs).backward()
    assert all(t.grad is not None for t in inputs)


# the options that change which ops a layer calls and how: the materialized attention's masked
# softmax, recomputation under checkpoints
LAYERS = {
    "bert": (BertLayer, {"pre_layer_norm": True}),
    "gpt": (GPTLayer, {}),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_gradient_penalty_matches_reference(kind, torch_path):
    """Through a whole layer, where every op's backward is recorded: a penalty on the gradient
    of the hidden states, differentiated with respect to them and to every parameter."""
    cls, options = LAYERS[kind]
    layer = cls(8, 2, 12, 0.0, 0.0, dtype=torch.float64, attention="materialized",
                gelu_checkpoint=True, attn_dropout_checkpoint=True, **options)
    with torch.no_grad():
        for index, (name, param) in enumerate(layer.named_parameters()):
            noise = randn(param.shape, seed=40 + index)
            # GEMM weights ~ 1/sqrt(fan_in); LayerNorm weights around 1 (never near the guard of
            # an invertible norm's division), biases small
            param.copy_(noise / param.shape[1] ** 0.5 if param.dim() == 2
                        else 1 + 0.2 * noise if name.endswith(("nw", "norm_w", "weight"))
                        else 0.1 * noise)
    reference = ReferenceLayer.like(layer)
    mask = torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    mask[..., -1] = -10000.0
    results = []
    for module in (layer, reference):
        x = randn((1, 3, 8), seed=50).requires_grad_()
        params = [x, *module.parameters()]
        first, = torch.autograd.grad((module(x, mask) * randn((1, 3, 8), seed=51)).sum(), x,
                                     create_graph=True)
        results.append(torch.autograd.grad(first.square().sum(), params, allow_unused=True,
                                           materialize_grads=True))
    names = ["hidden_states", *(name for name, _ in layer.named_parameters())]
    for name, got, want in zip(names, *results, strict=True):
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}", **FP64_TOL)


@pytest.mark.parametrize("name", sorted(INVERTIBLE))
def test_an_invertible_norm_names_the_mode_double_backward_needs(name, torch_path, dispatch):
    case = INVERTIBLE[name]
    inputs = leaves(case)
    outputs = case.ours(*inputs)
    total = sum(o.sum() for o in (outputs if isinstance(outputs, tuple) else (outputs,)))
    assert all(g is not None for g in torch.autograd.grad(total, inputs, retain_graph=True))
    function = name.split("-")[0]
    with pytest.raises(RuntimeError, match=rf"^{function}\(memory='invertible'\): double "
                       r"backward \(create_graph=True\) needs memory='default': this mode saves "
                       r"y, rstd"):
        torch.autograd.grad(total, inputs, create_graph=True)


# A softmax that keeps its unnormalised exponentials and their sum: neither is an input or an
# output, nor follows from one, and the row max they were shifted by has no gradient of its own
SHIFTED_EXP = '''
import sympy

from derive.api import DimAPI
from derive.spec import OpSpec


def spec():
    op = OpSpec("shifted_exp_softmax")
    x = op.input("x")
    row_max = op.row_max("row_max", x)
    e = op.element("e", sympy.exp(x - row_max), positive=True)
    denominator = op.row_sum("denominator", e, positive=True)
    op.output(op.element("p", e / denominator, positive=True))
    op.save(e, denominator)
    op.api = DimAPI(function="shifted_exp_softmax", module="ShiftedExpSoftmax",
                    torch_function="torch.softmax")
    return op
'''


@pytest.fixture(scope="module")
def unrecordable(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("unrecordable")
    spec = out / "shifted_exp_softmax.py"
    spec.write_text(SHIFTED_EXP)
    assert derive_main([str(spec), "--out", str(out / "built")]) == 0
    path = Path(out / "built" / "shifted_exp_softmax.py")
    module_spec = importlib.util.spec_from_file_location("shifted_exp_softmax", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_a_mode_autograd_cannot_differentiate_says_so(unrecordable, torch_path, dispatch):
    x = randn(SHAPE).requires_grad_()
    y = unrecordable.shifted_exp_softmax(x, -1)
    upstream = randn(SHAPE, seed=1)
    first, = torch.autograd.grad(y, x, upstream, retain_graph=True)
    torch.testing.assert_close(first, torch.autograd.grad(torch.softmax(x, -1), x, upstream)[0],
                               **FP64_TOL)
    with pytest.raises(RuntimeError, match=r"shifted_exp_softmax: double backward "
                       r"\(create_graph=True\) is not supported: it saves e, denominator"):
        torch.autograd.grad(y, x, upstream, create_graph=True)

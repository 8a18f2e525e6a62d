"""Every op and memory mode under torch's transforms beside autograd: fake and meta tensors,
torch.compile(dynamic=True, fullgraph=True) over several batch sizes, autocast, inference
tensors beside operands that need grad, and torch's random state after a dropout that is off.

Each test runs on both dispatch paths (`device`): without CUDA, the Triton kernels in the
interpreter and the generated torch path."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from reference import randn
from torch._subclasses.fake_tensor import FakeTensorMode

import generated.add_layernorm as add_layernorm
import generated.add_rmsnorm as add_rmsnorm
import generated.bias_dropout_add as bias_dropout_add
import generated.cross_entropy as cross_entropy
import generated.dropout_add_layernorm as dropout_add_layernorm
import generated.dropout_add_rmsnorm as dropout_add_rmsnorm
import generated.geglu as geglu
import generated.geglu_tanh as geglu_tanh
import generated.gelu as gelu
import generated.gelu_tanh as gelu_tanh
import generated.layernorm as layernorm
import generated.masked_softmax as masked_softmax
import generated.rmsnorm as rmsnorm
import generated.rotary as rotary
import generated.softmax as softmax
import generated.swiglu as swiglu
from codegen.runtime import amp

N = 16
ROWS = 4
IGNORE = -100


def rotate_half(x):
    return torch.cat((-x[..., N // 2:], x[..., :N // 2]), dim=-1)


class Case(NamedTuple):
    """A public call on the operands (x, r: (rows, N); w, b: (N,); t: (rows,) class indices
    with one ignored) and torch's composition of it. `exact`: the two give the same values
    (no dropout mask, no output torch lacks), else only their shapes and dtypes compare."""

    ours: Callable
    theirs: Callable
    exact: bool = True
    #: one graph under torch.compile (linear_cross_entropy's loop over chunks runs eagerly)
    compiles: bool = True


def _cases() -> dict[str, Case]:
    cases = {}
    for m in layernorm._MODES:
        cases[f"layer_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: layernorm.layer_norm(x, (N,), w, b, memory=m),
            lambda x, r, w, b, t: F.layer_norm(x, (N,), w, b))
        cases[f"add_layer_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: add_layernorm.add_layer_norm(
                x, r, (N,), w, b, prenorm=True, memory=m),
            lambda x, r, w, b, t: (F.layer_norm(x + r, (N,), w, b), x + r))
        cases[f"dropout_add_layer_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: dropout_add_layernorm.dropout_add_layer_norm(
                x, r, (N,), w, b, dropout_p=0.25, seed=3, prenorm=True, memory=m),
            lambda x, r, w, b, t: (F.layer_norm(F.dropout(x, 0.25) + r, (N,), w, b), x + r),
            exact=False)
    for m in rmsnorm._MODES:
        cases[f"rms_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: rmsnorm.rms_norm(x, (N,), w, 1e-6, memory=m),
            lambda x, r, w, b, t: F.rms_norm(x, (N,), w, 1e-6))
        cases[f"add_rms_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: add_rmsnorm.add_rms_norm(
                x, r, (N,), w, 1e-6, input_bias=b, prenorm=True, memory=m),
            lambda x, r, w, b, t: (F.rms_norm(x + b + r, (N,), w, 1e-6), x + b + r))
        cases[f"dropout_add_rms_norm-{m}"] = Case(
            lambda x, r, w, b, t, m=m: dropout_add_rmsnorm.dropout_add_rms_norm(
                x, r, (N,), w, 1e-6, dropout_p=0.25, seed=3, prenorm=True, memory=m),
            lambda x, r, w, b, t: (F.rms_norm(F.dropout(x, 0.25) + r, (N,), w, 1e-6), x + r),
            exact=False)
    cases.update({
        "bias_dropout_add": Case(
            lambda x, r, w, b, t: bias_dropout_add.bias_dropout_add(x, r, bias=b, p=0.25, seed=3),
            lambda x, r, w, b, t: r + F.dropout(x + b, 0.25), exact=False),
        "swiglu": Case(lambda x, r, w, b, t: swiglu.swiglu(x, r),
                       lambda x, r, w, b, t: F.silu(x) * r),
        "geglu": Case(lambda x, r, w, b, t: geglu.geglu(x, r),
                      lambda x, r, w, b, t: F.gelu(x) * r),
        "geglu_tanh": Case(lambda x, r, w, b, t: geglu_tanh.geglu_tanh(x, r),
                           lambda x, r, w, b, t: F.gelu(x, approximate="tanh") * r),
        "gelu": Case(lambda x, r, w, b, t: gelu.gelu(x, bias=b),
                     lambda x, r, w, b, t: F.gelu(x + b)),
        "gelu_tanh": Case(lambda x, r, w, b, t: gelu_tanh.gelu_tanh(x, bias=b),
                          lambda x, r, w, b, t: F.gelu(x + b, approximate="tanh")),
        "softmax": Case(lambda x, r, w, b, t: softmax.softmax(x),
                        lambda x, r, w, b, t: torch.softmax(x, -1)),
        # the mask an additive float one, read through its row stride 0
        "masked_softmax": Case(
            lambda x, r, w, b, t: masked_softmax.masked_softmax(x, b.detach(), scale=0.5),
            lambda x, r, w, b, t: torch.softmax(0.5 * x + b.detach(), -1)),
        "masked_softmax-dropout": Case(
            lambda x, r, w, b, t: masked_softmax.masked_softmax(
                x, b.detach(), scale=0.5, dropout_p=0.25, seed=4),
            lambda x, r, w, b, t: F.dropout(torch.softmax(0.5 * x + b.detach(), -1), 0.25),
            exact=False),
        "cross_entropy": Case(
            lambda x, r, w, b, t: cross_entropy.cross_entropy(x, t, label_smoothing=0.1),
            lambda x, r, w, b, t: F.cross_entropy(x, t, label_smoothing=0.1)),
        "cross_entropy-weight-none": Case(
            lambda x, r, w, b, t: cross_entropy.cross_entropy(x, t, w.detach(), reduction="none"),
            lambda x, r, w, b, t: F.cross_entropy(x, t, w.detach(), reduction="none")),
        # z-loss, softcap and the returned values, which torch lacks
        "cross_entropy-returns": Case(
            lambda x, r, w, b, t: cross_entropy.cross_entropy(
                x, t, lse_square_scale=0.125, softcap=3.0, return_z_loss=True,
                return_token_accuracy=True, return_predicted_tokens=True),
            lambda x, r, w, b, t: (F.cross_entropy(x, t), F.cross_entropy(x, t),
                                   F.cross_entropy(x, t).float(), t.clone()),
            exact=False),
        # the classes' weight (N, N) made of w and b, which get its gradient
        "linear_cross_entropy": Case(
            lambda x, r, w, b, t: cross_entropy.linear_cross_entropy(x, w[:, None] * b, t),
            lambda x, r, w, b, t: F.cross_entropy(F.linear(x, w[:, None] * b), t),
            compiles=False),
        "rotary": Case(
            lambda x, r, w, b, t: rotary.rotary(x, w.detach(), b.detach()),
            lambda x, r, w, b, t: x * w.detach() + rotate_half(x) * b.detach()),
        "apply_rotary_pos_emb": Case(
            lambda x, r, w, b, t: rotary.apply_rotary_pos_emb(
                x[:, None, None], r[:, None, None], w.detach()[None, None], b.detach()[None, None]),
            lambda x, r, w, b, t: tuple(
                q[:, None, None] * w.detach() + rotate_half(q[:, None, None]) * b.detach()
                for q in (x, r))),
    })
    return cases


CASES = _cases()
COMPILED = {name: case for name, case in CASES.items() if case.compiles}


def operands(device, rows=ROWS, dtype=torch.float32, grad=(True, True, True, True)):
    """[x, r, w, b, t]: x, r, w, b leaves (requiring grad as `grad` says), t class indices."""
    tensors = [randn((rows, N), seed=1), randn((rows, N), seed=2),
               randn((N,), seed=3, shift=2.0), randn((N,), seed=4)]
    tensors = [tensor.to(device=device, dtype=dtype).requires_grad_(needs)
               for tensor, needs in zip(tensors, grad, strict=True)]
    target = (torch.arange(rows) * 3) % N
    target[1] = IGNORE
    return [*tensors, target.to(device)]


def outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def forward_backward(call, tensors):
    """The call's outputs and the gradients of the sum of its floating outputs with respect to
    the operands that require grad (None where an operand gets none)."""
    results = outputs(call(*tensors))
    leaves = [tensor for tensor in tensors if tensor.requires_grad]
    loss = sum(result.float().sum() for result in results if result.is_floating_point())
    if not loss.requires_grad:  # nothing that requires grad reached an output
        return results, (None,) * len(leaves)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return results, grads


def described(tensors) -> list:
    return [None if t is None else (tuple(t.shape), t.dtype, t.device.type) for t in tensors]


# Fake and meta tensors


@pytest.mark.parametrize("name", list(CASES))
def test_fake_tensors_propagate_shapes_and_dtypes(device, name):
    """Under FakeTensorMode every call and its backward give the shapes and dtypes of the same
    call on real tensors, as torch's composition of it does."""
    case = CASES[name]
    real = operands(device)
    want_results, want_grads = forward_backward(case.ours, real)
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in real]
    with mode:
        got_results, got_grads = forward_backward(case.ours, fake)
        torch_results, torch_grads = forward_backward(case.theirs, fake)
    assert described(got_results) == described(want_results)
    assert described(got_grads) == described(want_grads)
    assert described(got_results)[:1] == described(torch_results)[:1]
    if case.exact:
        assert described(got_results) == described(torch_results)
        assert described(got_grads) == described(torch_grads)


@pytest.mark.parametrize("name", list(CASES))
def test_meta_tensors_propagate_shapes_and_dtypes(device, name):
    """Meta tensors, on the kernel path too, give the shapes and dtypes of real ones."""
    case = CASES[name]
    real = operands(device)
    want_results, want_grads = forward_backward(case.ours, real)
    meta = [t.detach().to("meta").requires_grad_(t.requires_grad) for t in real]
    got_results, got_grads = forward_backward(case.ours, meta)
    assert described(got_results) == [(*d[:2], "meta") for d in described(want_results)]
    assert described(got_grads) == [d and (*d[:2], "meta") for d in described(want_grads)]


def test_cross_entropy_still_checks_concrete_targets(device):
    """The target's values are checked where they exist (no check is dropped for real
    tensors; CPU tensors, whose check raises at once, on either path)."""
    x, _, _, _, t = operands("cpu")
    t[0] = N  # out of range
    with pytest.raises(IndexError, match="class indices in"):
        cross_entropy.cross_entropy(x, t)


# torch.compile(dynamic=True, fullgraph=True)


def compiled_matches_eager(call, device, backend):
    """`call` compiled with dynamic shapes and no graph break, run for three batch sizes
    without a recompile, gives eager's outputs and gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(call, backend=backend, dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (3, 5, 8):
            tensors = operands(device, rows)
            got_results, got_grads = forward_backward(compiled, tensors)
            want_results, want_grads = forward_backward(call, tensors)
            for got, want in zip((*got_results, *got_grads), (*want_results, *want_grads),
                                 strict=True):
                torch.testing.assert_close(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(COMPILED))
def test_compile_dynamic_fullgraph_without_recompiling(device, name):
    """Each call traced by Dynamo (its custom op's fake implementation given symbolic
    shapes), the backward run by the op's registered autograd formula."""
    compiled_matches_eager(COMPILED[name].ours, device, "eager")


#: the compiled calls in a few graphs (one each would take twice the compile time)
GRAPHS = 3


@pytest.mark.parametrize("graph", range(GRAPHS))
def test_compile_dynamic_fullgraph_backward_traced(graph):
    """A graph of every GRAPHS-th call through aot_eager, which traces the backward too (the
    backward ops' fake implementations given symbolic shapes). The trace is the same on either
    path; the process's path runs it (the test above runs each op's backward on both)."""
    cases = list(COMPILED.values())[graph::GRAPHS]

    def calls(*tensors):
        return tuple(result for case in cases for result in outputs(case.ours(*tensors)))

    compiled_matches_eager(calls, torch.device("cpu"), "aot_eager")


def test_compiled_rotary_tables_of_fixed_shape(device):
    """Tables of a fixed shape (a module's buffers) beside an input of symbolic shape: no false
    broadcast error, no recompile."""

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos", randn((7, N), seed=5, device=device))
            self.register_buffer("sin", randn((7, N), seed=6, device=device))

        def forward(self, q):
            return rotary.rotary(q, self.cos, self.sin)

    embed = Embed()
    torch._dynamo.reset()
    compiled = torch.compile(embed, backend="aot_eager", dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (2, 3, 5):
            # (batch, seq, heads, head_dim) seen as (batch, heads, seq, head_dim): the rows'
            # memory order found from symbolic strides
            q = randn((batch, 7, 4, N), seed=batch, device=device).transpose(1, 2)
            q.requires_grad_()
            got, = forward_backward(compiled, [q])[1]
            want, = forward_backward(embed, [q])[1]
            torch.testing.assert_close(compiled(q), embed(q))
            torch.testing.assert_close(got, want)
    torch._dynamo.reset()


# Autocast


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_autocast_dtypes_as_torch(device, name, dtype):
    """Under autocast each result and gradient has the dtype torch's composition gives (on the
    CPU: cross_entropy's loss float32, everything else the input's dtype; on CUDA the norms,
    softmax and the losses float32), and the results of the exact cases agree to the inputs'
    precision."""
    case = CASES[name]
    tensors = operands(device, dtype=dtype)
    with autocast(device):
        got_results, got_grads = forward_backward(case.ours, tensors)
        want_results, want_grads = forward_backward(case.theirs, tensors)
    assert described(got_results) == described(want_results)
    assert described(got_grads) == described(want_grads)
    if case.exact:
        # torch rounds some intermediates (a sum before a norm) to the inputs' dtype, which the
        # kernels keep in float32: the inputs' precision bounds the difference
        # (and autocast's bf16 product rounds the logits of linear_cross_entropy's reference)
        tolerance = ({"rtol": 1.6e-2, "atol": 1e-2}
                     if dtype == torch.bfloat16 or name == "linear_cross_entropy" else {})
        for got, want in zip(got_results, want_results, strict=True):
            torch.testing.assert_close(got, want, **tolerance)


def test_autocast_policy_is_the_installed_torch_s_eagerly_and_compiled(device, monkeypatch):
    """Which ops autocast runs in float32 is asked of the installed torch (its lists change
    between versions), with the same answer when the first call is traced by torch.compile."""
    x = torch.ones(2, 4, device=device, dtype=torch.bfloat16)
    with autocast(device):
        eager = {op: amp.listed(op, x.device) for op in amp._PROBES}
        for op, want in eager.items():
            monkeypatch.setattr(amp, "_LISTED", {})
            torch._dynamo.reset()
            compiled = torch.compile(lambda t, op=op: t * 2 if amp.listed(op, t.device) else t,
                                     backend="eager", fullgraph=True)
            assert torch.equal(compiled(x), x * 2 if want else x), op
    torch._dynamo.reset()
    # the CPU's lists keep norms and softmax in their dtype, CUDA's run softmax in float32
    assert eager["cross_entropy"] and eager["softmax"] == (device.type == "cuda")


def test_cross_entropy_autocast_loss_is_torchs(device):
    """The bf16 logits' loss under autocast: float32 and torch's value, computed from the logits
    in float32 (`F.cross_entropy(x.float(), t)`), to float32's precision."""
    x, _, w, _, t = operands(device, rows=64, dtype=torch.bfloat16)
    with autocast(device):
        got = cross_entropy.cross_entropy(x, t, w.detach().float(), label_smoothing=0.1)
        want = F.cross_entropy(x, t, w.detach().float(), label_smoothing=0.1)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, F.cross_entropy(x.float(), t, w.detach().float(),
                                                    label_smoothing=0.1))
    # torch's own: on CUDA autocast keeps its log-probabilities in bf16 (cross_entropy passes
    # log_softmax the logits' dtype), so ours, from float32 ones, is within twice its error
    exact = F.cross_entropy(x.double(), t, w.detach().double(), label_smoothing=0.1)
    assert (got.double() - exact).abs() <= 2 * (want.double() - exact).abs() + 1e-6


# Inference tensors


@pytest.mark.parametrize("which", ["x", "others"])
@pytest.mark.parametrize("name", list(CASES))
def test_inference_tensors_beside_operands_that_need_grad(device, name, which):
    """Operands made under torch.inference_mode beside operands that require grad: the call
    works, with the values and gradients of the same call on ordinary tensors."""
    case = CASES[name]
    grad = (False, True, True, True) if which == "x" else (True, False, False, False)
    plain = operands(device, grad=grad)
    with torch.inference_mode():
        made = [t.detach().clone() for t in plain]
    assert all(t.is_inference() for t in made)
    mixed = [t.detach().requires_grad_() if t.requires_grad else m
             for t, m in zip(plain, made, strict=True)]
    got_results, got_grads = forward_backward(case.ours, mixed)
    want_results, want_grads = forward_backward(case.ours, plain)
    for got, want in zip((*got_results, *got_grads), (*want_results, *want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# Random state


def rng_state(device):
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _off_dropouts():
    """Calls whose dropout is off, each with torch's composition: (ours, theirs) on the
    operands (x, r, w, b)."""
    calls = {}
    for p, training in ((0.0, True), (0.3, False)):
        tag = f"p={p}-training={training}"
        calls[f"bias_dropout_add-{tag}"] = (
            lambda x, r, w, b, p=p, training=training: bias_dropout_add.bias_dropout_add(
                x, r, bias=b, p=p, training=training),
            lambda x, r, w, b, p=p, training=training: r + F.dropout(x + b, p, training))
        for module, norm, function in (
                (dropout_add_layernorm, F.layer_norm, "dropout_add_layer_norm"),
                (dropout_add_rmsnorm, F.rms_norm, "dropout_add_rms_norm"),
                (add_layernorm, F.layer_norm, "add_layer_norm"),
                (add_rmsnorm, F.rms_norm, "add_rms_norm")):
            call = getattr(module, function)
            for m in module._MODES:
                calls[f"{function}-{m}-{tag}"] = (
                    lambda x, r, w, b, p=p, training=training, call=call, m=m:
                        call(x, r, (N,), w, dropout_p=p, training=training, memory=m),
                    lambda x, r, w, b, p=p, training=training, norm=norm:
                        norm(F.dropout(x, p, training) + r, (N,), w))
        calls[f"masked_softmax-{tag}"] = (
            lambda x, r, w, b, p=p, training=training: masked_softmax.masked_softmax(
                x, b.detach(), dropout_p=p, training=training),
            lambda x, r, w, b, p=p, training=training: F.dropout(
                torch.softmax(x + b.detach(), -1), p, training))
    calls["masked_softmax-default"] = (
        lambda x, r, w, b: masked_softmax.masked_softmax(x, b.detach(), scale=0.5),
        lambda x, r, w, b: torch.softmax(0.5 * x + b.detach(), -1))
    # modules in eval mode, their dropout on when training
    modules = {
        "BiasDropoutAdd": (bias_dropout_add.BiasDropoutAdd(0.3),
                           lambda module, x, r, w, b: module(x, r, b), torch.nn.Dropout(0.3),
                           lambda dropout, x, r, w, b: r + dropout(x + b)),
        "DropoutAddLayerNorm": (dropout_add_layernorm.DropoutAddLayerNorm(
                                    N, elementwise_affine=False, dropout_p=0.3),
                                lambda module, x, r, w, b: module(x, r), torch.nn.Dropout(0.3),
                                lambda dropout, x, r, w, b: F.layer_norm(dropout(x) + r, (N,))),
        "DropoutAddRMSNorm": (dropout_add_rmsnorm.DropoutAddRMSNorm(
                                  N, elementwise_affine=False, dropout_p=0.3),
                              lambda module, x, r, w, b: module(x, r), torch.nn.Dropout(0.3),
                              lambda dropout, x, r, w, b: F.rms_norm(dropout(x) + r, (N,))),
        "AddLayerNorm": (add_layernorm.AddLayerNorm(N, elementwise_affine=False, dropout_p=0.3),
                         lambda module, x, r, w, b: module(x, r), torch.nn.Dropout(0.3),
                         lambda dropout, x, r, w, b: F.layer_norm(dropout(x) + r, (N,))),
        "MaskedSoftmax": (masked_softmax.MaskedSoftmax(dropout_p=0.3),
                          lambda module, x, r, w, b: module(x, b.detach()),
                          torch.nn.Dropout(0.3),
                          lambda dropout, x, r, w, b: dropout(torch.softmax(x + b.detach(), -1))),
    }
    for name, (module, ours, dropout, theirs) in modules.items():
        # the norms without parameters, as their references: nothing moves to x's device
        # inside a compiled call, where a new Parameter breaks the graph
        calls[f"{name}-eval"] = (
            lambda x, r, w, b, module=module, ours=ours: ours(module.eval(), x, r, w, b),
            lambda x, r, w, b, dropout=dropout, theirs=theirs: theirs(dropout.eval(), x, r, w, b))
    return calls


OFF_DROPOUTS = _off_dropouts()


@pytest.mark.parametrize("name", list(OFF_DROPOUTS))
def test_off_dropout_draws_as_torch(device, name):
    """A dropout that is off draws from torch's generators what torch's draws (nothing), in the
    forward and the backward: every later random op of the program gives what it gives
    unpatched."""
    ours, theirs = OFF_DROPOUTS[name]
    tensors = operands(device)[:4]
    states = []
    for call in (theirs, ours):
        torch.manual_seed(1234)
        if device.type == "cuda":
            torch.cuda.manual_seed(1234)
        forward_backward(call, tensors)
        states.append(rng_state(device))
    for got, want in zip(states[1], states[0], strict=True):
        assert torch.equal(got, want)


def test_off_dropout_draws_as_torch_compiled(device):
    """The same under torch.compile: a graph of every call with its dropout off draws what
    torch's calls draw eagerly."""

    def every(which):
        def calls(*tensors):
            return tuple(result for pair in OFF_DROPOUTS.values()
                         for result in outputs(pair[which](*tensors)))
        return calls

    tensors = operands(device)[:4]
    torch._dynamo.reset()
    compiled = torch.compile(every(0), backend="eager", fullgraph=True)
    states = []
    for call in (every(1), compiled):
        torch.manual_seed(1234)
        if device.type == "cuda":
            torch.cuda.manual_seed(1234)
        forward_backward(call, tensors)
        states.append(rng_state(device))
    torch._dynamo.reset()
    for got, want in zip(states[1], states[0], strict=True):
        assert torch.equal(got, want)

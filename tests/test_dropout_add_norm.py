"""Dropout + residual add + LayerNorm: add_layer_norm(dropout_p=...) and the op that computes it
with dropout on (dropout_add_layernorm), add_rms_norm's alike, and BERT's outputs and Phi-3's
attention dropout fused with their add + norm by patch_model().

torch draws its dropout mask from its own generator, so every comparison with dropout on uses
the op's own keep mask in the reference: bias_dropout_add's for the same shape, p and seed (the
two ops draw the same one, which one test checks).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import (
    assert_low_precision_ok,
    assert_matches_torch,
    assert_unseeded_calls_replay,
    generated_torch_path,
    gradcheck,
    randn,
    select_path,
)

from codegen.runtime import dispatch, patching
from generated import add_layernorm
from generated import dropout_add_layernorm as dal_module
from generated.add_layernorm import AddLayerNorm, add_layer_norm
from generated.add_rmsnorm import add_rms_norm
from generated.bias_dropout_add import bias_dropout_add
from generated.dropout_add_layernorm import dropout_add_layer_norm
from generated.patch import RULES, patch_model

OP = dal_module  # for the `schedule` fixture
N = 37  # three column blocks of the looped schedule
SEED = 1234
# 1/(1 - p) is exact in fp32 (scalar options reach the kernels as fp32), so fp64 comparisons
# with torch hold to fp64 tolerance
EXACT_P = 0.5
BINOMIAL_SIGMAS = 5


def keep_mask(shape, p, seed, device):
    """The op's keep mask for a call of this shape, p and seed (bias_dropout_add's)."""
    return bias_dropout_add(torch.ones(shape, dtype=torch.float64, device=device), p=p,
                            seed=seed) != 0


def inputs(shape, device, dtype=torch.float64):
    """[input, residual, input_bias, weight, bias]"""
    return [randn(shape, seed=1, device=device, dtype=dtype),
            randn(shape, seed=2, device=device, dtype=dtype),
            randn(shape[-1:], seed=3, device=device, dtype=dtype),
            randn(shape[-1:], seed=4, device=device, dtype=dtype, shift=1.0),
            randn(shape[-1:], seed=5, device=device, dtype=dtype)]


def ours(p, seed=SEED, **kwargs):
    """The normalized output and the sum, stacked: one tensor whose gradient reaches both."""
    def call(x, residual, input_bias, weight, bias):
        y, s = add_layer_norm(x, residual, x.shape[-1:], weight, bias, input_bias=input_bias,
                              dropout_p=p, seed=seed, prenorm=True, **kwargs)
        return torch.stack([y, s.to(y.dtype)])
    return call


def theirs(p, keep):
    """torch's LayerNorm of the sum, the input dropped where `keep` is False."""
    def call(x, residual, input_bias, weight, bias):
        s = torch.where(keep, (x + input_bias) / (1 - p), 0.0) + residual
        return torch.stack([F.layer_norm(s, x.shape[-1:], weight, bias, 1e-5), s])
    return call


@pytest.mark.parametrize("p", [0.0, EXACT_P])
def test_matches_torch_with_its_mask(device, schedule, p):
    shape = (2, 3, N)
    keep = keep_mask(shape, p, SEED, device)
    assert_matches_torch(ours(p), theirs(p, keep), inputs(shape, device))


def test_gradcheck(device):
    # fp64 finite differences through the dropout: a fixed seed, the same mask every call
    gradcheck(ours(0.3), inputs((2, 4), device), fast=False)


def test_the_mask_is_bias_dropout_adds_and_the_backward_regenerates_it(device, schedule):
    x, residual, input_bias, weight, bias = (t.requires_grad_() for t in inputs((5, N), device))
    y, s = add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias, dropout_p=0.3,
                          seed=SEED, prenorm=True)
    # the same seed, shape and p: the same mask, the same sum bit for bit
    assert torch.equal(s, bias_dropout_add(x, residual, bias=input_bias, p=0.3, seed=SEED))
    (y * randn(y.shape, seed=9, device=device)).sum().backward()
    kept = keep_mask((5, N), 0.3, SEED, device)
    assert torch.equal(x.grad != 0, kept), "the backward dropped other elements"
    # the residual's gradient flows past the dropout: every element gets one
    assert (residual.grad != 0).all()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_is_one_minus_p(device, p):
    ones = torch.ones(64, 256, device=device)
    _, s = add_layer_norm(ones, None, (256,), dropout_p=p, seed=SEED, prenorm=True)
    kept = s != 0
    n = kept.numel()
    expected, sigma = n * (1 - p), math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - expected) <= BINOMIAL_SIGMAS * sigma
    # every kept element is scaled by 1/(1 - p) (p reaches the kernels as fp32)
    torch.testing.assert_close(s[kept], torch.full_like(s[kept], 1 / (1 - p)))
    assert not (kept == kept[0]).all(), "every row got the same mask"


@pytest.mark.parametrize("off", ["p_zero", "eval"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dropout_off_is_the_plain_op_bit_for_bit_and_draws_nothing(device, off, dtype):
    args = inputs((6, N), device, dtype)
    keywords = {"dropout_p": 0.0} if off == "p_zero" else {"dropout_p": 0.5,
                                                            "training": False}
    results = []
    for extra in ({}, keywords):
        leaves = [t.detach().clone().requires_grad_() for t in args]
        state = torch.get_rng_state()
        y, s = add_layer_norm(leaves[0], leaves[1], (N,), leaves[3], leaves[4],
                              input_bias=leaves[2], prenorm=True, **extra)
        assert torch.equal(torch.get_rng_state(), state), "a call without dropout drew a seed"
        (y.float() * randn(y.shape, seed=9, device=device)).sum().backward()
        results.append([y, s, *(t.grad for t in leaves)])
    for plain, off_result in zip(*results, strict=True):
        assert torch.equal(plain, off_result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_low_precision_with_its_mask(device, dtype):
    shape = (16, N)
    keep = keep_mask(shape, EXACT_P, SEED, device)
    assert_low_precision_ok(ours(EXACT_P), theirs(EXACT_P, keep), inputs(shape, device), dtype)


def test_stride_zero_residual(device):
    # one residual row broadcast over the rows: stride 0, read in place
    x, _, input_bias, weight, bias = inputs((5, N), device)
    residual = randn((N,), seed=6, device=device).expand(5, N)
    keep = keep_mask((5, N), EXACT_P, SEED, device)
    assert_matches_torch(lambda x, r, b: ours(EXACT_P)(x, r, b, weight, bias),
                         lambda x, r, b: theirs(EXACT_P, keep)(x, r, b, weight, bias),
                         [x, residual, input_bias])


def test_triton_path_equals_torch_path(monkeypatch):
    results = {}
    for path in ("triton", "torch"):
        device = select_path(monkeypatch, path)
        out = ours(0.3)(*inputs((4, N), device, torch.float32)).cpu()
        results[path] = out
    assert torch.equal(results["triton"][1] != 0, results["torch"][1] != 0), \
        "the two paths drew different keep masks"
    torch.testing.assert_close(results["triton"], results["torch"])


def test_unseeded_calls_draw_from_torch_generator(device):
    ones = torch.ones(8, N, device=device)
    assert_unseeded_calls_replay(
        lambda: add_layer_norm(ones, None, (N,), dropout_p=0.5, prenorm=True)[1], device)


def test_torch_expression_runs_only_with_dropout_off():
    # torch's dropout would draw another mask: forced to torch's expression, a call with dropout
    # on still runs the kernels (the op's mask), one with dropout off runs torch's ops
    x, residual, input_bias, weight, bias = inputs((3, N), "cpu")
    with dispatch.forcing("torch"):
        _, s = add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias,
                              dropout_p=0.3, seed=SEED, prenorm=True)
        off = add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias,
                             dropout_p=0.3, training=False)
    assert torch.equal(s, bias_dropout_add(x, residual, bias=input_bias, p=0.3, seed=SEED))
    assert torch.equal(off, F.layer_norm(x + input_bias + residual, (N,), weight, bias))


def test_the_dropout_op_alone(device):
    args = inputs((3, N), device)
    want = ours(EXACT_P)(*args)
    x, residual, input_bias, weight, bias = args
    y, s = dropout_add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias,
                                  dropout_p=EXACT_P, seed=SEED, prenorm=True)
    assert torch.equal(torch.stack([y, s]), want)


def test_module(device):
    x, residual, input_bias, weight, bias = inputs((4, N), device)
    module = AddLayerNorm(N, dropout_p=0.5, device=device, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    assert module.extra_repr().endswith(", dropout_p=0.5")
    assert torch.equal(module(x, residual, input_bias, seed=SEED),
                       add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias,
                                      dropout_p=0.5, seed=SEED))
    module.eval()
    assert torch.equal(module(x, residual, input_bias),
                       add_layer_norm(x, residual, (N,), weight, bias, input_bias=input_bias))


BAD_CALLS = {
    "p_one": (dict(dropout_p=1.0), ValueError,
              r"add_layer_norm\(\): argument 'dropout_p' must be a probability in \[0, 1\), "
              "got 1.0"),
    "p_string": (dict(dropout_p="0.1"), TypeError,
                 r"add_layer_norm\(\): argument 'dropout_p' must be a real number, got str"),
    "training": (dict(dropout_p=0.1, training=1), TypeError,
                 r"add_layer_norm\(\): argument 'training' must be a bool, got int"),
    # a seed is checked with dropout off too
    "seed_negative": (dict(seed=-1), ValueError,
                      r"add_layer_norm\(\): argument 'seed' must be in \[0, 2\*\*63\), got -1"),
    "seed_float": (dict(dropout_p=0.1, seed=1.5), TypeError,
                   r"argument 'seed' must be an int or None, got float"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_dropout_arguments_are_rejected(case):
    keywords, error, match = BAD_CALLS[case]
    x = torch.randn(4, 8)
    with pytest.raises(error, match=match):
        add_layer_norm(x, x, (8,), **keywords)
    if case == "p_one":
        with pytest.raises(ValueError, match="argument 'dropout_p' must be a probability"):
            AddLayerNorm(8, dropout_p=1.0)


# patch_model(): BERT's outputs with their dropout fused


VOCAB = 64
TOKENS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
OUTPUTS = ("BertSelfOutput", "BertOutput")


def tiny_bert(dtype=torch.float64, **config):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128,
                                     vocab_size=VOCAB, **config)
    return randomised(transformers.BertForMaskedLM(config).to(dtype))


def randomised(model):
    """Every parameter moved off its initial value (no weight of ones hides which is used)."""
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            parameter.add_(0.2 * randn(parameter.shape, seed=100 + index,
                                       dtype=parameter.dtype))
    return model


class SeededDropout(torch.nn.Module):
    """A dropout that draws the fused op's mask: a seed off torch's generator, as the op draws
    it, and the keep mask bias_dropout_add draws from it for the same (rows, width)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return bias_dropout_add(x, p=self.p, training=self.training)


def logits_and_grads(model, training, seed=5):
    model.train(training)
    model.zero_grad()
    torch.manual_seed(seed)
    logits = model(input_ids=TOKENS).logits
    (logits * randn(logits.shape, seed=7, dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.fixture
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


def patched_bert(dtype=torch.float64, **config):
    original = tiny_bert(dtype, **config)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert report.skipped == []
    assert [swap.new for swap in report.swapped] == [
        f"{cls}(add_layer_norm into LayerNorm, with dropout)" for _ in range(2) for cls in OUTPUTS]
    return original, patched


def assert_same(got, want, rtol):
    (logits, grads), (want_logits, want_grads) = got, want
    torch.testing.assert_close(logits, want_logits, rtol=rtol, atol=rtol)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        atol = rtol * max(float(want_grads[name].abs().max()), 1.0)
        torch.testing.assert_close(grads[name], want_grads[name], rtol=rtol, atol=atol,
                                   msg=lambda message, n=name: f"{n}: {message}")


def test_patched_bert_in_eval_gives_the_unpatched_logits_and_gradients(torch_path):
    original, patched = patched_bert()
    assert_same(logits_and_grads(patched, False), logits_and_grads(original, False), 1e-9)


def test_patched_bert_in_training_is_the_model_with_the_ops_mask(torch_path):
    # the unpatched model with each output's dropout drawing the fused op's mask (the same
    # seed off torch's generator, at the same point of the forward): the same logits and
    # gradients; the attention probabilities' dropout is torch's in both
    original, patched = patched_bert()
    for module in original.modules():
        if type(module).__name__ in OUTPUTS:
            module.dropout = SeededDropout(module.dropout.p)
    got = logits_and_grads(patched, True)
    assert_same(got, logits_and_grads(original, True), 1e-9)
    assert torch.isfinite(got[0]).all()
    # deterministic under torch's seed, and another seed draws other masks
    assert_same(logits_and_grads(patched, True), got, 0.0)
    assert not torch.equal(logits_and_grads(patched, True, seed=6)[0], got[0])


def tiny_phi3(**config):
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                     vocab_size=VOCAB, pad_token_id=0, **config)
    return randomised(transformers.Phi3ForCausalLM(config))


def test_patched_phi3_fuses_its_attention_dropout_into_add_rms_norm(torch_path):
    original = tiny_phi3(resid_pdrop=0.1)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert [swap.new for swap in report.swapped] == [
        "Phi3DecoderLayer(add_rms_norm into post_attention_layernorm, with resid_attn_dropout)"
    ] * 2 and report.skipped == []
    assert_same(logits_and_grads(patched, False), logits_and_grads(original, False), 1e-5)
    # in training: the original whose resid_attn_dropout draws the op's mask (the MLP's dropout
    # stays torch's in both, drawn from the same generator state)
    for layer in original.model.layers:
        layer.resid_attn_dropout = SeededDropout(layer.resid_attn_dropout.p)
    assert_same(logits_and_grads(patched, True), logits_and_grads(original, True), 1e-5)


GPT2_FUSED = "GPT2Block(add_layer_norm into ln_2, with attn.resid_dropout)"


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, vocab_size=VOCAB)
    return randomised(transformers.GPT2LMHeadModel(config).double())


def test_patched_gpt2_hands_its_attention_dropout_to_add_layer_norm(torch_path):
    # the dropout is the attention's last step: the attention returns its input as it is and
    # the block drops it out inside add_layer_norm, with the op's mask
    original = tiny_gpt2()
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert [swap.new for swap in report.swapped] == [GPT2_FUSED] * 2 and report.skipped == []
    dropout = patched.transformer.h[0].attn.resid_dropout
    assert isinstance(dropout, torch.nn.Dropout) and type(dropout).__name__ == "HandoffDropout"
    assert list(patched.state_dict()) == list(original.state_dict())
    assert_same(logits_and_grads(patched, False), logits_and_grads(original, False), 1e-9)
    # in training: the original whose resid_dropout draws the op's mask (the attention's and
    # the MLP's other dropouts stay torch's in both, drawn from the same generator state)
    seeded = copy.deepcopy(original)
    for block in seeded.transformer.h:
        block.attn.resid_dropout = SeededDropout(block.attn.resid_dropout.p)
    got = logits_and_grads(patched, True)
    assert_same(got, logits_and_grads(seeded, True), 1e-9)
    assert not torch.equal(got[0], logits_and_grads(original, True)[0])
    # the attention called on its own applies its dropout, as torch's does
    hidden = randn((2, 7, 64), seed=3)
    outputs = []
    for model in (patched, original):
        torch.manual_seed(1)
        outputs.append(model.transformer.h[0].attn.train()(hidden)[0])
    assert torch.equal(*outputs)
    # a dropout put in its place later is another one: the attention applies it
    for model in (original, patched):
        for block in model.transformer.h:
            block.attn.resid_dropout = torch.nn.Dropout(0.1)
    assert_same(logits_and_grads(patched, True), logits_and_grads(original, True), 1e-9)


def test_a_checkpointed_gpt2_block_hands_over_the_same_mask_again(torch_path):
    # Hugging Face's gradient checkpointing runs the block again in the backward, from the
    # generator state of its forward: the fused dropout draws the same seed, so the
    # gradients are those of the model without checkpointing
    patched = tiny_gpt2()
    patch_model(patched, include="residual")
    checkpointed = copy.deepcopy(patched)
    enable = (getattr(checkpointed, "activation_checkpointing_enable", None)
              or checkpointed.gradient_checkpointing_enable)
    enable({"use_reentrant": False})
    block = checkpointed.transformer.h[0]
    calls, checkpoint = [], block._gradient_checkpointing_func
    block._gradient_checkpointing_func = lambda *args, **kwargs: (
        calls.append(1), checkpoint(*args, **kwargs))[1]
    got = logits_and_grads(checkpointed, True)
    assert calls  # the block ran checkpointed
    assert_same(got, logits_and_grads(patched, True), 1e-12)
    assert not torch.equal(got[0], logits_and_grads(patched, True, seed=6)[0])


class ScaledAttention(transformers.models.gpt2.modeling_gpt2.GPT2Attention):
    """An attention that computes more after its dropout: its dropout cannot be handed over."""

    def forward(self, *args, **kwargs):
        output, weights = super().forward(*args, **kwargs)
        return 2 * output, weights


def test_an_attention_that_computes_after_its_dropout_keeps_it(torch_path):
    original = tiny_gpt2()
    original.transformer.h[0].attn.__class__ = ScaledAttention
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert [swap.new for swap in report.swapped] == [
        "GPT2Block(add_layer_norm into ln_2; attn.resid_dropout not fused: attn returned "
        "something other than its dropout's output)", GPT2_FUSED]
    assert type(patched.transformer.h[0].attn.resid_dropout) is torch.nn.Dropout
    # the first block's dropout is torch's in both, the second's the op's mask
    original.transformer.h[1].attn.resid_dropout = SeededDropout(0.1)
    assert_same(logits_and_grads(patched, True), logits_and_grads(original, True), 1e-9)


def test_an_attention_changed_after_patching_is_refused_in_training(torch_path):
    original = tiny_gpt2()
    patched = copy.deepcopy(original)
    patch_model(patched, include="residual")
    for model in (original, patched):
        model.transformer.h[1].attn.__class__ = ScaledAttention
    # in eval mode no dropout is handed over: the scaled model, as the original
    assert_same(logits_and_grads(patched, False), logits_and_grads(original, False), 1e-9)
    with pytest.raises(RuntimeError, match=r"GPT2Block: attn returned something other than "
                       r"its dropout's output, which the fused add_layer_norm would drop out; "
                       r"leave the layer unfused: patch_model\(exclude='GPT2Block'\)"):
        logits_and_grads(patched, True)


def test_a_handed_over_dropout_compiles_as_torch_dropout(torch_path):
    # a compiled graph gets the attention's own dropout (the compiler fuses it), in one graph
    original = tiny_gpt2()
    patched = copy.deepcopy(original)
    patch_model(patched, include="residual")
    block = patched.transformer.h[0].train()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    hidden = randn((2, 7, 64), seed=3)
    outputs = []
    for module in (compiled, original.transformer.h[0].train()):
        torch.manual_seed(1)
        outputs.append(module(hidden))
    torch.testing.assert_close(*outputs)


def test_add_rms_norm_dropout_is_its_dropout_op(device):
    x, residual, input_bias, weight, _ = inputs((3, N), device)
    y, s = add_rms_norm(x, residual, (N,), weight, input_bias=input_bias, dropout_p=EXACT_P,
                        seed=SEED, prenorm=True)
    assert torch.equal(s, bias_dropout_add(x, residual, bias=input_bias, p=EXACT_P, seed=SEED))
    torch.testing.assert_close(y, F.rms_norm(s, (N,), weight, torch.finfo(s.dtype).eps),
                               rtol=1e-10, atol=1e-10)
    off = add_rms_norm(x, residual, (N,), weight, input_bias=input_bias, dropout_p=EXACT_P,
                       training=False)
    assert torch.equal(off, add_rms_norm(x, residual, (N,), weight, input_bias=input_bias))


def test_a_dropout_with_hooks_stays_unfused(torch_path):
    original = tiny_bert(torch.float32)
    patched = copy.deepcopy(original)
    for model in (original, patched):
        for module in model.modules():
            if type(module).__name__ in OUTPUTS:
                module.dropout.register_forward_hook(lambda module, args, output: None)
    report = patch_model(patched, include="residual")
    assert [swap.new for swap in report.swapped] == [
        f"{cls}(add_layer_norm into LayerNorm)" for _ in range(2) for cls in OUTPUTS]
    # the dropouts are torch's, called as they are: the same masks as the original's
    assert_same(logits_and_grads(patched, True), logits_and_grads(original, True), 1e-5)


def test_a_fused_dropout_that_keeps_too_much_is_not_proven(torch_path):
    # an add + norm whose dropout ignores p: its kept fraction gives it away on the probe
    def undropped(*args, dropout_p=0.0, training=True, **kwargs):
        return add_layernorm.add_layer_norm(*args, **kwargs)

    undropped.__signature__ = inspect.signature(add_layernorm.add_layer_norm)
    rules = tuple(dataclasses.replace(r, function=undropped)
                  if r.function is add_layernorm.add_layer_norm else r for r in RULES)
    model = tiny_bert(torch.float32)
    report = patching.patch_model(model, rules, include="residual")
    # the report says why the dropout is called as it is
    labels = [swap.new for swap in report.swapped]
    assert len(labels) == 4
    for label, cls in zip(labels, OUTPUTS * 2, strict=True):
        assert re.fullmatch(rf"{cls}\(undropped into LayerNorm; dropout not fused: the fused "
                            r"dropout kept \d+ of \d+ elements at p = 0.1 \(in training mode\)\)",
                            label), label

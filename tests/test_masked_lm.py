"""patch_model(loss=True) on masked LMs (BERT, RoBERTa, DistilBERT): the training loss, which
their forward takes itself with CrossEntropyLoss of the logits, computed from the labelled
rows' hidden states by linear_cross_entropy; the logits a stand-in computed only if used."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import generated_torch_path, randn

from codegen.runtime.logits_route import LazyLogits
from generated.cross_entropy import linear_cross_entropy
from generated.patch import patch_model

VOCAB = 50
TOKENS = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
LABELS = TOKENS.clone()
LABELS[:, ::2] = -100  # a masked LM labels a few positions
ROUTED = "linear_cross_entropy(labelled rows' hidden states, output embeddings)"
MODELS = {
    "bert": (transformers.BertConfig, transformers.BertForMaskedLM),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM),
    "distilbert": (transformers.DistilBertConfig, transformers.DistilBertForMaskedLM),
}


@pytest.fixture
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


def tiny(kind, dtype=torch.float64):
    config, model = MODELS[kind]
    torch.manual_seed(0)
    sizes = (dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64) if kind == "distilbert"
             else dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64))
    return model(config(vocab_size=VOCAB, **sizes)).to(dtype)


def step(model, training=True):
    """The loss, the output's logits and every parameter's gradient of one step; dropout
    draws from seed 3."""
    model.train(training)
    model.zero_grad()
    torch.manual_seed(3)
    output = model(input_ids=TOKENS, labels=LABELS)
    output.loss.backward()
    return output.loss.detach(), output.logits, {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_training_loss_from_labelled_rows_is_the_models(torch_path, kind):
    original = tiny(kind)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert [tuple(s) for s in report.swapped] == [("forward", "CrossEntropyLoss", ROUTED)]
    assert report.skipped == []
    loss, logits, grads = step(original)
    got, lazy, got_grads = step(patched)
    torch.testing.assert_close(got, loss, rtol=1e-12, atol=1e-12)
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # the logits stand in, computed where they are used: the same values
    assert type(lazy) is LazyLogits and lazy.shape == logits.shape and lazy.dtype == logits.dtype
    torch.testing.assert_close(lazy.detach() + 0, logits.detach(), rtol=1e-12, atol=1e-12)
    # eval mode is the model's own forward
    loss, logits, _ = step(original, training=False)
    got, real, _ = step(patched, training=False)
    assert type(real) is torch.Tensor and torch.equal(got, loss) and torch.equal(real, logits)


def test_training_step_never_computes_the_logits(torch_path, monkeypatch):
    model = tiny("bert")
    patch_model(model, include="loss")

    def refuse(self):
        raise AssertionError("the logits were computed")

    monkeypatch.setattr(LazyLogits, "real", refuse)
    loss, _, grads = step(model)
    assert loss.isfinite() and grads


def test_bfloat16_within_twice_the_models_own_error(torch_path):
    """A bf16 model's loss and gradients, against the fp64 model of the same weights: within
    twice the unpatched bf16 model's own error, plus a bf16 ulp of the loss."""
    original = tiny("bert", torch.bfloat16)
    exact = copy.deepcopy(original).double()
    patched = copy.deepcopy(original)
    assert len(patch_model(patched, include="loss").swapped) == 1
    for module in (original, exact, patched):  # the same computation in each: no dropout
        for child in module.modules():
            if isinstance(child, torch.nn.Dropout):
                child.p = 0.0
    want, _, want_grads = step(exact)
    hf, _, hf_grads = step(original)
    got, _, got_grads = step(patched)
    eps = torch.finfo(torch.bfloat16).eps
    assert abs(float(got) - float(want)) <= 2 * abs(float(hf) - float(want)) + eps * abs(
        float(want))
    for name, exact_grad in want_grads.items():
        scale = float(exact_grad.abs().max())
        error = float((got_grads[name].double() - exact_grad).abs().max())
        their = float((hf_grads[name].double() - exact_grad).abs().max())
        assert error <= 2 * their + 4 * eps * scale, (name, error, their, scale)


def lazy_and_real():
    hidden = randn((2, 5, 8), seed=1, dtype=torch.float64).requires_grad_()
    weight = randn((VOCAB, 8), seed=2, dtype=torch.float64).requires_grad_()
    bias = randn((VOCAB,), seed=3, dtype=torch.float64).requires_grad_()
    lazy = LazyLogits(hidden, weight, bias, linear_cross_entropy, (2, 5, VOCAB), torch.float64)
    return lazy, F.linear(hidden, weight, bias), (hidden, weight, bias)


TARGET = torch.tensor([3, -100, 7, 7, -100, 0, 1, 2, 49, 5])


@pytest.mark.filterwarnings("ignore:size_average and reduce args")  # the legacy case's
@pytest.mark.parametrize("call", [
    lambda t: F.cross_entropy(t.view(-1, VOCAB), TARGET),
    lambda t: F.cross_entropy(t.reshape(10, VOCAB), TARGET, reduction="sum", label_smoothing=0.1),
    lambda t: F.cross_entropy(t.flatten(0, 1), TARGET, reduction="none"),
    lambda t: torch.nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, VOCAB,
                                                              dtype=torch.float64))(
        t.view(-1, VOCAB), TARGET),
    # what the linear loss does not take runs on the real logits
    lambda t: F.cross_entropy(t.view(-1, VOCAB), TARGET, size_average=False),
    lambda t: F.cross_entropy(t.transpose(0, 1).reshape(-1, VOCAB), TARGET),
    lambda t: F.cross_entropy(t.view(-1, VOCAB), torch.softmax(t.detach().view(-1, VOCAB) + 0,
                                                               -1)),
    lambda t: (t.float() * 2).log_softmax(-1).sum(),
    lambda t: t[:, 1:].argmax(-1).double().sum(),
], ids=["mean", "sum-smoothed", "none", "class-weights", "legacy", "transposed",
        "probabilities", "other-ops", "indexing"])
def test_a_stand_in_computes_what_the_logits_would(call):
    lazy, real, leaves = lazy_and_real()
    got, want = call(lazy), call(real)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if want.requires_grad:
        upstream = randn(want.shape, seed=4, dtype=want.dtype)
        for a, b in zip(torch.autograd.grad(got, leaves, upstream),
                        torch.autograd.grad(want, leaves, upstream), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_output_embeddings_with_a_hook_keep_the_models_loss(torch_path):
    model = tiny("bert")
    model.get_output_embeddings().register_forward_hook(lambda module, args, output: None)
    report = patch_model(model, include="loss")
    assert report.swapped == []
    [(name, old, reason)] = report.skipped
    assert (name, old) == ("forward", "CrossEntropyLoss")
    assert reason == ("its training loss stays the logits': its cls.predictions.decoder has "
                      "forward_hooks of its own, which would see the stand-in for the logits")


def test_labelled_rows_are_found_before_the_forward(torch_path, monkeypatch):
    """The labelled rows are found (`nonzero`, which waits for the GPU) once a step, before the
    model's encoder runs, so that the wait does not fall between the forward and the backward;
    labels modified in place after that are found again where the loss takes them."""
    patched = tiny("bert")
    patch_model(patched, include="loss")
    calls = []
    found = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: calls.append(
        "nonzero") or found(self, *a, **k))
    encoder = patched.bert.forward
    monkeypatch.setattr(patched.bert, "forward", lambda *a, **k: calls.append(
        "encoder") or encoder(*a, **k))
    loss, _, grads = step(patched)
    assert calls == ["nonzero", "encoder"]
    original = tiny("bert")
    want, _, want_grads = step(original)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-9, atol=1e-12)

    labels = LABELS.clone()

    def relabel(*args, **kwargs):
        labels[0, 1] = -100  # after the rows were found: they are found again
        return encoder(*args, **kwargs)

    monkeypatch.setattr(patched.bert, "forward", relabel)
    calls.clear()
    patched.zero_grad()
    torch.manual_seed(3)
    got = patched(input_ids=TOKENS, labels=labels).loss
    assert calls == ["nonzero", "nonzero"]
    torch.manual_seed(3)
    torch.testing.assert_close(got, original(input_ids=TOKENS, labels=labels).loss,
                               rtol=1e-12, atol=1e-12)


def test_loss_is_not_routed_unless_asked(torch_path):
    model = tiny("bert")
    assert "CrossEntropyLoss" not in patch_model(model)
    assert "forward" not in model.__dict__


def tiny_seq2seq(kind):
    """A T5 (v1.1's gated MLP) or BART sequence-to-sequence LM, float64."""
    torch.manual_seed(0)
    if kind == "t5":
        config = transformers.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                       vocab_size=VOCAB, feed_forward_proj="gated-gelu",
                                       decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(config).double()
    config = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                     max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(config).double()


def test_seq2seq_lm_loss_from_the_decoders_hidden_states(torch_path, monkeypatch):
    """T5's forward takes CrossEntropyLoss of its decoder's logits itself: routed as a masked
    LM's, its loss and gradients are the model's, and training never computes the logits."""
    original = tiny_seq2seq("t5")
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert [tuple(s) for s in report.swapped] == [("forward", "CrossEntropyLoss", ROUTED)]
    loss, _, grads = step(original)
    calls = []
    real = LazyLogits.real
    monkeypatch.setattr(LazyLogits, "real", lambda self: calls.append(1) or real(self))
    got, lazy, got_grads = step(patched)
    assert calls == [] and type(lazy) is LazyLogits
    torch.testing.assert_close(got, loss, rtol=1e-12, atol=1e-12)
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_forward_that_uses_the_logits_first_is_left_with_the_reason(torch_path):
    """BART adds a bias to its logits before the cross-entropy: the stand-in would compute them
    whole anyway, so nothing is swapped, and the report says why."""
    model = tiny_seq2seq("bart")
    report = patch_model(model, include="loss")
    assert report.swapped == []
    [(name, old, reason)] = report.skipped
    assert (name, old) == ("forward", "CrossEntropyLoss")
    assert "uses the logits otherwise than in the loss" in reason, reason
    assert "forward" not in model.__dict__

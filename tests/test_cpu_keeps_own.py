"""On a CPU outside Triton's interpreter no generated kernel runs: an op runs torch's own
expression of itself where it has one, and a patched model runs its own code where a route has
none (a fused dropout's draws, a loss from the hidden states), so that patching a CPU model
never makes it slower. `VJPFORGE_DISPATCH=kernels` (and the probes) keep the generated path."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from reference import randn

import generated.dropout_add_layernorm as dropout_add_layernorm
import generated.layernorm as layernorm
from codegen.runtime import dispatch
from generated.patch import patch_model


@pytest.fixture(autouse=True)
def cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "FORCED", None)


def _failing(*args, **kwargs):
    pytest.fail("the generated path ran")


def test_an_op_runs_torchs_expression(monkeypatch):
    x, weight, bias = randn((4, 16)), randn((16,), seed=2), randn((16,), seed=3)
    monkeypatch.setattr(layernorm, "_layernorm_fwd", _failing)
    y = layernorm.layer_norm(x, (16,), weight, bias)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,), weight, bias))
    with dispatch.forcing("kernels"), pytest.raises(pytest.fail.Exception):
        layernorm.layer_norm(x, (16,), weight, bias)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels
    with pytest.raises(pytest.fail.Exception):
        layernorm.layer_norm(x, (16,), weight, bias)


def _gpt2(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                     n_positions=32, resid_pdrop=dropout, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def _step(model, tokens):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("forced", [None, "kernels"])
def test_a_patched_model_keeps_its_own_dropout_and_loss(monkeypatch, forced):
    """A layer whose fused add + norm would draw its dropout mask runs its own forward, and a
    causal LM's routed loss its own loss function; forced to the kernels, both take the
    generated path."""
    model = _gpt2(0.1)
    patched = copy.deepcopy(model)
    report = patch_model(patched, loss=True)
    assert "GPT2Block" in report.counts and "ForCausalLMLoss" in report.counts, report
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ran = []
    fused = dropout_add_layernorm.dropout_add_layer_norm
    monkeypatch.setattr(dropout_add_layernorm, "dropout_add_layer_norm",
                        lambda *a, **k: ran.append("fused") or fused(*a, **k))
    monkeypatch.setattr(dispatch, "FORCED", forced)
    loss, grads = _step(patched, tokens)
    # the loss routed from the hidden states returns no logits (they never exist whole)
    routed = patched(input_ids=tokens, labels=tokens).logits is None
    if forced is None:
        assert ran == [] and not routed
        # the model's own code, the same draws: the unpatched model's step exactly
        want_loss, want_grads = _step(model, tokens)
        assert torch.equal(loss, want_loss)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    else:
        assert "fused" in ran and routed, ran

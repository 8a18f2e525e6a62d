"""patch_model(): swap a model's norm modules for generated ones; the loss and every gradient
stay those of the unpatched model (fp64), on small randomly initialised HF models."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import randn

from generated import gelu, gelu_tanh, layernorm, rmsnorm
from generated.patch import patch_model


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": 64}
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64, **common)
        return transformers.BertModel(config)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                         eos_token_id=0, **common)
        return transformers.GPT2Model(config)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2,
                                          intermediate_size=64, **common)
        return transformers.LlamaModel(config)
    config = transformers.GemmaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                      **common)
    return transformers.GemmaModel(config)


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor):
    model.zero_grad()
    hidden = model(input_ids=tokens).last_hidden_state
    loss = (hidden * randn(hidden.shape, seed=7)).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


class ExactRMSNorm(torch.nn.Module):
    """An RMSNorm computed in the input's dtype: HF's Llama/Gemma RMSNorm upcasts to float32
    even from float64, so the unpatched model itself is only fp32-accurate."""

    def __init__(self, module: torch.nn.Module, offset: float):
        super().__init__()
        self.weight, self.eps, self.offset = module.weight, module_eps(module), offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * (self.offset + self.weight)


def module_eps(module: torch.nn.Module) -> float:
    return getattr(module, "eps", getattr(module, "variance_epsilon", None))


def exact_reference(model: torch.nn.Module) -> torch.nn.Module:
    exact = copy.deepcopy(model)
    for parent in list(exact.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                offset = 1.0 if type(child).__name__.startswith("Gemma") else 0.0
                setattr(parent, name, ExactRMSNorm(child, offset))
    return exact


EXPECTED = {"bert": {"LayerNorm": 5, "GELUActivation": 2},
            "gpt2": {"LayerNorm": 5, "NewGELUActivation": 2},
            "llama": {"LlamaRMSNorm": 5}, "gemma": {"GemmaRMSNorm": 5, "GELUTanh": 2}}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_patched_hf_model_matches(kind, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the generated torch path on CPU
    original = tiny(kind).double().train()
    # keep dropout out of the comparison (it would draw different masks)
    for module in original.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    patched = copy.deepcopy(original)
    counts = patch_model(patched)
    assert counts == EXPECTED[kind]
    assert list(patched.state_dict()) == list(original.state_dict())
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    if kind in ("llama", "gemma"):
        # HF's own model agrees with the exact one to its fp32 upcast, no better
        hf_loss, _ = loss_and_grads(original, tokens)
        original = exact_reference(original)
        torch.testing.assert_close(hf_loss, loss_and_grads(original, tokens)[0], rtol=1e-5,
                                   atol=1e-5)
    loss, grads = loss_and_grads(original, tokens)
    patched_loss, patched_grads = loss_and_grads(patched, tokens)
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_patch_keeps_parameters_and_options():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, bias=False),
                                torch.nn.RMSNorm(8, eps=1e-3), torch.nn.LayerNorm(8),
                                torch.nn.GELU(), torch.nn.GELU(approximate="tanh"))
    weight = model[1].weight
    counts = patch_model(model, memory="invertible")
    assert counts == {"LayerNorm": 2, "RMSNorm": 1, "GELU": 2}
    assert isinstance(model[4], gelu.GELU) and isinstance(model[5], gelu_tanh.GELUTanh)
    assert isinstance(model[1], layernorm.LayerNorm) and model[1].bias is None
    assert model[1].weight is weight, "the Parameter object is shared, not copied"
    assert isinstance(model[2], rmsnorm.RMSNorm) and model[2].eps == 1e-3
    assert model[3].memory == "invertible"
    assert patch_model(model) == {}, "generated modules are left alone"


def test_patch_rejects_non_modules():
    with pytest.raises(TypeError, match="argument 'model' must be a torch.nn.Module"):
        patch_model("bert")

"""patch_model() on small randomly initialised Hugging Face models: the norms, the activations,
the gated MLPs and (asked for) the causal-LM loss are swapped, and the logits, the loss and every
gradient stay those of the unpatched model."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import generated_torch_path, pickled, randn
from transformers.loss.loss_utils import ForMaskedLMLoss

from codegen.runtime import logits_route, patch_rotary, patching
from generated import cross_entropy
from generated import rotary as rotary_module
from generated.patch import patch_model

VOCAB = 64
DECODERS = {"llama": (transformers.LlamaConfig, transformers.LlamaModel),
            "mistral": (transformers.MistralConfig, transformers.MistralModel),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2Model),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3Model),
            "gemma": (transformers.GemmaConfig, transformers.GemmaModel),
            "gemma2": (transformers.Gemma2Config, transformers.Gemma2Model),
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3TextModel),
            "phi3": (transformers.Phi3Config, transformers.Phi3Model)}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


def tiny(kind: str, causal_lm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128,
                                         vocab_size=VOCAB)
        return transformers.BertModel(config)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                         eos_token_id=0, vocab_size=VOCAB)
        return (transformers.GPT2LMHeadModel if causal_lm else transformers.GPT2Model)(config)
    if kind == "t5":
        # T5 v1.1's gated MLP: gelu_new (the tanh GELU) on wi_0, times wi_1, dropout, wo
        config = transformers.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
                                       feed_forward_proj="gated-gelu", vocab_size=VOCAB,
                                       dropout_rate=0.0)  # its attention drops functionally
        return transformers.T5EncoderModel(config)
    config_class, model_class = DECODERS[kind]
    # token ids within the tiny vocabulary (Phi-3's defaults are 32000)
    config = config_class(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=32, intermediate_size=128,
                          vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if causal_lm:
        model_class = getattr(transformers, model_class.__name__.replace("Model", "ForCausalLM"))
    return model_class(config)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout would draw different masks in the two models."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout_prob", None), float):
            module.dropout_prob = 0.0  # transformers 4's BERT SDPA attention: a float
    return model


def hidden_loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor):
    model.zero_grad()
    hidden = model(input_ids=tokens).last_hidden_state
    loss = (hidden * randn(hidden.shape, seed=7)).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


class ExactRMSNorm(torch.nn.Module):
    """An RMSNorm computed in the input's dtype: HF's RMSNorms (and T5LayerNorm's mean square)
    upcast to float32 even from float64, so the unpatched model itself is only fp32-accurate."""

    def __init__(self, module: torch.nn.Module, offset: float):
        super().__init__()
        # a weight that is a Parameter: FalconMamba's weightless norm holds a dummy buffer
        self.weight, self.eps, self.offset = module._parameters.get("weight"), \
            module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd if self.weight is None else x * rstd * (self.offset + self.weight)


def upcasts(module: torch.nn.Module) -> bool:
    """An RMS norm of HF's, which computes in float32."""
    return type(module).__name__.endswith("RMSNorm") or type(module).__name__ == "T5LayerNorm"


def exact_reference(model: torch.nn.Module) -> torch.nn.Module:
    exact = copy.deepcopy(model)
    for parent in list(exact.modules()):
        for name, child in list(parent.named_children()):
            if upcasts(child):
                offset = 1.0 if type(child).__name__.startswith("Gemma") else 0.0
                setattr(parent, name, ExactRMSNorm(child, offset))
    return exact


EXPECTED = {"bert": {"LayerNorm": 5, "BertSelfOutput": 2, "BertOutput": 2},
            "gpt2": {"LayerNorm": 5, "NewGELUActivation": 2, "GPT2Block": 2},
            # the attentions' rotary embedding too
            "llama": {"LlamaRMSNorm": 5, "LlamaMLP": 2, "LlamaDecoderLayer": 2,
                      "LlamaAttention": 2},
            "mistral": {"MistralRMSNorm": 5, "MistralMLP": 2, "MistralDecoderLayer": 2,
                        "MistralAttention": 2},
            "qwen2": {"Qwen2RMSNorm": 5, "Qwen2MLP": 2, "Qwen2DecoderLayer": 2,
                      "Qwen2Attention": 2},
            # q_norm and k_norm too
            "qwen3": {"Qwen3RMSNorm": 9, "Qwen3MLP": 2, "Qwen3DecoderLayer": 2,
                      "Qwen3Attention": 2},
            "gemma": {"GemmaRMSNorm": 5, "GemmaMLP": 2, "GemmaDecoderLayer": 2,
                      "GemmaAttention": 2},
            # pre- and post-feedforward norms
            "gemma2": {"Gemma2RMSNorm": 9, "Gemma2MLP": 2, "Gemma2DecoderLayer": 2,
                       "Gemma2Attention": 2},
            # and q_norm, k_norm
            "gemma3": {"Gemma3RMSNorm": 13, "Gemma3MLP": 2, "Gemma3DecoderLayer": 2,
                       "Gemma3Attention": 2},
            "phi3": {"Phi3RMSNorm": 5, "Phi3MLP": 2, "Phi3DecoderLayer": 2,
                     "Phi3Attention": 2},
            "t5": {"T5LayerNorm": 5, "T5DenseGatedActDense": 2}}
#: the gated MLPs and what computes their activation
MLPS = {"llama": ("layers.{}.mlp", "GatedMLP(swiglu, gate=gate_proj, up=up_proj)"),
        "mistral": ("layers.{}.mlp", "GatedMLP(swiglu, gate=gate_proj, up=up_proj)"),
        "qwen2": ("layers.{}.mlp", "GatedMLP(swiglu, gate=gate_proj, up=up_proj)"),
        "qwen3": ("layers.{}.mlp", "GatedMLP(swiglu, gate=gate_proj, up=up_proj)"),
        # the tanh GELU: geglu(approximate="tanh"), whose kernels are geglu_tanh's
        "gemma": ("layers.{}.mlp", "GatedMLP(geglu_tanh, gate=gate_proj, up=up_proj)"),
        "gemma2": ("layers.{}.mlp", "GatedMLP(geglu_tanh, gate=gate_proj, up=up_proj)"),
        "gemma3": ("layers.{}.mlp", "GatedMLP(geglu_tanh, gate=gate_proj, up=up_proj)"),
        # one Linear computes gate and up: its first half is the gate
        "phi3": ("layers.{}.mlp", "GatedMLP(swiglu, gate=gate_up_proj[0], up=gate_up_proj[1])"),
        "t5": ("encoder.block.{}.layer.1.DenseReluDense", "GatedMLP(geglu_tanh, gate=wi_0, "
               "up=wi_1)")}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_patched_hf_model_matches(kind):
    original = without_dropout(tiny(kind).double().train())
    patched = copy.deepcopy(original)
    # every kind but the loss: rotary too, which is swapped only when included
    report = patch_model(patched, include=["norm", "activation", "mlp", "residual", "rotary"])
    assert report == EXPECTED[kind]
    assert list(patched.state_dict()) == list(original.state_dict())
    for name, parameter in original.named_parameters():
        assert patched.get_parameter(name) is not parameter  # a copy of the model ...
    for name, parameter in patched.named_parameters():  # ... whose Parameters are all in use
        assert parameter.shape == original.get_parameter(name).shape
    if kind in MLPS:
        where, new = MLPS[kind]
        assert [s.new for s in report.swapped if s.name in (where.format(0), where.format(1))] \
            == [new, new]
        assert all(type(patched.get_submodule(where.format(i))) is patching.GatedMLP
                   for i in range(2))
    # BERT's GELUActivation is torch's one gelu op already: left alone, the report says why
    assert [(s.old, s.reason.split(",")[0]) for s in report.skipped] == \
        [("GELUActivation", "it runs one torch op already (aten.gelu)")] * (2 if kind == "bert"
                                                                             else 0)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    if any(upcasts(m) for m in original.modules()):
        # HF's own model agrees with the exact one to its fp32 upcast, no better
        hf_loss, _ = hidden_loss_and_grads(original, tokens)
        original = exact_reference(original)
        torch.testing.assert_close(hf_loss, hidden_loss_and_grads(original, tokens)[0],
                                   rtol=1e-5, atol=1e-5)
    loss, grads = hidden_loss_and_grads(original, tokens)
    patched_loss, patched_grads = hidden_loss_and_grads(patched, tokens)
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_bfloat16_family_within_twice_hfs_own_error(kind):
    """A bf16 model patched by default (every kind but the loss) against the exact fp64 model
    of the same weights: its output's loss and every gradient within twice the unpatched bf16
    model's own error, plus a few bf16 ulps of the gradient's scale."""
    original = without_dropout(tiny(kind).to(torch.bfloat16).train())
    exact = exact_reference(original).double()
    patched = copy.deepcopy(original)
    assert patch_model(patched) == EXPECTED[kind]
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    want, want_grads = hidden_loss_and_grads(exact, tokens)
    hf, hf_grads = hidden_loss_and_grads(original, tokens)
    got, got_grads = hidden_loss_and_grads(patched, tokens)
    eps = torch.finfo(torch.bfloat16).eps
    assert abs(float(got - want)) <= 2 * abs(float(hf - want)) + 4 * eps * abs(float(want))
    assert got_grads.keys() == want_grads.keys()
    for name, exact_grad in want_grads.items():
        scale = float(exact_grad.abs().max())
        error = float((got_grads[name].double() - exact_grad).abs().max())
        their = float((hf_grads[name].double() - exact_grad).abs().max())
        assert error <= 2 * their + 4 * eps * scale, (name, error, their, scale)


def test_falcon_mamba_weightless_norms_take_every_width():
    """FalconMamba's mixer normalises dt, B and C by weightless norms that hold a dummy ones
    buffer of the mixer's width, dt being of another (time_step_rank): they stand in whatever
    the width, and the patched model gives the unpatched one's hidden states and gradients."""
    torch.manual_seed(0)
    config = transformers.FalconMambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2,
                                            expand=2, conv_kernel=4, time_step_rank=4,
                                            vocab_size=VOCAB)
    original = transformers.FalconMambaModel(config).double().train()
    # the dummy is of the mixer's width (expand * hidden_size), dt of time_step_rank
    assert original.layers[0].mixer.dt_layernorm.weight.shape == (64,)
    patched = copy.deepcopy(original)
    report = patch_model(patched)
    assert report == {"FalconMambaRMSNorm": 3, "FalconMambaWeightlessRMSNorm": 6}
    assert report.skipped == []
    assert {s.new for s in report.swapped if s.old == "FalconMambaWeightlessRMSNorm"} == {
        "LastDimNorm(rms_norm)"}
    assert list(patched.state_dict()) == list(original.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    # HF's own model agrees with the exact one to its fp32 upcast, no better
    hf_loss, _ = hidden_loss_and_grads(original, tokens)
    original = exact_reference(original)
    loss, grads = hidden_loss_and_grads(original, tokens)
    torch.testing.assert_close(hf_loss, loss, rtol=1e-5, atol=1e-5)
    patched_loss, patched_grads = hidden_loss_and_grads(patched, tokens)
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


#: what computes each attention's rotary embedding: Phi-3's function rotates only the tables'
#: width (partial rotary), which the probe shows
ROTARY = {kind: "generated.rotary.apply_rotary_pos_emb" for kind in DECODERS}
ROTARY["phi3"] = "partial generated.rotary.apply_rotary_pos_emb"


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_rotary_embedding_is_the_generated_op(kind, monkeypatch):
    """Every attention's rotary embedding runs generated.rotary, on this model's instances
    alone, with the same loss and gradients in fp64 (the RMS norms made exact on both sides)."""
    original = exact_reference(without_dropout(tiny(kind).double().train()))
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="rotary")
    attention = type(original.layers[0].self_attn).__name__
    assert report == {attention: 2} and report.skipped == []
    assert [s.new for s in report.swapped] == [f"{attention}(apply_rotary_pos_emb: "
                                               f"{ROTARY[kind]})"] * 2
    swapped = type(patched.layers[0].self_attn)
    assert swapped.__name__ == attention and swapped.__base__ is type(original.layers[0].self_attn)
    assert type(original.layers[0].self_attn) is swapped.__base__  # the original left alone
    calls = []
    monkeypatch.setattr(rotary_module, "rotary", lambda *args, f=rotary_module.rotary: (
        calls.append(args[0].shape), f(*args))[1])
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    loss, grads = hidden_loss_and_grads(original, tokens)
    assert calls == []
    patched_loss, patched_grads = hidden_loss_and_grads(patched, tokens)
    assert len(calls) == 4  # q and k of two layers
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_phi3_partial_rotary():
    """partial_rotary_factor 0.5: only the first half of each head rotates."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=128,
                                     vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, partial_rotary_factor=0.5)
    original = exact_reference(without_dropout(transformers.Phi3Model(config).double()))
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="rotary")
    assert report == {"Phi3Attention": 1}
    embed = type(patched.layers[0].self_attn)._rotary_embed
    assert isinstance(embed, patch_rotary.PartialRotary)
    # pickled with its stand-in, which pickles by reference to the generated function
    patched = pickled(patched, original)
    assert type(patched.layers[0].self_attn)._rotary_embed == embed
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    loss, grads = hidden_loss_and_grads(original, tokens)
    patched_loss, patched_grads = hidden_loss_and_grads(patched, tokens)
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


def interleaved_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J's interleaved rotary embedding: pairs (2i, 2i + 1), which the generated op's
    "half" pairing does not compute."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


def test_a_rotary_embedding_computed_otherwise_is_left_with_the_reason():
    model = tiny("llama")
    attention = model.layers[0].self_attn
    # the same forward over globals whose apply_rotary_pos_emb is GPT-J's, wherever its
    # decorators (transformers' deprecations, kernels' use_kernelized_func) put the function
    # that reads the global
    chain = patch_rotary.forward_chain(type(attention).forward)
    inner = chain[-1]
    other = types.FunctionType(inner.__code__, {**inner.__globals__,
                                                "apply_rotary_pos_emb": interleaved_rotary},
                               "forward", inner.__defaults__, inner.__closure__)
    other.__kwdefaults__ = inner.__kwdefaults__
    for wrapper in reversed(chain[:-1]):  # each decorator's wrapper, around the new function
        wrapped = types.FunctionType(
            wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__,
            tuple(types.CellType(other) if cell.cell_contents is inner else cell
                  for cell in wrapper.__closure__))
        wrapped.__kwdefaults__ = wrapper.__kwdefaults__
        wrapped.__wrapped__, other, inner = other, wrapped, wrapper
    interleaved = type("InterleavedAttention", (type(attention),), {"forward": other})
    attention.__class__ = interleaved
    report = patch_model(model, include="rotary")
    assert report == {"LlamaAttention": 1}
    [(name, old, reason)] = report.skipped
    assert (name, old) == ("layers.0.self_attn", "InterleavedAttention")
    assert reason.startswith("its apply_rotary_pos_emb is not computed by "
                             "generated.rotary.apply_rotary_pos_emb differs by "), reason
    assert type(attention) is interleaved
    # excluded by kind or by class name: no candidate at all
    assert patch_model(tiny("llama"), exclude="rotary").get("LlamaAttention") is None
    # a default kind
    assert patch_model(tiny("llama")).get("LlamaAttention") == 2
    assert patch_model(tiny("llama"), exclude="Llama*Attention").get("LlamaAttention") is None


def test_a_rotary_model_pickles_compiles_and_generates():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    original = transformers.LlamaForCausalLM(config).eval()
    patched = copy.deepcopy(original)
    assert patch_model(patched, include="rotary") == {"LlamaAttention": 2}
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    restored = pickled(patched, original)
    assert type(restored.model.layers[1].self_attn) is type(patched.model.layers[0].self_attn)
    torch.testing.assert_close(restored(input_ids=tokens).logits,
                               original(input_ids=tokens).logits)
    # the cache passes through the rebuilt forward, step after step (grouped-query heads)
    generated = [model.generate(tokens, max_new_tokens=4, do_sample=False, pad_token_id=0)
                 for model in (original, patched)]
    assert torch.equal(generated[1], generated[0]) and generated[0].shape == (2, 11)
    # with every other kind swapped too (the layer's fused add, its norms and MLP): one graph
    everything = copy.deepcopy(original)
    assert patch_model(everything, include=["norm", "mlp", "residual", "rotary"])[
        "LlamaAttention"] == 2
    x = randn((2, 7, 64), seed=2, dtype=torch.float32)
    position = patched.model.rotary_emb(x, torch.arange(7)[None])
    for model, layer in ((patched, patched.model.layers[0].self_attn),
                         (everything, everything.model.layers[0])):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        # attention_mask given: transformers 4's attention forward requires it
        output = compiled(x, position_embeddings=position, attention_mask=None)
        wanted = (original.model.layers[0].self_attn if model is patched
                  else original.model.layers[0])(x, position_embeddings=position,
                                                 attention_mask=None)
        torch.testing.assert_close(output[0] if isinstance(output, tuple) else output,
                                   wanted[0] if isinstance(wanted, tuple) else wanted)


def lm_outputs(model, tokens, labels, **kwargs):
    model.zero_grad()
    out = model(input_ids=tokens, labels=labels, **kwargs)
    out.loss.backward()
    logits = out.logits.detach() if out.logits is not None else None
    return out.loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}  # (a vision tower without images)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_causal_lm_loss_is_routed_through_cross_entropy(kind):
    original = without_dropout(tiny(kind, causal_lm=True).train())
    patched = copy.deepcopy(original)
    report = patch_model(patched, loss=True)
    assert ("loss_function", "ForCausalLMLoss",
            "linear_cross_entropy(hidden states, lm_head)") in report.swapped
    route = patched.loss_function.__self__
    assert route.linear is cross_entropy.linear_cross_entropy
    # the logits' loss (no labels' stand-in: eval mode) is causal_lm_loss's
    assert route.fallback.func is patching.causal_lm_loss
    assert route.fallback.args == (cross_entropy.cross_entropy,)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = tokens.masked_fill(torch.rand(tokens.shape, generator=torch.Generator()
                                           .manual_seed(2)) < 0.3, -100)
    for training in (True, False):
        original.train(training)
        patched.train(training)
        for kwargs in ({}, {"num_items_in_batch": torch.tensor(11)}):
            loss, logits, grads = lm_outputs(original, tokens, labels, **kwargs)
            patched_loss, patched_logits, patched_grads = lm_outputs(patched, tokens, labels,
                                                                     **kwargs)
            # training: the loss from the hidden states, the logits never whole
            assert (patched_logits is None) == training
            if not training:
                torch.testing.assert_close(patched_logits, logits, rtol=1e-5, atol=1e-6)
            # fp32: the loss is computed in fp32 from fp32 logits either way
            torch.testing.assert_close(patched_loss, loss, rtol=1e-6, atol=0)
            for name in grads:
                torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-5,
                                           atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_loss_only_when_asked_and_only_a_causal_one():
    model = tiny("llama", causal_lm=True)
    assert "ForCausalLMLoss" not in patch_model(copy.deepcopy(model))
    assert patch_model(copy.deepcopy(model), include="loss") == {"ForCausalLMLoss": 1}
    assert patch_model(copy.deepcopy(model), loss=True, exclude="loss")["LlamaMLP"] == 2
    # named by its function's name, before and after it is swapped (a name no module nor loss
    # of the model has raises: test_patch.py)
    patched = copy.deepcopy(model)
    assert patch_model(patched, include="ForCausalLM*") == {"ForCausalLMLoss": 1}
    assert patch_model(patched, include="loss", exclude="ForCausalLMLoss") == {}
    # a loss computed otherwise (no shift: a masked LM's) is left, with the reason
    model.loss_function = ForMaskedLMLoss
    report = patch_model(model, include="loss")
    assert report == {} and model.loss_function is ForMaskedLMLoss
    [(name, kind, reason)] = report.skipped
    assert (name, kind) == ("loss_function", "ForMaskedLMLoss")
    assert reason.startswith("causal_lm_loss differs by "), reason


IMAGE_TOKEN = VOCAB - 1


def tiny_multimodal(kind: str) -> torch.nn.Module:
    """A LLaVA (a tiny CLIP vision tower, a tiny Llama) or a PaliGemma (SigLIP, Gemma 2, whose
    text config caps the logits): its vocabulary is its text_config's vocab_size; an 8 x 8
    image is 4 patches, 4 image tokens."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    if kind == "llava":
        text = transformers.LlamaConfig(**sizes, num_key_value_heads=2, head_dim=16,
                                        intermediate_size=64, vocab_size=VOCAB)
        vision = transformers.CLIPVisionConfig(**sizes, intermediate_size=64, image_size=8,
                                               patch_size=4)
        config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                          image_token_id=IMAGE_TOKEN,
                                          projector_hidden_act="gelu")
        model = transformers.LlavaForConditionalGeneration(config)
    else:
        text = transformers.Gemma2Config(**sizes, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=64, vocab_size=VOCAB,
                                         final_logit_softcapping=3.0)
        vision = transformers.SiglipVisionConfig(**sizes, intermediate_size=64, image_size=8,
                                                 patch_size=4)
        config = transformers.PaliGemmaConfig(vision_config=vision, text_config=text,
                                              image_token_id=IMAGE_TOKEN, projection_dim=32)
        model = transformers.PaliGemmaForConditionalGeneration(config)
    # the text config's: LLaVA's config has no vocab_size, PaliGemma's another (its default)
    assert getattr(config, "vocab_size", None) != VOCAB
    assert not hasattr(config, "final_logit_softcapping")
    return model.double()


@pytest.mark.parametrize("kind", ["llava", "paligemma"])
def test_a_multimodal_models_loss_is_routed_from_the_hidden_states(kind):
    """A multimodal model's vocabulary is in its text config (`get_text_config()`), and so is
    PaliGemma's cap of the logits: its causal-LM loss is routed from the hidden states (the
    text config's cap set aside and taken by the loss), and the probe proves it; with and
    without an image, the loss and every gradient are the model's."""
    original = without_dropout(tiny_multimodal(kind).train())
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert report.swapped == [("loss_function", "ForCausalLMLoss",
                               "linear_cross_entropy(hidden states, lm_head)")]
    assert report.skipped == []
    route = patched.loss_function.__self__
    assert route.cap == (3.0 if kind == "paligemma" else None)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, IMAGE_TOKEN, (2, 9), generator=generator)
    labels = tokens.masked_fill(torch.rand(tokens.shape, generator=generator) < 0.3, -100)
    with_image = tokens.clone()
    with_image[:, 1:5] = IMAGE_TOKEN
    images = {"pixel_values": randn((2, 3, 8, 8), seed=3, dtype=torch.float64)}
    for inputs, kwargs in ((tokens, {}), (tokens, {"num_items_in_batch": torch.tensor(11)}),
                           (with_image, images)):
        targets = labels.masked_fill(inputs == IMAGE_TOKEN, -100)
        loss, _, grads = lm_outputs(original, inputs, targets, **kwargs)
        patched_loss, patched_logits, patched_grads = lm_outputs(patched, inputs, targets,
                                                                 **kwargs)
        assert patched_logits is None  # never computed whole
        # the model's loss rounds its logits to float32: so far the same, no further
        torch.testing.assert_close(patched_loss, loss, rtol=1e-6, atol=0)
        # the vision tower's too, with an image
        assert patched_grads.keys() == grads.keys()
        assert any(name.startswith("model.vision_tower.") for name in grads) == bool(kwargs
                                                                                    is images)
        for name in grads:
            torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"{n}: {m}")
    if kind == "paligemma":  # set back after each forward
        assert patched.config.text_config.final_logit_softcapping == 3.0


def tiny_masked_lm(kind: str, **extra) -> torch.nn.Module:
    """A ModernBERT or EuroBERT masked LM, float64: its forward takes the loss through
    `self.loss_function`, transformers' ForMaskedLMLoss."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, mask_token_id=3)
    if kind == "eurobert":
        config = transformers.EuroBertConfig(**sizes, num_key_value_heads=2, **extra)
        return transformers.EuroBertForMaskedLM(config).double()
    config = transformers.ModernBertConfig(**sizes, cls_token_id=1, sep_token_id=2, **extra)
    return transformers.ModernBertForMaskedLM(config).double()


def exact_masked_lm_loss(logits, labels, vocab_size, num_items_in_batch=None,
                         ignore_index=-100, **kwargs):
    """transformers' ForMaskedLMLoss without its cast of the logits to float32."""
    return torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), labels.view(-1),
                                             ignore_index=ignore_index)


@pytest.mark.parametrize(("kind", "extra"), [
    ("modernbert", {}),
    # the head and the loss take the labelled rows alone, which the forward picks itself
    ("modernbert", {"sparse_prediction": True}),
    ("eurobert", {})], ids=["modernbert", "modernbert-sparse", "eurobert"])
def test_a_masked_lm_whose_loss_function_takes_the_loss_is_routed(kind, extra):
    """ModernBERT's and EuroBERT's masked LMs take their loss through `self.loss_function`
    (transformers' ForMaskedLMLoss, whose `logits.float()` stays a stand-in): routed from the
    labelled rows' hidden states, the loss and gradients are the model's (whose float32 logits
    round them), and those of the model computing in float64 throughout."""
    original = tiny_masked_lm(kind, **extra).train()
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert report.swapped == [("forward", "ForMaskedLMLoss", "linear_cross_entropy(labelled "
                               "rows' hidden states, output embeddings)")]
    assert report.skipped == []
    # selected by its loss function's name too
    assert patch_model(copy.deepcopy(original), include="loss",
                       exclude="ForMaskedLMLoss").swapped == []
    exact = copy.deepcopy(original)
    exact.loss_function = exact_masked_lm_loss
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, VOCAB, (2, 9), generator=generator)
    labels = tokens.masked_fill(torch.rand(tokens.shape, generator=generator) < 0.6, -100)
    loss, _, grads = lm_outputs(original, tokens, labels)
    want, _, want_grads = lm_outputs(exact, tokens, labels)
    real = logits_route.LazyLogits.real
    calls = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(logits_route.LazyLogits, "real",
                            lambda self: calls.append(1) or real(self))
        output = patched(input_ids=tokens, labels=labels)
    assert calls == [] and type(output.logits) is logits_route.LazyLogits
    patched.zero_grad()
    output.loss.backward()
    got = output.loss.detach()
    got_grads = {n: p.grad.clone() for n, p in patched.named_parameters()}
    assert got.dtype == torch.float32 == loss.dtype  # as ForMaskedLMLoss returns it
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0)  # float32's rounding
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # eval mode: the model's own forward and loss
    for model in (original, patched):
        model.eval()
    with torch.no_grad():
        want_eval = original(input_ids=tokens, labels=labels)
        got_eval = patched(input_ids=tokens, labels=labels)
    assert type(got_eval.logits) is torch.Tensor
    assert torch.equal(got_eval.loss, want_eval.loss)

"""patch_model()'s "residual" kind: the residual add before a norm inside a transformer layer is
fused with that norm (add_rms_norm / add_layer_norm), the layer's forward rewritten only where a
probe shows it computes what the original does; logits and gradients stay the unpatched ones."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import pickled, randn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from codegen.runtime import patch_residual, patching
from derive.api import NormalizedShapeAPI, Param, Replaces, replaces_mismatches
from generated import add_layernorm, add_rmsnorm
from generated.patch import PatchError, patch_model

VOCAB = 64
DECODERS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config}
LAYERS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer",
          "qwen2": "Qwen2DecoderLayer", "gpt2": "GPT2Block"}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every float tensor moved off its initial value, so that no weight of ones hides which
    norm's weight a fused add uses."""
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            parameter.add_(0.2 * randn(parameter.shape, seed=100 + index,
                                       dtype=parameter.dtype))
    return model


def decoder_config(kind: str, **kwargs):
    return DECODERS[kind](hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=32, intermediate_size=128,
                          vocab_size=VOCAB, **kwargs)


def tiny(kind: str) -> torch.nn.Module:
    """A language model with a vocabulary head: its logits are what is compared."""
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128,
                                         vocab_size=VOCAB)
        return randomised(transformers.BertForMaskedLM(config))
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                         eos_token_id=0, vocab_size=VOCAB)
        return randomised(transformers.GPT2LMHeadModel(config))
    model_class = getattr(transformers, LAYERS[kind].replace("DecoderLayer", "ForCausalLM"))
    return randomised(model_class(decoder_config(kind)))


class ExactRMSNorm(torch.nn.Module):
    """An RMSNorm computed in the input's dtype: HF's RMSNorms upcast to float32 even from
    float64, so that the unpatched model itself is only fp32-accurate."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.weight, self.eps = module.weight, module.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def exact(model: torch.nn.Module) -> torch.nn.Module:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(parent, name, ExactRMSNorm(child))
    return model


TOKENS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def logits_and_grads(model: torch.nn.Module, training: bool, **kwargs):
    model.train(training)
    model.zero_grad()
    torch.manual_seed(5)  # the same dropout masks in both models: dropout is torch's in both
    logits = model(input_ids=TOKENS, **kwargs).logits
    (logits * randn(logits.shape, seed=7, dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def assert_close(actual, expected, rtol, name):
    # relative to the tensor's largest value (at least 1): a gradient's small entries are sums
    # of larger terms that cancel, and carry their rounding (a key bias's gradient is 0 but
    # for it)
    atol = rtol * max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda message: f"{name}: {message}")


def assert_same(original, patched, rtol, training, **kwargs):
    logits, grads = logits_and_grads(original, training, **kwargs)
    patched_logits, patched_grads = logits_and_grads(patched, training, **kwargs)
    assert_close(patched_logits, logits, rtol, "logits")
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        assert_close(patched_grads[name], grads[name], rtol, name)


FUSED = {"llama": ("model.layers", "add_rms_norm into post_attention_layernorm"),
         "mistral": ("model.layers", "add_rms_norm into post_attention_layernorm"),
         "qwen2": ("model.layers", "add_rms_norm into post_attention_layernorm"),
         "gpt2": ("transformer.h", "add_layer_norm into ln_2, with attn.resid_dropout")}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2", "bert"])
def test_fused_layers_give_the_unpatched_logits_and_gradients(kind, dtype, training):
    original = tiny(kind).to(dtype)
    if dtype == torch.float64:
        original = exact(original)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert report.skipped == []
    if kind == "bert":
        prefix = "bert.encoder.layer"
        assert report.swapped == [
            patching.Swap(f"{prefix}.{i}.{name}", cls,
                          f"{cls}(add_layer_norm into LayerNorm, with dropout)")
            for i in range(2) for name, cls in (("attention.output", "BertSelfOutput"),
                                                ("output", "BertOutput"))]
        if training:
            # the fused dropout draws the op's mask, not torch's (tests/test_dropout_add_norm.py
            # compares it with a model that draws the same): here the add + norm alone
            for model in (original, patched):
                for name, module in model.named_modules():
                    if name.endswith("output.dropout"):
                        module.p = 0.0
    else:
        prefix, label = FUSED[kind]
        assert report.swapped == [patching.Swap(f"{prefix}.{i}", LAYERS[kind],
                                                f"{LAYERS[kind]}({label})") for i in range(2)]
        if kind == "gpt2" and training:
            # the attention's resid_dropout handed over to the fused op draws its mask
            # (tests/test_dropout_add_norm.py): here the add + norm alone
            for model in (original, patched):
                for block in model.transformer.h:
                    block.attn.resid_dropout.p = 0.0
    assert list(patched.state_dict()) == list(original.state_dict())
    # fp64: both exact, up to the order of the sums; fp32: the rounding of the sums (the fp32
    # model's own error against fp64 is of the same size)
    assert_same(original, patched, 1e-9 if dtype == torch.float64 else 1e-5, training)


@pytest.mark.parametrize("kind, config, label", [
    ("gemma2", transformers.Gemma2Config,
     "Gemma2DecoderLayer(add_rms_norm into pre_feedforward_layernorm, weight_offset=1.0)"),
    ("gemma3", transformers.Gemma3TextConfig,
     "Gemma3DecoderLayer(add_rms_norm into pre_feedforward_layernorm, weight_offset=1.0)"),
    ("phi3", transformers.Phi3Config,
     "Phi3DecoderLayer(add_rms_norm into post_attention_layernorm, with resid_attn_dropout)")])
def test_gemma_sandwich_and_phi3_layers(kind, config, label):
    """Gemma 2/3 add the normalised attention output to the residual, then normalise again
    before the MLP: that norm takes the add (with Gemma's weight offset of 1). Phi-3 drops out
    the attention output before its add."""
    torch.manual_seed(0)
    config = config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=32, intermediate_size=128,
                    vocab_size=VOCAB, pad_token_id=0)
    model_class = {"gemma2": transformers.Gemma2ForCausalLM,
                   "gemma3": transformers.Gemma3ForCausalLM,
                   "phi3": transformers.Phi3ForCausalLM}[kind]
    original = randomised(model_class(config))
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert [s.new for s in report.swapped] == [label] * 2 and report.skipped == []
    assert_same(original, patched, 1e-5, training=True)


class ScaledResidual(LlamaDecoderLayer):
    """A layer that scales its residual stream: the same children, another computation."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs)
        hidden_states = 0.5 * residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class MaskOnly(LlamaDecoderLayer):
    """A layer whose attention gets the mask and the rotary embeddings, nothing else."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states,
                                          attention_mask=attention_mask,
                                          position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class TupleReturning(LlamaDecoderLayer):
    """transformers 4's decoder layer: `(hidden_states,)`, and the attention weights after it
    with `output_attentions`."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                output_attentions=False, use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, weights = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, output_attentions=output_attentions,
            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states, weights) if output_attentions else (hidden_states,)


def test_a_layer_returning_a_tuple_keeps_its_outputs():
    torch.manual_seed(0)
    # LlamaRMSNorm's float32 casts lifted: fp64 throughout
    # an attention implementation named: a layer built outside a model has none in
    # transformers 4
    config = decoder_config("llama", attn_implementation="eager")
    original = exact(torch.nn.Sequential(randomised(TupleReturning(config, 0))).double())
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="residual")
    assert report == {"TupleReturning": 1}, report.skipped
    x = randn((2, 5, 64), seed=3, dtype=torch.float64)
    position = (randn((2, 5, 32), seed=4, dtype=torch.float64),
                randn((2, 5, 32), seed=5, dtype=torch.float64))
    for output_attentions in (False, True):
        results = []
        for model in (original, patched):
            leaf = x.clone().requires_grad_()
            out = model[0](leaf, position_embeddings=position,
                           output_attentions=output_attentions)
            assert isinstance(out, tuple) and len(out) == 1 + output_attentions
            out[0].square().sum().backward()
            results.append((out, leaf.grad))
        (want, want_grad), (got, got_grad) = results
        for w, g in zip((*want, want_grad), (*got, got_grad), strict=True):
            if w is None:
                assert g is None
            else:
                assert_close(g, w, 1e-9, "a tuple-returning layer's output or gradient")


def layers(*classes):
    config = decoder_config("llama")
    return torch.nn.Sequential(*(randomised(cls(config, 0)) for cls in classes))


def test_a_layer_that_computes_otherwise_is_left_with_the_reason():
    model = layers(ScaledResidual, MaskOnly, LlamaDecoderLayer)
    report = patch_model(model, include="residual")
    assert report == {"LlamaDecoderLayer": 1}
    assert [(s.name, s.old) for s in report.skipped] == [("0", "ScaledResidual"),
                                                         ("1", "MaskOnly")]
    scaled, mask_only = (s.reason for s in report.skipped)
    assert scaled.startswith("ScaledResidual(add_rms_norm into post_attention_layernorm) "
                             "differs by "), scaled
    assert scaled.endswith("(in eval mode)")
    assert mask_only == (
        "its forward calls self_attn(hidden_states=x, attention_mask=<attention_mask>, "
        "position_embeddings=<position_embeddings>), the rewritten one self_attn("
        "hidden_states=x, attention_mask=<attention_mask>, cache=<cache>, "
        "position_embeddings=<position_embeddings>, position_ids=<position_ids>, "
        "probe_keyword=<probe_keyword>, use_cache=<use_cache>) (in eval mode)")
    assert type(model[0]) is ScaledResidual and type(model[1]) is MaskOnly
    assert type(model[2]) is not LlamaDecoderLayer and isinstance(model[2], LlamaDecoderLayer)
    with pytest.raises(PatchError, match=r"patch_model\(\): 1 \(ScaledResidual\) cannot be "
                                         r"swapped: ScaledResidual\(add_rms_norm"):
        patch_model(layers(LlamaDecoderLayer, ScaledResidual), include="residual", strict=True)


@pytest.mark.parametrize("multiplier", [1.0, 0.22])
def test_granite_residual_multiplier_decides(multiplier):
    """Granite's layer has LLaMA's children and scales each sublayer's output before its add:
    by 1 it computes what LLaMA's does, by 0.22 (as its checkpoints) it does not."""
    config = transformers.GraniteConfig(hidden_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        intermediate_size=128, vocab_size=VOCAB,
                                        residual_multiplier=multiplier)
    model = transformers.GraniteModel(config)
    report = patch_model(model, include="residual")
    if multiplier == 1.0:
        assert report == {"GraniteDecoderLayer": 1} and report.skipped == []
    else:
        [(name, old, reason)] = report.skipped
        assert (name, old) == ("layers.0", "GraniteDecoderLayer") and report == {}
        assert reason.startswith("GraniteDecoderLayer(add_rms_norm into "
                                 "post_attention_layernorm) differs by "), reason


def test_an_instance_forward_or_a_hooked_norm_is_a_reason_to_skip():
    model = layers(LlamaDecoderLayer)
    model[0].forward = model[0].forward
    report = patch_model(model, include="residual")
    assert report.skipped == [patching.Skip(
        "0", "LlamaDecoderLayer",
        "its forward is replaced on the instance, which the rewritten forward would not do")]
    model = layers(LlamaDecoderLayer)
    model[0].post_attention_layernorm.register_forward_hook(lambda *_: None)
    model[0].input_layernorm.register_forward_hook(lambda *_: None)  # still called: no matter
    report = patch_model(model, include="residual")
    assert report.skipped == [patching.Skip(
        "0", "LlamaDecoderLayer", "its norm post_attention_layernorm: it has hooks "
        "(forward_hooks), which a replacement would not run")]


def test_strict_changes_nothing_and_the_kind_is_selected():
    model = layers(LlamaDecoderLayer, ScaledResidual)
    with pytest.raises(PatchError):
        patch_model(model, strict=True)
    assert type(model[0]) is LlamaDecoderLayer
    assert type(model[0].post_attention_layernorm).__name__ == "LlamaRMSNorm"
    # on by default, off by kind or by class name, its norms swapped or not
    assert patch_model(layers(LlamaDecoderLayer))["LlamaDecoderLayer"] == 1
    for exclude in ("residual", "Llama*Layer"):
        assert "LlamaDecoderLayer" not in patch_model(layers(LlamaDecoderLayer),
                                                      exclude=exclude)
    assert patch_model(layers(LlamaDecoderLayer), include="norm") == {"LlamaRMSNorm": 2}
    model = layers(LlamaDecoderLayer)
    report = patch_model(model, include=["residual", "norm"], memory="invertible")
    assert report == {"LlamaDecoderLayer": 1, "LlamaRMSNorm": 2}
    assert ("0", "LlamaDecoderLayer", "LlamaDecoderLayer(add_rms_norm into "
            "post_attention_layernorm, memory='invertible')") in report.swapped
    fusion = type(model[0])._residual_fusion
    assert fusion.function is add_rmsnorm.add_rms_norm
    assert dict(fusion.options) == {"eps": 1e-6, "weight_offset": 0.0, "memory": "invertible",
                                    "in_place": True}
    # patched again: the fused layer is no candidate any more
    assert patch_model(model, include="residual") == {}


def test_a_fused_model_pickles_checkpoints_and_copies():
    original = tiny("llama")
    patched = copy.deepcopy(original)
    patch_model(patched, include="residual")
    layer = patched.model.layers[0]
    assert type(layer).__name__ == "LlamaDecoderLayer" and isinstance(layer, LlamaDecoderLayer)
    assert list(type(layer).__mro__[1:3]) == [LlamaDecoderLayer, LlamaDecoderLayer.__base__]
    restored = pickled(patched, original)
    assert type(restored.model.layers[1]) is type(layer)  # the same fused class, rebuilt
    assert_same(original, restored, 1e-5, training=False)
    # Hugging Face's checkpointing wraps the rewritten forward as the original one
    for model in (original, patched):
        # transformers 5.24 names it activation_checkpointing_enable, earlier ones
        # gradient_checkpointing_enable
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    calls, checkpoint = [], layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda *args, **kwargs: (
        calls.append(args[0].func), checkpoint(*args, **kwargs))[1]
    assert_same(original, patched, 1e-5, training=True)
    assert calls  # the layer ran checkpointed
    if hasattr(type(layer).forward, "__wrapped__"):
        # transformers 5.24 decorates every layer class's forward (the rewritten one's too)
        # and checkpoints the forward itself, undecorated: the rewritten one (earlier ones
        # checkpoint Module.__call__, which calls it)
        assert calls == [type(layer).forward.__wrapped__]
        assert calls[0] is not LlamaDecoderLayer.forward.__wrapped__


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_probing_leaves_rng_and_modes_and_generation_uses_the_cache(kind):
    original = tiny(kind).eval()
    patched = copy.deepcopy(original).train()
    state = torch.get_rng_state()
    assert patch_model(patched, include="residual") == {LAYERS[kind]: 2}
    assert torch.equal(torch.get_rng_state(), state)
    assert all(module.training for module in patched.modules())
    # the cache passes through the rewritten forward to the attention, step after step
    tokens = [model.eval().generate(TOKENS, max_new_tokens=4, do_sample=False, pad_token_id=0)
              for model in (original, patched)]
    assert torch.equal(tokens[1], tokens[0]) and tokens[0].shape == (2, 11)


def test_a_fused_layer_compiles_without_graph_breaks():
    original = tiny("llama").eval()
    patched = copy.deepcopy(original)
    patch_model(patched, include="residual")
    x = randn((2, 7, 64), seed=2, dtype=torch.float32)
    position = patched.model.rotary_emb(x, torch.arange(7)[None])
    compiled = torch.compile(patched.model.layers[0], backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, position_embeddings=position),
                               original.model.layers[0](x, position_embeddings=position))


def test_gpt2_cross_attention_runs_the_original_forward():
    """With encoder states, a GPT-2 block adds the cross-attention between: that path is the
    original forward's; without them, the fused one."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=VOCAB,
                                     bos_token_id=0, eos_token_id=0, add_cross_attention=True)
    original = randomised(transformers.GPT2LMHeadModel(config))
    patched = copy.deepcopy(original)
    assert patch_model(patched, include="residual") == {"GPT2Block": 2}
    encoder = randn((2, 5, 64), seed=4, dtype=torch.float32)
    # the original forward: every dropout torch's, the attention's resid_dropout too
    assert_same(original, patched, 1e-5, training=True, encoder_hidden_states=encoder)
    # the fused one hands resid_dropout to the fused op, whose mask is its own
    # (tests/test_dropout_add_norm.py): here without it
    for model in (original, patched):
        for block in model.transformer.h:
            block.attn.resid_dropout.p = 0.0
    assert_same(original, patched, 1e-5, training=True)


def test_a_fused_add_with_a_weightless_norm():
    """A norm without weight (or bias) passes none to the fused op."""
    layer = transformers.BertConfig(hidden_size=64, intermediate_size=128)
    output = transformers.models.bert.modeling_bert.BertOutput(layer)
    output.LayerNorm = torch.nn.LayerNorm(64, elementwise_affine=False)
    model = torch.nn.Sequential(randomised(output)).eval()
    original = copy.deepcopy(model)
    assert patch_model(model, include="residual") == {"BertOutput": 1}
    fusion = type(model[0])._residual_fusion
    assert fusion.function is add_layernorm.add_layer_norm
    assert fusion.tensors == (("weight", False), ("bias", False))
    hidden, residual = randn((2, 3, 128), seed=1), randn((2, 3, 64), seed=2)
    torch.testing.assert_close(model[0](hidden.float(), residual.float()),
                               original[0](hidden.float(), residual.float()))


def test_residual_rules_name_their_op():
    assert [r.function for r in patch_layers_rules()] == [add_layernorm.add_layer_norm,
                                                          add_rmsnorm.add_rms_norm]
    norm = NormalizedShapeAPI("f", "M", "t", "T", params=(Param("weight", "ones"),), eps=1e-5,
                              replaces=(Replaces("*", kind="residual"),))
    assert replaces_mismatches(norm) == [
        "Replaces('*'): kind 'residual' needs a normalized-shape API with a residual input"]


def patch_layers_rules():
    from generated.patch import RULES

    return [rule for rule in RULES if rule.kind == patch_residual.KIND]


def test_a_16_bit_llama_layer_fuses_with_its_norms_casting_mode():
    # with bitwise=True a bfloat16 LlamaRMSNorm is swapped for RMSNorm(casting_mode="llama")
    # (the probe keeps the mode that rounds as it does); the add fused into it rounds so too
    model = layers(LlamaDecoderLayer)
    model.to(torch.bfloat16)
    with torch.no_grad():
        for index, norm in enumerate((model[0].input_layernorm,
                                      model[0].post_attention_layernorm)):
            norm.weight.copy_(randn(norm.weight.shape, seed=7 + index) * 0.5 + 1)
    report = patch_model(model, include=["residual", "norm"], bitwise=True)
    assert report == {"LlamaDecoderLayer": 1, "LlamaRMSNorm": 2}, report
    assert ("0", "LlamaDecoderLayer", "LlamaDecoderLayer(add_rms_norm into "
            "post_attention_layernorm, casting_mode='llama')") in report.swapped
    fusion = type(model[0])._residual_fusion
    assert dict(fusion.options) == {"eps": 1e-6, "weight_offset": 0.0, "casting_mode": "llama",
                                    "in_place": True}
    assert model[0].post_attention_layernorm.casting_mode == "llama"

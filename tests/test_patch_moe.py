"""patch_model() on small randomly initialised Hugging Face MoE models (Mixtral, Qwen3-MoE):
the experts' gated activation `act(gate) * up` is computed by the generated gated op, in every
experts implementation transformers dispatches to, the experts module keeping its object, its
Parameters and its routing; the loss and every gradient stay those of the unpatched model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import pickled

from codegen.runtime import patching
from generated import swiglu
from generated.patch import PatchError, patch_model

VOCAB = 64
LAYERS = 2
#: the experts module of each layer, and what the report says computes its activation
EXPERTS = "model.layers.{}.mlp.experts"
GATE = "swiglu(gate, up = gate_up_proj(x).chunk(2, -1))"
CLASSES = {"mixtral": "MixtralExperts", "qwen3_moe": "Qwen3MoeExperts"}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def tiny(kind: str, implementation: str | None = None, act: str = "silu") -> torch.nn.Module:
    """A two-layer causal LM of `kind` whose experts run `implementation` (transformers'
    default where None: grouped_mm, whose kernels take no float64)."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, hidden_act=act,
                  experts_implementation=implementation)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                             num_experts=6, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    return model.train()


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor):
    model.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def assert_same(patched, original, rtol, atol):
    loss, grads = loss_and_grads(original, tokens())
    patched_loss, patched_grads = loss_and_grads(patched, tokens())
    torch.testing.assert_close(patched_loss, loss, rtol=rtol, atol=atol)
    assert patched_grads.keys() == grads.keys()
    # every expert of every layer is hit by some token (the routers' gradients too)
    assert all(f"model.layers.{i}.mlp.experts.{n}" in grads for i in range(LAYERS)
               for n in ("gate_up_proj", "down_proj"))
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def assert_swapped(report, patched, original, kind, gate=GATE):
    old = CLASSES[kind]
    assert [(s.name, s.old, s.new) for s in report.swapped if s.old == old] == \
        [(EXPERTS.format(i), old, f"{old}({gate})") for i in range(LAYERS)]
    assert report[old] == LAYERS
    assert not [s for s in report.skipped if s.old == old]
    assert list(patched.state_dict()) == list(original.state_dict())
    for i in range(LAYERS):
        experts = patched.get_submodule(EXPERTS.format(i))
        unpatched = original.get_submodule(EXPERTS.format(i))
        # the same object (its Parameters, its config), of a subclass of the same name
        assert isinstance(experts, type(unpatched)) and type(experts) is not type(unpatched)
        assert type(experts).__name__ == type(unpatched).__name__
        assert type(experts).__module__ == type(unpatched).__module__


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_experts_activation_is_swapped_and_float64_matches(kind, implementation):
    original = tiny(kind, implementation).double()
    patched = copy.deepcopy(original)
    parameters = dict(patched.named_parameters())
    report = patch_model(patched, include="mlp")  # the experts alone: the rest is HF's own
    assert report == {CLASSES[kind]: LAYERS}
    assert_swapped(report, patched, original, kind)
    assert all(p is parameters[n] for n, p in patched.named_parameters())
    assert_same(patched, original, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_experts_swap_among_every_default_kind_in_float64(kind):
    original = tiny(kind, "eager").double()
    patched = copy.deepcopy(original)
    report = patch_model(patched)
    assert_swapped(report, patched, original, kind)
    # HF's RMSNorms compute in float32 even from float64: the patched model's norms do not,
    # so the models agree to float32's rounding (test_patch_hf.py proves the norms exactly)
    assert_same(patched, original, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_experts_in_float32_with_transformers_default_grouped_mm(kind):
    original = tiny(kind)
    assert original.config._experts_implementation == "grouped_mm"
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="mlp")
    assert_swapped(report, patched, original, kind)
    assert_same(patched, original, rtol=1e-5, atol=1e-6)


def test_the_implementation_is_read_at_each_call():
    """transformers' `set_experts_implementation` after patching: each implementation calls
    the swapped gate (the eager one through the swapped class's eager loop)."""
    original = tiny("mixtral", "eager").double()
    patched = copy.deepcopy(original)
    patch_model(patched, include="mlp")
    experts = patched.get_submodule(EXPERTS.format(0))
    assert type(experts)._experts_gate.function is swiglu.swiglu
    calls = []
    swapped_gate = experts._apply_gate
    experts._apply_gate = lambda gate_up: calls.append(gate_up.shape) or swapped_gate(gate_up)
    for implementation in ("eager", "batched_mm", "eager"):
        original.set_experts_implementation(implementation)
        patched.set_experts_implementation(implementation)
        calls.clear()
        assert_same(patched, original, rtol=1e-10, atol=1e-12)
        assert calls, implementation
        # eager: one call per expert hit; batched_mm: one call for every routed token
        assert len(calls) == (4 if implementation == "eager" else 1)


def test_geglu_experts():
    """Experts whose activation is the tanh GELU (Gemma 4's) take geglu_tanh."""
    original = tiny("qwen3_moe", "eager", act="gelu_pytorch_tanh").double()
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="mlp")
    assert_swapped(report, patched, original, "qwen3_moe",
                   gate="geglu_tanh(gate, up = gate_up_proj(x).chunk(2, -1))")
    assert_same(patched, original, rtol=1e-10, atol=1e-12)


def test_bfloat16_experts_are_swapped():
    original = tiny("mixtral").to(torch.bfloat16)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="mlp")
    assert_swapped(report, patched, original, "mixtral")
    loss, _ = loss_and_grads(original, tokens())
    patched_loss, _ = loss_and_grads(patched, tokens())
    torch.testing.assert_close(patched_loss, loss, rtol=2e-2, atol=0)


def test_a_patched_moe_model_pickles_and_copies():
    original = tiny("qwen3_moe", "eager").double()
    patched = copy.deepcopy(original)
    patch_model(patched, include="mlp")
    for other in (copy.deepcopy(patched), pickled(patched, original)):
        assert type(other.get_submodule(EXPERTS.format(0))) is \
            type(patched.get_submodule(EXPERTS.format(0)))
        assert_same(other, original, rtol=1e-10, atol=1e-12)
    # patched twice: nothing more to swap
    assert patch_model(patched, include="mlp") == {}


def test_excluded_experts_are_left_alone():
    original = tiny("mixtral", "eager").double()
    for exclude in ("mlp", "MixtralExperts"):
        patched = copy.deepcopy(original)
        report = patch_model(patched, exclude=exclude)
        assert "MixtralExperts" not in report
        assert type(patched.get_submodule(EXPERTS.format(0))) is \
            type(original.get_submodule(EXPERTS.format(0)))


class ClampedExperts(transformers.models.mixtral.modeling_mixtral.MixtralExperts):
    """A clamped SwiGLU (DeepSeek-V4's, GPT-OSS's limit): no generated op computes it."""

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=7.0)) * up.clamp(min=-7.0, max=7.0)


def clamped_model() -> torch.nn.Module:
    model = tiny("mixtral", "eager").double()
    for i in range(LAYERS):
        model.get_submodule(EXPERTS.format(i)).__class__ = ClampedExperts
    return model


def test_experts_computing_something_else_are_refused_with_the_reason():
    original = clamped_model()
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="mlp")
    assert report == {}
    assert [(s.name, s.old) for s in report.skipped] == \
        [(EXPERTS.format(i), "ClampedExperts") for i in range(LAYERS)]
    reason = report.skipped[0].reason
    assert reason.startswith("its experts' gated activation is not computed by geglu(")
    assert f"nor by {GATE} differs by" in reason and "at input 100" in reason
    assert type(patched.get_submodule(EXPERTS.format(0))) is ClampedExperts
    with pytest.raises(PatchError, match="ClampedExperts"):
        patch_model(copy.deepcopy(original), include="mlp", strict=True)


def test_a_gradient_that_differs_is_refused():
    """The float64 probe compares every gradient: a gate whose output is right but whose
    backward is not is refused."""

    class WrongBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return torch.nn.functional.silu(gate) * up

        @staticmethod
        def backward(ctx, grad):
            gate, up = ctx.saved_tensors
            return grad * up * torch.sigmoid(gate), grad * torch.nn.functional.silu(gate)

    def wrong(gate, up):
        return WrongBackward.apply(gate, up)

    rules = (patching.Rule("mlp", "*", None, wrong),)
    model = tiny("mixtral", "eager").double()
    report = patching.patch_model(model, rules)
    assert report == {}
    assert "wrong(gate, up = gate_up_proj(x).chunk(2, -1)) gives a gradient that differs by" \
        in report.skipped[0].reason


def test_experts_hooks_run_and_an_activations_hooks_keep_them():
    """The experts module stays, and its hooks with it; its activation's hooks would no longer
    run: those experts are left with the reason."""
    original = tiny("mixtral", "eager").double()
    model = copy.deepcopy(original)
    seen = []
    model.get_submodule(EXPERTS.format(0)).register_forward_hook(
        lambda module, args, output: seen.append(type(module).__name__))
    model.get_submodule(EXPERTS.format(1)).act_fn.register_forward_hook(lambda *args: None)
    report = patch_model(model, include="mlp")
    assert report == {"MixtralExperts": 1}
    assert [s.name for s in report.swapped] == [EXPERTS.format(0)]
    assert [(s.name, s.reason) for s in report.skipped] == [
        (EXPERTS.format(1), "its act_fn has hooks (forward_hooks), which the swapped gated "
                            "activation may not run")]
    assert_same(model, original, rtol=1e-10, atol=1e-12)
    assert seen == ["MixtralExperts"]


def test_the_probe_leaves_the_model_as_it_was():
    model = tiny("mixtral").double()  # grouped_mm, which the float64 probe runs as batched_mm
    state = {n: t.clone() for n, t in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    report = patch_model(model, include="mlp")
    assert report == {"MixtralExperts": LAYERS}
    assert model.config._experts_implementation == "grouped_mm"
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert model.training

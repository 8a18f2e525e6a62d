"""patch_model() on models kernelized by `kernels` (transformers' hard dependency): a norm whose
forward `kernels.kernelize` replaced by a Hub layer's, and an attention whose private
apply_rotary_pos_emb it replaced, are swapped where the generated op computes what the Hub layer
does, the report naming the layer, and left in place with the reason where it computes something
else. The Hub layers are local kernel repositories written into tmp_path (a noarch `torch-cpu`
build variant, which kernels loads offline), kernelized on the CPU."""

from __future__ import annotations

import copy
import json
import sys
import textwrap
import types
import uuid

import kernels
import pytest
import torch

# torch_path: the autouse fixture that runs whole models on the generated torch path
from test_patch_hf import VOCAB, hidden_loss_and_grads, tiny, torch_path  # noqa: F401
from transformers.models.llama import modeling_llama as llama_modeling

from codegen.runtime import patching
from generated import rotary as rotary_module
from generated.patch import patch_model

#: the right Hub layers compute as transformers' do, written otherwise; the wrong ones add the
#: norm's eps outside the square root, compute the sigmoid of 1.702 x (QuickGELU's) for SiLU's,
#: or pair the rotary's columns as GPT-J does; HalfTableRotary reads the first half of the tables
#: alone, which transformers' rotary embeddings repeat (as kernels-community/rotary's does)
LAYERS = '''
import torch

#: the calls of the rotary layers, which the tests count
CALLS = []


class SameRMSNorm(torch.nn.Module):
    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x / torch.sqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class EpsOutsideRMSNorm(torch.nn.Module):
    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x / (x.square().mean(-1, keepdim=True).sqrt() + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class SameSiLU(torch.nn.Module):
    def forward(self, input):
        return input * torch.sigmoid(input)


class QuickSiLU(torch.nn.Module):
    def forward(self, input):
        return input * torch.sigmoid(1.702 * input)


class SameRotary(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        CALLS.append("same")
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rotate(x):
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half],
                              x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1)

        return rotate(q), rotate(k)


class HalfTableRotary(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        half = q.shape[-1] // 2
        if cos.shape[-1] != half:
            cos, sin = cos[..., :half], sin[..., :half]

        def rotate(x):
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rotate(q), rotate(k)


class InterleavedRotary(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        CALLS.append("interleaved")
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rotate(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
'''


@pytest.fixture(autouse=True)
def global_functions_restored():
    """kernels before 0.17 (transformers 5.17's) hands every attention the modeling module's
    own apply_rotary_pos_emb, so kernelize sets the Hub layer's forward on that global: undone
    after each test, which would otherwise leave it to every later model of the process."""
    yield
    function = llama_modeling.apply_rotary_pos_emb
    for name in ("forward", "_kernel_repo"):
        function.__dict__.pop(name, None)


def hub_repository(tmp_path, layer_name: str) -> kernels.LocalLayerRepository:
    """A local kernel repository holding LAYERS, as kernels loads one from disk: a build variant
    directory with its metadata.json and the kernel's package (an id of its own per repository:
    kernels keeps a loaded kernel in sys.modules under its id). The variant is the universal
    noarch one, which kernels loads whatever torch's backend (a CUDA build of torch, as a fresh
    install picks, has a cuda backend even without a GPU); its metadata names the cpu backend,
    since kernels before 0.17 knows no "universal" there and the variant's name decides."""
    root = tmp_path / f"hub-{layer_name}"
    variant = root / "build" / "torch-universal"
    variant.mkdir(parents=True)
    metadata = {"name": "vjpforge-test-layers", "id": f"_vjpforge_test_{uuid.uuid4().hex}",
                "version": 1, "license": "Apache-2.0", "python-depends": [],
                "backend": {"type": "cpu"}}
    (variant / "metadata.json").write_text(json.dumps(metadata))
    (variant / "__init__.py").write_text("from . import layers\n")
    (variant / "layers.py").write_text(textwrap.dedent(LAYERS))
    return kernels.LocalLayerRepository(root, layer_name=layer_name)


def kernelized(mapping: dict[str, kernels.LocalLayerRepository]) -> torch.nn.Module:
    """The tiny fp64 LlamaModel, kernelized for training on the CPU with `mapping` (transformers'
    layer names: "RMSNorm", "rotary_pos_emb") and nothing else."""
    model = tiny("llama").double().train()
    with kernels.use_kernel_mapping({name: {"cpu": repo} for name, repo in mapping.items()},
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    return model


def hub_name(module: torch.nn.Module, repo: kernels.LocalLayerRepository):
    """What patch_model names the Hub layer that kernelize set on `module`: its repository
    where kernels records it (0.17 on), else the layer's class (kernels 0.16, transformers
    5.17's)."""
    if "_kernel_repo" in module.__dict__:
        assert module.__dict__["_kernel_repo"] == repo  # a deep copy's is a copy
        return repo
    layer = repo.load()
    return f"{layer.__module__}.{layer.__qualname__}"


def hub_calls(repo: kernels.LocalLayerRepository) -> list[str]:
    return sys.modules[repo.load().__module__].CALLS


def norms(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules()
            if type(module).__name__ == "LlamaRMSNorm"}


def private_rotary(attention: torch.nn.Module) -> torch.nn.Module:
    # transformers' use_kernelized_func: the instance's own copy, under the layer's name
    return attention._kernel_funcs["rotary_pos_emb"]


TOKENS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def assert_same_training_step(patched, original, exact=False, fp32=False):
    """The loss of the hidden states and every parameter's gradient: the same bits (`exact`),
    within a few float32 roundings of each gradient's scale (`fp32`: both models compute their
    norms in float32, each rounding them otherwise), else fp64 close."""
    loss, grads = hidden_loss_and_grads(original, TOKENS)
    patched_loss, patched_grads = hidden_loss_and_grads(patched, TOKENS)
    assert patched_grads.keys() == grads.keys() == {n for n, _ in original.named_parameters()}
    if exact:
        assert torch.equal(patched_loss, loss)
        assert all(torch.equal(patched_grads[name], grads[name]) for name in grads)
        return
    if fp32:
        ulps = 8 * torch.finfo(torch.float32).eps
        assert abs(float(patched_loss - loss)) <= ulps * abs(float(loss))
        for name, grad in grads.items():
            error = float((patched_grads[name] - grad).abs().max())
            assert error <= ulps * float(grad.abs().max()), (name, error)
        return
    torch.testing.assert_close(patched_loss, loss, rtol=1e-10, atol=1e-10)
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_kernelize_sets_the_hub_layers_forward_on_the_instance(tmp_path):
    """What the other tests rely on: kernelize binds the Hub layer's forward to each instance
    and records the repository; a deep copy keeps it, bound to the copy."""
    norm_repo = hub_repository(tmp_path, "SameRMSNorm")
    rotary_repo = hub_repository(tmp_path, "SameRotary")
    model = kernelized({"RMSNorm": norm_repo, "rotary_pos_emb": rotary_repo})
    for module in [*norms(model).values(), *(private_rotary(layer.self_attn)
                                            for layer in model.layers)]:
        forward = module.__dict__["forward"]
        assert forward.__self__ is module and patching.hub_layer(module) is not None
    assert patching.hub_layer(model.norm) == hub_name(model.norm, norm_repo)
    assert model.norm.forward.__func__.__qualname__ == "SameRMSNorm.forward"
    attention_rotary = private_rotary(model.layers[0].self_attn)
    assert patching.hub_layer(attention_rotary) == hub_name(attention_rotary, rotary_repo)
    twin = copy.deepcopy(model)
    assert twin.norm.forward.__self__ is twin.norm
    assert patching.hub_layer(twin.norm) == hub_name(model.norm, norm_repo)
    # a plain model's norms and private functions are no Hub layers (where its function is
    # its own: kernels before 0.17 shares the global, which kernelize changed for all)
    plain = tiny("llama")
    assert patching.hub_layer(plain.norm) is None
    if private_rotary(plain.layers[0].self_attn) is not attention_rotary:
        assert patching.hub_layer(private_rotary(plain.layers[0].self_attn)) is None


def test_a_hub_rmsnorm_that_computes_the_same_is_swapped_and_named(tmp_path):
    repo = hub_repository(tmp_path, "SameRMSNorm")
    original = kernelized({"RMSNorm": repo})
    patched = copy.deepcopy(original)
    report = patch_model(patched)
    assert report == {"LlamaRMSNorm": 5, "LlamaMLP": 2, "LlamaDecoderLayer": 2,
                      "LlamaAttention": 2}
    assert report.skipped == []
    labels = {s.name: s.new for s in report.swapped if s.old == "LlamaRMSNorm"}
    name = hub_name(original.norm, repo)
    assert labels == dict.fromkeys(norms(original), f"RMSNorm in place of Hub layer {name}")
    assert norms(patched) == {}  # every Hub layer replaced by the generated RMSNorm
    assert type(patched.norm).__name__ == "RMSNorm"
    # the fused layers compute the norm the probe proved in place of the Hub layer
    assert [s.new for s in report.swapped if s.old == "LlamaDecoderLayer"] == \
        ["LlamaDecoderLayer(add_rms_norm into post_attention_layernorm)"] * 2
    assert patched.get_parameter("norm.weight") is not original.get_parameter("norm.weight")
    assert list(patched.state_dict()) == list(original.state_dict())
    # the Hub layer computes in float32 as LlamaRMSNorm does: the fp64 model agrees at that level
    assert_same_training_step(patched, original, fp32=True)


def test_a_hub_rmsnorm_that_computes_otherwise_is_left_with_the_reason(tmp_path):
    repo = hub_repository(tmp_path, "EpsOutsideRMSNorm")
    original = kernelized({"RMSNorm": repo})
    patched = copy.deepcopy(original)
    report = patch_model(patched, include=["norm", "residual"])
    assert report == {}
    skipped = {s.name: (s.old, s.reason) for s in report.skipped}
    assert skipped.keys() == {*norms(original), "layers.0", "layers.1"}
    repo = hub_name(original.norm, repo)
    for name in norms(original):
        old, reason = skipped[name]
        assert old == "LlamaRMSNorm"
        assert reason.startswith(f"its forward is Hub layer {repo}'s: RMSNorm differs by "), \
            reason
        assert patching.hub_layer(patched.get_submodule(name)) is not None  # left as it was
    # a layer's fused add would compute its norm without calling the Hub layer: not fused
    for name in ("layers.0", "layers.1"):
        old, reason = skipped[name]
        assert old == "LlamaDecoderLayer"
        assert reason == (f"its norm post_attention_layernorm (LlamaRMSNorm) has no generated "
                          f"twin: its forward is Hub layer {repo}'s, which stays in place "
                          "(excluded, or not proven)"), reason
    assert_same_training_step(patched, original, exact=True)


def test_excluded_hub_layers_stay_called(tmp_path):
    """exclude= keeps the Hub layers: by class name the norms (and so the layers' fused adds,
    which would compute them without calling them), by kind the rotary embedding."""
    norm_repo = hub_repository(tmp_path, "SameRMSNorm")
    rotary_repo = hub_repository(tmp_path, "SameRotary")
    original = kernelized({"RMSNorm": norm_repo, "rotary_pos_emb": rotary_repo})
    patched = copy.deepcopy(original)
    report = patch_model(patched, exclude=["LlamaRMSNorm", "rotary"])
    assert report == {"LlamaMLP": 2}
    assert [(s.name, s.old) for s in report.skipped] == [("layers.0", "LlamaDecoderLayer"),
                                                         ("layers.1", "LlamaDecoderLayer")]
    assert all(patching.hub_layer(m) == hub_name(m, norm_repo) for m in norms(patched).values())
    assert len(norms(patched)) == 5
    calls = hub_calls(rotary_repo)
    calls.clear()
    hidden_loss_and_grads(patched, TOKENS)
    assert calls == ["same"] * 2  # each layer's attention still calls its Hub layer
    # the gated MLPs: the generated swiglu computes in fp64, SiLU and product alike
    assert_same_training_step(patched, original)


def test_a_gated_mlp_whose_activation_is_a_hub_layer(tmp_path):
    """The MLP's swap computes its activation too: proven against the Hub layer, and named."""
    repo = hub_repository(tmp_path, "SameSiLU")
    original = kernelized({"SiLU": repo})
    name = hub_name(original.layers[0].mlp.act_fn, repo)
    assert patching.hub_layer(original.layers[0].mlp.act_fn) == name
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="mlp")
    assert report == {"LlamaMLP": 2} and report.skipped == []
    assert [s.new for s in report.swapped] == [
        f"GatedMLP(swiglu, gate=gate_proj, up=up_proj) in place of Hub layer {name} (act_fn)"] * 2
    assert_same_training_step(patched, original)
    # a Hub layer computing another activation: no gated op's
    repo = hub_repository(tmp_path, "QuickSiLU")
    original = kernelized({"SiLU": repo})
    report = patch_model(copy.deepcopy(original), include="mlp")
    assert report == {} and [s.name for s in report.skipped] == ["layers.0.mlp", "layers.1.mlp"]
    repo = hub_name(original.layers[0].mlp.act_fn, repo)
    for skip in report.skipped:
        assert skip.reason.startswith(f"its activation act_fn (SiLUActivation, Hub layer {repo}) "
                                      "does not compute the activation of geglu "), skip.reason


def test_a_hub_rotary_that_computes_the_same_is_swapped_and_named(tmp_path, monkeypatch):
    repo = hub_repository(tmp_path, "SameRotary")
    original = kernelized({"rotary_pos_emb": repo})
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="rotary")
    assert report == {"LlamaAttention": 2} and report.skipped == []
    name = hub_name(private_rotary(original.layers[0].self_attn), repo)
    assert [s.new for s in report.swapped] == [
        "LlamaAttention(apply_rotary_pos_emb: generated.rotary.apply_rotary_pos_emb) in place "
        f"of Hub layer {name}"] * 2
    generated = []
    monkeypatch.setattr(rotary_module, "rotary", lambda *args, f=rotary_module.rotary: (
        generated.append(args[0].shape), f(*args))[1])
    calls = hub_calls(repo)
    calls.clear()
    hidden_loss_and_grads(original, TOKENS)
    assert calls == ["same"] * 2 and generated == []  # the unpatched model runs the Hub layer
    calls.clear()
    hidden_loss_and_grads(patched, TOKENS)
    assert calls == [] and len(generated) == 4  # the patched one q and k of two layers
    # both compute the rotary embedding in fp64, the rest alike
    assert_same_training_step(patched, original)
    # kernelized again, with another layer: the swapped attentions call the generated op still
    with kernels.use_kernel_mapping({"rotary_pos_emb": {
            "cpu": hub_repository(tmp_path, "InterleavedRotary")}}, inherit_mapping=False):
        kernels.kernelize(patched, mode=kernels.Mode.TRAINING, device="cpu")
    assert patching.hub_layer(private_rotary(patched.layers[0].self_attn)) is not None
    assert_same_training_step(patched, original)


def test_an_interleaved_hub_rotary_is_refused(tmp_path):
    """The attention's own function, kernelized as GPT-J's interleaved rotary, is what the probe
    measures (the modeling module's apply_rotary_pos_emb, which the generated op computes, is
    never called by this model)."""
    repo = hub_repository(tmp_path, "InterleavedRotary")
    original = kernelized({"rotary_pos_emb": repo})
    patched = copy.deepcopy(original)
    classes = [type(layer.self_attn) for layer in patched.layers]
    report = patch_model(patched, include="rotary")
    assert report == {}
    assert [(s.name, s.old) for s in report.skipped] == [("layers.0.self_attn", "LlamaAttention"),
                                                         ("layers.1.self_attn", "LlamaAttention")]
    name = hub_name(private_rotary(original.layers[0].self_attn), repo)
    for skip in report.skipped:
        assert skip.reason.startswith(
            f"its apply_rotary_pos_emb (Hub layer {name}) is not computed by "
            "generated.rotary.apply_rotary_pos_emb differs by "), skip.reason
    assert [type(layer.self_attn) for layer in patched.layers] == classes
    calls = hub_calls(repo)
    calls.clear()
    assert_same_training_step(patched, original, exact=True)
    assert calls == ["interleaved"] * 4  # both models still call it


def test_a_hub_rotary_reading_half_the_tables_is_kept(tmp_path):
    """A kernel that takes the tables' two halves to be equal gives the model's own outputs
    (transformers' rotary embeddings repeat the first half), but the probe's tables are random
    over their whole width: it is kept, with the difference as the reason."""
    repo = hub_repository(tmp_path, "HalfTableRotary")
    original = kernelized({"rotary_pos_emb": repo})
    assert_same_training_step(original, tiny("llama").double().train())
    report = patch_model(copy.deepcopy(original), include="rotary")
    assert report == {} and len(report.skipped) == 2
    name = hub_name(private_rotary(original.layers[0].self_attn), repo)
    for skip in report.skipped:
        assert skip.reason.startswith(
            f"its apply_rotary_pos_emb (Hub layer {name}) is not computed by "
            "generated.rotary.apply_rotary_pos_emb differs by "), skip.reason
        assert "with tables of width 32 for heads of 32" in skip.reason


def test_a_private_rotary_not_kernelized_is_proven_as_the_global_one():
    """Without kernelize the attention's private copy computes the modeling module's function:
    swapped, no Hub layer named."""
    model = tiny("llama")
    assert patching.hub_layer(private_rotary(model.layers[0].self_attn)) is None
    report = patch_model(model, include="rotary")
    assert [s.new for s in report.swapped] == [
        "LlamaAttention(apply_rotary_pos_emb: generated.rotary.apply_rotary_pos_emb)"] * 2


def test_forwards_bound_elsewhere_are_still_skipped(tmp_path):
    """A Hub layer's forward bound to the module is probed whether or not kernels recorded the
    repository (it records none before 0.17), as is the class's own forward bound to it (what
    kernelize sets where no layer is mapped); a forward bound to another module is left."""
    repo = hub_repository(tmp_path, "SameRMSNorm")
    model = tiny("llama")
    layer = repo.load()
    model.norm.forward = types.MethodType(layer.forward, model.norm)  # no repository recorded
    own = model.layers[1].post_attention_layernorm
    own.forward = types.MethodType(type(own).forward, own)
    other = model.layers[0].input_layernorm
    # a repository recorded, but the forward bound to another module
    other.forward = types.MethodType(layer.forward, model.layers[1].input_layernorm)
    other.__dict__["_kernel_repo"] = repo
    report = patch_model(model, include="norm")
    assert report == {"LlamaRMSNorm": 4}
    new = {s.name: s.new for s in report.swapped}
    assert new["norm"] == f"RMSNorm in place of Hub layer {layer.__module__}.SameRMSNorm"
    assert new["layers.1.post_attention_layernorm"] == "RMSNorm"
    assert [(s.name, s.reason) for s in report.skipped] == [
        ("layers.0.input_layernorm",
         "its forward is replaced on the instance, which a replacement would not do")]

"""patch_model(): each swap proven by behaviour. A module is swapped only for a replacement that
computes what it computes (the configuration found by probing, not by name); what cannot be
swapped is reported with the reason, and the model is then left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import generated_torch_path, randn

from codegen.runtime import patching
from derive.api import ElementwiseAPI, NormalizedShapeAPI, Param, Replaces, replaces_mismatches
from generated import geglu_tanh, gelu, gelu_tanh, layernorm, rmsnorm, swiglu
from generated.patch import PatchError, PatchReport, patch_model

H = 64


class ErfGELU(torch.nn.Module):
    """The exact GELU spelled in torch ops (four kernels each way), as models' own often are."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.erf(x * 0.5**0.5))


class TanhGELU(torch.nn.Module):
    """The tanh GELU spelled in torch ops, as GPT-2's NewGELUActivation."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


@pytest.fixture
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


def hf(model: str, name: str, *args, **kwargs) -> torch.nn.Module:
    """An instance of a transformers class, its float tensors set to random values so that no
    weight of ones or zeros hides how it is used."""
    # a model family newer than the installed transformers is not there to test against
    found = pytest.importorskip(f"transformers.models.{model}.modeling_{model}")
    module = getattr(found, name)(*args, **kwargs)
    with torch.no_grad():
        for index, tensor in enumerate([*module.parameters(), *module.buffers()]):
            if tensor.is_floating_point():
                tensor.add_(0.5 * randn(tensor.shape, seed=10 + index, dtype=tensor.dtype))
    return module


def swap_one(module: torch.nn.Module, **kwargs):
    """Patch a model holding only `module`; return the report and what stands in its place."""
    model = torch.nn.Sequential(module)
    report = patch_model(model, **kwargs)
    return report, model[0]


def assert_same_outputs(original, new, shape=(3, 5, H), dtype=torch.float32):
    x = randn(shape, seed=3, dtype=dtype) * torch.tensor([1.0, 1e-3, 30.0], dtype=dtype)[:, None,
                                                                                          None]
    torch.testing.assert_close(new(x), original(x), rtol=1e-5, atol=1e-6)


# Norms whose configuration only behaviour tells: the names say Gemma or not, the maths differs.
OFFSET_ONE = [("qwen3_next", "Qwen3NextRMSNorm"), ("vaultgemma", "VaultGemmaRMSNorm"),
              ("recurrent_gemma", "RecurrentGemmaRMSNorm"), ("t5gemma", "T5GemmaRMSNorm"),
              ("gemma", "GemmaRMSNorm")]
OFFSET_ZERO = [("gemma3n", "Gemma3nRMSNorm"), ("gemma4", "Gemma4RMSNorm"),
               ("llama", "LlamaRMSNorm"), ("t5", "T5LayerNorm")]


@pytest.mark.parametrize(("model", "name"), OFFSET_ONE + OFFSET_ZERO)
def test_weight_offset_is_found_by_behaviour(model, name, torch_path):
    original = hf(model, name, H)
    report, new = swap_one(copy.deepcopy(original))
    offset = 1.0 if (model, name) in OFFSET_ONE else 0.0
    assert isinstance(new, rmsnorm.RMSNorm) and new.weight_offset == offset, report
    assert report.swapped == [("0", name, "RMSNorm(weight_offset=1.0)" if offset
                               else "RMSNorm")]
    assert_same_outputs(original, new)


@pytest.mark.parametrize(("model", "name", "label"), [
    ("llama", "LlamaRMSNorm", "RMSNorm(casting_mode=llama)"),
    ("gemma", "GemmaRMSNorm", "RMSNorm(weight_offset=1.0)")])
def test_16_bit_norms_keep_their_rounding(model, name, label, torch_path):
    # in bfloat16 both casting modes are within the probe's tolerance of either norm; with
    # bitwise=True the one that rounds as the module does (bit for bit) is kept: LlamaRMSNorm
    # rounds x_hat first
    original = hf(model, name, H).to(torch.bfloat16)
    with torch.no_grad():
        original.weight.copy_(randn((H,), seed=5) * 0.5 + (1.0 if model == "llama" else 0.0))
    report, new = swap_one(copy.deepcopy(original), bitwise=True)
    assert report.swapped == [("0", name, label)], report
    x = (randn((3, 5, H), seed=3) * 3).to(torch.bfloat16)
    assert torch.equal(new(x), original(x))
    # by default the first within the tolerance: the default casting mode
    report, _ = swap_one(copy.deepcopy(original))
    assert report.swapped == [("0", name, label.replace("(casting_mode=llama)", ""))], report


def test_a_norm_that_scales_before_normalising_is_left_with_the_reason(torch_path):
    original = hf("muse_spark", "MuseSparkTextInputScaledRMSNorm", H)
    module = copy.deepcopy(original)
    report, new = swap_one(module)
    assert new is module and report == {}
    [(name, kind, reason)] = report.skipped
    assert (name, kind) == ("0", "MuseSparkTextInputScaledRMSNorm")
    # both offsets were tried, and both differ
    assert reason.startswith("RMSNorm differs by ") and "; RMSNorm(weight_offset=1.0) differs" \
        in reason, reason


def test_a_weightless_norm_of_any_width(torch_path):
    original = hf("nanochat", "NanoChatRMSNorm")
    report, new = swap_one(copy.deepcopy(original))
    assert isinstance(new, patching.LastDimNorm), report
    assert report.swapped == [("0", "NanoChatRMSNorm", "LastDimNorm(rms_norm)")]
    for width in (8, H, 100):
        assert_same_outputs(original, new, shape=(3, 2, width))


def test_an_unused_dummy_buffer_weight_is_left_out(torch_path):
    # FalconMamba's weightless norm keeps a ones buffer it never reads (non-persistent), of the
    # mixer's width, and normalises dt (of another width) with it: without the dummy it fixes
    # no width, and what stands in takes any width too
    original = hf("falcon_mamba", "FalconMambaWeightlessRMSNorm", H)
    report, new = swap_one(copy.deepcopy(original))
    assert isinstance(new, patching.LastDimNorm), report
    assert report.swapped == [("0", "FalconMambaWeightlessRMSNorm", "LastDimNorm(rms_norm)")]
    assert new.state_dict().keys() == original.state_dict().keys() == set()
    for width in (4, 16, H, 100):
        assert_same_outputs(original, new, shape=(3, 2, width))


class OneWidthRMSNorm(torch.nn.Module):
    """A weightless RMS norm with an unused dummy weight, whose forward takes the dummy's width
    alone."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(width), persistent=False)

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"width {x.shape[-1]}, not {self.weight.shape[0]}")
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_weightless_norm_is_proven_at_another_width(torch_path):
    """A norm that fixes no width stands in at any width: it is proven at a second width,
    where a module that takes one width alone raises, and is left in place with the reason."""
    module = OneWidthRMSNorm(H)
    report, new = swap_one(module)
    assert new is module and report == {}
    [(name, old, reason)] = report.skipped
    assert (name, old) == ("0", "OneWidthRMSNorm")
    # with the dummy weight, perturbed: it differs
    assert reason.startswith("RMSNorm(weight buffer) differs by "), reason
    assert reason.endswith("; LastDimNorm(rms_norm) cannot be proven at another width: its "
                           "forward raised on the probe input of width 40: ValueError: width "
                           "40, not 64"), reason


def test_a_weightless_gemma3n_norm(torch_path):
    # named Gemma, no weight, no offset: it fixes no width either
    original = hf("gemma3n", "Gemma3nRMSNorm", H, with_scale=False)
    report, new = swap_one(copy.deepcopy(original))
    assert isinstance(new, patching.LastDimNorm), report
    assert_same_outputs(original, new)


class BufferScaledRMSNorm(torch.nn.Module):
    """An RMSNorm whose (frozen) scale is a persistent buffer, read in the forward."""

    def __init__(self, width, eps=1e-6, persistent=True):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.linspace(0.5, 2.0, width), persistent=persistent)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@pytest.mark.parametrize("persistent", [True, False])
def test_a_buffer_weight_stays_a_buffer(persistent, torch_path):
    original = BufferScaledRMSNorm(H, persistent=persistent)
    module = copy.deepcopy(original)
    report, new = swap_one(module)
    assert isinstance(new, rmsnorm.RMSNorm), report
    assert report.swapped[0].new == "RMSNorm(weight buffer)"
    assert new.weight is module.weight and "weight" in dict(new.named_buffers())
    assert list(new.parameters()) == []
    assert new.state_dict().keys() == original.state_dict().keys()
    assert_same_outputs(original, new)


def test_rmsnorm_offset_needs_its_weight():
    """Without a weight the offset is dropped with it: the output is x_hat, not 2 * x_hat."""
    x = randn((4, 16), seed=1)
    expected = torch.nn.functional.rms_norm(x, (16,), eps=1e-6)
    module = rmsnorm.RMSNorm(16, eps=1e-6, weight_offset=1.0, elementwise_affine=False)
    torch.testing.assert_close(module(x), expected)
    torch.testing.assert_close(rmsnorm.rms_norm(x, (16,), None, 1e-6, weight_offset=1.0),
                               expected)


def test_patch_keeps_parameters_and_options():
    # under the Triton interpreter: the probes run the kernels
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, bias=False),
                                torch.nn.RMSNorm(8, eps=1e-3), torch.nn.LayerNorm(8),
                                ErfGELU(), TanhGELU(),
                                torch.nn.RMSNorm(8, elementwise_affine=False))
    weight = model[1].weight
    report = patch_model(model, memory="invertible")
    assert report == {"LayerNorm": 2, "RMSNorm": 2, "ErfGELU": 1, "TanhGELU": 1}
    assert isinstance(report, PatchReport) and report.skipped == []
    assert isinstance(model[4], gelu.GELU) and isinstance(model[5], gelu_tanh.GELUTanh)
    assert isinstance(model[1], layernorm.LayerNorm) and model[1].bias is None
    assert model[1].weight is weight, "the Parameter object is shared, not copied"
    assert isinstance(model[2], rmsnorm.RMSNorm) and model[2].eps == 1e-3
    assert model[3].memory == "invertible" and model[6].weight is None
    assert patch_model(model) == {}, "generated modules are left alone"


def test_report_lists_swaps_and_skips(torch_path):
    model = torch.nn.Sequential(torch.nn.Linear(H, H))
    model.add_module("norm", torch.nn.LayerNorm(H, bias=False))
    model.add_module("scaled", hf("muse_spark", "MuseSparkTextInputScaledRMSNorm", H))
    model.add_module("act", TanhGELU())
    report = patch_model(model)
    assert report.swapped == [("norm", "LayerNorm", "LayerNorm(bias=False)"),
                              ("act", "TanhGELU", "GELUTanh")]
    assert [s[:2] for s in report.skipped] == [("scaled", "MuseSparkTextInputScaledRMSNorm")]
    assert report.counts == {"LayerNorm": 1, "TanhGELU": 1} == dict(report)
    assert report["TanhGELU"] == 1 and len(report) == 2 and "RMSNorm" not in report
    assert str(report).splitlines()[0] == "swapped norm: LayerNorm -> LayerNorm(bias=False)"
    assert str(report).splitlines()[2].startswith(
        "skipped scaled (MuseSparkTextInputScaledRMSNorm): RMSNorm differs by ")


def test_strict_raises_on_the_first_skip_and_changes_nothing(torch_path):
    model = torch.nn.Sequential(torch.nn.LayerNorm(H),
                                hf("muse_spark", "MuseSparkTextInputScaledRMSNorm", H))
    before = list(model)
    with pytest.raises(PatchError, match=r"patch_model\(\): 1 \(MuseSparkTextInputScaledRMSNorm\)"
                                         r" cannot be swapped: RMSNorm differs by "):
        patch_model(model, strict=True)
    assert list(model) == before


def test_one_op_activations_are_left_alone(torch_path):
    """torch.nn.GELU (either form) and HF's GELUActivation run torch's gelu, one kernel each
    way: nothing to fuse, so they stay, with the reason, and strict mode does not raise."""
    from transformers.activations import GELUActivation

    model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.GELU(approximate="tanh"),
                                GELUActivation(), ErfGELU())
    before = list(model)
    report = patch_model(model, strict=True)
    assert report == {"ErfGELU": 1} and isinstance(model[3], gelu.GELU)
    assert list(model)[:3] == before[:3]
    assert [(s.name, s.old) for s in report.skipped] == [
        ("0", "GELU"), ("1", "GELU"), ("2", "GELUActivation")]
    assert all(s.reason.startswith("it runs one torch op already (aten.gelu), one kernel each "
                                   "way") for s in report.skipped)


def test_include_and_exclude(torch_path):
    def model():
        return torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.RMSNorm(H), ErfGELU())

    assert patch_model(model(), include="norm") == {"LayerNorm": 1, "RMSNorm": 1}
    assert patch_model(model(), include=["activation", "RMS*"]) == {"RMSNorm": 1, "ErfGELU": 1}
    assert patch_model(model(), exclude=("LayerNorm",)) == {"RMSNorm": 1, "ErfGELU": 1}
    assert patch_model(model(), include=["norm"], exclude=["RMS*"]) == {"LayerNorm": 1}
    assert patch_model(model(), exclude=["norm", "activation"]) == {}
    with pytest.raises(TypeError, match="argument 'include' must hold kinds .* got int"):
        patch_model(model(), include=["norm", 3])
    with pytest.raises(TypeError, match="argument 'exclude' must be a str or an iterable"):
        patch_model(model(), exclude=3)
    with pytest.raises(TypeError, match="argument 'strict' must be bool, got str"):
        patch_model(model(), strict="yes")
    with pytest.raises(ValueError, match="argument 'memory' must be None or one of 'default', "
                                         "'recompute_mean', 'invertible', got 'fast'"):
        patch_model(model(), memory="fast")


def test_unknown_names_in_include_and_exclude_raise(torch_path):
    """A name that is no kind and matches the class name of no module of the model (a
    misspelt kind or class) would select nothing: it raises, naming the argument, the names
    and the kinds, before anything is probed or swapped."""
    def model():
        return torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.RMSNorm(H), ErfGELU())

    kinds = "norm, activation, mlp, residual, rotary, loss"
    with pytest.raises(ValueError, match=f"argument 'include' names 'norms', which is no kind "
                                         rf"\({kinds}\) and matches the class name of no "
                                         "module of the model nor the name of its loss"):
        patch_model(model(), include="norms")
    module = model()
    norm = module[0]
    with pytest.raises(ValueError, match="argument 'exclude' names 'LayerNrom', 'Llama\\*', "
                                         "which are no kind"):
        patch_model(module, exclude=["norm", "LayerNrom", "Llama*", "RMS*"])
    assert module[0] is norm, "nothing is swapped"
    # a kind, a class name or a pattern matching one of the model's modules (the model's own
    # class too, a container's: it names no candidate, but the model has it) is known
    assert patch_model(model(), include=["norm", "Sequential"]) == {"LayerNorm": 1,
                                                                     "RMSNorm": 1}
    assert patch_model(model(), exclude=["Erf*", "LayerNorm"]) == {"RMSNorm": 1}
    assert patch_model(model(), include="loss", exclude="rotary") == {}
    # the names of a loss: known where the model has that loss
    with pytest.raises(ValueError, match="names 'ForCausalLMLoss'"):
        patch_model(model(), exclude="ForCausalLMLoss")


class WatchfulRMSNorm(torch.nn.Module):
    """An RMSNorm that draws a random number and records how it was called."""

    calls: list[tuple[bool, bool]] = []

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, width))
        self.eps = 1e-6

    def forward(self, x):
        torch.rand(())
        WatchfulRMSNorm.calls.append((torch.is_grad_enabled(), self.training))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@pytest.mark.parametrize("training", [True, False])
def test_probing_leaves_rng_and_mode_alone(training, torch_path, monkeypatch):
    monkeypatch.setattr(WatchfulRMSNorm, "calls", [])
    model = torch.nn.Sequential(WatchfulRMSNorm(H)).train(training)
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    report = patch_model(model)
    assert torch.equal(torch.random.get_rng_state(), state), "probing drew from the RNG"
    assert report == {"WatchfulRMSNorm": 1} and model[0].training is training
    # probed with its own and perturbed parameters, without grad, in the model's mode
    assert WatchfulRMSNorm.calls == [(False, training)] * 2


def test_hooks_and_extra_arguments_are_reasons_to_skip(torch_path):
    class GatedRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(H))

        def forward(self, x, gate=None):
            return torch.nn.functional.rms_norm(x, (H,), self.weight)

    hooked = torch.nn.RMSNorm(H)
    hooked.register_forward_hook(lambda *args: None)
    report = patch_model(torch.nn.Sequential(hooked, GatedRMSNorm()))
    assert report == {}
    assert [s.reason for s in report.skipped] == [
        "it has hooks (forward_hooks), which a replacement would not run",
        "its forward takes gate besides the input, which a replacement would not"]


class ParentOf(torch.nn.Module):
    """A container whose assignment of `fail` raises, as a broken __setattr__ would."""

    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def __setattr__(self, name, value):
        if name == "fail" and isinstance(value, torch.nn.Module) and hasattr(self, "fail"):
            raise RuntimeError("cannot assign")
        super().__setattr__(name, value)


def test_a_failing_assignment_leaves_the_model_untouched(torch_path):
    first, second = torch.nn.LayerNorm(H), torch.nn.RMSNorm(H)
    model = ParentOf(first=first, fail=second)
    with pytest.raises(RuntimeError, match="cannot assign"):
        patch_model(model)
    assert model.first is first and model.fail is second


class GatedMLP(torch.nn.Module):
    """An MLP of LLaMA's structure under other names, registered in another order."""

    def __init__(self, act, *, act_on_up=False, bias=False):
        super().__init__()
        self.w2 = torch.nn.Linear(2 * H, H, bias=bias)
        self.w1 = torch.nn.Linear(H, 2 * H, bias=bias)
        self.w3 = torch.nn.Linear(H, 2 * H, bias=bias)
        self.act = act
        self.act_on_up = act_on_up

    def forward(self, x):
        if self.act_on_up:
            return self.w2(self.w1(x) * self.act(self.w3(x)))
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def test_a_gated_mlp_is_found_by_structure(torch_path):
    torch.manual_seed(0)
    original = GatedMLP(torch.nn.SiLU(), bias=True)
    module = copy.deepcopy(original)
    report, new = swap_one(module)
    assert isinstance(new, patching.GatedMLP), report
    assert report.swapped == [("0", "GatedMLP", "GatedMLP(swiglu, gate=w1, up=w3)")]
    assert new._function is swiglu.swiglu
    assert [n for n, _ in new.named_children()] == ["w2", "w1", "w3"]
    assert new.w1 is module.w1 and new.w2.weight is module.w2.weight
    assert new.state_dict().keys() == original.state_dict().keys()
    assert_same_outputs(original, new, shape=(3, 4, H))
    # the activation on the other branch is another MLP
    torch.manual_seed(0)
    report, new = swap_one(GatedMLP(torch.nn.SiLU(), act_on_up=True))
    assert isinstance(new, patching.GatedMLP) and report.swapped[0].new.endswith("gate=w3, up=w1)")


def test_gated_mlp_activation_decides_the_op(torch_path):
    torch.manual_seed(0)
    original = GatedMLP(torch.nn.GELU())
    report, new = swap_one(copy.deepcopy(original))
    assert report.swapped[0].new == "GatedMLP(geglu, gate=w1, up=w3)"
    assert_same_outputs(original, new, shape=(3, 4, H))
    # the tanh GELU is not geglu's exact one: geglu(approximate="tanh")'s kernels take it
    torch.manual_seed(0)
    original = GatedMLP(torch.nn.GELU(approximate="tanh"))
    report, new = swap_one(copy.deepcopy(original))
    assert report.swapped[0].new == "GatedMLP(geglu_tanh, gate=w1, up=w3)"
    assert new._function is geglu_tanh.geglu_tanh
    assert_same_outputs(original, new, shape=(3, 4, H))
    # a module of that structure computing something else is left, with the reason: the
    # activation is none of the gated ops'
    report, new = swap_one(GatedMLP(torch.nn.ReLU()))
    assert isinstance(new, GatedMLP)
    [(name, kind, reason)] = report.skipped
    assert (name, kind) == ("0", "GatedMLP")
    assert reason.startswith("its activation act (ReLU) does not compute the activation of geglu "
                             "(differs by "), reason
    assert "; nor of geglu_tanh (differs by " in reason and "; nor of swiglu (differs by " in reason


class MultipliedMLP(GatedMLP):
    """Falcon-H1's MLP: the gate scaled before the activation, the result after down."""

    def __init__(self, gate_multiplier, down_multiplier, bias=False):
        super().__init__(torch.nn.SiLU(), bias=bias)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def forward(self, x):
        hidden = self.w3(x) * self.act(self.w1(x) * self.gate_multiplier)
        return self.w2(hidden) * self.down_multiplier


def test_a_gated_mlps_multipliers_pass_to_the_op(torch_path):
    """Numbers the MLP holds under the names of the op's options are tried first: the probe
    proves them (a down projection with a bias does not commute with the down multiplier)."""
    torch.manual_seed(0)
    original = MultipliedMLP(0.5, 1.5)
    report, new = swap_one(copy.deepcopy(original))
    assert report.swapped == [("0", "MultipliedMLP", "GatedMLP(swiglu, gate=w1, up=w3, "
                               "gate_multiplier=0.5, down_multiplier=1.5)")]
    # in fp64: the down multiplier scales down's input, not its output (a rounding apart)
    assert_same_outputs(original.double(), new.double(), shape=(3, 4, H), dtype=torch.float64)
    # multipliers of 1 change nothing: the op's defaults
    report, _ = swap_one(MultipliedMLP(1.0, 1.0))
    assert report.swapped[0].new == "GatedMLP(swiglu, gate=w1, up=w3)"
    report, new = swap_one(MultipliedMLP(0.5, 1.5, bias=True))
    assert isinstance(new, MultipliedMLP) and report.skipped[0].old == "MultipliedMLP"


class FusedMLP(torch.nn.Module):
    """Phi-3's MLP: one Linear computes gate and up (its two halves), with a dropout before down
    as T5's."""

    def __init__(self, *, up_first=False):
        super().__init__()
        self.gate_up = torch.nn.Linear(H, 4 * H, bias=True)
        self.act = torch.nn.SiLU()
        self.drop = torch.nn.Dropout(0.5)
        self.down = torch.nn.Linear(2 * H, H)
        self.up_first = up_first

    def forward(self, x):
        first, second = self.gate_up(x).chunk(2, dim=-1)
        gate, up = (second, first) if self.up_first else (first, second)
        return self.down(self.drop(self.act(gate) * up))


@pytest.mark.parametrize("up_first", [False, True])
def test_a_fused_gate_up_mlp_is_split_in_halves(torch_path, up_first):
    torch.manual_seed(0)
    original = FusedMLP(up_first=up_first).eval()
    report, new = swap_one(copy.deepcopy(original).train())
    half = "gate=gate_up[1], up=gate_up[0]" if up_first else "gate=gate_up[0], up=gate_up[1]"
    assert report.swapped == [("0", "FusedMLP", f"GatedMLP(swiglu, {half})")]
    assert [n for n, _ in new.named_children()] == ["gate_up", "drop", "down"]
    assert new.training and new.drop.training  # probed in eval mode, the model's mode kept
    assert_same_outputs(original, new.eval(), shape=(3, 4, H))
    # the dropout is applied where the module applies it: in training, the same mask
    original.train(), new.train()
    x = randn((3, 4, H), seed=5, dtype=torch.float32)
    torch.manual_seed(1)
    expected = original(x)
    torch.manual_seed(1)
    torch.testing.assert_close(new(x), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected, original.eval()(x))  # the mask did drop values


def test_replaces_mismatches_name_the_rule():
    norm = NormalizedShapeAPI("f", "M", "t", "T", params=(Param("weight", "ones"),), eps=1e-5,
                              replaces=(Replaces("*Norm", tries=(("offset", (0.0, 1.0)),)),
                                        Replaces("*Norm", kind="loss")))
    assert replaces_mismatches(norm) == [
        "Replaces('*Norm'): tries 'offset', which is not one of the API's options",
        "Replaces('*Norm'): kind 'loss' needs a row-loss API"]
    glu = ElementwiseAPI("f", "M", "t", inputs=("gate",), replaces=(Replaces("*", kind="mlp"),
                                                                     Replaces("*", kind="moe")))
    assert replaces_mismatches(glu) == [
        "Replaces('*'): kind 'mlp' needs an elementwise API of two inputs (gate, up), no "
        "call_params, switches or dropout",
        "Replaces('*'): kind must be None or one of mlp, loss, residual, rotary, got 'moe'"]
    # a rotary embedding is computed by a position-embedding API's embed function
    rotary = ElementwiseAPI("f", "M", "t", inputs=("x", "cos", "sin"),
                            replaces=(Replaces("*Attention", kind="rotary"),))
    assert replaces_mismatches(rotary) == [
        "Replaces('*Attention'): kind 'rotary' needs a position-embedding API"]


def test_patch_rejects_non_modules():
    with pytest.raises(TypeError, match="argument 'model' must be a torch.nn.Module"):
        patch_model("bert")


class _Scaled(torch.nn.Module):
    """A parametrization: the weight as twice what is stored."""

    def forward(self, weight):
        return 2 * weight


def test_parametrized_modules_are_probed_not_refused():
    """A module with a parametrization (torch.nn.utils.parametrize: weight norm, spectral
    norm, orthogonal) refuses to be pickled and so to be copied; the probes copy it all the
    same, and patch_model swaps around it (or proves what holds it) instead of raising."""
    from torch.nn.utils import parametrize

    from codegen.runtime import probe

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    parametrize.register_parametrization(block[0], "weight", _Scaled())
    with pytest.raises(RuntimeError):
        copy.copy(block[0])
    twin = probe.twin(block, probe.Noise(), {})
    assert twin[0] is not block[0] and twin[0].weight.shape == (8, 8)
    assert not torch.equal(twin[0].weight, block[0].weight)  # its own perturbed weight
    x = randn((3, 8), seed=1, dtype=torch.float32)
    expected = block(x)
    report = patch_model(block)
    assert report.counts == {"LayerNorm": 1}, report
    torch.testing.assert_close(block(x), expected)

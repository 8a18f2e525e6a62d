"""vjpforge's layers in the `kernels` package's mechanism (codegen/runtime/hub.py): mapped with
`kernel_mapping()`, `kernels.kernelize` binds them to transformers' declared modules and
functions offline; they honour kernels' layer contract, and a kernelized model gives the loss,
the logits and every gradient of the same model unkernelized, eagerly and under
`torch.compile(fullgraph=True)`. A module whose code is not one a layer computes is refused.

Passes with transformers 5.25 and kernels 0.19, and with transformers 5.17 and kernels 0.16, in
which every model of a modeling module calls that module's own `apply_rotary_pos_emb` (a model
copied or built after another kernelized it computes with the same layer): the tests build
each model afresh, compute what they compare against before kernelizing, and unbind the
modeling modules' functions after each test."""

from __future__ import annotations

import collections
import copy

import kernels  # the mechanism under test: import, never skip
import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from kernels import Mode
from reference import HAS_CUDA, generated_torch_path, randn
from transformers import activations
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from codegen.runtime import hub

try:  # kernels 0.17 on
    from kernels._internals.layer.layer import _validate_layer
except ImportError:  # kernels 0.16 (transformers 5.17's)
    from kernels.layer.layer import _validate_layer

VOCAB = 64
#: the devices a kernelized model is tested on: the CPU runs the generated torch path, CUDA the
#: Triton kernels
DEVICES = ("cpu", "cuda") if HAS_CUDA else ("cpu",)
#: LlamaRMSNorm computes in float32 even in a float64 model (and so do the rotary tables, in
#: both models alike): the kernelized model agrees with it to float32's rounding
FP32_LEVEL = {"rtol": 1e-5, "atol": 1e-7}
#: against a model whose norms compute in float64, as the generated op does
EXACT = {"rtol": 1e-10, "atol": 1e-12}
#: kernels 0.17 on records each kernelized module's repository (`_kernel_repo`,
#: `get_kernelized_layers`); 0.16 binds the forward alone
RECORDS = hasattr(kernels, "get_kernelized_layers")
#: the functions transformers declares that the tests' models call
FUNCTIONS = (modeling_llama.apply_rotary_pos_emb, modeling_gpt_oss.apply_rotary_pos_emb)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


@pytest.fixture(autouse=True)
def unbind_functions():
    """kernels 0.16 kernelizes the modeling modules' own function modules, which every later
    model calls: each test leaves them as they were (kernels 0.17 on binds none)."""
    yield
    for function in FUNCTIONS:
        function.__dict__.pop("forward", None)


def bound(module: torch.nn.Module):
    """The function the module's forward calls now (its class's or a layer's)."""
    return module.forward.__func__


def tiny_llama(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                      intermediate_size=128, vocab_size=VOCAB, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).double().to(device).train()


def kernelized(model: torch.nn.Module, device: str, mode: Mode = Mode.TRAINING,
               **mapping) -> torch.nn.Module:
    """`model` kernelized in place, through kernels' public API and vjpforge's mapping."""
    with kernels.use_kernel_mapping(hub.kernel_mapping(**mapping), inherit_mapping=False):
        return kernels.kernelize(model, mode=mode, device=device)


def run(model: torch.nn.Module, tokens: torch.Tensor):
    model.zero_grad()
    output = model(input_ids=tokens, labels=tokens)
    output.loss.backward()
    return (output.loss.detach(), output.logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def assert_same_run(got, want, tolerance):
    torch.testing.assert_close(got[0], want[0], **tolerance)
    torch.testing.assert_close(got[1], want[1], **tolerance)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tolerance,
                                   msg=lambda m, n=name: f"{n}: {m}")


def tokens(device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)


class ExactRMSNorm(torch.nn.Module):
    """LlamaRMSNorm computed in its input's dtype (float64 here), as the generated op does."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def exact(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, modeling_llama.LlamaRMSNorm):
                setattr(parent, name, ExactRMSNorm(child))
    return model


#: the class (or kernels' function module) each layer stands in for
REPLACED = {"RMSNorm": modeling_llama.LlamaRMSNorm,
            "RMSNormZeroCentered": Qwen3_5RMSNorm,
            "rotary_pos_emb": type(modeling_llama.apply_rotary_pos_emb),
            "GeLU": activations.GELUActivation,
            "GeluTanh": activations.GELUTanh,
            "NewGELU": activations.NewGELUActivation}


@pytest.mark.parametrize("name", sorted(hub.LAYERS))
def test_layer_passes_kernels_contract(name):
    """kernels' own check of a layer (stateless, no constructor, no members but the two flags,
    the forward's parameters those of the forward it replaces), and the repository's load."""
    assert REPLACED[name].kernel_layer_name == name
    repository = hub.Repository(name)
    layer = repository.load()
    assert layer is hub.LAYERS[name]
    _validate_layer(check_cls=REPLACED[name], cls=layer, repo=repository)
    assert layer.has_backward is True and layer.can_torch_compile is True
    assert repository == hub.Repository(name) and hash(repository) == hash(hub.Repository(name))


def test_kernel_mapping():
    mapping = hub.kernel_mapping()
    assert sorted(mapping) == sorted(hub.DEFAULT_LAYERS)
    assert "GeLU" not in mapping and "GeluTanh" not in mapping  # torch's one gelu op already
    for name, devices in mapping.items():
        assert devices == {device: {Mode.TRAINING | Mode.TORCH_COMPILE: hub.Repository(name)}
                           for device in ("cuda", "cpu")}
    assert list(hub.kernel_mapping("cpu", layers=["GeLU"])) == ["GeLU"]
    assert list(hub.kernel_mapping("cpu", layers="GeLU")["GeLU"]) == ["cpu"]
    with pytest.raises(ValueError, match="rocm"):
        hub.kernel_mapping(["cuda", "rocm"])
    with pytest.raises(ValueError, match="no layer 'SiLU'"):
        hub.kernel_mapping(layers=["SiLU"])
    # kernels takes it as a global mapping too (inside a context, which restores the mapping)
    with kernels.use_kernel_mapping({}, inherit_mapping=False):
        kernels.register_kernel_mapping(hub.kernel_mapping("cpu"))
        model = kernels.kernelize(tiny_llama("cpu"), mode=Mode.INFERENCE, device="cpu")
    assert bound(model.model.norm) is hub.RMSNorm.forward


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
                                  Mode.INFERENCE | Mode.TORCH_COMPILE])
def test_kernelize_binds_the_layers(mode):
    other = tiny_llama("cpu")
    model = kernelized(tiny_llama("cpu"), "cpu", mode)
    norms = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    attentions = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaAttention)]
    functions = [attention._kernel_funcs["rotary_pos_emb"] for attention in attentions]
    assert len(norms) == 5 and len(functions) == 2
    assert all(bound(norm) is hub.RMSNorm.forward for norm in norms)
    assert all(bound(function) is hub.RotaryPosEmb.forward for function in functions)
    if RECORDS:
        assert all(norm.__dict__["_kernel_repo"] == hub.Repository("RMSNorm")
                   for norm in norms)
        assert all(function.__dict__["_kernel_repo"] == hub.Repository("rotary_pos_emb")
                   for function in functions)
        found = kernels.get_kernelized_layers(model)
        assert collections.Counter(str(k.repo) for k in found.layers.values()) == {
            "vjpforge (layer `RMSNorm`)": 5}
        assert sorted(found.funcs) == [(f"model.layers.{i}.self_attn", "rotary_pos_emb")
                                       for i in range(2)]
        assert not kernels.get_kernelized_layers(other).layers
    # another model keeps its own forwards (but for the function kernels 0.16 shares)
    assert all("forward" not in m.__dict__ for m in other.modules())
    # bound through transformers' train() and eval() (the model does not kernelize itself)
    model.eval().train()
    assert all(bound(norm) is hub.RMSNorm.forward for norm in norms)
    # and undone by kernelizing with an empty mapping
    with kernels.use_kernel_mapping({}, inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device="cpu")
    assert all(bound(norm) is modeling_llama.LlamaRMSNorm.forward for norm in norms)
    assert all(bound(function) is type(function).forward for function in functions)


@pytest.mark.parametrize("device", DEVICES)
def test_kernelized_llama_matches(device):
    """Loss, logits and every gradient: those of the unkernelized model to float32's rounding
    (its norms compute in float32), those of a model whose norms compute in float64 to
    float64's."""
    original = tiny_llama(device)
    want, want_exact = run(original, tokens(device)), run(exact(original), tokens(device))
    got = run(kernelized(tiny_llama(device), device), tokens(device))
    assert_same_run(got, want, FP32_LEVEL)
    assert_same_run(got, want_exact, EXACT)


class Recorder:
    """A torch.compile backend (aot_eager) that counts the vjpforge ops of the graphs."""

    def __init__(self):
        self.ops = collections.Counter()

    def __call__(self, graph, inputs):
        for node in graph.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("vjpforge."):
                self.ops[str(node.target).split(".")[1]] += 1
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)


def test_kernelized_model_compiles_fullgraph():
    """`can_torch_compile`: the kernelized model in one graph, the generated ops in it as
    custom ops, the same loss, logits and gradients as eagerly."""
    torch._dynamo.reset()
    model = kernelized(tiny_llama("cpu"), "cpu", Mode.TRAINING | Mode.TORCH_COMPILE)
    eager = run(model, tokens("cpu"))
    recorder = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    got = run(compiled, tokens("cpu"))
    # 5 norms, and the rotary embedding of q and of k in 2 attentions
    assert recorder.ops == {"rmsnorm": 5, "rotary": 4}
    assert_same_run((got[0], got[1], {n.removeprefix("_orig_mod."): g for n, g in got[2].items()}),
                    eager, EXACT)


def test_kernelized_layer_compiles_fullgraph():
    torch._dynamo.reset()
    norm = kernelized(tiny_llama("cpu"), "cpu").model.norm
    x = randn((2, 7, 64), seed=3).requires_grad_()
    x_compiled = x.detach().clone().requires_grad_()
    recorder = Recorder()
    compiled = torch.compile(norm, fullgraph=True, backend=recorder)
    dy = randn((2, 7, 64), seed=4)
    norm(x).backward(dy)
    want = (x.grad, norm.weight.grad.clone())
    norm.weight.grad = None
    compiled(x_compiled).backward(dy)
    assert recorder.ops == {"rmsnorm": 1}
    torch.testing.assert_close((x_compiled.grad, norm.weight.grad), want, **EXACT)


#: (weight, input) dtypes: a 16-bit model's, and mixed ones whose product promotes
NORM_DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("weight_dtype, dtype", NORM_DTYPES)
@pytest.mark.parametrize("norm_class", [modeling_llama.LlamaRMSNorm, modeling_olmo2.Olmo2RMSNorm,
                                        Qwen3_5RMSNorm])
def test_rms_norms_round_as_the_originals(norm_class, weight_dtype, dtype):
    """The norms the layers stand in for (Olmo 2's is Llama's code from transformers 5.25 on,
    before that `(w · x̂).to(dtype)`): a 16-bit output is the original's bit for bit, a float32
    one (a promoting weight's, or float32 input's) within float32's rounding, the dtype the
    original's."""
    def build():
        norm = norm_class(64).to(weight_dtype)
        with torch.no_grad():
            norm.weight.copy_(randn((64,), seed=13, dtype=weight_dtype))
        return norm

    x = randn((6, 64), seed=14, dtype=dtype, shift=0.2) * 3
    want = build()(x)
    got = kernelized(build(), "cpu", layers=hub.LAYERS)(x)
    assert got.dtype == want.dtype
    if want.dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class Holder(torch.nn.Module):
    """The other layers' modules: Qwen3.5's norm and the GELUs, both forms of each."""

    def __init__(self, dtype):
        super().__init__()
        self.norm = Qwen3_5RMSNorm(48).to(dtype)
        with torch.no_grad():
            self.norm.weight.copy_(randn((48,), seed=5, dtype=dtype))
        self.acts = torch.nn.ModuleList([
            activations.GELUActivation(), activations.GELUActivation(use_gelu_python=True),
            activations.GELUTanh(), activations.GELUTanh(use_gelu_tanh_python=True),
            activations.NewGELUActivation()])

    def layers(self):
        return [self.norm, *self.acts]


def output_and_grads(module, x):
    """A module's output and the gradients of its input and parameters, of a seeded upstream
    gradient."""
    x = x.detach().clone().requires_grad_()
    output = module(x)
    return output, torch.autograd.grad(output, [x, *module.parameters()],
                                       randn(output.shape, seed=7, dtype=output.dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_zero_centered_norm_and_gelus(dtype):
    """Qwen3.5's norm and the GELUs, in each dtype: the outputs and gradients of the modules as
    they were. Qwen3.5's norm computes in float32 (from float64 too), the GELUs in their
    input's dtype, a 16-bit one in float32 rounded once: the kernelized norm gives a bfloat16
    original's outputs to the bit, and the gradients, which the original rounds at every step,
    to its rounding."""
    original = Holder(dtype)
    model = kernelized(Holder(dtype), "cpu", layers=hub.LAYERS)
    assert [bound(layer) for layer in model.layers()] == [
        hub.RMSNormZeroCentered.forward, hub.GeLU.forward, hub.GeLU.forward,
        hub.GeluTanh.forward, hub.GeluTanh.forward, hub.NewGELU.forward]
    x = randn((3, 5, 48), seed=6, dtype=dtype, shift=0.3) * 3
    for i, (theirs, ours) in enumerate(zip(original.layers(), model.layers(), strict=True)):
        (want, want_grads), (got, got_grads) = (output_and_grads(theirs, x),
                                                output_and_grads(ours, x))
        if dtype == torch.bfloat16:
            # the norm to the bit; torch's erf and tanh may differ from the op's by an ulp
            assert got.dtype == want.dtype and (i > 0 or torch.equal(got, want))
            tolerance = {"rtol": 2e-2, "atol": 2e-2}
        elif dtype == torch.float32 or i == 0:
            tolerance = {"rtol": 1e-5, "atol": 1e-5 if dtype == torch.float32 else 1e-7}
        else:
            tolerance = EXACT
        torch.testing.assert_close(got, want, **tolerance)
        torch.testing.assert_close(got_grads, want_grads, **tolerance)


def test_gpt2_new_gelu_matches():
    """GPT-2's NewGELUActivation (its MLPs' activation, eight torch ops) in a whole model."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, vocab_size=VOCAB, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    want = run(transformers.GPT2LMHeadModel(config).double().train(), tokens("cpu"))
    torch.manual_seed(0)
    model = kernelized(transformers.GPT2LMHeadModel(config).double().train(), "cpu")
    acts = [m for m in model.modules() if isinstance(m, activations.NewGELUActivation)]
    assert len(acts) == 2 and all(bound(act) is hub.NewGELU.forward for act in acts)
    assert_same_run(run(model, tokens("cpu")), want, EXACT)


@kernels.use_kernel_forward_from_hub("RMSNorm")
class CopiedRMSNorm(torch.nn.Module):
    """LlamaRMSNorm's code, copied into another module (as transformers copies it)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


@kernels.use_kernel_forward_from_hub("RMSNorm")
class OffsetRMSNorm(CopiedRMSNorm):
    """Declared "RMSNorm", but Gemma's `x̂ · (1 + w)`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (1.0 + self.weight) * hidden_states.to(input_dtype)


@kernels.use_kernelized_func(modeling_gpt_oss.apply_rotary_pos_emb)
class GptOssLikeAttention(torch.nn.Module):
    """Calls GPT-OSS's `apply_rotary_pos_emb` (declared "rotary_pos_emb"), whose tables are
    half the head wide and pair column j with j + head_dim / 2 otherwise than Llama's."""

    def forward(self, q, k, cos, sin):
        return modeling_gpt_oss.apply_rotary_pos_emb(q, k, cos, sin)


def test_other_code_is_refused():
    """A layer computes only what its reference computes: a copy of LlamaRMSNorm's code is
    computed, a norm of other code declared "RMSNorm" and GPT-OSS's rotary embedding raise
    (eagerly, and under torch.compile), the model left to be mapped otherwise."""
    x = randn((4, 16), seed=8)
    copied = CopiedRMSNorm(16).double()
    with torch.no_grad():
        copied.weight.copy_(randn((16,), seed=12))
    want = copied(x)
    kernelized(copied, "cpu")
    assert bound(copied) is hub.RMSNorm.forward
    torch.testing.assert_close(copied(x), want, **FP32_LEVEL)
    offset = kernelized(OffsetRMSNorm(16).double(), "cpu")
    assert bound(offset) is hub.RMSNorm.forward  # bound, as kernels binds it ...
    with pytest.raises(hub.UnsupportedModuleError, match="hub_layers.OffsetRMSNorm runs other"):
        offset(x)  # ... but it does not compute what it cannot
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="UnsupportedModuleError"):
        torch.compile(offset, fullgraph=True, backend="aot_eager")(x)
    q = randn((1, 2, 3, 8), seed=9)
    tables = randn((1, 3, 4), seed=10), randn((1, 3, 4), seed=11)
    want = GptOssLikeAttention()(q, q, *tables)
    attention = kernelized(GptOssLikeAttention(), "cpu")
    with pytest.raises(hub.UnsupportedModuleError, match="gpt_oss.apply_rotary_pos_emb runs"):
        attention(q, q, *tables)
    # mapped without "rotary_pos_emb", the function computes as it did
    unmapped = kernelized(GptOssLikeAttention(), "cpu", layers=["RMSNorm"])
    torch.testing.assert_close(unmapped(q, q, *tables), want, rtol=0, atol=0)

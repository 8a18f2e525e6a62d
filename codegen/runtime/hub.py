"""vjpforge's generated ops as layers of the `kernels` package, which Hugging Face transformers
uses to replace the forward of the modules and functions it declares with
`@use_kernel_forward_from_hub(name)`.

`kernels.kernelize(model, mode=..., device=...)` looks each declared name up in the kernel
mapping (`kernels.use_kernel_mapping`, `kernels.register_kernel_mapping`), loads a layer class
from the repository the mapping names and binds that class's `forward` to the instance in
place of its own. A layer is stateless: an `nn.Module` subclass with a `forward` of the same
parameters as the one it replaces, no constructor of its own, no members but the flags
`has_backward` and `can_torch_compile`; its forward reads the instance's own attributes
(`self.weight`, `self.variance_epsilon`). `kernel_mapping()` gives a mapping whose repository
(`Repository`) hands these layers over without a download.

The layers (`LAYERS`), by the name transformers declares:

- "RMSNorm" (LlamaRMSNorm and its copies): `generated.rmsnorm.rms_norm`;
- "RMSNormZeroCentered" (Qwen3.5's `x̂ · (1 + w)` norms): `rms_norm(weight_offset=1.0)`;
- "rotary_pos_emb" (`apply_rotary_pos_emb`): `generated.rotary.apply_rotary_pos_emb`;
- "GeLU", "GeluTanh", "NewGELU" (transformers' GELU activations): `generated.gelu.gelu`,
  `generated.gelu_tanh.gelu_tanh`.

A name says nothing of what a class computes, and anyone may declare it. So before it
computes, a layer checks that the forward it stands in for is the code of one it is known to
compute: the same bytecode, constants and names, every global and method that code names
resolving to the same code or object (`_same_function`), against the class transformers itself
ships (`REFERENCES`). The verdict is kept per class; under `torch.compile` it is a constant of
the trace (`torch.compiler.assume_constant_result`). Where the code is another, the layer raises
and says which: computing something else under the module's name would be pretending.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable

import torch

from generated import gelu as _gelu
from generated import gelu_tanh as _gelu_tanh
from generated import rmsnorm as _rmsnorm
from generated import rotary as _rotary

#: what a name of the mapping stands for, per layer name: (modeling module, attribute, variant)
#: of the classes or functions transformers ships whose code the layer computes; a variant says
#: how the layer computes that one (the rotary embeddings: which dtype the results take)
REFERENCES: dict[str, tuple[tuple[str, str, str], ...]] = {
    # LlamaRMSNorm (x̂ cast to the input's dtype before the weight), and the norms that
    # transformers before 5.25 declares under the same name but cast once, after the weight:
    # Olmo 2's `(w · x̂).to(dtype)` (from 5.25 on Olmo 2's is Llama's code, which the first
    # reference matches)
    "RMSNorm": (("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "llama"),
                ("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm", "gemma")),
    "RMSNormZeroCentered": (
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm", "offset"),),
    # Llama's `q * cos + rotate_half(q) * sin` in the dtype torch's arithmetic gives; the
    # copies that upcast q and k to float32 and cast both results to q's dtype; and Olmo's
    # before transformers 5.25, which casts each result to its input's dtype (a reference
    # that is Llama's code is matched as Llama's, first)
    "rotary_pos_emb": (
        ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb", "promotes"),
        ("transformers.models.modernbert.modeling_modernbert", "apply_rotary_pos_emb",
         "as_q"),
        ("transformers.models.hunyuan_vl.modeling_hunyuan_vl", "apply_rotary_pos_emb",
         "as_q"),
        ("transformers.models.olmo.modeling_olmo", "apply_rotary_pos_emb", "as_own"),
    ),
    "GeLU": (("transformers.activations", "GELUActivation", "gelu"),),
    "GeluTanh": (("transformers.activations", "GELUTanh", "gelu_tanh"),),
    "NewGELU": (("transformers.activations", "NewGELUActivation", "gelu_tanh"),),
}
#: the methods of a class whose code must be the reference's: the forward, and where the
#: forward calls what the constructor chose (GELUActivation's `self.act`), the constructor
METHODS: dict[str, tuple[str, ...]] = {"GeLU": ("forward", "__init__"),
                                        "GeluTanh": ("forward", "__init__")}
#: the devices `kernel_mapping()` maps: CUDA runs the generated Triton kernels, the CPU the
#: generated torch path (the kernels under TRITON_INTERPRET=1)
DEVICES = ("cuda", "cpu")


class RMSNorm(torch.nn.Module):
    """transformers' "RMSNorm" (LlamaRMSNorm: `w · x̂` with x̂ computed in float32 and cast back
    to the input's dtype before the weight multiplies it; before transformers 5.25 also Olmo 2's
    and its kin, which cast `w · x̂` once)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        variant = _require("RMSNorm", type(self))
        weight, eps = self.weight, self.variance_epsilon
        shape = (hidden_states.shape[-1],)
        if variant == "gemma":
            # `(w · x̂).to(dtype)`: the product in float32, rounded once to the input's dtype,
            # which is the op's default casting mode whatever the weight's dtype
            return _rmsnorm.rms_norm(hidden_states, shape, weight, eps, in_place=True)
        if torch.promote_types(weight.dtype, hidden_states.dtype) != hidden_states.dtype:
            # HF's product takes the promoted dtype (a float32 weight on bfloat16 input): x̂
            # rounded to the input's dtype by the op, the product in torch's arithmetic
            return weight * _rmsnorm.rms_norm(hidden_states, shape, None, eps)
        # "llama" rounds x̂ to a 16-bit input's dtype before the weight as HF does; for
        # float32 and float64 the two modes are one, and the default one lets small calls and
        # compiled ones run torch's own rms_norm where that measured faster
        # (codegen/runtime/dispatch.py)
        mode = "llama" if hidden_states.dtype in (torch.float16, torch.bfloat16) else "gemma"
        return _rmsnorm.rms_norm(hidden_states, shape, weight, eps, casting_mode=mode,
                                 in_place=True)


class RMSNormZeroCentered(torch.nn.Module):
    """transformers' "RMSNormZeroCentered" (Qwen3.5's norms: `x̂ · (1 + w)` in float32, the
    product cast to the input's dtype)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x):
        _require("RMSNormZeroCentered", type(self))
        return _rmsnorm.rms_norm(x, (x.shape[-1],), self.weight, self.eps, weight_offset=1.0,
                                 in_place=True)


class RotaryPosEmb(torch.nn.Module):
    """transformers' "rotary_pos_emb" (`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`,
    which `kernels` wraps in a module of its own)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        variant = _require("rotary_pos_emb", type(self))
        q_embed, k_embed = _rotary.apply_rotary_pos_emb(q, k, cos, sin,
                                                        unsqueeze_dim=unsqueeze_dim)
        # computed in float32 (or wider) as the upcasting copies do, then cast as they cast
        if variant == "as_q":
            return q_embed.to(q.dtype), k_embed.to(q.dtype)
        if variant == "as_own":
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed


class GeLU(torch.nn.Module):
    """transformers' "GeLU" (GELUActivation: the exact GELU, torch's or its Python form)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input):
        _require("GeLU", type(self))
        return _gelu.gelu(input)


class GeluTanh(torch.nn.Module):
    """transformers' "GeluTanh" (GELUTanh: the tanh approximation, torch's or its Python
    form)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input):
        _require("GeluTanh", type(self))
        return _gelu_tanh.gelu_tanh(input)


class NewGELU(torch.nn.Module):
    """transformers' "NewGELU" (NewGELUActivation, GPT-2's: the tanh approximation written out
    in eight torch ops)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input):
        _require("NewGELU", type(self))
        return _gelu_tanh.gelu_tanh(input)


#: the layer of each name transformers declares that a generated op computes
LAYERS: dict[str, type[torch.nn.Module]] = {
    "RMSNorm": RMSNorm,
    "RMSNormZeroCentered": RMSNormZeroCentered,
    "rotary_pos_emb": RotaryPosEmb,
    "GeLU": GeLU,
    "GeluTanh": GeluTanh,
    "NewGELU": NewGELU,
}
#: the layers `kernel_mapping()` maps unless told otherwise: not "GeLU" and "GeluTanh", which
#: stand in for torch's one gelu op (GELUActivation and GELUTanh call `F.gelu`), already one
#: kernel each way: the generated op fuses nothing there and measured slower (docs/patching.md)
DEFAULT_LAYERS = ("RMSNorm", "RMSNormZeroCentered", "rotary_pos_emb", "NewGELU")


class Repository:
    """The repository `kernels` loads vjpforge's layer `layer_name` from (its protocol: a
    `layer_name` and a `load()` that returns the layer class). Nothing is downloaded: the
    layers are this module's. Equal repositories are one to `kernels`' cache of loaded
    layers."""

    def __init__(self, layer_name: str):
        if layer_name not in LAYERS:
            raise ValueError(f"vjpforge has no layer {layer_name!r}: it has {sorted(LAYERS)}")
        self.layer_name = layer_name

    def load(self) -> type[torch.nn.Module]:
        return LAYERS[self.layer_name]

    def __eq__(self, other) -> bool:
        return isinstance(other, Repository) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash((Repository, self.layer_name))

    def __repr__(self) -> str:
        return f"Repository({self.layer_name!r})"

    def __str__(self) -> str:
        return f"vjpforge (layer `{self.layer_name}`)"


def kernel_mapping(devices: str | Iterable[str] = DEVICES,
                   layers: Iterable[str] = DEFAULT_LAYERS) -> dict:
    """The kernel mapping of vjpforge's `layers` on `devices` ("cuda", "cpu" or both), for
    `kernels.use_kernel_mapping(...)` or `kernels.register_kernel_mapping(...)`:

        with kernels.use_kernel_mapping(kernel_mapping()):
            kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cuda")

    Each layer is mapped for training with `torch.compile`, which `kernels` also picks for
    inference and for either without `torch.compile`: every layer has its backward and
    compiles without a graph break. `layers`: names of `LAYERS` (by default `DEFAULT_LAYERS`,
    which leaves out "GeLU" and "GeluTanh")."""
    from kernels import Mode  # only a user of `kernels` asks for its mapping

    devices = (devices,) if isinstance(devices, str) else tuple(devices)
    for device in devices:
        if device not in DEVICES:
            raise ValueError(f"kernel_mapping(): vjpforge's layers run on {DEVICES}, "
                             f"not {device!r}")
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    return {name: {device: {Mode.TRAINING | Mode.TORCH_COMPILE: Repository(name)}
                   for device in devices}
            for name in layers}


class UnsupportedModuleError(TypeError):
    """A layer was bound to a module (or function) whose code is not one it computes."""


def _require(layer_name: str, cls: type) -> str:
    """The variant of `layer_name`'s reference that `cls` computes; raises where none."""
    variant = _verdict(layer_name, cls)
    if variant is None:
        names = ", ".join(f"{module}.{name}" for module, name, _ in REFERENCES[layer_name])
        raise UnsupportedModuleError(
            f"vjpforge's {layer_name!r} layer computes what {names} computes, and "
            f"{_described(cls)} runs other code: map {layer_name!r} to another layer for this "
            f"model, or leave it out (kernel_mapping(layers=...))")
    return variant


#: the verdict of `_verdict` per (layer name, class)
_VERDICTS: dict[tuple[str, type], str | None] = {}


@torch.compiler.assume_constant_result
def _verdict(layer_name: str, cls: type) -> str | None:
    """The variant of the reference whose code `cls` (its methods, or for a `kernels` function
    module the function it wraps) is, or None. A constant of a `torch.compile` trace: the
    class is, and so is the code it runs."""
    key = (layer_name, cls)
    if key not in _VERDICTS:
        _VERDICTS[key] = next((variant for reference, variant in _references(layer_name)
                               if _same_code_as(layer_name, cls, reference)), None)
    return _VERDICTS[key]


def _references(layer_name: str) -> list[tuple[object, str]]:
    """The classes or functions of transformers that `layer_name` computes, with their
    variants (those this transformers lacks left out)."""
    found = []
    for module_name, attribute, variant in REFERENCES[layer_name]:
        try:
            reference = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            continue
        found.append((reference, variant))
    return found


def _same_code_as(layer_name: str, cls: type, reference) -> bool:
    if isinstance(reference, type):
        return all(_same_function(getattr(cls, method, None), getattr(reference, method, None),
                                  cls, reference, set())
                   for method in METHODS.get(layer_name, ("forward",)))
    # a decorated function is an instance of a module class `kernels` made for it
    return _same_function(_wrapped(cls), _wrapped(type(reference)), None, None, set())


def _wrapped(cls: type):
    """The function a `kernels` function module (`use_kernel_forward_from_hub` on a function)
    calls: the cell `func` of its forward's closure; None for any other class."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars or forward.__closure__ is None:
        return None
    try:
        return forward.__closure__[code.co_freevars.index("func")].cell_contents
    except ValueError:  # an empty cell
        return None


_MISSING = object()


def _same_function(function, reference, owner, reference_owner, seen: set) -> bool:
    """Whether `function` is `reference`'s code: the same bytecode, constants (a docstring
    aside) and names, and every name it reads resolving alike, as a global of its module and,
    for a method, as an attribute of its class (`owner`)."""
    if function is reference:
        return True
    if not (isinstance(function, types.FunctionType)
            and isinstance(reference, types.FunctionType)):
        return False
    if (function, reference) in seen:  # recursion: equal so far
        return True
    seen.add((function, reference))
    if not _same_code(function.__code__, reference.__code__, function, reference, owner,
                      reference_owner, seen):
        return False
    # what its closure holds (a decorator's wrapped function): the same free variables, as
    # the code compared says
    cells, reference_cells = function.__closure__ or (), reference.__closure__ or ()
    return all(_same_value(_contents(cell), _contents(reference_cell), None, None, seen)
               for cell, reference_cell in zip(cells, reference_cells, strict=True))


def _same_code(code, reference_code, function, reference, owner, reference_owner,
               seen) -> bool:
    if (code.co_code != reference_code.co_code or code.co_names != reference_code.co_names
            or code.co_varnames != reference_code.co_varnames
            or code.co_freevars != reference_code.co_freevars
            or code.co_argcount != reference_code.co_argcount
            or code.co_kwonlyargcount != reference_code.co_kwonlyargcount):
        return False
    constants, reference_constants = code.co_consts, reference_code.co_consts
    if code is function.__code__:
        # a function's docstring is its first constant (None without one): copies of a
        # function in other modeling modules name their own model in it
        constants, reference_constants = constants[1:], reference_constants[1:]
    if len(constants) != len(reference_constants):
        return False
    for constant, reference_constant in zip(constants, reference_constants, strict=True):
        if isinstance(constant, types.CodeType):
            # a nested function or comprehension: reads the same globals
            if not (isinstance(reference_constant, types.CodeType)
                    and _same_code(constant, reference_constant, function, reference, owner,
                                   reference_owner, seen)):
                return False
        elif type(constant) is not type(reference_constant) or constant != reference_constant:
            return False
    for name in code.co_names:
        if not _same_value(function.__globals__.get(name, _MISSING),
                           reference.__globals__.get(name, _MISSING), None, None, seen):
            return False
        if owner is not None and not _same_value(getattr(owner, name, _MISSING),
                                                 getattr(reference_owner, name, _MISSING),
                                                 owner, reference_owner, seen):
            return False
    return True


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _same_value(value, reference, owner, reference_owner, seen) -> bool:
    """A name read resolving alike: the same object, a function of the same code, or an equal
    number or string."""
    if value is reference:
        return True
    if isinstance(value, types.FunctionType):
        return _same_function(value, reference, owner, reference_owner, seen)
    return (type(value) is type(reference) and isinstance(value, (bool, int, float, str))
            and value == reference)


def _described(cls: type) -> str:
    function = _wrapped(cls)
    if function is not None:
        return f"{function.__module__}.{function.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"

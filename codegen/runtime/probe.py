"""What proves a swap by behaviour: the probe inputs, the copies of a module they run on, and
how outputs are compared. `patch_model()` (codegen/runtime/patching.py) and each of its plugin
modules (`patch_norm`, `patch_mlp`, `patch_residual`, `patch_rotary`, `patch_loss`,
`logits_route`) prove their swaps with these, so that every kind is judged by the same inputs,
the same tolerance and the same messages.

A probe runs on a shallow copy of the module (`twin`: its Parameters shared or perturbed
copies of them, its buffers copied, no hooks), under `probing`: no autograd graph, the RNG state
left as it was, the generated kernels at every size. Its inputs are deterministic (`SEED`,
`probe_input`), and an output is compared with the module's within a tolerance suited to the
dtype (`difference`, `tolerance`): a few units in the last place of a 16-bit dtype, 2e-5
relative in float32 and float64.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from codegen.runtime import dispatch

#: the hook dicts of a module that a replacement would not carry over
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
         "_load_state_dict_post_hooks")
#: seed of the probe inputs and of the perturbation of a module's tensors
SEED = 0x5EED
#: leading dims of a probe input: 12 rows, 4-d so that a module that branches on the input's
#: rank (a channels-first norm) shows it
PROBE_ROWS = (2, 2, 3)
#: the width of a probe where the module does not fix one (an activation, a weightless norm)
PROBE_WIDTH = 64
#: an activation's probe: a grid over where GELUs and SiLUs differ, plus large values where a
#: clipped activation shows itself
ACTIVATION_RANGE = 8.0
ACTIVATION_EXTREMES = (-100.0, -50.0, -20.0, -12.0, 12.0, 20.0, 50.0, 100.0)

#: why a module on the meta device is left in place
META = "it is on the meta device, where its outputs cannot be compared"


@contextlib.contextmanager
def probing(device: torch.device):
    """No autograd graph, the RNG state (the CPU's and the device's) as it was after, and the
    generated kernels at every size: the probe proves them, not torch's expression of the op
    that small calls run (codegen/runtime/dispatch.py)."""
    if device.type == "cpu":
        fork = torch.random.fork_rng(devices=[])
    else:
        index = device.index if device.index is not None else getattr(torch, device.type) \
            .current_device()
        fork = torch.random.fork_rng(devices=[index], device_type=device.type)
    with fork, torch.no_grad(), dispatch.forcing("kernels"):
        yield


def probe_input(tail, scales, dtype, device) -> torch.Tensor:
    """A deterministic probe: rows of `tail`'s shape at `scales` (each row shifted off a zero
    mean, which tells a LayerNorm from an RMSNorm), or an activation's grid (scales None)."""
    shape = (*PROBE_ROWS, *tail)
    if scales is None:
        count = math.prod(shape)
        grid = torch.linspace(-ACTIVATION_RANGE, ACTIVATION_RANGE,
                              count - len(ACTIVATION_EXTREMES), dtype=torch.float64)
        x = torch.cat([grid, torch.tensor(ACTIVATION_EXTREMES, dtype=torch.float64)])
    else:
        generator = torch.Generator().manual_seed(SEED)
        x = torch.randn(shape, generator=generator, dtype=torch.float64) + 0.5
        x = x * torch.tensor(scales, dtype=torch.float64).view(-1, *([1] * len(tail)))
    return x.reshape(shape).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Candidate:
    """A configured replacement: `label` names it in the report, `build(module)` makes it from
    the module (or from a probe's copy of it), sharing the module's tensors."""

    label: str
    build: Callable[[torch.nn.Module], torch.nn.Module]
    #: it fixes no width (a LastDimNorm): proven at a second width too (`prove`)
    any_width: bool = False


def prove(module, candidates, tail, scales, dtype, device, evaluate=False, bitwise=False):
    """The first candidate whose outputs match the module's within the dtype's tolerance
    (`difference`) on the probe, with the module's tensors and with perturbed ones; else None
    and why each failed. With `bitwise`, a later candidate that gives the module's outputs bit
    for bit wins over an earlier close one: a bfloat16 LlamaRMSNorm is within tolerance of
    RMSNorm's default casting_mode, but only casting_mode="llama" rounds as it does.
    `evaluate`: the copies probed (and the candidates built from them) are in eval mode.
    A candidate that fixes no width (`Candidate.any_width`) must match at a second width too
    (`other_width`), where the module must run as well: it stands in at any width."""
    with probing(device):
        perturb = any(t.is_floating_point() for t in itertools.chain(module.parameters(),
                                                                     module.buffers()))
        twins = []
        for noise, note in ((None, ""), (Noise(), " with perturbed parameters"))[:1 + perturb]:
            try:
                copied = twin(module, noise, {})
                if evaluate:
                    copied.eval()  # the copies' own training flags: the module keeps its
            except Exception as raised:  # noqa: BLE001 (any failure means: cannot be proven)
                return None, f"it cannot be copied to be probed{note}: {error(raised)}"
            twins.append((copied, note))
        probes: dict[tuple[int, ...], tuple[torch.Tensor, list] | str] = {}

        def probe(shape):
            """The probe input of `shape`'s rows and the twins' outputs, or why none."""
            if shape not in probes:
                x = probe_input(shape, scales, dtype, device)
                at = "" if shape == tuple(tail) else f" of width {shape[-1]}"
                references = []
                for copied, note in twins:
                    try:
                        references.append(copied(x))
                    except Exception as raised:  # noqa: BLE001
                        probes[shape] = (f"its forward raised on the probe input{at}{note}: "
                                         f"{error(raised)}")
                        break
                else:
                    probes[shape] = (x, references)
            return probes[shape]

        first = probe(tuple(tail))
        if isinstance(first, str):
            return None, first
        reasons, close = [], None
        for candidate in candidates:
            problem, exact = None, True
            shapes = [tuple(tail)] + [other_width(tail)] * candidate.any_width
            for shape in shapes:
                found = probe(shape)
                if isinstance(found, str):  # the module fixes its width after all
                    problem = f"cannot be proven at another width: {found}"
                    break
                x, references = found
                at = "" if shape == tuple(tail) else f" at width {shape[-1]}"
                for (copied, note), reference in zip(twins, references, strict=True):
                    try:
                        output = candidate.build(copied)(x)
                    except Exception as raised:  # noqa: BLE001
                        problem = f"raised {error(raised)}"
                    else:
                        problem = difference(reference, output, x, dtype, scales is None)
                        exact = exact and problem is None and torch.equal(output, reference)
                    if problem is not None:
                        problem += at + note
                        break
                if problem is not None:
                    break
            if problem is None and (exact or not bitwise):
                return candidate, None
            if problem is None:
                close = close or candidate
            else:
                reasons.append(f"{candidate.label} {problem}")
        if close is not None:
            return close, None
        return None, "; ".join(reasons)


def other_width(tail) -> tuple[int, ...]:
    """The second probe shape of a candidate that fixes no width: `tail` with another last
    width (PROBE_WIDTH, or five eighths of it where that is the first)."""
    width = PROBE_WIDTH if tail[-1] != PROBE_WIDTH else PROBE_WIDTH * 5 // 8
    return (*tuple(tail)[:-1], width)


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a probe: a few units in the last place of the dtype, and never
    below fp32's (many modules compute in fp32 whatever their dtype, and so do the generated
    ops' accumulators)."""
    return max(2.5 * torch.finfo(dtype).eps, 2e-5)


def difference(reference, output, x, dtype, elementwise: bool) -> str | None:
    """Why `output` is not `reference` within the dtype's tolerance, or None. Elementwise (an
    activation): relative to each value, plus the rounding of the input as computed in fp32.
    Else (a norm, an MLP, a loss): relative to each value plus its row's mean magnitude, as the
    rounding of a sum over the row is."""
    if not isinstance(output, torch.Tensor):
        return f"returned {type(output).__name__}"
    if not isinstance(reference, torch.Tensor):
        return f"cannot be compared: the module returned {type(reference).__name__}"
    if output.shape != reference.shape:
        return f"returned shape {tuple(output.shape)}, the module {tuple(reference.shape)}"
    if output.dtype != reference.dtype:
        return f"returned {output.dtype}, the module {reference.dtype}"
    ref, out = reference.double(), output.double()
    if not (torch.isfinite(ref).all() and torch.isfinite(out).all()):
        return "gave non-finite values on the probe where the module did not" if \
            torch.isfinite(ref).all() else "cannot be compared: the module gave non-finite values"
    rtol = tolerance(dtype)
    floor = rtol * torch.finfo(dtype).smallest_normal
    if elementwise:
        bound = rtol * ref.abs() + 8 * torch.finfo(torch.float32).eps * x.double().abs() + floor
    else:
        bound = rtol * (ref.abs() + ref.abs().mean(-1, keepdim=True)) + floor
    excess = (out - ref).abs() / bound
    worst = int(excess.argmax())
    if excess.reshape(-1)[worst] <= 1:
        return None
    where = f" at input {x.reshape(-1)[worst].item():.3g}" if elementwise else ""
    return (f"differs by {(out - ref).abs().reshape(-1)[worst].item():.3g}{where} where the "
            f"module gives {ref.reshape(-1)[worst].item():.4g} (tolerance "
            f"{bound.reshape(-1)[worst].item():.2g})")


def error(raised: Exception) -> str:
    """An exception as a report names it: its type and the start of its message's first line."""
    message = str(raised).strip().splitlines()
    return f"{type(raised).__name__}: {message[0][:160]}" if message else type(raised).__name__


class Noise:
    """Deterministic perturbations of a module's tensors, one generator per device."""

    def __init__(self):
        self.generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        generator = self.generators.get(tensor.device)
        if generator is None:
            generator = torch.Generator(device=tensor.device).manual_seed(SEED)
            self.generators[tensor.device] = generator
        magnitude = float(torch.linalg.vector_norm(
            tensor.detach(), dtype=torch.promote_types(tensor.dtype, torch.float32)))
        magnitude /= math.sqrt(max(tensor.numel(), 1))
        # half the tensor's own magnitude, and at least half the natural scale of its values:
        # 1 for a per-column parameter (a norm's weight of zeros becomes O(1)), a Linear's
        # init scale 1/sqrt(fan in) for a matrix
        natural = 1 / math.sqrt(tensor.shape[-1]) if tensor.dim() >= 2 and tensor.shape[-1] else 1
        scale = 0.5 * max(magnitude, natural)
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device,
                            dtype=tensor.dtype)
        return tensor.detach() + noise.mul_(scale)


def twin(module, noise, done):
    """A shallow copy of `module` and its descendants to probe: Parameters shared (perturbed
    copies with `noise`), buffers copied, no hooks; the module is left as it is."""
    if id(module) in done:
        return done[id(module)]
    try:
        copied = copy.copy(module)
    except RuntimeError:
        # a parametrized module (torch.nn.utils.parametrize) refuses to be pickled and so to
        # be copied: its attributes are copied as copy.copy copies a plain object's
        copied = type(module).__new__(type(module))
        copied.__dict__.update(module.__dict__)
    done[id(module)] = copied
    state = copied.__dict__
    for name in HOOKS + ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                         "_forward_pre_hooks_with_kwargs"):
        if isinstance(state.get(name), dict):
            state[name] = type(state[name])()
    state["_parameters"] = {n: twin_tensor(p, noise, True)
                            for n, p in module._parameters.items()}
    state["_buffers"] = {n: twin_tensor(b, noise, False) for n, b in module._buffers.items()}
    state["_modules"] = {n: None if m is None else twin(m, noise, done)
                         for n, m in module._modules.items()}
    forward = state.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        # a forward bound to the module on the instance (a Hub layer's, set by kernelize)
        # would compute with the module's tensors: the copy's computes with its own
        state["forward"] = types.MethodType(forward.__func__, copied)
    return copied


def twin_tensor(tensor, noise, parameter):
    if tensor is None:
        return None
    if noise is None or not tensor.is_floating_point():
        return tensor if parameter else tensor.clone()
    values = noise(tensor)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(values, requires_grad=tensor.requires_grad)
    return values


def placement(module, default) -> tuple[torch.dtype, torch.device]:
    """The dtype and device a module computes in: those of its first floating tensor."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return default


def unswappable(module) -> str | None:
    """Why a module cannot be swapped whatever computes it, or None. A Hub layer's forward
    set by kernelize is no reason: the probe measures it as it measures the class's."""
    hooks = [name.strip("_") for name in HOOKS if getattr(module, name, None)]
    if hooks:
        return f"it has hooks ({', '.join(hooks)}), which a replacement would not run"
    forward = module.__dict__.get("forward")
    if forward is not None and hub_layer(module) is None and not (
            isinstance(forward, types.MethodType) and forward.__self__ is module
            and forward.__func__ is getattr(type(module), "forward", None)):
        # (kernelize without a layer for the module binds the class's own forward to it)
        return "its forward is replaced on the instance, which a replacement would not do"
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward inspect cannot read: the probe decides
        return None
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(named) > 1:
        return (f"its forward takes {', '.join(named[1:])} besides the input, which a "
                "replacement would not")
    return None


def persistent_tensors(module) -> list[str]:
    """The names of the tensors a module's state_dict holds, its own (not its children's)."""
    return [*(n for n, p in module._parameters.items() if p is not None),
            *(n for n, b in module._buffers.items()
              if b is not None and n not in module._non_persistent_buffers_set)]


def hub_layer(module):
    """The repository of the Hub layer whose forward `kernels.kernelize` set on `module`
    (`module.forward` the layer's forward bound to the module, `_kernel_repo` its repository),
    or None. transformers decorates its norms, activations and `apply_rotary_pos_emb` so that
    kernelize may do this per instance."""
    state = getattr(module, "__dict__", {})
    forward = state.get("forward")
    if not (isinstance(forward, types.MethodType) and forward.__self__ is module):
        return None
    if "_kernel_repo" in state:
        return state["_kernel_repo"]
    if hasattr(type(module), "kernel_layer_name") \
            and forward.__func__ is not getattr(type(module), "forward", None):
        # kernels before 0.17 records no repository: the layer's class names it
        function = forward.__func__
        return f"{function.__module__}.{function.__qualname__.rpartition('.')[0]}"
    return None


def hub_label(module, where: str | None = None) -> str:
    """What a swap's label adds where `module` (the child `where` of the swapped one) is a Hub
    layer: the swap replaces that layer, not the class's forward."""
    repo = hub_layer(module)
    if repo is None:
        return ""
    return f" in place of Hub layer {repo}" + (f" ({where})" if where else "")


def keywords(function) -> set[str]:
    """The names of the parameters `function` (a function or a class) takes (none where its
    signature cannot be read)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


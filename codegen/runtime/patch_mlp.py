"""The "mlp" kind of `patch_model()`: a gated MLP `down(act(gate(x)) * up(x))` found by its
structure, swapped for a `GatedMLP` whose `act(gate) * up` is one generated op; and, by their
structure too, the stacked experts of transformers' MoE layers, whose class is swapped for one
whose `_apply_gate` is that op (`experts_class`).

The planner asks `replacement` for what stands in for a module (a `GatedMLP` takes the MLP's
place in its parent, as a norm's replacement does), and `plan_experts` for the experts module
it walked into (the same object, its class swapped). Both record their swap or skip through the
`swaps.PlanContext` they are handed.

An MLP is a candidate where it holds three Linear layers whose shapes fit the gated product (or
two, the first computing gate and up as the halves of its output, as Phi-3's `gate_up_proj`),
one activation module and at most one dropout. Its activation is proven against the op's first,
on the activation's grid; then the whole MLP, each layout (which Linear is the gate) and each
set of the op's options the module holds in turn.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import itertools
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from codegen.runtime import probe, swaps

MLP_SCALES = (0.5, 2.0, 8.0)


class GatedMLP(torch.nn.Module):
    """`down(function(gate(x), up(x)))`: a gated MLP whose activation and product are one
    generated op. Its Linear layers (and a dropout before `down`, if the MLP had one) are those
    of the module it replaced, under their names, so the state_dict and every Parameter are
    kept. `half`: where one Linear computes both (Phi-3's `gate_up_proj`, gate and up its name),
    which half of its output is the gate (0: the first)."""

    def __init__(self, function: Callable, layers: list[tuple[str, torch.nn.Module]],
                 gate: str, up: str, down: str, *, half: int | None = None,
                 dropout: str | None = None, options: dict[str, Any] | None = None):
        super().__init__()
        for name, layer in layers:
            self.add_module(name, layer)
        self._function = function
        self._roles = (gate, up, down)
        self._half = half
        self._dropout = dropout
        #: the function's keyword options (Falcon-H1's gate and down multipliers)
        self._options = dict(options or {})

    def forward(self, input):
        gate, up, down = (self._modules[name] for name in self._roles)
        if self._half is None:
            hidden = self._function(gate(input), up(input), **self._options)
        else:
            halves = gate(input).chunk(2, dim=-1)
            hidden = self._function(halves[self._half], halves[1 - self._half], **self._options)
        if self._dropout is not None:
            hidden = self._modules[self._dropout](hidden)
        weight = getattr(down, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point() \
                and weight.dtype != hidden.dtype:
            # the down projection's input in its weight's dtype, as T5 does for an fp32 `wo`
            hidden = hidden.to(weight.dtype)
        return down(hidden)

    def extra_repr(self) -> str:
        gate, up, down = self._roles
        if self._half is None:
            inner = f"{self._function.__name__}({gate}(x), {up}(x))"
        else:
            order = "gate, up" if self._half == 0 else "up, gate"
            inner = f"{self._function.__name__}({order} = {gate}(x).chunk(2, -1))"
        if self._options:
            inner = inner[:-1] + "".join(f", {k}={v!r}" for k, v in self._options.items()) + ")"
        if self._dropout is not None:
            inner = f"{self._dropout}({inner})"
        return f"{down}({inner})"

def replacement(context, module, name):
    """The `GatedMLP` that replaces `module` where it has a gated MLP's structure
    (`_mlp_structure`) and an "mlp" rule's op computes it, its swap recorded in `context` (a
    `swaps.PlanContext`); else None (its skip recorded where it is a candidate)."""
    class_name = type(module).__name__
    rules = [r for r in context.rules if r.kind == "mlp"
             and fnmatch.fnmatchcase(class_name, r.pattern)
             and context.allows("mlp", class_name)]
    structure = _mlp_structure(module) if rules else None
    if structure is None:
        return None
    act_name, act, layouts, dropout = structure
    problem = probe.unswappable(module)
    if problem is None and probe.unswappable(act) is not None:
        problem = f"its activation {act_name}: {probe.unswappable(act)}"
    if problem is not None:
        return context.skip(module, name, problem)
    dtype, device = probe.placement(module, context.default)
    if device.type == "meta":
        return context.skip(module, name, probe.META)
    matching, problems = [], []
    for rule in rules:
        difference = _activation_difference(act, rule.function,
                                            torch.promote_types(dtype, torch.float32), device)
        if difference is None:
            matching.append(rule)
        else:
            problems.append(f"{rule.function.__name__} ({difference})")
    if not matching:
        hub = probe.hub_layer(act)
        hub = f", Hub layer {hub}" if hub is not None else ""
        return context.skip(module, name, f"its activation {act_name} ({type(act).__name__}"
                            f"{hub}) does not compute the activation of "
                            + "; nor of ".join(problems))
    layers = [n for n, _ in module.named_children() if n != act_name]
    candidates = [probe.Candidate(f"GatedMLP({rule.function.__name__}, {layout.label}"
                                  + "".join(f", {k}={v!r}" for k, v in options.items()) + ")",
                                  functools.partial(_build_mlp, rule.function, layout, layers,
                                                    dropout, options))
                  for rule in matching for options in _mlp_options(module, rule.function)
                  for layout in layouts]
    width = module._modules[layouts[0].down].out_features
    # a dropout draws its mask from the RNG: the probe compares the MLPs without it
    return context.prove(module, name, candidates, (width,), MLP_SCALES, dtype, device,
                         evaluate=dropout is not None, note=probe.hub_label(act, act_name))


def plan_experts(context, module, name) -> None:
    """Plan the swap of the gated activation of `module` where it is an experts module of
    transformers' structure (`_experts_structure`): the same object, its class become a
    subclass whose `_apply_gate` is the gated op of an "mlp" rule (`experts_class`), the first
    that both probes prove (`_gate_difference`, `_experts_difference`); the swap or the skip
    recorded in `context` (a `swaps.PlanContext`)."""
    class_name = type(module).__name__
    if "_experts_gate" in type(module).__dict__:
        return  # swapped already
    rules = [r for r in context.rules if r.kind == "mlp"
             and fnmatch.fnmatchcase(class_name, r.pattern)
             and context.allows("mlp", class_name)]
    shape = _experts_structure(module) if rules else None
    if shape is None:
        return
    problem = _experts_unswappable(module)
    if problem is not None:
        context.skip(module, name, problem)
        return
    dtype, device = probe.placement(module, context.default)
    if device.type == "meta":
        context.skip(module, name, probe.META)
        return
    problems = []
    for rule in rules:
        for options in _mlp_options(module, rule.function):
            gate = ExpertsGate(rule.function, tuple(options.items()))
            problem = _gate_difference(module, gate, shape, dtype, device)
            if problem is None:
                cls = experts_class(type(module), gate)
                problem = _experts_difference(module, cls, shape, dtype, device)
            if problem is None:
                context.swap(name, class_name, f"{class_name}({gate.label})"
                             + probe.hub_label(module._modules.get("act_fn"), "act_fn"),
                             (module, "__class__", type(module), cls))
                return
            problems.append(f"{gate.label} {problem}")
    context.skip(module, name, "its experts' gated activation is not computed by "
                 + "; nor by ".join(problems))



def _activation_difference(act, function, dtype, device) -> str | None:
    """How `act` differs from the activation of a gated op (`function(gate, ones)`), or None."""
    with probe.probing(device):
        x = probe.probe_input((probe.PROBE_WIDTH,), None, dtype, device)
        try:
            reference = probe.twin(act, None, {})(x)
            output = function(x, torch.ones_like(x))
        except Exception as error:  # noqa: BLE001
            return f"raised {probe.error(error)}"
        return probe.difference(reference, output, x, dtype, True)


class _Layout(NamedTuple):
    """Which Linear layers of a gated MLP play which role: gate and up are one layer's name
    where it computes both, `half` then the half of its output that is the gate."""

    gate: str
    up: str
    down: str
    half: int | None = None

    @property
    def label(self) -> str:
        if self.half is None:
            return f"gate={self.gate}, up={self.up}"
        return f"gate={self.gate}[{self.half}], up={self.up}[{1 - self.half}]"


def _mlp_structure(module):
    """(activation name, activation, layouts, dropout name or None) where `module` has the
    structure of a gated MLP: three Linear layers whose shapes fit `down(act(gate(x)) * up(x))`
    (or two, the first computing gate and up as the halves of its output, as Phi-3's
    `gate_up_proj`), one activation module holding no tensor, at most one Dropout (applied
    before `down`, as T5's; the probe tells), a forward of one input; else None."""
    children = list(module.named_children())
    linears = [(n, m) for n, m in children if isinstance(m, torch.nn.Linear)]
    dropouts = [n for n, m in children if isinstance(m, torch.nn.Dropout)]
    others = [(n, m) for n, m in children
              if not isinstance(m, (torch.nn.Linear, torch.nn.Dropout))]
    if len(linears) not in (2, 3) or len(others) != 1 or len(dropouts) > 1 \
            or probe.persistent_tensors(module):
        return None
    act_name, act = others[0]
    if any(True for _ in act.children()) or probe.persistent_tensors(act):
        return None
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if len([p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]) != 1:
        return None
    if len(linears) == 3:
        layouts = [_Layout(gate, up, down)
                   for (gate, g), (up, u), (down, d) in itertools.permutations(linears)
                   if g.in_features == u.in_features == d.out_features
                   and g.out_features == u.out_features == d.in_features]
    else:
        layouts = [_Layout(both, both, down, half)
                   for (both, b), (down, d) in itertools.permutations(linears)
                   if b.in_features == d.out_features and b.out_features == 2 * d.in_features
                   for half in (0, 1)]
    return (act_name, act, layouts, dropouts[0] if dropouts else None) if layouts else None


def _mlp_options(module, function) -> list[dict[str, float]]:
    """The keyword options of a gated MLP's `function` to try, first with those the module
    holds as numbers of the same names (Falcon-H1's `gate_multiplier` and `down_multiplier`,
    which its forward applies), then none: the probe tells which computes the module."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return [{}]
    held = {p.name: float(value) for p in parameters
            if p.kind is p.KEYWORD_ONLY and isinstance(p.default, float)
            and isinstance(value := getattr(module, p.name, None), numbers.Real)
            and not isinstance(value, bool) and float(value) != p.default}
    return [held, {}] if held else [{}]


def _build_mlp(function, layout, layer_names, dropout, options, module):
    return GatedMLP(function, [(n, module._modules[n]) for n in layer_names], layout.gate,
                    layout.up, layout.down, half=layout.half, dropout=dropout,
                    options=options).train(module.training)



# MoE experts: transformers 5 keeps the experts of an MoE layer in one module
# (`@use_experts_implementation`: Mixtral's, Qwen3-MoE's, DeepSeek-V3's and some sixty more
# families' `*Experts`), every expert's gate and up projections stacked in one 3-D Parameter
# `gate_up_proj` and its down projections in `down_proj`. The routing is the caller's (the
# module takes the hidden states, each token's expert indices and routing weights), and so is
# the matrix product: an eager loop over the experts hit, or `batched_mm`, `grouped_mm` and the
# other forwards of transformers' experts interface, chosen at each call by the config's
# `_experts_implementation`. Those compute `act(gate) * up` through the module's `_apply_gate`;
# most families' eager loop computes it inline. A swap makes the module's `_apply_gate` the
# generated gated op and, where the eager loop computes it inline, runs an eager loop that
# calls `_apply_gate` (`_eager_experts`) where the config asks for eager: the weights, the
# routing and every other step are the module's own.


#: how many experts the probe of an experts module keeps: the first ones (each computes as the
#: others do, and a float64 copy of every expert would cost the whole module's weights over)
PROBE_EXPERTS = 4
#: experts each probe token is routed to (fewer where the probe keeps fewer experts)
PROBE_TOP_K = 2
#: the Parameters of an experts module: gate and up of every expert as the two halves (gate
#: first) of one (experts, 2 x intermediate, width) tensor, down as (experts, width,
#: intermediate); both transposed where the module's `is_transposed` is set
EXPERTS_WEIGHTS = ("gate_up_proj", "down_proj")
#: the experts implementations that run the module's own eager forward
EAGER = (None, "eager")


@dataclass(frozen=True)
class ExpertsGate:
    """What a swapped experts module's `_apply_gate` computes: `function(gate, up, **options)`
    of the two halves of each expert's gate_up projection, the first half the gate."""

    function: Callable
    options: tuple[tuple[str, float], ...] = ()

    def __call__(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.function(gate, up, **dict(self.options))

    @property
    def label(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options)
        return f"{self.function.__name__}(gate, up = gate_up_proj(x).chunk(2, -1){options})"


class _ExpertsShape(NamedTuple):
    """The number of experts of an experts module and its hidden width."""

    count: int
    width: int


def _experts_structure(module) -> _ExpertsShape | None:
    """The shape of `module` where it is an experts module whose experts are gated: 3-D
    floating Parameters `gate_up_proj` (experts, 2 x intermediate, width) and `down_proj`
    (experts, width, intermediate) (both transposed where its `is_transposed` is set), a
    `_apply_gate` method and no `has_gate` set false (transformers' `@use_experts_implementation`
    structure, whatever the class is called); else None. What the module computes is the
    probes' to say."""
    tensors = [module._parameters.get(name) for name in EXPERTS_WEIGHTS]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_floating_point()
               for t in tensors):
        return None
    if getattr(module, "has_gate", True) is False \
            or not callable(getattr(module, "_apply_gate", None)):
        return None
    gate_up, down = tensors
    count = gate_up.shape[0]
    if getattr(module, "is_transposed", False):
        width, double = gate_up.shape[1:]
        fits = tuple(down.shape) == (count, double // 2, width)
    else:
        double, width = gate_up.shape[1:]
        fits = tuple(down.shape) == (count, width, double // 2)
    if not fits or double % 2 or not count or not width:
        return None
    return _ExpertsShape(count, width)


def _experts_unswappable(module) -> str | None:
    """Why the class of experts module `module` cannot be swapped whatever it computes. Its own
    hooks are none: the module stays, and so do they; a child's hooks are (the swapped gate
    calls no activation module)."""
    for child_name, child in module.named_children():
        hooks = [name.strip("_") for name in probe.HOOKS if getattr(child, name, None)]
        if hooks:
            return f"its {child_name} has hooks ({', '.join(hooks)}), which the swapped " \
                   "gated activation may not run"
    for name in ("forward", "_apply_gate"):
        if name in module.__dict__:
            return f"its {name} is replaced on the instance, which the swapped class would " \
                   "not see"
    return None


def _experts_implementation(module):
    """The experts implementation `module`'s config asks for (None where it has none)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _gates_through_apply_gate(original: type) -> bool:
    """Whether the eager forward of experts class `original` (the one its experts interface
    falls back to) computes the gated activation by `self._apply_gate`, rather than inline."""
    eager = inspect.unwrap(original.forward)
    return "_apply_gate" in getattr(getattr(eager, "__code__", None), "co_names", ())


def _expert_linear(self, input, name, expert):
    """`input` times expert `expert`'s weight `name` (and its bias where the module has
    them), as transformers' eager loops compute it."""
    weight = getattr(self, name)[expert]
    bias = getattr(self, f"{name}_bias")[expert] if getattr(self, "has_bias", False) else None
    if getattr(self, "is_transposed", False):
        output = input @ weight
        return output if bias is None else output + bias
    return torch.nn.functional.linear(input, weight, bias)


def _eager_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager loop over the experts hit (`MixtralExperts.forward`'s, with the
    transposed weights, biases and post-expert norm its experts interface knows), the gated
    activation computed by `self._apply_gate`."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current = _expert_linear(self, hidden_states[token_idx], "gate_up_proj", expert_idx)
        current = self._apply_gate(current)
        current = _expert_linear(self, current, "down_proj", expert_idx)
        if getattr(self, "has_post_expert_norm", False):
            current = self.post_expert_norm(current)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _swapped_apply_gate(self, gate_up):
    return type(self)._experts_gate(gate_up)


def _experts_forward(original: type) -> Callable:
    """The forward of a swapped experts class whose eager forward computes its activation
    inline: `_eager_experts` where the config asks for eager (or the class dispatches on no
    implementation), else the class's forward, whose implementation calls `_apply_gate`."""
    dispatches = inspect.unwrap(original.forward) is not original.forward

    def forward(self, *args, **kwargs):
        if not dispatches or _experts_implementation(self) in EAGER:
            return _eager_experts(self, *args, **kwargs)
        return original.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(original.forward)
    forward.__doc__ = original.forward.__doc__
    forward.__qualname__ = f"{original.__qualname__}.forward"
    return forward


_EXPERTS_CLASSES: dict[tuple[type, ExpertsGate], type] = {}


def experts_class(original: type, gate: ExpertsGate) -> type:
    """The subclass of experts class `original` whose `_apply_gate` is `gate` (and whose
    forward runs `_eager_experts` in eager mode where the original's computes the activation
    inline), one per class and gate: same name, module and signature, so that what finds the
    experts by class name (device maps, wrapping policies, transformers' implementation
    switch) still does; pickled as the original class and the gate."""
    key = (original, gate)
    cls = _EXPERTS_CLASSES.get(key)
    if cls is not None:
        return cls
    namespace = {"_apply_gate": _swapped_apply_gate, "_experts_gate": gate,
                 "_experts_original": original}
    if not _gates_through_apply_gate(original):
        namespace["forward"] = _experts_forward(original)
    cls = _EXPERTS_CLASSES[key] = swaps.swapped_class(original, experts_class, gate, namespace)
    return cls


class _ConfigView:
    """A module's config as a probe's copy of the module reads it: `_experts_implementation`
    the one the probe runs, anything else the config's (which is left as it is)."""

    def __init__(self, config, implementation):
        self._config = config
        self._experts_implementation = implementation

    def __getattr__(self, name):
        return getattr(self.__dict__["_config"], name)


def _experts_twin(module, noise, shape, dtype, implementation):
    """A probe copy of experts module `module` (`probe.twin`) holding copies of its tensors, and of
    its children's, in `dtype` (perturbed with `noise`), every floating Parameter requiring
    its gradient; only the first PROBE_EXPERTS experts where the module counts them in
    `num_experts`; running `implementation` of its experts interface."""
    twin = probe.twin(module, None, {})
    keep = shape.count
    if getattr(module, "num_experts", None) == shape.count:
        keep = min(shape.count, PROBE_EXPERTS)
        twin.__dict__["num_experts"] = keep
    for owner in twin.modules():
        for store in (owner._parameters, owner._buffers):
            for key, tensor in list(store.items()):
                if tensor is None:
                    continue
                value = tensor.detach()
                if owner is twin and value.dim() and value.shape[0] == shape.count:
                    value = value[:keep]
                if value.is_floating_point():
                    value = value.to(dtype)
                    value = noise(value) if noise is not None else value.clone()
                else:
                    value = value.clone()
                store[key] = (torch.nn.Parameter(value, requires_grad=value.is_floating_point())
                              if isinstance(tensor, torch.nn.Parameter) else value)
    twin.__dict__["config"] = _ConfigView(module.__dict__.get("config"), implementation)
    return twin, keep


def _experts_run(module, inputs, gradients: bool):
    """The output of experts module `module` on the probe `inputs` and, with `gradients`, the
    gradients of the hidden states, of the routing weights and of every Parameter."""
    hidden, index, weights, grad = inputs
    hidden = hidden.clone().requires_grad_(gradients)
    weights = weights.clone().requires_grad_(gradients)
    output = module(hidden, index, weights)
    if not gradients or not isinstance(output, torch.Tensor):
        return output, {}
    leaves = {"the hidden states": hidden, "the routing weights": weights,
              **{name: p for name, p in module.named_parameters() if p.requires_grad}}
    grads = torch.autograd.grad(output, list(leaves.values()), grad, allow_unused=True)
    return output.detach(), {name: torch.zeros_like(leaf) if g is None else g
                             for (name, leaf), g in zip(leaves.items(), grads, strict=True)}


def _experts_probe(shape, keep, dtype, device):
    """An experts module's probe: hidden states of its width (`probe.probe_input`'s 12 rows at
    MLP_SCALES), each token routed to PROBE_TOP_K consecutive experts of the `keep` first with
    random softmax weights, and the gradient of the output."""
    hidden = probe.probe_input((shape.width,), MLP_SCALES, dtype, device).reshape(-1, shape.width)
    tokens, top_k = hidden.shape[0], min(PROBE_TOP_K, keep)
    index = (torch.arange(tokens)[:, None] + torch.arange(top_k)[None, :]) % keep
    generator = torch.Generator().manual_seed(probe.SEED + 1)
    weights = torch.randn((tokens, top_k), generator=generator, dtype=torch.float64).softmax(-1)
    grad = torch.randn((tokens, shape.width), generator=generator, dtype=torch.float64)
    return (hidden, index.to(device), weights.to(device=device, dtype=dtype),
            grad.to(device=device, dtype=dtype))


def _gate_difference(module, gate, shape, dtype, device) -> str | None:
    """How `gate` differs from experts module `module`'s own `_apply_gate` on a gate_up probe
    whose halves are the activation's grid (out to ±100, where a clamped gate or up shows),
    or None: in float64 the output and gradient, in the module's dtype the output."""
    with probe.probing(device), torch.enable_grad():
        for probe_dtype in dict.fromkeys((torch.float64, dtype)):
            at = f" (its gate_up in {str(probe_dtype).removeprefix('torch.')})"
            gradients = probe_dtype == torch.float64
            twin, _ = _experts_twin(module, None, shape, probe_dtype, None)
            grid = probe.probe_input((probe.PROBE_WIDTH,), None, probe_dtype, device).reshape(
                -1, probe.PROBE_WIDTH)
            gate_up = torch.cat([grid, grid.flip(0, 1)], dim=-1).requires_grad_(gradients)
            try:
                reference = twin._apply_gate(gate_up)
            except Exception as error:  # noqa: BLE001
                return f"cannot be proven: its _apply_gate raised on the probe{at}: " \
                       f"{probe.error(error)}"
            try:
                output = gate(gate_up)
            except Exception as error:  # noqa: BLE001
                return f"raised {probe.error(error)}{at}"
            problem = probe.difference(reference, output, grid, probe_dtype, True)
            if problem is None and gradients:
                generator = torch.Generator().manual_seed(probe.SEED)
                grad = torch.randn(output.shape, generator=generator, dtype=torch.float64).to(
                    device=device, dtype=probe_dtype)
                try:
                    (want,) = torch.autograd.grad(reference, gate_up, grad)
                    (got,) = torch.autograd.grad(output, gate_up, grad)
                except Exception as error:  # noqa: BLE001
                    return f"cannot be proven: the gradient raised{at}: {probe.error(error)}"
                problem = probe.difference(want, got, gate_up.detach(), probe_dtype, True)
                problem = problem and f"gives a gradient that {problem}"
            if problem is not None:
                return problem + at
    return None


def _experts_difference(module, cls, shape, dtype, device) -> str | None:
    """How experts module `module` swapped to `cls` differs from the module on
    `_experts_probe`, with its own tensors and with perturbed ones, or None: in float64, the
    output and the gradients of the hidden states, of the routing weights and of every
    Parameter, in eager mode and in the implementation the config asks for (`batched_mm` in
    its place where the module cannot run that in float64: grouped_mm's kernels take 16- and
    32-bit floats alone); in the module's dtype, the output in that implementation."""
    current = _experts_implementation(module)
    plans = [(("eager",), torch.float64, True)]
    if current not in EAGER:
        plans.append(((current, "batched_mm"), torch.float64, True))
    if dtype != torch.float64:
        plans.append(((current if current not in EAGER else "eager",), dtype, False))
    with probe.probing(device), torch.enable_grad():
        for noise, note in ((None, ""), (probe.Noise, " with perturbed parameters")):
            for implementations, probe_dtype, gradients in plans:
                for implementation in implementations:
                    where = f" ({implementation or 'eager'} experts, " \
                            f"{str(probe_dtype).removeprefix('torch.')}{note})"
                    try:
                        twin, keep = _experts_twin(module, noise and noise(), shape,
                                                   probe_dtype, implementation)
                        swapped = copy.copy(twin)
                        swapped.__class__ = cls
                    except Exception as error:  # noqa: BLE001
                        return f"cannot be proven: it cannot be copied to be probed{where}: " \
                               f"{probe.error(error)}"
                    inputs = _experts_probe(shape, keep, probe_dtype, device)
                    try:
                        reference, want = _experts_run(twin, inputs, gradients)
                    except Exception as error:  # noqa: BLE001
                        if implementation != implementations[-1]:
                            continue  # the next stands in
                        if len(implementations) > 1:
                            break  # none runs in float64: the module's dtype's probe decides
                        return f"cannot be proven: its forward raised on the probe{where}: " \
                               f"{probe.error(error)}"
                    try:
                        output, got = _experts_run(swapped, inputs, gradients)
                    except Exception as error:  # noqa: BLE001
                        return f"raised {probe.error(error)}{where}"
                    problem = probe.difference(reference, output, None, probe_dtype, False)
                    for name in want if problem is None else ():
                        problem = probe.difference(want[name], got.get(name), None,
                                                   probe_dtype, False)
                        if problem is not None:
                            problem = f"gives a gradient of {name} that {problem}"
                            break
                    if problem is not None:
                        return problem + where
                    break  # proven in this implementation
    return None


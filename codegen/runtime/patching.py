"""`patch_model()`: swap a model's modules for generated ones, each swap proven by behaviour.

The rule table (`generated/patch.py`, one row per `Replaces` a spec declares) says which
generated op may stand in for what: a norm or an activation module found by class name, a gated
MLP `down(act(gate(x)) * up(x))` found by its structure (and, by theirs, the stacked experts
of transformers' MoE layers, whose `act(gate) * up` the op computes: `experts_class`), a
Hugging Face causal-LM loss, the residual add before a norm inside a transformer layer
(codegen/runtime/patch_layers.py). A
candidate is swapped only if its replacement computes the same outputs as the module on a small
deterministic probe input, once with the module's own tensors and once with perturbed copies
of them (so that a weight of ones or zeros cannot hide how the weight is used). The
configuration of a replacement (an offset of the weight, a weight or none, a weight held as a
buffer, eps where the module keeps none) is the first the probe accepts, so the behaviour, not
the name, decides. A module whose forward `kernels.kernelize` replaced by a Hub layer's (as
transformers' decorated norms and activations may be) is probed with that forward: it is
swapped where the replacement computes what the Hub layer does, the report naming the layer.

Probes run on shallow copies of the modules (their Parameters shared, their buffers copied, no
hooks), under `torch.no_grad()` and a forked RNG: the model, its training mode and the RNG
state are left as they were. Every replacement is built before any is assigned, and an
exception while assigning restores the ones already assigned.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import inspect
import itertools
import math
import numbers
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from codegen.runtime import dispatch, linear_loss, logits_route, patch_layers, patch_rotary

#: what a rule swaps; `patch_model(include=..., exclude=...)` names these
KINDS = ("norm", "activation", "mlp", "residual", "rotary", "loss")
#: the kinds swapped unless `include` says otherwise (a loss only when asked for)
DEFAULT_KINDS = ("norm", "activation", "mlp", "residual", "rotary")
#: where a module keeps its eps, in the order looked up
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
#: eps values tried (after the op's default) for a norm that keeps none as an attribute
EPS_TRIES = (1e-5, 1e-6)
#: the hook dicts of a module that a replacement would not carry over
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
         "_load_state_dict_post_hooks")
#: seed of the probe inputs and of the perturbation of a module's tensors
SEED = 0x5EED
#: leading dims of a probe input: 12 rows, 4-d so that a module that branches on the input's
#: rank (a channels-first norm) shows it
PROBE_ROWS = (2, 2, 3)
#: per-row scales of a norm's probe rows (the small ones tell eps values apart: 1e-5 from 1e-6)
#: and of an MLP's (the large ones reach the activation's nonlinear range)
NORM_SCALES = (1.0, 1e-3, 1e-4)
MLP_SCALES = (0.5, 2.0, 8.0)
#: the width of a probe where the module does not fix one (an activation, a weightless norm)
PROBE_WIDTH = 64
#: an activation's probe: a grid over where GELUs and SiLUs differ, plus large values where a
#: clipped activation shows itself
ACTIVATION_RANGE = 8.0
ACTIVATION_EXTREMES = (-100.0, -50.0, -20.0, -12.0, 12.0, 20.0, 50.0, 100.0)
#: vocabulary and rows of a loss's probe
LOSS_CLASSES = 13
LOSS_SHAPE = (2, 6)


@dataclass(frozen=True)
class Rule:
    """One row of the rule table: `kind` of what is swapped, `pattern` of its class name, the
    generated `module` (None for an MLP or a loss) and `function` that stand in; for a norm its
    parameters as (name, constructor flag, offset option), the option values to `tries`, the
    op's default `eps` and its `memory` modes."""

    kind: str
    pattern: str
    module: type | None
    function: Callable
    params: tuple[tuple[str, str | None, str | None], ...] = ()
    tries: tuple[tuple[str, tuple[float | str, ...]], ...] = ()
    eps: float | None = None
    memory: tuple[str, ...] = ()


class Swap(NamedTuple):
    """A swapped module: its qualified name, its class and what replaced it."""

    name: str
    old: str
    new: str


class Skip(NamedTuple):
    """A candidate left in place: its qualified name, its class and why."""

    name: str
    old: str
    reason: str


class PatchError(RuntimeError):
    """`patch_model(..., strict=True)` met a candidate it cannot swap."""


class PatchReport(Mapping):
    """What `patch_model()` did. `swapped`: (qualified name, old class, new class) per swapped
    module; `skipped`: (qualified name, class, reason) per candidate left in place. As a
    mapping (and `counts`): how many modules of each old class were swapped."""

    def __init__(self, swapped: list[Swap], skipped: list[Skip]):
        self.swapped = list(swapped)
        self.skipped = list(skipped)

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for swap in self.swapped:
            counts[swap.old] = counts.get(swap.old, 0) + 1
        return counts

    def __getitem__(self, old_class: str) -> int:
        return self.counts[old_class]

    def __iter__(self):
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)

    def __repr__(self) -> str:
        return f"PatchReport(counts={self.counts}, skipped={len(self.skipped)})"

    def __str__(self) -> str:
        lines = [f"swapped {s.name}: {s.old} -> {s.new}" for s in self.swapped]
        lines += [f"skipped {s.name} ({s.old}): {s.reason}" for s in self.skipped]
        return "\n".join(lines) or "nothing to swap"


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


class LastDimNorm(torch.nn.Module):
    """A weightless norm over the input's last dim, whatever its width: what stands in for a
    module that fixes no width (no normalized_shape, no weight)."""

    def __init__(self, function: Callable, eps, options: dict[str, Any]):
        super().__init__()
        self._function = function
        self.eps = eps
        self.options = dict(options)

    def forward(self, input):
        return self._function(input, input.shape[-1:], eps=self.eps, **self.options)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"{self._function.__name__}, eps={self.eps}{options}"


def causal_lm_loss(cross_entropy: Callable, logits, labels, vocab_size, num_items_in_batch=None,
                   ignore_index=-100, shift_labels=None, **kwargs):
    """transformers' `ForCausalLMLoss` computed by `cross_entropy`: float32 logits, labels
    shifted one left (unless `shift_labels` is given), the mean over the counted tokens, or the
    sum over `num_items_in_batch`. Other keyword arguments are ignored, as transformers does."""
    logits = logits.float()
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def patch_model(model, rules: tuple[Rule, ...], *, include=None, exclude=None, loss=False,
                strict=False, memory=None, bitwise=False) -> PatchReport:
    """`generated.patch.patch_model` with the rule table given (see its docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("patch_model(): argument 'model' must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for name, value in (("loss", loss), ("strict", strict), ("bitwise", bitwise)):
        if not isinstance(value, bool):
            raise TypeError(f"patch_model(): argument '{name}' must be bool, got "
                            f"{type(value).__name__}")
    modes = list(dict.fromkeys(mode for rule in rules for mode in rule.memory))
    if memory is not None and memory not in modes:
        raise ValueError(f"patch_model(): argument 'memory' must be None or one of "
                         f"{', '.join(map(repr, modes))}, got {memory!r}")
    selection = _Selection(include, exclude, loss)
    selection.check(model, rules)
    planner = _Planner(model, rules, selection, strict, memory, bitwise)
    planner.visit(model, "")
    planner.visit_losses(model)
    _assign(planner.assignments, planner.losses)
    return PatchReport(planner.swapped, planner.skipped)


class _Selection:
    """Which candidates `include` and `exclude` let through: by kind or by class name."""

    def __init__(self, include, exclude, loss):
        self.include = _names("include", include)
        self.exclude = _names("exclude", exclude) or ()
        #: the names the caller gave, by argument (`check`)
        self.given = {"include": self.include or (), "exclude": self.exclude}
        if self.include is None:
            self.include = DEFAULT_KINDS
        if loss:
            self.include = (*self.include, "loss")

    def allows(self, kind: str, class_name: str) -> bool:
        return _named(kind, class_name, self.include) and not _named(kind, class_name,
                                                                     self.exclude)

    def check(self, model, rules) -> None:
        """Raise ValueError for a name given in `include` or `exclude` that is no kind and
        matches no name a candidate of `model` could have: the class name of one of its
        modules (the model's own included), or the name of one of its losses
        (`_loss_names`). Such a name selects nothing: a misspelt kind or class name would
        otherwise leave the swaps it meant to select or keep silently undone."""
        known: set[str] | None = None
        for argument, names in self.given.items():
            patterns = [name for name in dict.fromkeys(names) if name not in KINDS]
            if not patterns:
                continue
            if known is None:  # walked once, and only where a name needs it
                known = {type(module).__name__ for module in model.modules()}
                known |= _loss_names(model, rules)
            unknown = [name for name in patterns
                       if not any(fnmatch.fnmatchcase(k, name) for k in known)]
            if unknown:
                raise ValueError(
                    f"patch_model(): argument '{argument}' names "
                    f"{', '.join(map(repr, unknown))}, which "
                    + ("is" if len(unknown) == 1 else "are")
                    + f" no kind ({', '.join(KINDS)}) and match"
                    + ("es" if len(unknown) == 1 else "")
                    + " the class name of no module of the model nor the name of its loss")


def _names(argument: str, value) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"patch_model(): argument '{argument}' must be a str or an iterable of "
                        f"str, got {type(value).__name__}") from None
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"patch_model(): argument '{argument}' must hold kinds "
                            f"({', '.join(KINDS)}) or class-name patterns (str), got "
                            f"{type(item).__name__}")
    return items


def _named(kind: str, class_name: str, names: tuple[str, ...]) -> bool:
    return any(name == kind if name in KINDS else fnmatch.fnmatchcase(class_name, name)
               for name in names)


class _Planner:
    """Walks the model, proves each candidate's replacement and records the assignments; it
    changes nothing itself."""

    def __init__(self, model, rules, selection, strict, memory, bitwise=False):
        self.rules, self.selection, self.strict, self.memory = rules, selection, strict, memory
        self.bitwise = bitwise
        self.own = tuple({r.module for r in rules if r.module is not None}) + (GatedMLP,
                                                                             LastDimNorm)
        reference = next((t for t in itertools.chain(model.parameters(), model.buffers())
                          if t.is_floating_point()), None)
        self.default = ((reference.dtype, reference.device) if reference is not None
                        else (torch.float32, torch.device("cpu")))
        self.assignments: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] = []
        self.losses: list[tuple[torch.nn.Module, Callable]] = []
        self.swapped: list[Swap] = []
        self.skipped: list[Skip] = []
        self.done: dict[int, torch.nn.Module | None] = {}
        #: the Hub layers visited and left in place (excluded, or not proven): a fused layer
        #: must not compute one without calling it (`replacement`)
        self.kept: set[int] = set()

    def visit(self, parent: torch.nn.Module, prefix: str) -> None:
        """Plan the swaps of `parent`'s descendants, not looking into what is swapped."""
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in self.done:  # a module reached twice keeps one replacement
                new = self.done[id(child)]
                if new is not None:
                    self.assignments.append((parent, name, child, new))
                continue
            new = None if isinstance(child, self.own) else self.replacement(child, prefix + name)
            self.done[id(child)] = new
            if new is None and hub_layer(child) is not None:
                self.kept.add(id(child))
            if new is not None:
                self.assignments.append((parent, name, child, new))
            elif not isinstance(child, self.own):
                self.visit(child, prefix + name + ".")
                # an MoE experts module's act(gate) * up (same object, its class swapped)
                self.plan_experts(child, prefix + name)
                # after its children: a layer's fused add reuses its norm's proven swap
                patch_layers.plan(self, child, prefix + name)
                # an attention's rotary embedding, by its forward's apply_rotary_pos_emb
                patch_rotary.plan(self, child, prefix + name)

    def replacement(self, module, name):
        """What replaces `module`, or None (its skip recorded where it is a candidate)."""
        class_name = type(module).__name__
        if id(module) in self.kept:
            # asked again by a layer's fusion (codegen/runtime/patch_layers.py), which would
            # compute the norm without calling it: the Hub layer the walk kept stays called
            return self.skip(module, name, f"its forward is Hub layer {hub_layer(module)}'s, "
                                           "which stays in place (excluded, or not proven)")
        for kind in ("norm", "activation"):
            rules = [r for r in self.rules if r.kind == kind
                     and fnmatch.fnmatchcase(class_name, r.pattern)
                     and self.selection.allows(kind, class_name)]
            if rules:
                return self.swap_named(module, name, kind, rules)
        rules = [r for r in self.rules if r.kind == "mlp"
                 and fnmatch.fnmatchcase(class_name, r.pattern)
                 and self.selection.allows("mlp", class_name)]
        structure = _mlp_structure(module) if rules else None
        if structure is not None:
            return self.swap_mlp(module, name, rules, *structure)
        return None

    def swap_named(self, module, name, kind, rules):
        problem = _unswappable(module)
        if problem is None and any(True for _ in module.children()):
            problem = "it has submodules, which no replacement holds"
        if problem is None and kind == "activation" and _persistent_tensors(module):
            problem = ("it holds tensors (" + ", ".join(_persistent_tensors(module))
                       + "), which no replacement holds")
        if problem is not None:
            return self.skip(module, name, problem)
        dtype, device = _placement(module, self.default)
        if kind == "activation":
            # an activation holds no dtype of its own: it is probed in fp32 (fp64 in an fp64
            # model), where what it computes shows, not how a low precision rounds it
            dtype = torch.promote_types(dtype, torch.float32)
            single = _single_op(module, dtype, device) if device.type != "meta" else None
            if single is not None:
                return self.skip(module, name, f"it runs one torch op already ({single}), one "
                                 "kernel each way: a swap would fuse nothing and add host time "
                                 "to every call", needless=True)
            candidates = [_Candidate(r.module.__name__, functools.partial(_build_activation, r))
                          for r in rules]
            tail, scales = (PROBE_WIDTH,), None
        else:
            candidates, problems, tail = [], [], None
            for rule in rules:
                found, problem, shape = _norm_candidates(rule, module, self.memory)
                candidates += found
                problems += [problem] if problem else []
                tail = tail or shape
            if not candidates:
                return self.skip(module, name, "; ".join(dict.fromkeys(problems)))
            tail, scales = tail or (PROBE_WIDTH,), NORM_SCALES
        return self.prove(module, name, candidates, tail, scales, dtype, device)

    def swap_mlp(self, module, name, rules, act_name, act, layouts, dropout):
        problem = _unswappable(module)
        if problem is None and _unswappable(act) is not None:
            problem = f"its activation {act_name}: {_unswappable(act)}"
        if problem is not None:
            return self.skip(module, name, problem)
        dtype, device = _placement(module, self.default)
        if device.type == "meta":
            return self.skip(module, name, _META)
        matching, problems = [], []
        for rule in rules:
            difference = _activation_difference(act, rule.function,
                                                torch.promote_types(dtype, torch.float32), device)
            if difference is None:
                matching.append(rule)
            else:
                problems.append(f"{rule.function.__name__} ({difference})")
        if not matching:
            hub = f", Hub layer {hub_layer(act)}" if hub_layer(act) is not None else ""
            return self.skip(module, name, f"its activation {act_name} ({type(act).__name__}"
                             f"{hub}) does not compute the activation of "
                             + "; nor of ".join(problems))
        layers = [n for n, _ in module.named_children() if n != act_name]
        candidates = [_Candidate(f"GatedMLP({rule.function.__name__}, {layout.label}"
                                 + "".join(f", {k}={v!r}" for k, v in options.items()) + ")",
                                 functools.partial(_build_mlp, rule.function, layout, layers,
                                                   dropout, options))
                      for rule in matching for options in _mlp_options(module, rule.function)
                      for layout in layouts]
        width = module._modules[layouts[0].down].out_features
        # a dropout draws its mask from the RNG: the probe compares the MLPs without it
        return self.prove(module, name, candidates, (width,), MLP_SCALES, dtype, device,
                          evaluate=dropout is not None, note=hub_label(act, act_name))

    def plan_experts(self, module, name) -> None:
        """Plan the swap of the gated activation of `module` where it is an experts module of
        transformers' structure (`_experts_structure`): the same object, its class become a
        subclass whose `_apply_gate` is the gated op of an "mlp" rule (`experts_class`), the
        first that both probes prove (`_gate_difference`, `_experts_difference`)."""
        class_name = type(module).__name__
        if "_experts_gate" in type(module).__dict__:
            return  # swapped already
        rules = [r for r in self.rules if r.kind == "mlp"
                 and fnmatch.fnmatchcase(class_name, r.pattern)
                 and self.selection.allows("mlp", class_name)]
        shape = _experts_structure(module) if rules else None
        if shape is None:
            return
        problem = _experts_unswappable(module)
        if problem is not None:
            self.skip(module, name, problem)
            return
        dtype, device = _placement(module, self.default)
        if device.type == "meta":
            self.skip(module, name, _META)
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
                    self.assignments.append((module, "__class__", type(module), cls))
                    self.swapped.append(Swap(name, class_name, f"{class_name}({gate.label})"
                                             + hub_label(module._modules.get("act_fn"),
                                                         "act_fn")))
                    return
                problems.append(f"{gate.label} {problem}")
        self.skip(module, name, "its experts' gated activation is not computed by "
                  + "; nor by ".join(problems))

    def prove(self, module, name, candidates, tail, scales, dtype, device, evaluate=False,
              note=""):
        """Swap `module` for the first of `candidates` the probe proves; `note` ends the
        label (a Hub layer inside the module that the replacement computes)."""
        if device.type == "meta":
            return self.skip(module, name, _META)
        # the probe measures what the module computes now: a Hub layer's forward where
        # kernels' kernelize set one (`_twin` binds it to the probe's copies)
        winner, reason = _prove(module, candidates, tail, scales, dtype, device, evaluate,
                                self.bitwise)
        if winner is None:
            if hub_layer(module) is not None:
                reason = f"its forward is Hub layer {hub_layer(module)}'s: {reason}"
            return self.skip(module, name, reason)
        new = winner.build(module)
        self.swapped.append(Swap(name, type(module).__name__,
                                 winner.label + hub_label(module) + note))
        return new


    def skip(self, module, name, reason, old=None, needless=False):
        """Record why `module` (of class `old`, its class name by default) is left in place,
        or raise with `strict` (but for a `needless` swap, one that could only be slower);
        return None."""
        skip = Skip(name, old or type(module).__name__, reason)
        if self.strict and not needless:
            raise PatchError(f"patch_model(): {name} ({skip.old}) cannot be swapped: {reason}")
        self.skipped.append(skip)
        return None

    def visit_losses(self, model):
        """Plan the loss swaps of the language models in `model` (itself included)."""
        rules = [r for r in self.rules if r.kind == "loss"]
        for prefix, module in model.named_modules():
            matching = [r for r in rules if fnmatch.fnmatchcase(type(module).__name__, r.pattern)]
            route, old = _loss_route(module) if matching else (None, None)
            if route == "logits":
                self.visit_logits_loss(module, prefix, matching, old)
                continue
            if route is None:
                continue
            name = f"{prefix}.loss_function" if prefix else "loss_function"
            original = module.loss_function
            if (isinstance(original, functools.partial) and original.func is causal_lm_loss) \
                    or linear_loss.is_route(original) or not self.selection.allows("loss", old):
                continue
            dtype, device = _placement(module, self.default)
            problems = []
            for rule in matching:
                candidate = functools.partial(causal_lm_loss, rule.function)
                candidate.replaces = old  # its name in a later call's include and exclude
                problem = _loss_difference(original, candidate, dtype, device)
                if problem is None:
                    # the training loss from the hidden states where the forward's structure
                    # allows (linear_loss.CausalLMRoute), else from the logits
                    linear = linear_loss.linear_function(rule.function)
                    why = linear_loss.route_problem(module, linear, candidate, dtype, device)
                    if why is None:
                        install = functools.partial(linear_loss.install, linear=linear,
                                                    fallback=candidate)
                        new = f"{linear.__name__}(hidden states, lm_head)"
                    else:
                        self.skip(module, f"{prefix}.forward" if prefix else "forward",
                                  f"its training loss is computed from the whole logits: {why}")
                        install = functools.partial(_set_loss, function=candidate)
                        new = f"causal_lm_loss({rule.function.__name__})"
                    self.losses.append((module, install))
                    self.swapped.append(Swap(name, old, new))
                    break
                problems.append(problem)
            else:
                self.skip(module, name, "; ".join(dict.fromkeys(problems)), old)


    def visit_logits_loss(self, module, prefix, rules, old="CrossEntropyLoss"):
        """Plan the loss swap of a model whose forward takes the cross-entropy of its logits
        itself (a masked LM's), or through a `loss_function` that does (ModernBERT's
        `ForMaskedLMLoss`; `old`, its name): the training loss from the labelled rows' hidden
        states (codegen/runtime/logits_route.py)."""
        name = f"{prefix}.forward" if prefix else "forward"
        if logits_route.is_route(module.forward) or not self.selection.allows("loss", old):
            return
        dtype, device = _placement(module, self.default)
        problems = []
        for rule in rules:
            linear = linear_loss.linear_function(rule.function)
            problem = logits_route.route_problem(module, linear, dtype, device)
            if problem is None:
                self.losses.append((module, functools.partial(logits_route.install,
                                                              linear=linear)))
                self.swapped.append(Swap(name, old, f"{linear.__name__}("
                                         "labelled rows' hidden states, output embeddings)"))
                return
            problems.append(problem)
        self.skip(module, name, "its training loss stays the logits': "
                  + "; ".join(dict.fromkeys(problems)), old)


def _calls_loss_function(module) -> bool:
    """Whether the module's forward computes its loss through `self.loss_function`
    (transformers' causal LMs) rather than by itself."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is None or "loss_function" in code.co_names


#: transformers' loss type (`model.loss_type`, from the class name) of a masked LM: its
#: `loss_function` takes the cross-entropy of the logits at every labelled position, unshifted
MASKED_LOSS_TYPE = "ForMaskedLM"


def _loss_route(module) -> tuple[str | None, str | None]:
    """How the loss of `module` (a candidate of a loss rule) is routed, and its name (what
    `include` and `exclude` select it by): "logits" for a forward that takes the cross-entropy
    of the logits itself ("CrossEntropyLoss"), or through the `loss_function` of a masked LM
    (transformers' `ForMaskedLMLoss`, ModernBERT's: its name), the labelled rows' loss then
    routed as the forward's own (`_Planner.visit_logits_loss`); "function" for the
    `loss_function` of a causal LM (`ForCausalLMLoss`); (None, None) for neither."""
    if not _calls_loss_function(module):
        return "logits", "CrossEntropyLoss"
    if not isinstance(getattr(type(module), "loss_function", None), property):
        return None, None
    name = _loss_name(module.loss_function)
    if getattr(module, "loss_type", None) == MASKED_LOSS_TYPE:
        return "logits", name
    return "function", name


def _loss_name(function) -> str:
    """The name of a loss function: its own, or for one a loss swap set, the name of the one
    it replaced."""
    if linear_loss.is_route(function):
        return getattr(function.__self__, "replaces", "ForCausalLMLoss")
    replaced = getattr(function, "replaces", None)  # a causal_lm_loss `_set_loss` set
    if isinstance(replaced, str):
        return replaced
    return getattr(function, "__name__", type(function).__name__)


def _loss_names(model, rules) -> set[str]:
    """The names of the losses of `model` and its submodules that a loss rule may swap (or
    swapped): what `include` and `exclude` may name them by."""
    patterns = [r.pattern for r in rules if r.kind == "loss"]
    names = set()
    for module in model.modules():
        if any(fnmatch.fnmatchcase(type(module).__name__, p) for p in patterns):
            names.add(_loss_route(module)[1])
    return names - {None}


_META = "it is on the meta device, where its outputs cannot be compared"


def _assign(assignments, losses) -> None:
    """Make every planned swap, or on an exception none."""
    undo: list[Callable[[], None]] = []
    try:
        for parent, name, old, new in assignments:
            setattr(parent, name, new)
            undo.append(functools.partial(setattr, parent, name, old))
        for module, install in losses:
            undo.append(functools.partial(_restore_loss, module, module.__dict__.copy()))
            install(module)
    except BaseException:
        for step in reversed(undo):
            step()
        raise


def _set_loss(module, function) -> None:
    module.loss_function = function


def _restore_loss(module, state) -> None:
    for name in ("_loss_function", "forward"):  # what a loss swap sets on the instance
        if name in state:
            module.__dict__[name] = state[name]
        else:
            module.__dict__.pop(name, None)


@dataclass(frozen=True)
class _Candidate:
    """A configured replacement: `label` names it in the report, `build(module)` makes it from
    the module (or from a probe's copy of it), sharing the module's tensors."""

    label: str
    build: Callable[[torch.nn.Module], torch.nn.Module]
    #: it fixes no width (a LastDimNorm): proven at a second width too (`_prove`)
    any_width: bool = False


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


def _unswappable(module) -> str | None:
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


def _persistent_tensors(module) -> list[str]:
    """The names of the tensors a module's state_dict holds, its own (not its children's)."""
    return [*(n for n, p in module._parameters.items() if p is not None),
            *(n for n, b in module._buffers.items()
              if b is not None and n not in module._non_persistent_buffers_set)]


def _placement(module, default) -> tuple[torch.dtype, torch.device]:
    """The dtype and device a module computes in: those of its first floating tensor."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return default


def _norm_candidates(rule: Rule, module, memory):
    """The configurations of `rule`'s module that may compute what `module` does, why there are
    none, and the normalized shape the module fixes (None where it fixes none)."""
    names = [name for name, _, _ in rule.params]
    own = {**{n: p for n, p in module._parameters.items() if p is not None},
           **{n: b for n, b in module._buffers.items() if b is not None}}
    persistent = set(_persistent_tensors(module))
    extra = [n for n in own if n not in names and n in persistent]
    if extra:
        return [], (f"it holds tensors no {rule.module.__name__} holds: {', '.join(extra)}"), None
    found = [n for n in names if n in own]
    fixed = getattr(module, "normalized_shape", None)
    if isinstance(fixed, int):
        fixed = (fixed,)
    elif isinstance(fixed, (tuple, list, torch.Size)) and all(isinstance(s, int) for s in fixed):
        fixed = tuple(fixed)
    else:
        fixed = None
    # the width the probe takes: the module's normalized_shape, else its first tensor's
    shape = fixed or (tuple(own[found[0]].shape) if found else None)
    eps_values = next(([getattr(module, n)] for n in EPS_NAMES if hasattr(module, n)), None)
    eps_searched = eps_values is None
    if eps_searched:
        eps_values = list(dict.fromkeys((rule.eps, *EPS_TRIES)))
    # an unused weight held as a non-persistent buffer (a dummy) may be left out
    carries = [found]
    dummies = [n for n in found if n in module._buffers and n not in persistent]
    if dummies:
        carries.append([n for n in found if n not in dummies])
    candidates = []
    for carried in carries:
        # without its normalized_shape, a norm fixes the width of the tensors it carries; one
        # that carries none (a dummy left out: FalconMamba's weightless norm, whose ones
        # buffer is of the mixer's width where its forward normalises dt, B and C of other
        # widths) fixes none, and stands in whatever the input's width (LastDimNorm)
        width = fixed or (tuple(own[carried[0]].shape) if carried else None)
        offsets_absent = {offset for name, _, offset in rule.params
                          if offset and name not in carried}
        # without its parameter an offset changes nothing: one value is enough
        grid = [[(option, value) for value in (values[:1] if option in offsets_absent
                                                else values)]
                for option, values in rule.tries]
        for options, eps in itertools.product(itertools.product(*grid), eps_values):
            options = dict(options)
            label = _norm_label(rule, module, carried, options, eps if eps_searched else None,
                                width)
            build = functools.partial(_build_norm, rule, tuple(carried), options, eps, width,
                                      memory)
            candidates.append(_Candidate(label, build, any_width=width is None))
    return candidates, None, shape


def _norm_label(rule, module, carried, options, eps, shape) -> str:
    if shape is None:
        return f"{LastDimNorm.__name__}({rule.function.__name__})"
    # an option at its default (the first value tried) goes unnamed
    defaults = {option: values[0] for option, values in rule.tries}
    settings = [f"{k}={v}" for k, v in options.items() if v != defaults.get(k)]
    if not carried:
        settings.append("elementwise_affine=False")
    settings += [f"{flag}=False" for name, flag, _ in rule.params
                 if flag and carried and name not in carried]
    settings += [f"{n} buffer" for n in carried if n in module._buffers]
    if eps is not None:
        settings.append(f"eps={eps}")
    return rule.module.__name__ + (f"({', '.join(settings)})" if settings else "")


#: the option of a norm whose backward writes the input's gradient over the output's where
#: autograd hands that over alone (as Liger's RMSNorm does by default): the values are the
#: same, one allocation fewer; a swap turns it on where the op takes it
IN_PLACE = "in_place"


def keywords(function) -> set[str]:
    """The names of the parameters `function` (a function or a class) takes (none where its
    signature cannot be read)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _build_norm(rule, carried, options, eps, shape, memory, module):
    kwargs = dict(options)
    if memory is not None and memory in rule.memory:
        kwargs["memory"] = memory
    if IN_PLACE in keywords(rule.function):
        kwargs[IN_PLACE] = True
    if shape is None:
        return LastDimNorm(rule.function, eps, kwargs).train(module.training)
    tensors = {name: getattr(module, name) for name in carried}
    factory = {}
    if tensors:
        reference = next(iter(tensors.values()))
        factory = {"device": reference.device, "dtype": reference.dtype}
    flags = {flag: name in tensors for name, flag, _ in rule.params if flag}
    new = rule.module(shape, eps=eps, elementwise_affine=bool(tensors), **flags, **kwargs,
                      **factory)
    for name, _, _ in rule.params:
        tensor = tensors.get(name)
        if isinstance(tensor, torch.nn.Parameter) or tensor is None:
            new.register_parameter(name, tensor)
        else:  # a buffer stays a buffer: not trained, in the state_dict as before
            del new._parameters[name]
            new.register_buffer(name, tensor,
                                persistent=name not in module._non_persistent_buffers_set)
    return new.train(module.training)


def _build_activation(rule, module):
    return rule.module().train(module.training)


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
            or _persistent_tensors(module):
        return None
    act_name, act = others[0]
    if any(True for _ in act.children()) or _persistent_tensors(act):
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
        hooks = [name.strip("_") for name in HOOKS if getattr(child, name, None)]
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
    cls = _EXPERTS_CLASSES[key] = swapped_class(original, experts_class, gate, namespace)
    return cls


def swapped_class(original: type, factory: Callable, argument: Any, namespace: dict) -> type:
    """A subclass of `original` with `namespace` (what a swap replaces) under the original's
    name, module, qualified name and doc, so that what finds a module by its class name
    (device maps, wrapping policies, transformers' implementation switches) still does. Pickle
    would find the original class by that name: an instance pickles as
    `factory(original, argument)`, the module-level function that made the class (each keeps
    its own cache of them)."""
    return type(original.__name__, (original,), {
        "__module__": original.__module__, "__qualname__": original.__qualname__,
        "__doc__": original.__doc__, "_swap_factory": factory, "_swap_original": original,
        "_swap_argument": argument, "__reduce_ex__": _swapped_reduce_ex, **namespace})


def _swapped_reduce_ex(self, protocol):
    cls = type(self)
    return (_rebuild_swapped, (cls._swap_factory, cls._swap_original, cls._swap_argument),
            self.__getstate__())


def _rebuild_swapped(factory, original, argument):
    cls = factory(original, argument)
    return cls.__new__(cls)


class _ConfigView:
    """A module's config as a probe's copy of the module reads it: `_experts_implementation`
    the one the probe runs, anything else the config's (which is left as it is)."""

    def __init__(self, config, implementation):
        self._config = config
        self._experts_implementation = implementation

    def __getattr__(self, name):
        return getattr(self.__dict__["_config"], name)


def _experts_twin(module, noise, shape, dtype, implementation):
    """A probe copy of experts module `module` (`_twin`) holding copies of its tensors, and of
    its children's, in `dtype` (perturbed with `noise`), every floating Parameter requiring
    its gradient; only the first PROBE_EXPERTS experts where the module counts them in
    `num_experts`; running `implementation` of its experts interface."""
    twin = _twin(module, None, {})
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
    """An experts module's probe: hidden states of its width (`_probe_input`'s 12 rows at
    MLP_SCALES), each token routed to PROBE_TOP_K consecutive experts of the `keep` first with
    random softmax weights, and the gradient of the output."""
    hidden = _probe_input((shape.width,), MLP_SCALES, dtype, device).reshape(-1, shape.width)
    tokens, top_k = hidden.shape[0], min(PROBE_TOP_K, keep)
    index = (torch.arange(tokens)[:, None] + torch.arange(top_k)[None, :]) % keep
    generator = torch.Generator().manual_seed(SEED + 1)
    weights = torch.randn((tokens, top_k), generator=generator, dtype=torch.float64).softmax(-1)
    grad = torch.randn((tokens, shape.width), generator=generator, dtype=torch.float64)
    return (hidden, index.to(device), weights.to(device=device, dtype=dtype),
            grad.to(device=device, dtype=dtype))


def _gate_difference(module, gate, shape, dtype, device) -> str | None:
    """How `gate` differs from experts module `module`'s own `_apply_gate` on a gate_up probe
    whose halves are the activation's grid (out to ±100, where a clamped gate or up shows),
    or None: in float64 the output and gradient, in the module's dtype the output."""
    with _probing(device), torch.enable_grad():
        for probe_dtype in dict.fromkeys((torch.float64, dtype)):
            at = f" (its gate_up in {str(probe_dtype).removeprefix('torch.')})"
            gradients = probe_dtype == torch.float64
            twin, _ = _experts_twin(module, None, shape, probe_dtype, None)
            grid = _probe_input((PROBE_WIDTH,), None, probe_dtype, device).reshape(
                -1, PROBE_WIDTH)
            gate_up = torch.cat([grid, grid.flip(0, 1)], dim=-1).requires_grad_(gradients)
            try:
                reference = twin._apply_gate(gate_up)
            except Exception as error:  # noqa: BLE001
                return f"cannot be proven: its _apply_gate raised on the probe{at}: " \
                       f"{_error(error)}"
            try:
                output = gate(gate_up)
            except Exception as error:  # noqa: BLE001
                return f"raised {_error(error)}{at}"
            problem = _difference(reference, output, grid, probe_dtype, True)
            if problem is None and gradients:
                grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(SEED),
                                   dtype=torch.float64).to(device=device, dtype=probe_dtype)
                try:
                    (want,) = torch.autograd.grad(reference, gate_up, grad)
                    (got,) = torch.autograd.grad(output, gate_up, grad)
                except Exception as error:  # noqa: BLE001
                    return f"cannot be proven: the gradient raised{at}: {_error(error)}"
                problem = _difference(want, got, gate_up.detach(), probe_dtype, True)
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
    with _probing(device), torch.enable_grad():
        for noise, note in ((None, ""), (_Noise, " with perturbed parameters")):
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
                               f"{_error(error)}"
                    inputs = _experts_probe(shape, keep, probe_dtype, device)
                    try:
                        reference, want = _experts_run(twin, inputs, gradients)
                    except Exception as error:  # noqa: BLE001
                        if implementation != implementations[-1]:
                            continue  # the next stands in
                        if len(implementations) > 1:
                            break  # none runs in float64: the module's dtype's probe decides
                        return f"cannot be proven: its forward raised on the probe{where}: " \
                               f"{_error(error)}"
                    try:
                        output, got = _experts_run(swapped, inputs, gradients)
                    except Exception as error:  # noqa: BLE001
                        return f"raised {_error(error)}{where}"
                    problem = _difference(reference, output, None, probe_dtype, False)
                    for name in want if problem is None else ():
                        problem = _difference(want[name], got.get(name), None, probe_dtype,
                                              False)
                        if problem is not None:
                            problem = f"gives a gradient of {name} that {problem}"
                            break
                    if problem is not None:
                        return problem + where
                    break  # proven in this implementation
    return None


@contextlib.contextmanager
def _probing(device: torch.device):
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


def _single_op(module, dtype, device) -> str | None:
    """The torch op `module`'s forward runs on an activation's probe input where it runs just
    one (torch.nn.GELU's aten.gelu: one kernel each way, at the copy ceiling, which the
    generated kernel of the same activation can only match), else None (a composite such as
    GPT-2's NewGELUActivation, eight ops, which the swap fuses into one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # views move no data
                ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with _probing(device):
        x = _probe_input((PROBE_WIDTH,), None, dtype, device)
        try:
            with Recorder():
                module(x)
        except Exception:  # noqa: BLE001 (the probe proper reports what fails)
            return None
    return ops[0] if len(ops) == 1 else None


def _probe_input(tail, scales, dtype, device) -> torch.Tensor:
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


def _prove(module, candidates, tail, scales, dtype, device, evaluate=False, bitwise=False):
    """The first candidate whose outputs match the module's within the dtype's tolerance
    (`_difference`) on the probe, with the module's tensors and with perturbed ones; else None
    and why each failed. With `bitwise`, a later candidate that gives the module's outputs bit
    for bit wins over an earlier close one: a bfloat16 LlamaRMSNorm is within tolerance of
    RMSNorm's default casting_mode, but only casting_mode="llama" rounds as it does.
    `evaluate`: the copies probed (and the candidates built from them) are in eval mode.
    A candidate that fixes no width (`_Candidate.any_width`) must match at a second width too
    (`_other_width`), where the module must run as well: it stands in at any width."""
    with _probing(device):
        perturb = any(t.is_floating_point() for t in itertools.chain(module.parameters(),
                                                                     module.buffers()))
        twins = []
        for noise, note in ((None, ""), (_Noise(), " with perturbed parameters"))[:1 + perturb]:
            try:
                twin = _twin(module, noise, {})
                if evaluate:
                    twin.eval()  # the copies' own training flags: the module keeps its
            except Exception as error:  # noqa: BLE001 (any failure means: cannot be proven)
                return None, f"it cannot be copied to be probed{note}: {_error(error)}"
            twins.append((twin, note))
        probes: dict[tuple[int, ...], tuple[torch.Tensor, list] | str] = {}

        def probe(shape):
            """The probe input of `shape`'s rows and the twins' outputs, or why none."""
            if shape not in probes:
                x = _probe_input(shape, scales, dtype, device)
                at = "" if shape == tuple(tail) else f" of width {shape[-1]}"
                references = []
                for twin, note in twins:
                    try:
                        references.append(twin(x))
                    except Exception as error:  # noqa: BLE001
                        probes[shape] = (f"its forward raised on the probe input{at}{note}: "
                                         f"{_error(error)}")
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
            shapes = [tuple(tail)] + [_other_width(tail)] * candidate.any_width
            for shape in shapes:
                found = probe(shape)
                if isinstance(found, str):  # the module fixes its width after all
                    problem = f"cannot be proven at another width: {found}"
                    break
                x, references = found
                at = "" if shape == tuple(tail) else f" at width {shape[-1]}"
                for (twin, note), reference in zip(twins, references, strict=True):
                    try:
                        output = candidate.build(twin)(x)
                    except Exception as error:  # noqa: BLE001
                        problem = f"raised {_error(error)}"
                    else:
                        problem = _difference(reference, output, x, dtype, scales is None)
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


def _other_width(tail) -> tuple[int, ...]:
    """The second probe shape of a candidate that fixes no width: `tail` with another last
    width (PROBE_WIDTH, or five eighths of it where that is the first)."""
    width = PROBE_WIDTH if tail[-1] != PROBE_WIDTH else PROBE_WIDTH * 5 // 8
    return (*tuple(tail)[:-1], width)


def _activation_difference(act, function, dtype, device) -> str | None:
    """How `act` differs from the activation of a gated op (`function(gate, ones)`), or None."""
    with _probing(device):
        x = _probe_input((PROBE_WIDTH,), None, dtype, device)
        try:
            reference = _twin(act, None, {})(x)
            output = function(x, torch.ones_like(x))
        except Exception as error:  # noqa: BLE001
            return f"raised {_error(error)}"
        return _difference(reference, output, x, dtype, True)


def _loss_difference(original, candidate, dtype, device) -> str | None:
    """How `candidate` differs from a causal-LM loss function on random logits and labels
    (with ignored labels, num_items_in_batch, shift_labels and ignore_index), or None."""
    with _probing(device):
        generator = torch.Generator().manual_seed(SEED)
        logits = (3 * torch.randn((*LOSS_SHAPE, LOSS_CLASSES), generator=generator)).to(
            device=device, dtype=dtype)
        labels = torch.randint(0, LOSS_CLASSES, LOSS_SHAPE, generator=generator)
        labels[0, 2] = labels[1, -1] = -100
        # the same labels with class 4 ignored in place of -100
        other = torch.where(labels == -100, 4, labels)
        calls = ((labels, {}), (labels, {"num_items_in_batch": torch.tensor(7)}),
                 (labels, {"shift_labels": labels.roll(1, dims=-1).to(device)}),
                 (other, {"ignore_index": 4}))
        for targets, kwargs in calls:
            try:
                reference = original(logits=logits, labels=targets.to(device),
                                     vocab_size=LOSS_CLASSES, **kwargs)
                output = candidate(logits=logits, labels=targets.to(device),
                                   vocab_size=LOSS_CLASSES, **kwargs)
            except Exception as error:  # noqa: BLE001
                return f"raised {_error(error)} (with {', '.join(kwargs) or 'no options'})"
            if not (isinstance(reference, torch.Tensor) and isinstance(output, torch.Tensor)):
                return "the model's loss function returned no tensor"
            problem = _difference(reference.reshape(1, -1), output.reshape(1, -1), None,
                                  torch.float32, False)
            if problem is not None:
                return f"causal_lm_loss {problem} (with {', '.join(kwargs) or 'no options'})"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a probe: a few units in the last place of the dtype, and never
    below fp32's (many modules compute in fp32 whatever their dtype, and so do the generated
    ops' accumulators)."""
    return max(2.5 * torch.finfo(dtype).eps, 2e-5)


def _difference(reference, output, x, dtype, elementwise: bool) -> str | None:
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
    rtol = _tolerance(dtype)
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


def _error(error: Exception) -> str:
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0][:160]}" if message else type(error).__name__


class _Noise:
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


def _twin(module, noise, done):
    """A shallow copy of `module` and its descendants to probe: Parameters shared (perturbed
    copies with `noise`), buffers copied, no hooks; the module is left as it is."""
    if id(module) in done:
        return done[id(module)]
    twin = copy.copy(module)
    done[id(module)] = twin
    state = twin.__dict__
    for name in HOOKS + ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                         "_forward_pre_hooks_with_kwargs"):
        if isinstance(state.get(name), dict):
            state[name] = type(state[name])()
    state["_parameters"] = {n: _twin_tensor(p, noise, True)
                            for n, p in module._parameters.items()}
    state["_buffers"] = {n: _twin_tensor(b, noise, False) for n, b in module._buffers.items()}
    state["_modules"] = {n: None if m is None else _twin(m, noise, done)
                         for n, m in module._modules.items()}
    forward = state.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        # a forward bound to the module on the instance (a Hub layer's, set by kernelize)
        # would compute with the module's tensors: the copy's computes with its own
        state["forward"] = types.MethodType(forward.__func__, twin)
    return twin


def _twin_tensor(tensor, noise, parameter):
    if tensor is None:
        return None
    if noise is None or not tensor.is_floating_point():
        return tensor if parameter else tensor.clone()
    values = noise(tensor)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(values, requires_grad=tensor.requires_grad)
    return values

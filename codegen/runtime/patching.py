"""`patch_model()`: swap a model's modules for generated ones, each swap proven by behaviour.

The rule table (`generated/patch.py`, one row per `Replaces` a spec declares) says which
generated op may stand in for what. This module walks the model and carries the plan out; what
each kind's candidates become is its plugin module's to say:

- `patch_norm`: a norm or an activation module found by class name ("norm", "activation");
- `patch_mlp`: a gated MLP `down(act(gate(x)) * up(x))` found by its structure, and, by
  theirs, the stacked experts of transformers' MoE layers ("mlp");
- `patch_residual`: the residual add before a norm inside a transformer layer ("residual");
- `patch_rotary`: an attention's `apply_rotary_pos_emb` ("rotary");
- `patch_loss` (and `logits_route`): a Hugging Face language model's loss ("loss").

A plugin plans in a `swaps.PlanContext`, never in the planner's own state, and proves its swaps
with codegen/runtime/probe.py: a candidate is swapped only if its replacement computes the same
outputs as the module on a small deterministic probe input, once with the module's own tensors
and once with perturbed copies of them (so that a weight of ones or zeros cannot hide how the
weight is used). The configuration of a replacement (an offset of the weight, a weight or none,
a weight held as a buffer, eps where the module keeps none) is the first the probe accepts, so
the behaviour, not the name, decides. A module whose forward `kernels.kernelize` replaced by a
Hub layer's (as transformers' decorated norms and activations may be) is probed with that
forward: it is swapped where the replacement computes what the Hub layer does, the report
naming the layer.

Probes run on shallow copies of the modules (their Parameters shared, their buffers copied, no
hooks), under `torch.no_grad()` and a forked RNG: the model, its training mode and the RNG
state are left as they were. Every replacement is built before any is assigned, and an
exception while assigning restores the ones already assigned.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
from collections.abc import Callable, Mapping

import torch

from codegen.runtime import patch_loss, patch_mlp, patch_norm, patch_residual, patch_rotary, swaps
from codegen.runtime.patch_loss import causal_lm_loss
from codegen.runtime.patch_mlp import GatedMLP
from codegen.runtime.patch_norm import LastDimNorm
from codegen.runtime.probe import hub_layer
from codegen.runtime.swaps import PatchError, Rule, Skip, Swap

#: the names users and the generated rule table reach through this module; the classes and
#: functions are defined where their kind is (the swaps' vocabulary in `swaps`)
__all__ = ["DEFAULT_KINDS", "KINDS", "GatedMLP", "LastDimNorm", "PatchError", "PatchReport",
           "Rule", "Skip", "Swap", "causal_lm_loss", "hub_layer", "patch_model"]

#: what a rule swaps; `patch_model(include=..., exclude=...)` names these
KINDS = ("norm", "activation", "mlp", "residual", "rotary", "loss")
#: the kinds swapped unless `include` says otherwise (a loss only when asked for)
DEFAULT_KINDS = ("norm", "activation", "mlp", "residual", "rotary")


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
    patch_loss.plan(planner.context, model)
    planned = planner.context.planned()
    _assign(planned.assignments, planned.losses)
    return PatchReport(planned.swapped, planned.skipped)


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
        (`patch_loss.loss_names`). Such a name selects nothing: a misspelt kind or class name would
        otherwise leave the swaps it meant to select or keep silently undone."""
        known: set[str] | None = None
        for argument, names in self.given.items():
            patterns = [name for name in dict.fromkeys(names) if name not in KINDS]
            if not patterns:
                continue
            if known is None:  # walked once, and only where a name needs it
                known = {type(module).__name__ for module in model.modules()}
                known |= patch_loss.loss_names(model, rules)
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
    """Walks the model, asking each kind's plugin module what its candidates become; the plan
    is recorded in `context` (a `swaps.PlanContext`, all a plugin sees of it). It changes
    nothing itself."""

    def __init__(self, model, rules, selection, strict, memory, bitwise=False):
        own = tuple({r.module for r in rules if r.module is not None}) + (GatedMLP, LastDimNorm)
        reference = next((t for t in itertools.chain(model.parameters(), model.buffers())
                          if t.is_floating_point()), None)
        default = ((reference.dtype, reference.device) if reference is not None
                   else (torch.float32, torch.device("cpu")))
        self.context = swaps.PlanContext(rules, selection.allows, memory, default, own,
                                         self.replacement, strict=strict, bitwise=bitwise)
        #: the Hub layers visited and left in place (excluded, or not proven): a fused layer
        #: must not compute one without calling it (`replacement`)
        self.kept: set[int] = set()

    def visit(self, parent: torch.nn.Module, prefix: str) -> None:
        """Plan the swaps of `parent`'s descendants, not looking into what is swapped."""
        context = self.context
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if context.visited(child):  # a module reached twice keeps one replacement
                context.place(parent, name, child, context.done(child))
                continue
            own = isinstance(child, context.own)
            new = None if own else self.replacement(context, child, prefix + name)
            context.place(parent, name, child, new)
            if new is None and hub_layer(child) is not None:
                self.kept.add(id(child))
            if new is None and not own:
                self.visit(child, prefix + name + ".")
                # an MoE experts module's act(gate) * up (same object, its class swapped)
                patch_mlp.plan_experts(context, child, prefix + name)
                # after its children: a layer's fused add reuses its norm's proven swap
                patch_residual.plan(context, child, prefix + name)
                # an attention's rotary embedding, by its forward's apply_rotary_pos_emb
                patch_rotary.plan(context, child, prefix + name)

    def replacement(self, context, module, name):
        """What replaces `module` in its parent (a norm's, an activation's or an MLP's
        replacement), or None (its skip recorded in `context` where it is a candidate)."""
        if id(module) in self.kept:
            # asked again by a layer's fusion (codegen/runtime/patch_residual.py), which would
            # compute the norm without calling it: the Hub layer the walk kept stays called
            return context.skip(module, name, f"its forward is Hub layer {hub_layer(module)}'s, "
                                              "which stays in place (excluded, or not proven)")
        found = patch_norm.rules_for(context, module)
        if found is not None:
            return patch_norm.replacement(context, module, name, *found)
        return patch_mlp.replacement(context, module, name)


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


def _restore_loss(module, state) -> None:
    for name in ("_loss_function", "forward"):  # what a loss swap sets on the instance
        if name in state:
            module.__dict__[name] = state[name]
        else:
            module.__dict__.pop(name, None)

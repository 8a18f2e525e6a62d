"""The vocabulary of a swap, below the planner: the rule table's rows (`Rule`), what the report
records (`Swap`, `Skip`), how a swapped class is made and pickled (`swapped_class`), and the
context a plugin module plans in (`PlanContext`).

`patch_model()` (codegen/runtime/patching.py) walks the model; each kind's plugin module
(`patch_norm`, `patch_mlp`, `patch_residual`, `patch_rotary`, `patch_loss`) decides what its
candidates become. A plugin sees the plan only through a `PlanContext`: it reads the rules and
options, records a swap or a skip through its methods, and never the planner's own lists, so
that what a plan holds (and what `patch_model` assigns, all or nothing) stays the planner's to
say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from codegen.runtime import probe


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


#: the option of a norm whose backward writes the input's gradient over the output's where
#: autograd hands that over alone (as Liger's RMSNorm does by default): the values are the
#: same, one allocation fewer; a swap turns it on where the op takes it
IN_PLACE = "in_place"


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


class Planned(NamedTuple):
    """What a plan holds once the walk is done: the assignments (owner, attribute, old value,
    new value), the loss installs (module, install), the swaps and the skips, in order."""

    assignments: tuple[tuple[Any, str, Any, Any], ...]
    losses: tuple[tuple[torch.nn.Module, Callable], ...]
    swapped: tuple[Swap, ...]
    skipped: tuple[Skip, ...]


class PlanContext:
    """What a plugin module plans with: the rule table (`rules`), the memory mode asked for
    (`memory`), the dtype and device of a module that holds no floating tensor (`default`), the
    replacement classes no candidate is (`own`), and the options of the probe (`bitwise`);
    which candidates the selection lets through (`allows`); and the methods that record a plan:
    `skip`, `swap`, `swap_loss`, `prove` (a replacement proven and its swap recorded), `done`
    (the replacement already planned for a module) and `norm_replacement` (the replacement
    the norm kind alone would plan for a module, whatever the selection says of norms).

    Nothing is changed while planning: the planner assigns what `planned()` holds once every
    candidate is planned. The walk's own bookkeeping (`visited`, `place`) is the planner's.

    `allows(kind, class_name)`: the selection; `replace(context, module, name)`: the planner's
    replacement of a module (its norm, activation and MLP kinds), which `norm_replacement` runs
    in a context of its own; `strict`: a skip raises `PatchError`."""

    def __init__(self, rules: tuple[Rule, ...], allows: Callable[[str, str], bool],
                 memory: str | None, default: tuple[torch.dtype, torch.device],
                 own: tuple[type, ...], replace: Callable, *, strict: bool = False,
                 bitwise: bool = False):
        self.rules, self.memory, self.default, self.own = rules, memory, default, own
        self.bitwise = bitwise
        self._allows, self._replace, self._strict = allows, replace, strict
        self._assignments: list[tuple[Any, str, Any, Any]] = []
        self._losses: list[tuple[torch.nn.Module, Callable]] = []
        self._swapped: list[Swap] = []
        self._skipped: list[Skip] = []
        self._done: dict[int, torch.nn.Module | None] = {}

    def allows(self, kind: str, class_name: str) -> bool:
        """Whether `include` and `exclude` let a candidate of `kind` and `class_name` through."""
        return self._allows(kind, class_name)

    def skip(self, module, name, reason, old=None, needless=False) -> None:
        """Record why `module` (of class `old`, its class name by default) is left in place,
        or raise with `strict` (but for a `needless` swap, one that could only be slower);
        return None."""
        skip = Skip(name, old or type(module).__name__, reason)
        if self._strict and not needless:
            raise PatchError(f"patch_model(): {name} ({skip.old}) cannot be swapped: {reason}")
        self._skipped.append(skip)
        return None

    def swap(self, name: str, old: str, new: str, *assignments) -> None:
        """Record the swap of `name` (of class `old`) for what `new` names, made by
        `assignments`, each (owner, attribute, old value, new value), set in turn."""
        self._assignments.extend(assignments)
        self._swapped.append(Swap(name, old, new))

    def swap_loss(self, module, install: Callable, name: str, old: str, new: str) -> None:
        """Record the swap of `module`'s loss (`name`, the loss `old`) for what `new` names,
        made by `install(module)`; what it sets on the instance is restored where a later
        assignment fails."""
        self._losses.append((module, install))
        self._swapped.append(Swap(name, old, new))

    def prove(self, module, name, candidates, tail, scales, dtype, device, evaluate=False,
              note=""):
        """The first of `candidates` the probe proves for `module` (`probe.prove`), built and
        its swap recorded (`note` ends the label: a Hub layer inside the module that the
        replacement computes); else None, the skip recorded. The planner assigns it in the
        module's place."""
        if device.type == "meta":
            return self.skip(module, name, probe.META)
        # the probe measures what the module computes now: a Hub layer's forward where
        # kernels' kernelize set one (`probe.twin` binds it to the probe's copies)
        winner, reason = probe.prove(module, candidates, tail, scales, dtype, device, evaluate,
                                     self.bitwise)
        if winner is None:
            if probe.hub_layer(module) is not None:
                reason = f"its forward is Hub layer {probe.hub_layer(module)}'s: {reason}"
            return self.skip(module, name, reason)
        new = winner.build(module)
        self._swapped.append(Swap(name, type(module).__name__,
                                  winner.label + probe.hub_label(module) + note))
        return new

    def done(self, module) -> torch.nn.Module | None:
        """The replacement planned for `module` where the walk reached it already, else None."""
        return self._done.get(id(module))

    def norm_replacement(self, module, name) -> tuple[torch.nn.Module | None, list[str]]:
        """The replacement the "norm" kind plans for `module`, whatever `include` and
        `exclude` say of norms (a fused residual add computes its norm by it), or None and the
        reasons of its skips. Nothing is recorded here, and no skip raises."""
        scratch = PlanContext(self.rules, lambda kind, class_name: kind == "norm", self.memory,
                              self.default, self.own, self._replace, bitwise=self.bitwise)
        new = self._replace(scratch, module, name)
        return new, [skip.reason for skip in scratch._skipped]

    def visited(self, module) -> bool:
        """Whether the walk planned `module` already (the planner's)."""
        return id(module) in self._done

    def place(self, parent, name: str, module, new) -> None:
        """Record `new` (None: nothing) as what stands in for `module`, the child `name` of
        `parent`, and its assignment there (the planner's: it does this for every child it
        walks)."""
        self._done[id(module)] = new
        if new is not None:
            self._assignments.append((parent, name, module, new))

    def planned(self) -> Planned:
        """What the plan holds now."""
        return Planned(tuple(self._assignments), tuple(self._losses), tuple(self._swapped),
                       tuple(self._skipped))

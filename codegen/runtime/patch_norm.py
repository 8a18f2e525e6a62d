"""The "norm" and "activation" kinds of `patch_model()`: a module found by its class name (a
norm's `*RMSNorm`, `*LayerNorm`; an activation's `*GELU*`) swapped for the generated module of
the first rule whose configuration the probe accepts.

These are the planner's core kinds: their replacement takes the module's place in its parent
(as an MLP's does, codegen/runtime/patch_mlp.py), and the residual kind
(codegen/runtime/patch_residual.py) fuses a norm by the configuration its swap here proves
(`PlanContext.norm_replacement`). The planner asks `rules_for` whether a module is a candidate,
then `replacement` for what stands in.

A norm's configuration (an offset of the weight, a weight or none, a weight held as a buffer,
eps where the module keeps none, a casting mode) is each combination of what the module holds
and what its rule `tries`, the first the probe accepts winning (`PlanContext.prove`); a
weightless norm that fixes no width becomes a `LastDimNorm`, proven at two widths. An
activation that runs a single torch op is left in place: a swap would fuse nothing.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from codegen.runtime import probe, swaps

#: where a module keeps its eps, in the order looked up
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
#: eps values tried (after the op's default) for a norm that keeps none as an attribute
EPS_TRIES = (1e-5, 1e-6)
#: per-row scales of a norm's probe rows (the small ones tell eps values apart: 1e-5 from 1e-6)
#: and of an MLP's (the large ones reach the activation's nonlinear range)
NORM_SCALES = (1.0, 1e-3, 1e-4)


class LastDimNorm(torch.nn.Module):
    """A weightless norm over the input's last dim, whatever its width: what stands in for a
    module that fixes no width (no normalized_shape, no weight)."""

    def __init__(self, function: Callable, eps, options: dict[str, Any]):
        super().__init__()
        self._function = function
        self.eps = eps
        self.options = dict(options)

    @property
    def function(self) -> Callable:
        """The generated norm function it calls (the fused residual add finds its rule by it)."""
        return self._function

    def forward(self, input):
        return self._function(input, input.shape[-1:], eps=self.eps, **self.options)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"{self._function.__name__}, eps={self.eps}{options}"

#: the kinds of this module, in the order a module's class name is matched against their rules
KINDS = ("norm", "activation")


def rules_for(context, module) -> tuple[str, list] | None:
    """The kind and the rules of that kind whose pattern matches `module`'s class name and that
    the selection lets through, or None where no rule of these kinds does."""
    class_name = type(module).__name__
    for kind in KINDS:
        rules = [r for r in context.rules if r.kind == kind
                 and fnmatch.fnmatchcase(class_name, r.pattern)
                 and context.allows(kind, class_name)]
        if rules:
            return kind, rules
    return None


def replacement(context, module, name, kind, rules):
    """What replaces `module`, a candidate of `rules` of `kind` (`rules_for`), its swap
    recorded in `context` (a `swaps.PlanContext`); else None, its skip recorded."""
    problem = probe.unswappable(module)
    if problem is None and any(True for _ in module.children()):
        problem = "it has submodules, which no replacement holds"
    if problem is None and kind == "activation" and probe.persistent_tensors(module):
        problem = ("it holds tensors (" + ", ".join(probe.persistent_tensors(module))
                   + "), which no replacement holds")
    if problem is not None:
        return context.skip(module, name, problem)
    dtype, device = probe.placement(module, context.default)
    if kind == "activation":
        # an activation holds no dtype of its own: it is probed in fp32 (fp64 in an fp64
        # model), where what it computes shows, not how a low precision rounds it
        dtype = torch.promote_types(dtype, torch.float32)
        single = single_op(module, dtype, device) if device.type != "meta" else None
        if single is not None:
            return context.skip(module, name, f"it runs one torch op already ({single}), one "
                                "kernel each way: a swap would fuse nothing and add host time "
                                "to every call", needless=True)
        candidates = [probe.Candidate(r.module.__name__, functools.partial(_build_activation, r))
                      for r in rules]
        tail, scales = (probe.PROBE_WIDTH,), None
    else:
        candidates, problems, tail = [], [], None
        for rule in rules:
            found, problem, shape = _norm_candidates(rule, module, context.memory)
            candidates += found
            problems += [problem] if problem else []
            tail = tail or shape
        if not candidates:
            return context.skip(module, name, "; ".join(dict.fromkeys(problems)))
        tail, scales = tail or (probe.PROBE_WIDTH,), NORM_SCALES
    return context.prove(module, name, candidates, tail, scales, dtype, device)



def single_op(module, dtype, device) -> str | None:
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

    with probe.probing(device):
        x = probe.probe_input((probe.PROBE_WIDTH,), None, dtype, device)
        try:
            with Recorder():
                module(x)
        except Exception:  # noqa: BLE001 (the probe proper reports what fails)
            return None
    return ops[0] if len(ops) == 1 else None


def _norm_candidates(rule, module, memory):
    """The configurations of `rule`'s module that may compute what `module` does, why there are
    none, and the normalized shape the module fixes (None where it fixes none)."""
    names = [name for name, _, _ in rule.params]
    own = {**{n: p for n, p in module._parameters.items() if p is not None},
           **{n: b for n, b in module._buffers.items() if b is not None}}
    persistent = set(probe.persistent_tensors(module))
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
            candidates.append(probe.Candidate(label, build, any_width=width is None))
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


def _build_norm(rule, carried, options, eps, shape, memory, module):
    kwargs = dict(options)
    if memory is not None and memory in rule.memory:
        kwargs["memory"] = memory
    if swaps.IN_PLACE in probe.keywords(rule.function):
        kwargs[swaps.IN_PLACE] = True
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


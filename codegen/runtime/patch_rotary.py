"""The "rotary" kind of `patch_model()`: the rotary position embedding an attention module applies
through the `apply_rotary_pos_emb` function of its modeling module (Hugging Face's LLaMA,
Mistral, Qwen2/3, Gemma 1/2/3, Phi-3 and their kin), computed by a generated op instead.

A module is a candidate where its class name matches a "rotary" rule and its forward (through
the `__wrapped__` chain of its decorators) reads the global `apply_rotary_pos_emb`. Nothing is
rebound for everyone: the instance's class becomes a subclass of its own class (same name,
`isinstance` holds) whose forward is the original forward function rebuilt over a copy of its
globals in which `apply_rotary_pos_emb` is the generated one, its decorators rebuilt around it.
Other instances of the class, and the modeling module, are left as they were.

The swap is proven by behaviour first, as every swap, against what the instance computes: its
own copy of the function where kernels' `use_kernelized_func` gave it one (transformers'
attention classes), with the forward of a Hub layer where `kernels.kernelize` set one (the
report then names the Hub layer replaced), else the modeling module's function. That function
and the stand-in are called on probe q, k, cos and sin as an attention calls them ((batch,
heads, seq, head_dim) with fewer key than query heads, (batch, seq, head_dim) tables) and must
agree within the module dtype's tolerance, or raise alike. Tables narrower than the head are
probed too: where the original rotates only their width and passes the rest (Phi-3's partial
rotary, `partial_rotary_factor` < 1), the stand-in that does the same (`PartialRotary`) is the
one proven; where neither stand-in agrees, the module is left with the reason.
"""

from __future__ import annotations

import fnmatch
import sys
import types
from collections.abc import Callable

import torch

from codegen.runtime import probe, swaps

#: the kind `patch_model(include=..., exclude=...)` names
KIND = "rotary"
#: the global an attention's forward calls, which the rebuilt forward reads as the generated one
GLOBAL = "apply_rotary_pos_emb"
#: probe shapes: batch, query heads, key heads, sequence; the head width where the module
#: keeps none (`head_dim`)
PROBE_BATCH, PROBE_HEADS, PROBE_KEY_HEADS, PROBE_SEQ = 2, 4, 2, 3
PROBE_HEAD_DIM = 16


class PartialRotary:
    """`embed` on the first cos.shape[-1] columns of q and k, the others passed through: the
    partial rotary embedding (Phi-3's `partial_rotary_factor`). Picklable (a class, not a
    closure), as a swapped model must be."""

    def __init__(self, embed: Callable):
        self.embed = embed
        self.__name__ = f"partial {embed.__name__}"

    def __call__(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        width = cos.shape[-1]
        if width == q.shape[-1] and width == k.shape[-1]:
            return self.embed(q, k, cos, sin, position_ids, unsqueeze_dim)
        q_embed, k_embed = self.embed(q[..., :width], k[..., :width], cos, sin, position_ids,
                                      unsqueeze_dim)
        return (torch.cat([q_embed, q[..., width:].to(q_embed.dtype)], dim=-1),
                torch.cat([k_embed, k[..., width:].to(k_embed.dtype)], dim=-1))

    def __repr__(self) -> str:
        return f"PartialRotary({self.embed.__module__}.{self.embed.__name__})"

    def __eq__(self, other) -> bool:
        return isinstance(other, PartialRotary) and other.embed is self.embed

    def __hash__(self) -> int:
        return hash((PartialRotary, self.embed))


def forward_chain(function) -> list[types.FunctionType] | None:
    """The forward and the functions its decorators wrap (`__wrapped__`), outermost first, down
    to the one whose code reads the global; None where none does."""
    chain = []
    while isinstance(function, types.FunctionType):
        chain.append(function)
        if GLOBAL in function.__code__.co_names:
            return chain
        function = getattr(function, "__wrapped__", None)
    return None


def _copy(function: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    """`function` with other globals or closure cells, its names, defaults and attributes kept."""
    new = types.FunctionType(function.__code__, globals_, function.__name__,
                             function.__defaults__, closure)
    new.__kwdefaults__ = function.__kwdefaults__
    new.__dict__.update(function.__dict__)
    for name in ("__qualname__", "__module__", "__doc__", "__annotations__"):
        setattr(new, name, getattr(function, name))
    return new


def rebuilt_forward(chain: list[types.FunctionType], embed: Callable
                    ) -> types.FunctionType | None:
    """The forward whose innermost function reads `embed` as its global GLOBAL (over a copy of
    its globals), each decorator's wrapper rebuilt around the new inner function (the closure
    cell that held the old one holding the new); None where a wrapper holds its inner
    function otherwise than in a closure cell."""
    inner = chain[-1]
    new = _copy(inner, _globals(inner.__globals__, embed), inner.__closure__)
    old = inner
    for wrapper in reversed(chain[:-1]):
        cells, replaced = [], False
        for cell in wrapper.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                held = None
            if held is old:
                cells.append(types.CellType(new))
                replaced = True
            else:
                cells.append(cell)
        if not replaced:
            return None
        rebuilt = _copy(wrapper, wrapper.__globals__, tuple(cells))
        if getattr(rebuilt, "__wrapped__", None) is old:
            rebuilt.__wrapped__ = new
        old, new = wrapper, rebuilt
    return new


_GLOBALS: dict[tuple[int, Callable], dict] = {}


def _globals(original: dict, embed: Callable) -> dict:
    """A copy of a modeling module's globals in which GLOBAL is `embed`: the namespace of a
    module of its own, registered under a name of its own (one per module and embed), since
    torch.compile finds the globals of a function it inlines by their module's `__name__`; under
    the original's name it would read, and guard on, the original apply_rotary_pos_emb."""
    key = (id(original), embed)
    if key not in _GLOBALS:
        name = f"_vjpforge_rotary_{len(_GLOBALS)}_" + "".join(
            c if c.isalnum() else "_" for c in str(original.get("__name__", "module")))
        module = types.ModuleType(name)
        module.__dict__.update(original)
        module.__dict__.update({"__name__": name, GLOBAL: embed})
        sys.modules[name] = module
        _GLOBALS[key] = module.__dict__
    return _GLOBALS[key]


_CLASSES: dict[tuple[type, Callable], type] = {}


def rotary_class(original: type, embed: Callable) -> type | None:
    """The subclass of `original` whose forward calls `embed` for GLOBAL (one per class and
    embed; None where its forward cannot be rebuilt): same name and signature; pickled as the
    original class and the embed."""
    key = (original, embed)
    if key in _CLASSES:
        return _CLASSES[key]
    chain = forward_chain(original.forward)
    forward = rebuilt_forward(chain, embed) if chain is not None else None
    if forward is None:
        return None
    namespace = {"forward": forward, "_rotary_embed": embed, "_rotary_original": original}
    cls = _CLASSES[key] = swaps.swapped_class(original, rotary_class, embed, namespace)
    return cls


def plan(context, module, name: str) -> None:
    """Plan the swap of `module`'s rotary embedding, recording the swap or the skip in
    `context` (a `swaps.PlanContext`)."""
    class_name = type(module).__name__
    if "_rotary_embed" in type(module).__dict__ or not context.allows(KIND, class_name):
        return
    rules = [r for r in context.rules if r.kind == KIND
             and fnmatch.fnmatchcase(class_name, r.pattern)]
    chain = forward_chain(getattr(type(module), "forward", None)) if rules else None
    if chain is None:
        return  # no candidate: its forward applies no apply_rotary_pos_emb
    if "forward" in module.__dict__:
        context.skip(module, name, "its forward is replaced on the instance, which the rebuilt "
                                   "forward would not do")
        return
    original = chain[-1].__globals__.get(GLOBAL)
    if not callable(original):
        context.skip(module, name, f"its modeling module's {GLOBAL} is not a function")
        return
    # what the instance computes: its private copy where it has one (kernels routes the global
    # to it while the forward runs), a Hub layer's forward where kernelize set one
    private = private_function(module, original)
    original = private if private is not None else original
    repo = probe.hub_layer(original)
    dtype, device = probe.placement(module, context.default)
    if device.type == "meta":
        context.skip(module, name, probe.META)
        return
    head_dim = getattr(module, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) and head_dim > 0 else PROBE_HEAD_DIM
    problems = []
    for rule in rules:
        for embed in (rule.function, PartialRotary(rule.function)):
            problem = difference(original, embed, head_dim, dtype, device)
            if problem is None:
                cls = rotary_class(type(module), embed)
                if cls is None:
                    context.skip(module, name, "a decorator of its forward holds the function "
                                               "it wraps otherwise than in a closure, so the "
                                               "forward cannot be rebuilt")
                    return
                context.swap(name, class_name, f"{class_name}({GLOBAL}: {label(embed)})"
                             + probe.hub_label(original), (module, "__class__", type(module), cls))
                return
            problems.append(f"{label(embed)} {problem}")
    hub = f" (Hub layer {repo})" if repo is not None else ""
    context.skip(module, name, f"its {GLOBAL}{hub} is not computed by "
                 + "; nor by ".join(problems))


def private_function(module, function):
    """The instance's own copy of `function` (kernels' `use_kernelized_func`, which transformers
    applies to its attention classes: each instance holds `type(function)()` in its
    `_kernel_funcs`, which the global calls while the instance's forward runs), or None."""
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict) or isinstance(function, types.FunctionType):
        return None
    return next((f for f in funcs.values() if type(f) is type(function)), None)


def label(embed: Callable) -> str:
    if isinstance(embed, PartialRotary):
        return f"partial {label(embed.embed)}"
    return f"{embed.__module__}.{embed.__name__}"


def difference(original: Callable, embed: Callable, head_dim: int, dtype, device
               ) -> str | None:
    """How `embed` differs from `original` on the probes (whole-width tables, then tables of
    half the head where the head is wide enough to pair them), or None."""
    widths = [head_dim] + [head_dim // 2] * (head_dim % 4 == 0)
    with probe.probing(device):
        for index, width in enumerate(widths):
            generator = torch.Generator().manual_seed(probe.SEED + index)

            def draw(*shape, generator=generator):
                return torch.randn(shape, generator=generator, dtype=torch.float64).to(
                    device=device, dtype=dtype)

            q = draw(PROBE_BATCH, PROBE_HEADS, PROBE_SEQ, head_dim)
            k = draw(PROBE_BATCH, PROBE_KEY_HEADS, PROBE_SEQ, head_dim)
            cos, sin = draw(PROBE_BATCH, PROBE_SEQ, width), draw(PROBE_BATCH, PROBE_SEQ, width)
            results = []
            for function in (original, embed):
                try:
                    results.append(function(q, k, cos, sin))
                except Exception as error:  # noqa: BLE001 (a refusal is a behaviour too)
                    results.append(error)
            reference, output = results
            tables = f"tables of width {width} for heads of {head_dim}"
            if isinstance(reference, Exception) or isinstance(output, Exception):
                if isinstance(reference, Exception) and isinstance(output, Exception):
                    continue  # refused alike
                if isinstance(output, Exception):
                    return f"raised {probe.error(output)} with {tables}"
                return f"gave a result with {tables}, where the original raised " \
                       f"{probe.error(reference)}"
            if not (isinstance(reference, tuple) and isinstance(output, tuple)
                    and len(reference) == len(output) == 2):
                return f"returned {type(output).__name__}, the original " \
                       f"{type(reference).__name__}, with {tables}"
            for which, want, got in zip("qk", reference, output, strict=True):
                problem = probe.difference(want, got, None, dtype, False)
                if problem is not None:
                    return f"{problem} in {which}_embed with {tables}"
    return None


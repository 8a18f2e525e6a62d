"""The "residual" kind of `patch_model()`: the residual add before a norm inside a transformer
layer, fused with that norm into one add + norm call (`prenorm=True` where the sum is carried on).

A layer is a candidate where its children have the names of a known structure (`FAMILIES`):
a pre-norm decoder layer (LLaMA, Mistral, Qwen2/3, Phi-3, Gemma), Gemma 2/3's layer with its
extra norms, a GPT-2 block, BERT's attention and feed-forward outputs. Its forward is replaced,
on the instance's class, by one that calls the same submodules with the same arguments and
computes `norm(x + residual)` (and the sum) by the generated add + norm op the rule table pairs
with the norm's own swap (`add_rms_norm` with an `RMSNorm`, `add_layer_norm` with a
`LayerNorm`), with the configuration the norm's probe proved (eps, weight offset, weight, bias).

The rewrite is proven by behaviour, as every swap: on a probe copy of the layer whose attention,
MLP, dropout and dense children are deterministic stand-ins (nonlinear maps of the hidden state
that record how they are called) and whose norms hold perturbed copies of their weights, the
original forward and the rewritten one must give the same output, call every stand-in with the
same arguments, in training and in eval mode. A layer that computes anything else (a scaled
residual, another order) is left in place with the reason.

Where the layer's dropout before the add is a plain `torch.nn.Dropout` (BERT's outputs, Phi-3's
`resid_attn_dropout`) and the add + norm op takes a dropout probability (`dropout_p`), it is fused
too: one kernel each way for `norm(dropout(x) + residual)`, the child's `p` and training mode
read at each call. Its mask is the op's own (from a seed drawn off torch's generator, as the op
draws it), not torch's: that part is proven by behaviour on a second probe, whose dropout is the
layer's own: in eval mode and in training with p = 0 the output is the original's; in training
with p > 0 the elements whose gradient reaches the dropout's input are the kept ones, about
1 - p of them, and the output and the gradients are those of the original forward whose
dropout applies that mask. A dropout with hooks, or of another class, is called as it is (its
layer is fused without it). GPT-2's `resid_dropout` is the attention's own last step: it becomes
a `HandoffDropout`, which returns its input as it is while the block calls the attention, so
that the block drops it out in its add + norm (see `HandoffDropout`).

The layer object stays the same: its class becomes a subclass of its own class (same name,
`isinstance` holds, Hugging Face's gradient checkpointing wraps it as the original), whose
forward reads the norm's tensors from the norm child at each call, so the state_dict, the
Parameters and any later swap of the child's tensors are kept.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from codegen.runtime import dispatch, patch_norm, probe, swaps

#: the kind `patch_model(include=..., exclude=...)` names
KIND = "residual"
#: shape of a layer probe's hidden state (batch, sequence, width)
PROBE_ROWS = (2, 3)
#: keyword of the probe's extra argument, where a forward takes **kwargs (passed on, unread)
PROBE_KEYWORD = "probe_keyword"
#: the keyword of an add + norm function that drops its input out before the add (it then takes
#: `training` and `seed` too, as add_layer_norm)
DROPOUT = "dropout_p"
#: the probability a fused dropout is probed at where the layer's own is 0
PROBE_DROPOUT = 0.5
#: how far the probe's kept fraction may lie from 1 - p, in binomial standard deviations
BINOMIAL_SIGMAS = 5
#: a flag that sends a call to the original forward where set (transformers 4's layers return
#: the attention weights then); probed unset, so that the probe runs the rewritten path
ORIGINAL_IF_TRUE = "output_attentions"


@dataclass(frozen=True)
class Family:
    """A layer structure whose residual add before `norm` is fused: the names of its children
    (`children` all present, `optional` may be; `norms` probed as themselves, the others by
    stand-ins; `pairs` return a tuple, as HF's attention its output and weights), how many
    tensors its forward takes first (`inputs`: the hidden state, and the residual where it is
    passed in), the arguments passed to none of its sublayers (`unused`), those that send the
    forward on a path the rewrite does not cover when set (`original_if`: the original forward
    runs then), and the rewritten forward."""

    name: str
    children: tuple[str, ...]
    norm: str
    forward: Callable
    inputs: int = 1
    optional: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    pairs: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    original_if: tuple[str, ...] = ()
    #: the child that drops out the input of the add (a torch.nn.Dropout, fused where the add
    #: + norm op takes a dropout) and the child whose output it drops; a dotted path names a
    #: dropout that this child calls last on its output (GPT-2's `attn.resid_dropout`), handed
    #: over to the add + norm op by a `HandoffDropout`
    dropout: tuple[str, str] | None = None


@dataclass(frozen=True)
class Fusion:
    """How a fused layer computes `norm(x + residual)`: the add + norm `function`, the norm
    child it reads its tensors from (`tensors`: the function's parameter names, each read from
    the child or None where the norm carries none), its `options` (eps, offset, memory), the
    normalized shape (None: the input's last dim) and whether the family's dropout is fused
    into the call (`dropout`)."""

    family: Family
    function: Callable
    norm: str
    tensors: tuple[tuple[str, bool], ...]
    options: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...] | None
    dropout: bool = False
    #: why the family's dropout is not fused where it could have been (None: it is, or
    #: the layer has no plain dropout child), for the report
    unfused: str | None = None
    #: the layer returns its hidden states as a 1-tuple (transformers 4's layers: `(h,)`, and
    #: `(h, attention weights)` with `output_attentions`, where the original forward runs)
    returns_tuple: bool = False

    def __call__(self, layer, x, residual, prenorm=True, dropout=None):
        """`norm(x + residual)`, or `norm(dropout(x) + residual)` with `dropout` (a
        torch.nn.Dropout: its p and training mode as they are now)."""
        norm = layer._modules[self.norm]
        tensors = {name: getattr(norm, name) if carried else None
                   for name, carried in self.tensors}
        shape = self.shape if self.shape is not None else x.shape[-1:]
        if dropout is not None:
            tensors[DROPOUT] = dropout.p
            tensors["training"] = dropout.training
        return self.function(x, residual, shape, **tensors, **dict(self.options),
                             prenorm=prenorm)

    def fused_dropout(self, layer, planning=False):
        """The family's dropout where this call fuses it: a plain torch.nn.Dropout without hooks
        (any other is called as it is), a `HandoffDropout` where it lies inside a child (a
        plain one while the swap is planned: a later plain one is applied where it is); else
        None."""
        if not self.dropout:
            return None
        path = self.family.dropout[0]
        child = _descendant(layer, path)
        wanted = HandoffDropout if "." in path and not planning else torch.nn.Dropout
        if type(child) is not wanted or child._forward_hooks or child._forward_pre_hooks:
            return None
        return child

    def label(self, layer_class: str) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options
                          if k not in ("eps", swaps.IN_PLACE) and v)
        fused = f", with {self.family.dropout[0]}" if self.dropout else ""
        if self.unfused is not None:
            fused = f"; {self.family.dropout[0]} not fused: {self.unfused}"
        return f"{layer_class}({self.function.__name__} into {self.norm}{options}{fused})"


class _Arguments:
    """The named parameters of a forward, bound the way Python binds a call, in plain dict
    operations (which torch.compile traces, where `inspect.Signature.bind` would break the
    graph)."""

    def __init__(self, signature: inspect.Signature, qualname: str):
        parameters = list(signature.parameters.values())[1:]  # self
        kinds = inspect.Parameter
        self.qualname = qualname
        self.names = tuple(p.name for p in parameters
                           if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD))
        self.positional = sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
                              for p in parameters)
        self.keywords = frozenset(p.name for p in parameters
                                  if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
        self.defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        self.var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
        self.var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in parameters)

    def bind(self, args, kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """(named arguments, defaults filled in; the **kwargs), or TypeError as Python's."""
        if len(args) > self.positional:
            raise TypeError(f"{self.qualname}() takes {self.positional + 1} positional "
                            f"arguments but {len(args) + 1} were given")
        values = dict(zip(self.names[:len(args)], args, strict=True))
        extra = {}
        for key, value in kwargs.items():
            if key in values and key in self.keywords:
                raise TypeError(f"{self.qualname}() got multiple values for argument '{key}'")
            if key in self.keywords:
                values[key] = value
            elif self.var_keyword:
                extra[key] = value
            else:
                raise TypeError(f"{self.qualname}() got an unexpected keyword argument '{key}'")
        for name in self.names:
            if name not in values:
                if name not in self.defaults:
                    raise TypeError(f"{self.qualname}() missing required argument: '{name}'")
                values[name] = self.defaults[name]
        return values, extra


def _sublayer_arguments(layer, family, values, extra):
    """The layer's hidden state and the keyword arguments its attention gets (from the call's
    bound arguments `values` and its **kwargs `extra`): every named argument after the hidden
    state (defaults included) but the family's unused ones, then the **kwargs, as the original
    forward passes them on."""
    names = type(layer)._residual_arguments.names
    rest = {name: values[name] for name in names[1:] if name not in family.unused}
    rest.update(extra)
    return values[names[0]], rest


def _prenorm_forward(layer, fusion, values, extra):
    """LLaMA's decoder layer (and Phi-3's, with its dropouts):
    `h = x + attn(ln_1(x)); return h + mlp(ln_2(h))`, the first add fused with ln_2 (and
    Phi-3's resid_attn_dropout with it, where fused)."""
    modules = layer._modules
    hidden, rest = _sublayer_arguments(layer, fusion.family, values, extra)
    residual = hidden
    hidden = modules["input_layernorm"](hidden)
    hidden, _ = modules["self_attn"](hidden_states=hidden, **rest)
    dropout = fusion.fused_dropout(layer)
    if dropout is None and "resid_attn_dropout" in modules:
        hidden = modules["resid_attn_dropout"](hidden)
    hidden, residual = fusion(layer, hidden, residual, dropout=dropout)
    hidden = modules["mlp"](hidden)
    if "resid_mlp_dropout" in modules:
        hidden = modules["resid_mlp_dropout"](hidden)
    return residual + hidden


def _sandwich_forward(layer, fusion, values, extra):
    """Gemma 2/3's decoder layer: `h = x + post_ln(attn(ln(x)));
    return h + post_ff_ln(mlp(pre_ff_ln(h)))`, the first add fused with pre_ff_ln."""
    modules = layer._modules
    hidden, rest = _sublayer_arguments(layer, fusion.family, values, extra)
    residual = hidden
    hidden = modules["input_layernorm"](hidden)
    hidden, _ = modules["self_attn"](hidden_states=hidden, **rest)
    hidden = modules["post_attention_layernorm"](hidden)
    hidden, residual = fusion(layer, hidden, residual)
    hidden = modules["mlp"](hidden)
    hidden = modules["post_feedforward_layernorm"](hidden)
    return residual + hidden


def _gpt2_forward(layer, fusion, values, extra):
    """GPT-2's block: `h = attn(ln_1(x)) + x; return h + mlp(ln_2(h))`, the first add fused with
    ln_2; with encoder states (cross-attention) the original forward runs."""
    modules = layer._modules
    hidden, rest = _sublayer_arguments(layer, fusion.family, values, extra)
    residual = hidden
    hidden = modules["ln_1"](hidden)
    dropout = fusion.fused_dropout(layer)
    if dropout is not None and dropout.training and dropout.p > 0 \
            and not torch.compiler.is_compiling():
        attn_output = _handed_over(layer, fusion, dropout, hidden, rest)
    else:
        # no dropout to hand over (eval mode, p = 0, or a dropout of another kind), or a
        # compiled graph (whose compiler fuses the dropout itself): the attention applies it
        dropout = None
        attn_output, _ = modules["attn"](hidden, **rest)
    hidden, residual = fusion(layer, attn_output, residual, dropout=dropout)
    return residual + modules["mlp"](hidden)


#: the dropouts whose next call hands its input over, per thread: id(dropout) -> [inputs]
_OPEN = threading.local()


class HandoffDropout(torch.nn.Dropout):
    """A torch.nn.Dropout that a fused layer's forward can take over for one call: while the
    layer calls the child that applies it (GPT-2's attention, whose `resid_dropout` it is), its
    first call returns its input as it is, and the layer drops that out inside its add + norm
    op. Called from anywhere else (the child called on its own, a compiled graph) it is the
    dropout it was; `p`, `inplace` and the training mode are its own."""

    def forward(self, input):
        if not torch.compiler.is_compiling():
            slot = getattr(_OPEN, "slots", {}).get(id(self))
            if slot is not None and not slot:
                slot.append(input)
                return input
        return super().forward(input)


def _handed_over(layer, fusion, dropout, hidden, rest):
    """The output of `layer`'s attention called with its dropout `dropout` handed over (not
    applied): it must be that dropout's input, returned as it is, else the layer cannot stand
    for what the attention computes after it."""
    path, source = fusion.family.dropout
    (output, _), problem = _hand_over(dropout, layer._modules[source], (hidden,), rest)
    if problem is not None:
        raise RuntimeError(
            f"{type(layer).__name__}: {source} {problem}, which the fused "
            f"{fusion.function.__name__} would drop out; leave the layer unfused: "
            f"patch_model(exclude={type(layer).__name__!r})")
    return output


def _hand_over(dropout, child, args, kwargs):
    """`child(*args, **kwargs)` with `dropout` (a `HandoffDropout` it calls) handed over, and
    None where it returned (as its first output) the handed over input as it is, else what it
    did instead."""
    slots = _OPEN.__dict__.setdefault("slots", {})
    slot = slots[id(dropout)] = []
    try:
        output = child(*args, **kwargs)
    finally:
        del slots[id(dropout)]
    first = output[0] if isinstance(output, tuple) else output
    if not slot:
        return output, "did not call its dropout"
    if first is not slot[0]:
        return output, "returned something other than its dropout's output"
    return output, None


def _descendant(module, path: str):
    """The module at the dotted `path` below `module` (through `_modules`), or None."""
    for name in path.split("."):
        module = module._modules.get(name) if module is not None else None
    return module


def _output_forward(layer, fusion, values, extra):
    """BERT's attention and feed-forward outputs: `LayerNorm(dropout(dense(h)) + input)`."""
    modules = layer._modules
    hidden, input_tensor = (values[name] for name in type(layer)._residual_arguments.names)
    hidden = modules["dense"](hidden)
    dropout = fusion.fused_dropout(layer)
    if dropout is not None:
        return fusion(layer, hidden, input_tensor, prenorm=False, dropout=dropout)
    hidden = modules["dropout"](hidden)
    return fusion(layer, hidden, input_tensor, prenorm=False)


#: the layer structures whose residual add is fused, first match first
FAMILIES = (
    Family("pre-norm decoder layer",
           ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
           "post_attention_layernorm", _prenorm_forward,
           optional=("resid_attn_dropout", "resid_mlp_dropout"),
           norms=("input_layernorm", "post_attention_layernorm"), pairs=("self_attn",),
           dropout=("resid_attn_dropout", "self_attn")),
    Family("sandwich-norm decoder layer",
           ("input_layernorm", "self_attn", "post_attention_layernorm",
            "pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
           "pre_feedforward_layernorm", _sandwich_forward,
           norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"), pairs=("self_attn",)),
    Family("GPT-2 block", ("ln_1", "attn", "ln_2", "mlp"), "ln_2", _gpt2_forward,
           optional=("crossattention", "ln_cross_attn"), norms=("ln_1", "ln_2", "ln_cross_attn"),
           pairs=("attn", "crossattention"),
           unused=("encoder_hidden_states", "encoder_attention_mask"),
           original_if=("encoder_hidden_states",), dropout=("attn.resid_dropout", "attn")),
    Family("post-norm output", ("dense", "dropout", "LayerNorm"), "LayerNorm", _output_forward,
           inputs=2, norms=("LayerNorm",), dropout=("dropout", "dense")),
)


def family_of(layer) -> Family | None:
    """The structure `layer`'s children have, or None."""
    names = {name for name, child in layer._modules.items() if child is not None}
    for family in FAMILIES:
        if set(family.children) <= names <= set(family.children) | set(family.optional):
            return family
    return None


_CLASSES: dict[tuple[type, Fusion], type] = {}


def _keeps_layer(layer, fusion: Fusion, route, args, kwargs) -> bool:
    """Whether this call runs the layer's own forward instead of the rewritten one:

    - where the add + norm op would run torch's expression of itself anyway (`route`, its
      `Dispatch`, None where the fusion's memory mode is not the default, says so for this
      size, device and compilation): that is the layer's own computation, and the rewritten
      forward would only add its host time;
    - where its fused dropout would draw without a kernel (`dispatch.keeps_own`: a CPU tensor
      outside Triton's interpreter): the op's torch path then computes the kernels'
      counter-based random numbers with dozens of torch ops a call, where the layer's own
      dropout draws once.

    `VJPFORGE_DISPATCH=kernels` keeps the fusion."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        hidden = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if hidden is None:
            return False
    if route is not None and route.to_torch(hidden):
        return True
    if not (fusion.dropout and layer.training) or torch.compiler.is_compiling():
        return False
    dropout = fusion.fused_dropout(layer)
    if dropout is None or not dropout.training or dropout.p == 0:
        return False
    return dispatch.keeps_own(hidden)


def fused_class(original: type, fusion: Fusion) -> type:
    """The subclass of `original` whose forward is `fusion.family.forward` (one per class and
    fusion): same name and signature, so that what looks a layer up by its class name (device
    maps, wrapping policies) still finds it; pickled as the original class and the fusion."""
    key = (original, fusion)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    signature = inspect.signature(original.forward)
    family = fusion.family
    arguments = _Arguments(signature, f"{original.__qualname__}.forward")

    default_memory = dict(fusion.options).get("memory", "default") == "default"
    route = dispatch.of(fusion.function) if default_memory else None

    def forward(self, *args, **kwargs):
        if _keeps_layer(self, fusion, route, args, kwargs):
            return original.forward(self, *args, **kwargs)
        values, extra = arguments.bind(args, kwargs)
        if values.get(ORIGINAL_IF_TRUE) or any(values.get(name) is not None
                                               for name in family.original_if):
            return original.forward(self, *args, **kwargs)
        hidden = family.forward(self, fusion, values, extra)
        return (hidden,) if fusion.returns_tuple else hidden

    forward.__signature__ = signature
    forward.__doc__ = original.forward.__doc__
    forward.__qualname__ = f"{original.__qualname__}.forward"
    namespace = {"forward": forward, "_residual_fusion": fusion, "_residual_original": original,
                 "_residual_arguments": arguments}
    cls = _CLASSES[key] = swaps.swapped_class(original, fused_class, fusion, namespace)
    return cls


class _StandIn(torch.nn.Module):
    """A deterministic nonlinear map of the hidden state to `width` columns, standing in for
    an attention, an MLP, a dropout or a dense layer in a layer's probe; it records how it is
    called (the arguments besides the hidden state, by identity), and returns (output, None)
    where the child it stands for returns a pair."""

    def __init__(self, seed: int, width: int, pair: bool, dtype, device):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.index = torch.randint(0, 1 << 30, (width,), generator=generator).to(device)
        self.scale = (torch.randn(width, generator=generator, dtype=torch.float64) + 1.0).to(
            device=device, dtype=dtype)
        self.shift = torch.randn(width, generator=generator, dtype=torch.float64).to(
            device=device, dtype=dtype)
        self.pair = pair
        self.calls: list[str] = []

    def forward(self, *args, **kwargs):
        if args:
            hidden, args = args[0], ("x", *map(_token, args[1:]))
        else:
            hidden, args = kwargs.pop("hidden_states"), ("hidden_states=x",)
        self.calls.append(", ".join([*args, *sorted(f"{k}={_token(v)}"
                                                    for k, v in kwargs.items())]))
        columns = hidden[..., self.index % hidden.shape[-1]]
        output = self.before = torch.tanh(columns * self.scale + self.shift)
        for child in self._modules.values():  # a dropout the child it stands for applies last
            output = child(output)
        return (output, None) if self.pair else output


class _Sentinel:
    """A probe argument that stands for whatever the caller would pass (a mask, a cache)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _token(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return repr(value) if value is None or isinstance(value, (_Sentinel, bool, int, float,
                                                                     str)) \
        else f"{type(value).__name__} at {id(value):#x}"


def plan(context, layer, name: str) -> None:
    """Plan the fusion of `layer`'s residual add (its children already planned), recording the
    swap or the skip in `context` (a `swaps.PlanContext`)."""
    family = family_of(layer)
    class_name = type(layer).__name__
    if (family is None or "_residual_fusion" in type(layer).__dict__
            or not context.allows(KIND, class_name)):
        return
    rules = [r for r in context.rules if r.kind == KIND
             and fnmatch.fnmatchcase(class_name, r.pattern)]
    if not rules:
        return
    problem = _unfusable(layer, family)
    norm = layer._modules[family.norm]
    if problem is None and probe.unswappable(norm) is not None:
        # the fused forward computes the norm without calling it
        problem = f"its norm {family.norm}: {probe.unswappable(norm)}"
    replacement = None
    if problem is None:
        replacement, problem = _norm_replacement(context, norm, f"{name}.{family.norm}")
    fusion = None
    if problem is None:
        fusion, problem = _fusion(context, rules, family, replacement)
    if problem is None and fusion.dropout and fusion.fused_dropout(layer, True) is None:
        # no dropout child, or one of another class or with hooks: called as it is
        fusion = dataclasses.replace(fusion, dropout=False)
    if problem is None:
        dtype, device = probe.placement(norm, context.default)
        if device.type == "meta":
            problem = probe.META
        else:
            problem, fusion = _difference(layer, family, fusion, dtype, device)
    if problem is None and fusion.dropout:
        # the layer's own dropout, fused where the probe proves it; else called as it is,
        # the report saying why
        unfused = _dropout_difference(layer, family, fusion, dtype, device)
        if unfused is not None:
            fusion = dataclasses.replace(fusion, dropout=False, unfused=unfused)
    if problem is not None:
        context.skip(layer, name, problem)
        return
    assignments = [(layer, "__class__", type(layer), fused_class(type(layer), fusion))]
    if fusion.dropout and "." in family.dropout[0]:
        dropout = _descendant(layer, family.dropout[0])
        assignments.append((dropout, "__class__", type(dropout), HandoffDropout))
    context.swap(name, class_name, fusion.label(class_name), *assignments)


def _unfusable(layer, family) -> str | None:
    """Why the forward of `layer` cannot be rewritten whatever it computes, or None."""
    if "forward" in layer.__dict__:
        return "its forward is replaced on the instance, which the rewritten forward would not do"
    try:
        signature = inspect.signature(type(layer).forward)
    except (TypeError, ValueError) as error:
        return f"its forward's signature cannot be read ({error})"
    parameters = list(signature.parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return "its forward takes *args, which the rewritten forward would not pass on"
    named = [p.name for p in parameters if p.kind is not p.VAR_KEYWORD]
    # the hidden state first; with a residual passed in, the two alone
    if len(named) < family.inputs or (family.inputs == 2 and len(named) != 2):
        what = "the hidden state and the residual" if family.inputs == 2 else "the hidden state"
        return f"its forward takes {', '.join(named) or 'no argument'}, not {what} first"
    return None


def _norm_replacement(context, norm, name):
    """The generated norm the norm probe proves for `norm` (whatever include and exclude say of
    norms), or None and why."""
    if isinstance(norm, context.own):
        return norm, None
    swapped = context.done(norm)
    if swapped is not None:
        return swapped, None
    new, reasons = context.norm_replacement(norm, name)
    if new is not None:
        return new, None
    reasons = "; ".join(reasons)
    return None, (f"its norm {name.rsplit('.', 1)[-1]} ({type(norm).__name__}) "
                  + (f"has no generated twin: {reasons}" if reasons
                     else "is no candidate of any norm rule"))


def _fusion(context, rules, family, replacement):
    """The fusion that computes `norm(x + residual)` with `replacement`'s configuration: by the
    residual rule whose parameters are those of the rule that built the replacement."""
    if isinstance(replacement, patch_norm.LastDimNorm):
        norm_rules = [r for r in context.rules if r.kind == "norm"
                      and r.function is replacement.function]
        shape, eps = None, replacement.eps
        offsets = dict(replacement.options)
    else:
        norm_rules = [r for r in context.rules if r.kind == "norm"
                      and r.module is type(replacement)]
        shape, eps = tuple(replacement.normalized_shape), replacement.eps
        offsets = {offset: getattr(replacement, offset) for rule in norm_rules
                   for _, _, offset in rule.params if offset}
        # the other options the probe tried (a casting mode), as the replacement has them
        offsets |= {option: getattr(replacement, option) for rule in norm_rules
                    for option, _ in rule.tries if hasattr(replacement, option)}
    # an option tried away from its default (its first value): the fused op must take it too
    tried = {option: values[0] for rule in norm_rules for option, values in rule.tries}
    chosen = [(option, value) for option, value in offsets.items()
              if option in tried and value != tried[option]
              and option not in {o for r in norm_rules for _, _, o in r.params}]

    # the op's parameters as the norm's, but for an offset at 0, which the norm computes
    # without (a LayerNorm's, tried since its rule has one, where add_layer_norm takes none)
    def used(rule_params):
        return tuple((name, flag, offset if offset and offsets.get(offset, 0.0) != 0.0 else None)
                     for name, flag, offset in rule_params)

    params = {used(rule.params) for rule in norm_rules}
    matching = [r for r in rules if used(r.params) in params]
    if not matching:
        return None, (f"no add + norm op takes the parameters of its norm's "
                      f"{type(replacement).__name__}")
    rule = matching[0]
    missing = [option for option, _ in chosen if option not in probe.keywords(rule.function)]
    if missing:
        return None, (f"{rule.function.__name__} takes no {', '.join(missing)}, which its "
                      f"norm's {type(replacement).__name__} sets")
    tensors = tuple((param, getattr(replacement, param, None) is not None)
                    for param, _, _ in rule.params)
    options = [("eps", eps)]
    dropout = family.dropout is not None and DROPOUT in probe.keywords(rule.function)
    options += [(offset, float(offsets.get(offset, 0.0))) for _, _, offset in rule.params
                if offset]
    options += chosen
    if context.memory is not None and context.memory in rule.memory:
        options.append(("memory", context.memory))
    if swaps.IN_PLACE in probe.keywords(rule.function):
        options.append((swaps.IN_PLACE, True))
    return Fusion(family, rule.function, family.norm, tensors, tuple(options), shape,
                  dropout), None


def _difference(layer, family, fusion, dtype, device) -> tuple[str | None, Fusion]:
    """How the rewritten forward differs from `layer`'s on the probe, or None; and the fusion,
    returning a 1-tuple where the original forward does."""
    tail = fusion.shape or (probe.PROBE_WIDTH,)
    width = tail[-1]
    with probe.probing(device):
        noise, done = probe.Noise(), {}
        stand_ins = {}
        for index, (child_name, child) in enumerate(layer._modules.items()):
            if child is not None and child_name not in family.norms:
                stand_in = _StandIn(probe.SEED + index, width, child_name in family.pairs,
                                    dtype, device)
                # the plain settings of the child the layer may read (Gemma 3's
                # `self_attn.is_sliding` in transformers 4), the same in both forwards
                for key, value in vars(child).items():
                    if not key.startswith("_") and not hasattr(stand_in, key) \
                            and isinstance(value, bool | int | float | str | type(None)):
                        setattr(stand_in, key, value)
                stand_ins[child_name] = done[id(child)] = stand_in
        try:
            original = probe.twin(layer, noise, done)
        except Exception as error:  # noqa: BLE001 (any failure means: cannot be proven)
            return f"it cannot be copied to be probed: {probe.error(error)}", fusion
        rewritten = copy.copy(original)
        generator = torch.Generator().manual_seed(probe.SEED)
        inputs = [torch.randn((*PROBE_ROWS, *tail), generator=generator,
                              dtype=torch.float64).to(device=device, dtype=dtype)
                  for _ in range(family.inputs)]
        kwargs = _probe_keywords(type(layer), family)
        for training in (False, True):
            runs = []
            for twin in (original, rewritten):
                twin.train(training)
                for stand_in in stand_ins.values():
                    stand_in.calls.clear()
                try:
                    output = twin(*inputs, **kwargs)
                except Exception as error:  # noqa: BLE001
                    which = "its forward" if twin is original else "the rewritten forward"
                    return (f"{which} raised on the probe input: {probe.error(error)}",
                            fusion)
                runs.append((output, {n: list(s.calls) for n, s in stand_ins.items()}))
                if twin is original and not training:
                    # the original's return convention decides the rewritten one's
                    fusion = dataclasses.replace(
                        fusion, returns_tuple=isinstance(output, tuple) and len(output) == 1)
                    rewritten.__class__ = fused_class(type(layer), fusion)
            (reference, calls), (output, fused_calls) = runs
            mode = "training" if training else "eval"
            problem = _outputs_difference(reference, output, dtype)
            if problem is not None:
                return f"{fusion.label(type(layer).__name__)} {problem} (in {mode} mode)", fusion
            for child_name in stand_ins:
                if calls[child_name] != fused_calls[child_name]:
                    return (f"its forward calls {_calls(child_name, calls[child_name])}, the "
                            f"rewritten one {_calls(child_name, fused_calls[child_name])} (in "
                            f"{mode} mode)"), fusion
    return None, fusion


def _dropout_difference(layer, family, fusion, dtype, device) -> str | None:
    """How the rewritten forward with the layer's dropout fused differs from the original, or
    None: on a probe copy whose children but the norms and the dropout are stand-ins, in eval
    mode and in training with p = 0 the outputs must agree; in training with p > 0 the kept
    elements (those whose gradient reaches the dropout's input) must be about 1 - p of them,
    and the output and the gradients those of the original forward whose dropout applies that
    mask.

    A 16-bit layer is probed in float32: what this probe proves (which elements are dropped,
    the 1 / (1 - p) scale, where the gradient goes) has no dtype of its own, and the fused
    forward's 16-bit rounding was proven without dropout by `_difference`. In 16 bits the
    gradient through a stand-in sums terms far larger than itself, so one rounding of the fused
    op's (more exact) dropout gradient shows there as a difference of an ulp of those terms."""
    tail = fusion.shape or (probe.PROBE_WIDTH,)
    width = tail[-1]
    dropout_path, source = family.dropout
    fused = fused_class(type(layer), fusion)
    own = dtype
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    with probe.probing(device):
        noise, done, stand_ins = probe.Noise(), {}, {}
        for index, (child_name, child) in enumerate(layer._modules.items()):
            if child is not None and child_name not in family.norms + (dropout_path,):
                stand_ins[child_name] = _StandIn(probe.SEED + index, width,
                                                 child_name in family.pairs, dtype, device)
                done[id(child)] = stand_ins[child_name]
        if "." in dropout_path:
            # a dropout inside `source`: its stand-in applies a copy of it last, handed over
            handed = copy.copy(_descendant(layer, dropout_path))
            handed.__class__ = HandoffDropout
            stand_ins[source].add_module(dropout_path.rpartition(".")[2], handed)
        try:
            # the twin's tensors are its own copies: casting them leaves the layer as it is
            original = probe.twin(layer, noise, done).to(dtype)
        except Exception as error:  # noqa: BLE001 (any failure means: cannot be proven)
            return f"it cannot be copied to be probed: {probe.error(error)}"
        if "." in dropout_path:
            problem = _handover_difference(layer, dropout_path, source, tail, own, device)
            if problem is not None:
                return problem
        rewritten = copy.copy(original)
        rewritten.__class__ = fused
        dropout = _descendant(original, dropout_path)  # the twins share it
        p = dropout.p or PROBE_DROPOUT
        generator = torch.Generator().manual_seed(probe.SEED)
        inputs = [torch.randn((*PROBE_ROWS, *tail), generator=generator,
                              dtype=torch.float64).to(device=device, dtype=dtype)
                  for _ in range(family.inputs)]
        kwargs = _probe_keywords(type(layer), family)
        try:
            for training, probability in ((False, p), (True, 0.0)):
                dropout.p = probability
                outputs = [twin.train(training)(*inputs, **kwargs)
                           for twin in (original, rewritten)]
                problem = _outputs_difference(*outputs, dtype)
                if problem is not None:
                    mode = "training, p = 0" if training else "eval"
                    return f"{fusion.label(type(layer).__name__)} {problem} (in {mode} mode)"
            dropout.p = p
            return _mask_difference(original, rewritten, dropout_path, stand_ins[source],
                                    fusion, inputs, kwargs, p, dtype)
        except Exception as error:  # noqa: BLE001
            return f"the rewritten forward raised on the probe input: {probe.error(error)}"


def _handover_difference(layer, dropout_path, source, tail, dtype, device) -> str | None:
    """Why the dropout at `dropout_path` inside the child `source` cannot be handed over, or
    None: a copy of the child (its own tensors, the dropout handed over) is called in training
    on a probe hidden state alone, and must return that dropout's input as it is. The layer's
    stand-in probes take this on trust: they apply the dropout last, as this child does."""
    twin = probe.twin(layer._modules[source], None, {})
    handed = _descendant(twin, dropout_path.partition(".")[2])
    handed.__class__ = HandoffDropout
    handed.p = handed.p or PROBE_DROPOUT
    hidden = torch.randn((*PROBE_ROWS, *tail), generator=torch.Generator().manual_seed(
        probe.SEED), dtype=torch.float64).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            _, problem = _hand_over(handed, twin.train(True), (hidden,), {})
    except Exception as error:  # noqa: BLE001 (any failure means: cannot be proven)
        return f"{source} raised on the probe input: {probe.error(error)}"
    return None if problem is None else f"{source} {problem}"


class _MaskDropout(torch.nn.Module):
    """A dropout that applies a given keep mask, scaled by 1 / (1 - p), as torch's does."""

    def __init__(self, kept: torch.Tensor, p: float):
        super().__init__()
        self.kept, self.p = kept, p

    def forward(self, x):
        return torch.where(self.kept, x / (1 - self.p), torch.zeros_like(x))


def _hidden(output):
    """A layer's hidden states: its output, or the first of the outputs it returns as a tuple
    (transformers 4's decoder layers and GPT-2 blocks return `(hidden_states, ...)`)."""
    return output[0] if isinstance(output, tuple) and output else output


def _outputs_difference(reference, output, dtype) -> str | None:
    """How a layer's outputs differ, or None: one tensor, or a tuple of the same length whose
    tensors are compared one by one and whose other members (None, a cache) are the same."""
    if not isinstance(reference, tuple):
        return probe.difference(reference, output, None, dtype, False)
    if not isinstance(output, tuple) or len(output) != len(reference):
        what = f"{len(output)} outputs" if isinstance(output, tuple) else type(output).__name__
        return f"returned {what}, the module {len(reference)} outputs"
    for index, (want, got) in enumerate(zip(reference, output, strict=True)):
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            problem = probe.difference(want, got, None, dtype, False)
            if problem is not None:
                return f"{problem} in output {index}"
        elif want is not got:
            return (f"cannot be compared: its output {index} is a {type(want).__name__}, "
                    f"not a tensor")
    return None


def _mask_difference(original, rewritten, dropout_path, source, fusion, inputs, kwargs, p,
                     dtype) -> str | None:
    """The fused dropout of `rewritten` (in training, at `p`) judged by its mask, read off
    the gradient that reaches its input (the output of the stand-in `source`, before the
    dropout it applies where it holds it): about 1 - p of the elements kept, and the output and
    the gradients those of the original forward whose dropout applies that mask."""
    captured = []
    parent, _, dropout_name = dropout_path.rpartition(".")
    inside = bool(parent)
    handle = source.register_forward_hook(lambda module, args, output: captured.append(
        module.before if inside else output[0] if isinstance(output, tuple) else output))
    modules = (source if inside else original)._modules  # the twins share their children
    dropout = modules[dropout_name]
    results = []
    try:
        with torch.enable_grad():
            for twin in (rewritten, original):
                leaves = [x.clone().requires_grad_() for x in inputs]
                output = _hidden(twin.train(True)(*leaves, **kwargs))
                upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(
                    probe.SEED), dtype=torch.float64).to(output)
                grads = torch.autograd.grad(output, [captured[-1], *leaves], upstream)
                results.append((output, grads))
                if twin is rewritten:
                    kept = grads[0] != 0
                    count, n = int(kept.sum()), kept.numel()
                    if abs(count - n * (1 - p)) > BINOMIAL_SIGMAS * math.sqrt(n * p * (1 - p)):
                        return (f"the fused dropout kept {count} of {n} elements at p = {p} "
                                "(in training mode)")
                    modules[dropout_name] = _MaskDropout(kept, p)
    finally:
        handle.remove()
        modules[dropout_name] = dropout
    (output, grads), (reference, wanted) = results
    names = ["output", "the dropout input's gradient"] + [f"input {i}'s gradient"
                                                          for i in range(len(inputs))]
    for what, got, want in zip(names, (output, *grads), (reference, *wanted), strict=True):
        problem = probe.difference(want.detach(), got.detach(), None, dtype, False)
        if problem is not None:
            return (f"{fusion.label(type(original).__name__)}: {what} {problem} against the "
                    "original forward whose dropout applies the fused one's mask (in training "
                    "mode)")
    return None


def _calls(name: str, calls: list[str]) -> str:
    return " then ".join(f"{name}({call})" for call in calls) or f"no {name}"


def _probe_keywords(cls, family) -> dict[str, Any]:
    """A sentinel for every named argument after the input(s) but those the family leaves
    unset, and one more keyword where the forward takes **kwargs."""
    signature = inspect.signature(cls.forward)
    parameters = list(signature.parameters.values())[1:]
    kwargs = {p.name: False if p.name == ORIGINAL_IF_TRUE else _Sentinel(p.name)
              for p in parameters[family.inputs:]
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in
              family.unused}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        kwargs[PROBE_KEYWORD] = _Sentinel(PROBE_KEYWORD)
    return kwargs

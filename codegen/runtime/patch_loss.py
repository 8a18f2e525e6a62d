"""The "loss" kind of `patch_model()`: a Hugging Face language model's training loss computed by
a generated row loss, from the hidden states where the forward's structure allows, so that the
logits are never held whole.

A model is a candidate where its class name matches a "loss" rule (`*ForCausalLM`,
`*LMHeadModel`, `*ForMaskedLM`, `*ForConditionalGeneration`). How its loss is routed depends on
how its forward takes it (`loss_route`):

- through `self.loss_function` (transformers' causal LMs, `ForCausalLMLoss`): the function is
  replaced by `causal_lm_loss` of the rule's op, once a probe shows it computes the same; in
  training, where the forward's structure allows (proven on a probe of the whole model), the
  loss is taken from the hidden states by the op's linear variant instead (`CausalLMRoute`,
  below: lm_head returns a stand-in that holds no memory, and the loss function computes from
  the hidden states it was given);
- by the cross-entropy of the logits in the forward itself, or through the `loss_function` of a
  masked LM (BERT's, RoBERTa's, ModernBERT's masked LMs, T5's sequence-to-sequence LM): the
  loss of the labelled rows alone, from their hidden states (codegen/runtime/logits_route.py).

The planner calls `plan` once, after the walk of the modules; `loss_names` gives the names
`include` and `exclude` may select a loss by.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Callable

import torch

from codegen.runtime import dispatch, logits_route, probe

#: vocabulary and rows of a loss's probe
LOSS_CLASSES = 13
LOSS_SHAPE = (2, 6)
#: transformers' loss type (`model.loss_type`, from the class name) of a masked LM: its
#: `loss_function` takes the cross-entropy of the logits at every labelled position, unshifted
MASKED_LOSS_TYPE = "ForMaskedLM"


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


def plan(context, model):
    """Plan the loss swaps of the language models in `model` (itself included), each swap or
    skip recorded in `context` (a `swaps.PlanContext`)."""
    rules = [r for r in context.rules if r.kind == "loss"]
    for prefix, module in model.named_modules():
        matching = [r for r in rules if fnmatch.fnmatchcase(type(module).__name__, r.pattern)]
        route, old = loss_route(module) if matching else (None, None)
        if route == "logits":
            plan_logits(context, module, prefix, matching, old)
            continue
        if route is None:
            continue
        name = f"{prefix}.loss_function" if prefix else "loss_function"
        original = module.loss_function
        if (isinstance(original, functools.partial) and original.func is causal_lm_loss) \
                or is_route(original) or not context.allows("loss", old):
            continue
        dtype, device = probe.placement(module, context.default)
        problems = []
        for rule in matching:
            candidate = functools.partial(causal_lm_loss, rule.function)
            candidate.replaces = old  # its name in a later call's include and exclude
            problem = _loss_difference(original, candidate, dtype, device)
            if problem is None:
                # the training loss from the hidden states where the forward's structure
                # allows (`CausalLMRoute`), else from the logits
                linear = linear_function(rule.function)
                why = route_problem(module, linear, candidate, dtype, device)
                if why is None:
                    installer = functools.partial(install, linear=linear, fallback=candidate)
                    new = f"{linear.__name__}(hidden states, lm_head)"
                else:
                    context.skip(module, f"{prefix}.forward" if prefix else "forward",
                                 f"its training loss is computed from the whole logits: {why}")
                    installer = functools.partial(_set_loss, function=candidate)
                    new = f"causal_lm_loss({rule.function.__name__})"
                context.swap_loss(module, installer, name, old, new)
                break
            problems.append(problem)
        else:
            context.skip(module, name, "; ".join(dict.fromkeys(problems)), old)


def plan_logits(context, module, prefix, rules, old="CrossEntropyLoss"):
    """Plan the loss swap of a model whose forward takes the cross-entropy of its logits
    itself (a masked LM's), or through a `loss_function` that does (ModernBERT's
    `ForMaskedLMLoss`; `old`, its name): the training loss from the labelled rows' hidden
    states (codegen/runtime/logits_route.py)."""
    name = f"{prefix}.forward" if prefix else "forward"
    if logits_route.is_route(module.forward) or not context.allows("loss", old):
        return
    dtype, device = probe.placement(module, context.default)
    problems = []
    for rule in rules:
        linear = linear_function(rule.function)
        problem = logits_route.route_problem(module, linear, dtype, device)
        if problem is None:
            context.swap_loss(module, functools.partial(logits_route.install, linear=linear),
                              name, old, f"{linear.__name__}(labelled rows' hidden states, "
                              "output embeddings)")
            return
        problems.append(problem)
    context.skip(module, name, "its training loss stays the logits': "
                 + "; ".join(dict.fromkeys(problems)), old)


def _calls_loss_function(module) -> bool:
    """Whether the module's forward computes its loss through `self.loss_function`
    (transformers' causal LMs) rather than by itself."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is None or "loss_function" in code.co_names


def loss_route(module) -> tuple[str | None, str | None]:
    """How the loss of `module` (a candidate of a loss rule) is routed, and its name (what
    `include` and `exclude` select it by): "logits" for a forward that takes the cross-entropy
    of the logits itself ("CrossEntropyLoss"), or through the `loss_function` of a masked LM
    (transformers' `ForMaskedLMLoss`, ModernBERT's: its name), the labelled rows' loss then
    routed as the forward's own (`plan_logits`); "function" for the
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
    if is_route(function):
        return getattr(function.__self__, "replaces", "ForCausalLMLoss")
    replaced = getattr(function, "replaces", None)  # a causal_lm_loss `_set_loss` set
    if isinstance(replaced, str):
        return replaced
    return getattr(function, "__name__", type(function).__name__)


def loss_names(model, rules) -> set[str]:
    """The names of the losses of `model` and its submodules that a loss rule may swap (or
    swapped): what `include` and `exclude` may name them by."""
    patterns = [r.pattern for r in rules if r.kind == "loss"]
    names = set()
    for module in model.modules():
        if any(fnmatch.fnmatchcase(type(module).__name__, p) for p in patterns):
            names.add(loss_route(module)[1])
    return names - {None}


def _set_loss(module, function) -> None:
    module.loss_function = function


def _loss_difference(original, candidate, dtype, device) -> str | None:
    """How `candidate` differs from a causal-LM loss function on random logits and labels
    (with ignored labels, num_items_in_batch, shift_labels and ignore_index), or None."""
    with probe.probing(device):
        generator = torch.Generator().manual_seed(probe.SEED)
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
                return f"raised {probe.error(error)} (with {', '.join(kwargs) or 'no options'})"
            if not (isinstance(reference, torch.Tensor) and isinstance(output, torch.Tensor)):
                return "the model's loss function returned no tensor"
            problem = probe.difference(reference.reshape(1, -1), output.reshape(1, -1), None,
                                       torch.float32, False)
            if problem is not None:
                return f"causal_lm_loss {problem} (with {', '.join(kwargs) or 'no options'})"
    return None


# ---- the causal-LM route: the training loss from the hidden states ----------------------------

#: the probe's batch of token ids, and the labels it ignores (flat positions)
PROBE_TOKENS = (2, 6)
PROBE_IGNORED = (2, 7)


def linear_function(function):
    """The linear variant of a generated row loss (`linear_<name>` of its module), or None."""
    module = inspect.getmodule(function)
    return getattr(module, "linear_" + getattr(function, "__name__", ""), None)


class _Call:
    """One forward in progress: what lm_head was given, what it returned in place of the
    logits, and whether the loss read them."""

    __slots__ = ("hidden", "placeholder", "used")

    def __init__(self):
        self.hidden = self.placeholder = None
        self.used = False


class CausalLMRoute:
    """What `patch_model(model, loss=True)` installs on a Hugging Face causal-LM model whose
    forward has the standard structure (hidden states of `self.model`, `self.lm_head` of them,
    `self.loss_function` of its output), as the model's `forward` and `loss_function`.

    A training forward given labels runs the model's own forward with lm_head returning, in
    place of the logits, a stand-in of their shape that holds no memory (every stride 0);
    `loss_function`, handed that stand-in, computes transformers' causal-LM loss (labels
    shifted one left unless `shift_labels` is given, the mean over the counted tokens or the
    sum over `num_items_in_batch`) from the hidden states by `linear` (a chunked
    `linear_cross_entropy`), so the logits are never held whole; the output's `logits` are
    None. Any other call (no labels, eval mode, under torch.compile) is the model's own, its
    loss computed by
    `fallback` from the logits.

    A model whose config sets `final_logit_softcapping` (Gemma 2's and 3's: the forward caps
    the logits, cap·tanh(logits / cap), between lm_head and the loss; a multimodal model's text
    config, Gemma 3n's) runs the routed forward with the config's cap set aside, and the cap
    passes to `linear` as its `softcap`."""

    def __init__(self, model, linear, fallback):
        self.model, self.linear, self.fallback = model, linear, fallback
        self.forward = model.forward
        self.head = model.get_output_embeddings()
        #: the name of the loss function replaced (`patch_model`'s include and exclude take it)
        original = getattr(model, "loss_function", None)
        self.replaces = getattr(original, "__name__", type(original).__name__)
        #: the model's own loss function, which a call where the route loses keeps
        #: (`route_loses`)
        self.own = original
        #: the measurements of `linear`'s op that say where the route loses
        self.route = dispatch.of(linear)
        self.capped, self.cap = _softcap(model)
        names = [p.name for p in inspect.signature(self.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.labels_at = names.index("labels") if "labels" in names else None
        self.calls: list[_Call] = []

    def model_forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and self.labels_at is not None and len(args) > self.labels_at:
            labels = args[self.labels_at]
        if labels is None or not self.model.training or torch.compiler.is_compiling() \
                or self.route_loses(self.head.weight, logits_route.label_count(labels)):
            # a compiled graph takes the logits and their loss in whole (the compiler's own
            # fusion; a module attribute swapped and restored inside it, as below, is replayed
            # wrongly by some torch versions' graph capture); a call where the chunked loss
            # would be slower than the model's own (`route_loses`)
            return self.forward(*args, **kwargs)
        call = _Call()
        head = self.head
        own = head.__dict__.get("forward")

        def capture(hidden):
            call.hidden = hidden
            # the logits' shape, no memory: a forward that used them would show on the probe
            call.placeholder = hidden.new_zeros(()).expand(*hidden.shape[:-1],
                                                           head.out_features)
            return call.placeholder

        self.calls.append(call)
        head.forward = capture
        if self.cap is not None:  # the loss caps instead (class doc)
            self.capped.final_logit_softcapping = None
        try:
            output = self.forward(*args, **kwargs)
        finally:
            if own is None:
                del head.forward
            else:
                head.forward = own
            if self.cap is not None:
                self.capped.final_logit_softcapping = self.cap
            self.calls.pop()
        if call.placeholder is None:  # lm_head not called: nothing was computed in its place
            return output
        if not call.used:
            raise RuntimeError(
                f"{type(self.model).__name__}.forward did not hand lm_head's output to its "
                "loss_function unchanged, which the loss patched by patch_model(loss=True) "
                "needs: unpatch the model (a fresh copy) to compute its loss"
            )
        return _without(output, call.placeholder)

    def route_loses(self, tensor, rows: int) -> bool:
        """Whether a call of `rows` tokens on `tensor`'s device keeps the model's own loss:
        `dispatch.keeps_own`, the work being the output layer's multiply (rows x hidden x
        vocabulary), whose GPU time hides the host time of the chunked loss."""
        return dispatch.keeps_own(tensor, rows * self.head.weight.numel(), self.route)

    def loss(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        call = self.calls[-1] if self.calls else None
        if call is None or logits is not call.placeholder:
            rows = logits.numel() // max(logits.shape[-1], 1) if logits.dim() else 1
            loss = self.own if self.own is not None and self.route_loses(logits, rows) \
                else self.fallback
            return loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        call.used = True
        hidden = call.hidden
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        options = {"ignore_index": ignore_index, "out_dtype": torch.float32}
        if self.cap is not None:
            options["softcap"] = self.cap
        weight, bias = self.head.weight, self.head.bias
        if num_items_in_batch is None:
            return self.linear(hidden, weight, shift_labels, bias, **options)
        loss = self.linear(hidden, weight, shift_labels, bias, reduction="sum", **options)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch


def text_config(model):
    """The config of `model`'s text output: transformers' `get_text_config(decoder=True)`
    where the config has one (a multimodal model's `text_config`, LLaVA's, Qwen2-VL's; most
    models' own config), else the model's config (None where it has none)."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            text = get(decoder=True)
        except Exception:  # noqa: BLE001 (several text configs: none is the one)
            text = None
        if text is not None:
            return text
    return config


def vocab_size(model):
    """The vocabulary of `model`'s logits as its config says: its text config's
    `vocab_size` (`text_config`), else its own config's, or None."""
    for config in (text_config(model), getattr(model, "config", None)):
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None:
            return vocab
    return None


def _softcap(model):
    """The config whose `final_logit_softcapping` caps a model's logits before the loss (the
    model's own where it has that setting, Gemma 2's; else its text config, Gemma 3n's and
    Gemma 4's multimodal models'), and that cap or None."""
    config = getattr(model, "config", None)
    if not hasattr(config, "final_logit_softcapping"):
        config = text_config(model)
    return config, getattr(config, "final_logit_softcapping", None)


def _without(output, placeholder):
    """The model's output with the stand-in for the logits left out (None)."""
    if isinstance(output, tuple):  # return_dict=False
        return tuple(value for value in output if value is not placeholder)
    return type(output)(**{k: v for k, v in output.items() if v is not placeholder})


def install(model, linear, fallback):
    """Route `model`'s training loss through `linear` (`CausalLMRoute`)."""
    route = CausalLMRoute(model, linear, fallback)
    model.forward = route.model_forward
    model.loss_function = route.loss


def is_route(function) -> bool:
    """Whether a model's loss_function is one `install` set."""
    return isinstance(getattr(function, "__self__", None), CausalLMRoute)


def route_problem(model, linear, fallback, dtype, device) -> str | None:
    """Why `model`'s training loss cannot be computed by `install`'s route, or None: its
    structure, then a probe (a training forward of a few tokens, with and without
    num_items_in_batch, whose loss must be the model's own, dropout's draws the same)."""
    if linear is None:
        return "no linear variant of the loss function exists"
    problem = logits_route.structure_problem(model, device)
    if problem is not None:
        return problem
    head = model.get_output_embeddings()
    # a multimodal model's vocabulary is its text config's (LLaVA's `text_config.vocab_size`)
    vocab = vocab_size(model)
    if vocab != head.out_features:
        return (f"its lm_head has {head.out_features} outputs, its config's vocab_size is "
                f"{vocab}")
    _, cap = _softcap(model)
    if cap is not None and "softcap" not in inspect.signature(linear).parameters:
        return (f"its forward caps the logits (final_logit_softcapping = {cap}) between lm_head "
                "and the loss, and the loss takes no softcap")
    generator = torch.Generator().manual_seed(probe.SEED)
    tokens = torch.randint(0, vocab, PROBE_TOKENS, generator=generator)
    labels = tokens.clone()
    labels.view(-1)[list(PROBE_IGNORED)] = -100
    tokens, labels = tokens.to(device), labels.to(device)
    with probe.probing(device):
        try:
            plain = probe.twin(model, None, {}).train()
            routed = probe.twin(model, None, {}).train()
            install(routed, linear, fallback)
        except Exception as error:  # noqa: BLE001 (any failure means: not proven)
            return f"it cannot be copied to be probed: {probe.error(error)}"
        for kwargs in ({}, {"num_items_in_batch": torch.tensor(7, device=device)}):
            losses_ = []
            for twin in (plain, routed):
                torch.manual_seed(probe.SEED)  # the same dropout draws in both
                try:
                    losses_.append(twin(input_ids=tokens, labels=labels, **kwargs).loss)
                except Exception as error:  # noqa: BLE001 (any failure means: not proven)
                    return f"its forward raised on the probe: {probe.error(error)}"
            reference, output = losses_
            if not isinstance(reference, torch.Tensor):
                return "its forward returned no loss"
            problem = probe.difference(reference.reshape(1, -1), output.reshape(1, -1),
                                       None, dtype, False)
            if problem is not None:
                return (f"the loss from the hidden states {problem} (with "
                        f"{', '.join(kwargs) or 'no options'})")
    return None

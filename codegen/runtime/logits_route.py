"""The training loss of a model whose own forward takes the cross-entropy of its output
embeddings' logits (BERT's, RoBERTa's and ELECTRA's masked LMs, T5's sequence-to-sequence LM:
`CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))`), computed from the hidden states by a
chunked linear loss on the labelled rows alone.

A masked LM labels a few of its positions (BERT's recipe: 15%), but its head computes the
logits of every position, three (tokens x hidden x vocabulary) matrix products forward and
backward, and the loss reads and writes all of them in float32. The logits of an unlabelled row
change neither the loss nor any gradient, so only the labelled rows need them.

`patch_model(model, loss=True)` installs `LogitsRoute.model_forward` as such a model's
`forward`. A training call given labels runs the model's own forward with the output
embeddings returning `LazyLogits` in place of the logits: a tensor of their shape and dtype that
holds no memory (every stride 0) and records the hidden states it stands for. Reshaping it
gives another stand-in; `torch.nn.functional.cross_entropy` of it (which
`torch.nn.CrossEntropyLoss` calls) is computed by the linear loss from the hidden states of the
rows whose target is not `ignore_index`; casting it to float32 (transformers' `ForMaskedLMLoss`,
which ModernBERT's masked LM takes its loss by, starts with `logits.float()`) gives a stand-in
whose loss is returned in float32. Any other use computes the real logits first (one
matrix product, as the head would have) and applies to them, so nothing is ever wrong, only
slower. The output's `logits` is that stand-in. Any other call (no labels, eval mode, under
torch.compile) is the model's own. The probe refuses a model whose loss does not go through the
stand-in (BART adds a bias to its logits first): it would compute the logits whole anyway.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from codegen.runtime import dispatch, probe

#: reshaping methods whose result is another stand-in (the rows keep their order)
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten,
             torch.Tensor.contiguous, torch.reshape, torch.flatten}
#: dtype casts whose result is another stand-in where they cast to float32 or to the
#: stand-in's own dtype (transformers' `ForMaskedLMLoss` takes `logits.float()`): its loss is
#: computed from the hidden states as before (in float32, or float64 from float64 ones) and
#: returned in that dtype
_CASTS = {torch.Tensor.float, torch.Tensor.to}
#: a probe's tokens and the flat positions left unlabelled
PROBE_TOKENS = (2, 6)
PROBE_UNLABELLED = (0, 2, 3, 7, 8, 11)


class LazyLogits(torch.Tensor):
    """The logits `weight`·hidden + `bias` of an output embedding, not computed (module doc)."""

    @staticmethod
    def __new__(cls, hidden, weight, bias, linear, shape, dtype, route=None):
        placeholder = torch.zeros((), dtype=dtype, device=hidden.device).expand(shape)
        stand_in = torch.Tensor._make_subclass(cls, placeholder)
        stand_in.hidden, stand_in.weight, stand_in.bias = hidden, weight, bias
        stand_in.linear, stand_in.route = linear, route
        return stand_in

    def like(self, shape, dtype=None) -> LazyLogits:
        """The same logits, reshaped (and cast to `dtype`)."""
        return LazyLogits(self.hidden, self.weight, self.bias, self.linear, shape,
                          self.dtype if dtype is None else dtype, self.route)

    def real(self) -> torch.Tensor:
        """The logits themselves, in this stand-in's shape and dtype."""
        logits = torch.nn.functional.linear(self.hidden, self.weight, self.bias)
        return logits.reshape(self.shape).to(self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__" or func in (torch.Tensor.size,
                                                                    torch.Tensor.dim):
            # shape, dtype, device, ...: the stand-in's own, which are the logits'
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        first = args[0] if args else None
        if func in _RESHAPES and isinstance(first, LazyLogits):
            # the shape it would have, found on a tensor without memory
            with torch._C.DisableTorchFunctionSubclass():
                shape = func(torch.empty(first.shape, device="meta"), *args[1:], **kwargs).shape
            if shape and shape[-1] == first.shape[-1]:
                return first.like(shape)
        if func in _CASTS and isinstance(first, LazyLogits):
            dtype = _cast(func, first, args[1:], kwargs)
            if dtype is not None:
                return first.like(first.shape, dtype)
        if func is torch.nn.functional.cross_entropy and isinstance(first, LazyLogits):
            loss = _routed_loss(*args, **kwargs)
            if loss is not None:
                if first.route is not None:
                    first.route.routed += 1
                return loss

        def real(value):
            if isinstance(value, LazyLogits):
                return value.real()
            if isinstance(value, (list, tuple)):
                return type(value)(real(item) for item in value)
            return value

        return func(*real(args), **{k: real(v) for k, v in kwargs.items()})


def _cast(func, stand_in, args, kwargs):
    """The dtype a cast of `stand_in` (`func(stand_in, *args, **kwargs)`, one of `_CASTS`)
    gives where it is a stand-in too (to float32, or to its own dtype, on its device, nothing
    else asked), else None."""
    if func is torch.Tensor.float:
        dtype = torch.float32 if not args and not kwargs else None
    else:
        options = dict(kwargs)
        if args and isinstance(args[0], torch.dtype) and len(args) == 1:
            options.setdefault("dtype", args[0])
        elif args:
            return None
        dtype = options.pop("dtype", None)
        if options or not isinstance(dtype, torch.dtype):
            return None
    if dtype in (torch.float32, stand_in.dtype):
        return dtype
    return None


def _routed_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0):
    """cross_entropy(input, target, ...) of a stand-in from its hidden states, or None where
    the call is not one the linear loss takes (legacy size_average / reduce, class indices not
    along the last dim, probabilities as targets)."""
    linear = input.linear
    if (size_average is not None or reduce is not None
            or input.dim() != 2 or target.shape != input.shape[:1]
            or target.is_floating_point()):
        return None
    hidden = input.hidden.reshape(-1, input.hidden.shape[-1])
    target = target.to(hidden.device)
    options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
               "class_weight": weight, "reduction": reduction}
    if input.dtype != torch.result_type(input.hidden, input.weight):
        # cast (`_CASTS`): the loss in that dtype, computed from the hidden states as before
        if "out_dtype" not in inspect.signature(linear).parameters:
            return None
        options["out_dtype"] = input.dtype
    if reduction in ("mean", "sum"):
        # the labelled rows alone: an ignored row adds nothing to the loss nor to a gradient,
        # and a mean divides by the labelled rows (their weights) either way
        rows = input.route.rows_of(target, ignore_index) if input.route is not None else None
        if rows is None:
            rows = (target != ignore_index).nonzero().squeeze(1)
        hidden, target = hidden.index_select(0, rows), target.index_select(0, rows)
    return linear(hidden, input.weight, target, input.bias, **options)


#: the ignore_index the labelled rows are found for before the forward (transformers')
IGNORE_INDEX = -100


class _Labelled(NamedTuple):
    """A call's labels when its forward began: where their memory was, how many, their version
    and device, and the flat positions not IGNORE_INDEX."""

    address: int
    numel: int
    version: int
    device: torch.device
    rows: torch.Tensor


def _labelled(labels) -> _Labelled | None:
    """The labelled rows of a call's labels, found before its forward runs: `nonzero` waits
    for the GPU, and there it waits only for work queued before the step. Found where the
    loss takes them, it would wait for the whole forward, and the host, which runs ahead of the
    GPU while it queues the forward, would start queueing the backward with no lead: a step
    whose backward costs the host more time than the GPU would then run at the host's pace.
    None for labels that are not a contiguous tensor."""
    if not isinstance(labels, torch.Tensor) or not labels.is_contiguous() or \
            labels.is_floating_point():
        return None
    flat = labels.reshape(-1)
    return _Labelled(flat.data_ptr(), flat.numel(), labels._version, labels.device,
                     (flat != IGNORE_INDEX).nonzero().squeeze(1))


def label_count(labels) -> int:
    """The tokens of a call's labels (a tensor, or what torch.as_tensor takes)."""
    return labels.numel() if isinstance(labels, torch.Tensor) else torch.as_tensor(labels).numel()


class LogitsRoute:
    """What `install` sets on a model: its `forward` (module doc)."""

    def __init__(self, model, linear):
        self.model, self.linear = model, linear
        self.forward = model.forward
        self.head = model.get_output_embeddings()
        #: the measurements of `linear`'s op that say where the route loses
        self.route = dispatch.of(linear)
        names = [p.name for p in inspect.signature(self.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.labels_at = names.index("labels") if "labels" in names else None
        #: the losses computed from the hidden states (the probe's proof that the forward
        #: takes the loss of the stand-in itself, not of logits it computed first)
        self.routed = 0
        #: per call in progress, its labels' labelled rows (`_Labelled`), or None
        self.labelled: list[_Labelled | None] = []

    def rows_of(self, target, ignore_index):
        """The labelled rows of `target` found before the call's forward ran, or None where
        `target` is not the call's labels as they were then (another tensor, another
        ignore_index, modified since)."""
        found = self.labelled[-1] if self.labelled else None
        if (found is None or ignore_index != IGNORE_INDEX or target.dim() != 1
                or target.device != found.device or target.numel() != found.numel
                or (target.numel() > 1 and target.stride(0) != 1)
                or target.data_ptr() != found.address or target._version != found.version):
            return None
        return found.rows

    def model_forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and self.labels_at is not None and len(args) > self.labels_at:
            labels = args[self.labels_at]
        if labels is None or not self.model.training or torch.compiler.is_compiling() \
                or dispatch.keeps_own(self.head.weight,
                                      label_count(labels) * self.head.weight.numel(), self.route):
            # where the chunked loss would be slower than the model's own: the work is the
            # output layer's multiply of every position (rows x hidden x vocabulary; the
            # labelled rows are not counted here, which would wait for the GPU)
            return self.forward(*args, **kwargs)
        head = self.head
        own = head.__dict__.get("forward")

        def lazy(hidden):
            shape = (*hidden.shape[:-1], head.out_features)
            dtype = torch.result_type(hidden, head.weight)
            return LazyLogits(hidden, head.weight, head.bias, self.linear, shape, dtype, self)

        head.forward = lazy
        self.labelled.append(_labelled(labels))
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.labelled.pop()
            if own is None:
                del head.forward
            else:
                head.forward = own


def install(model, linear):
    """Route `model`'s training loss through `linear` (`LogitsRoute`)."""
    model.forward = LogitsRoute(model, linear).model_forward


def is_route(forward) -> bool:
    """Whether a model's forward is one `install` set."""
    return isinstance(getattr(forward, "__self__", None), LogitsRoute)


def structure_problem(model, device) -> str | None:
    """Why `model`'s training loss cannot be routed from the hidden states whatever its
    forward computes, or None: its output embeddings must be a plain torch.nn.Linear without
    hooks or a forward of their own (named in the message by where the model holds them:
    lm_head, cls.predictions.decoder, ...), its forward must take input_ids and labels, and it
    must be where a probe can run. The causal-LM route (codegen/runtime/patch_loss.py) asks
    this too: both stand in for the output embeddings' logits."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return f"its output embeddings are a {type(head).__name__}, not a torch.nn.Linear"
    hooks = [name.strip("_") for name in ("_forward_pre_hooks", "_forward_hooks")
             if getattr(head, name, None)] + ["forward"] * ("forward" in head.__dict__)
    if hooks:
        where = next(name for name, module in model.named_modules() if module is head)
        return (f"its {where} has {' and '.join(hooks)} of its own, which would see the "
                "stand-in for the logits")
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    if "labels" not in parameters or "input_ids" not in parameters:
        return "its forward takes no input_ids and labels"
    if device.type == "meta":
        return "it is on the meta device, where its outputs cannot be compared"
    return None


def route_problem(model, linear, dtype, device) -> str | None:
    """Why `model`'s training loss cannot be routed, or None: its structure, then a probe (a
    training forward of a few tokens, some unlabelled, on a float64 copy whose Parameters are
    perturbed, whose loss and gradients must be the model's own, dropout's draws the same)."""
    if linear is None:
        return "no linear variant of the loss function exists"
    problem = structure_problem(model, device)
    if problem is not None:
        return problem
    vocab = model.get_output_embeddings().out_features
    generator = torch.Generator().manual_seed(probe.SEED)
    tokens = torch.randint(0, vocab, PROBE_TOKENS, generator=generator)
    labels = tokens.clone()
    labels.view(-1)[list(PROBE_UNLABELLED)] = -100
    tokens, labels = tokens.to(device), labels.to(device)
    # which rows and parameters the loss reaches has no dtype of its own, and the loss's
    # rounding is the cross-entropy kernels' (tested as such): the probe runs in float64, where
    # the gradients' sums over a vocabulary round far below what a wrong route would change
    # (in float32 a BERT-large gradient differed by 1.4e-7 at -1.0e-4 from its order of summing
    # alone, above a tolerance of 1.3e-8 at the scale of all the gradients)
    dtype = torch.float64
    with probe.probing(device), torch.enable_grad():
        # a copy with perturbed Parameters of its own, and a twin of it sharing them
        try:
            plain = probe.twin(model, probe.Noise(), {}).to(dtype).train()
            routed = probe.twin(plain, None, {}).train()
            route = LogitsRoute(routed, linear)
        except Exception as error:  # noqa: BLE001 (any failure means: not proven)
            return f"it cannot be copied to be probed: {probe.error(error)}"
        routed.forward = route.model_forward
        results = []
        for twin in (plain, routed):
            torch.manual_seed(probe.SEED)  # the same dropout draws in both
            try:
                loss = twin(input_ids=tokens, labels=labels).loss
            except Exception as error:  # noqa: BLE001 (any failure means: not proven)
                return f"its forward raised on the probe: {probe.error(error)}"
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return "its forward returned no loss that has a gradient"
            parameters = [p for p in twin.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, parameters, allow_unused=True)
            # one row of every gradient: judged at the scale of them all (a gradient that is 0
            # but for rounding, as an attention key bias's, has no scale of its own)
            reached = [g is not None for g in grads]
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None]).reshape(1, -1)
            results.append((loss.reshape(1, -1), reached, flat))
        if route.routed == 0:
            # right, but the logits computed whole all the same: no swap to report
            return ("its forward uses the logits otherwise than in the loss (adds to them, "
                    "scales them) before the cross-entropy, which then takes real logits")
        (want, want_reached, want_grads), (got, got_reached, got_grads) = results
        problem = probe.difference(want.detach(), got.detach(), None, dtype, False)
        if problem is not None:
            return f"the loss from the hidden states {problem}"
        if want_reached != got_reached:
            return "the loss from the hidden states reaches other parameters"
        problem = probe.difference(want_grads, got_grads, None, dtype, False)
        if problem is not None:
            return f"the parameters' gradients {problem}"
    return None

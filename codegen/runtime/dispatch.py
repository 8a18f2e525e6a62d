"""When a call runs torch's own op instead of the generated kernels.

A generated op's forward+backward costs a nearly flat host time per call (a Python
`autograd.Function`, its argument checks, its allocations and launches) that torch's C++ ops do
not pay. Below a size the kernels cannot win that back, and the step of a model that is bound by
host time gets slower. An op whose spec names a torch expression with the same result
(`reference=` of its API) therefore runs that expression:

- eagerly, for CUDA tensors whose elements times their last dim's size (rows x width^2: the
  multiply work of the transformer block around the op, whose GPU time hides the host time of
  a call) is below the op's measured `eager_below` (`python -m benchmarks.crossover --write`),
  or, where autograd records nothing (`torch.no_grad`, `torch.inference_mode`: a forward with
  no backward, whose host time is the forward's alone), below its `infer_below`, measured
  forward-only (`--inference`; unmeasured, `eager_below` decides there too);
- eagerly, for CPU tensors outside Triton's interpreter (`TRITON_INTERPRET=1`): there the
  alternative is the generated torch path (the derived formulas as plain torch ops, what meta
  and fake tensors and the interpreter's absence run), never faster than torch's own CPU op;
- under `torch.compile`, when the op measured faster traced as torch ops, which Inductor fuses
  with their neighbours, than as one opaque custom op (`compiled="torch"`).

Every argument is checked before the choice, on every path and device: a bad call raises the
same error naming the same argument whichever path would have run it (tests/test_paths.py).
Options torch's expression cannot express (a memory mode other than the default, active
dropout, a normalized_shape of several dims with parameters, ...) always run the kernels.
A route of `patch_model` (the fused residual add + norm of a layer, a loss from the hidden
states) keeps the model's own code where its fused ops would not win: below the crossover of the
op it calls (`own_below`, measured per route by `python -m benchmarks.crossover --routes`), on
CPU tensors outside the interpreter, and under `VJPFORGE_DISPATCH=torch` (`keeps_own`).
The environment variable `VJPFORGE_DISPATCH` decides for
the whole process: `kernels` (never torch's expression), `torch` (always, on every device), or
unset (each op's measurements and the rules above). `Dispatch.override` does the same per op,
for a block of code.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

#: VJPFORGE_DISPATCH values
MODES = ("kernels", "torch")
#: what an op runs under torch.compile
COMPILED = ("kernels", "torch")


def _mode() -> str | None:
    mode = os.environ.get("VJPFORGE_DISPATCH") or None
    if mode is not None and mode not in MODES:
        raise ValueError(f"VJPFORGE_DISPATCH must be one of {', '.join(MODES)} or unset, "
                         f"got {mode!r}")
    return mode


#: the process-wide choice (None: each op's measurements)
FORCED = _mode()


class Dispatch:
    """One op's choice between its generated kernels and torch's expression of it."""

    __slots__ = ("op", "eager_below", "compiled", "forced", "own_below", "infer_below")

    def __init__(self, op: str, eager_below: int = 0, compiled: str = "kernels",
                 own_below: int = 0, infer_below: int | None = None):
        if compiled not in COMPILED:
            raise ValueError(f"Dispatch({op!r}): compiled must be one of {COMPILED}, "
                             f"got {compiled!r}")
        self.op = op
        #: CUDA inputs whose rows x width^2 is below this run torch's expression (0: never)
        self.eager_below = int(eager_below)
        #: what runs under torch.compile
        self.compiled = compiled
        #: "kernels" or "torch" set by `override` (None: the measurements above)
        self.forced = None
        #: a patch_model route through this op keeps the model's own code for CUDA calls
        #: whose work (the route's measure: `keeps_own`) is below this (0: never)
        self.own_below = int(own_below)
        #: as `eager_below`, for calls autograd does not record (None: `eager_below`)
        self.infer_below = None if infer_below is None else int(infer_below)

    def to_torch(self, tensor: torch.Tensor) -> bool:
        """Whether a call on `tensor` (the op's first input, as given) runs torch's
        expression."""
        forced = self.forced or FORCED
        if forced is not None:
            return forced == "torch"
        if torch.compiler.is_compiling():
            return self.compiled == "torch"
        if not isinstance(tensor, torch.Tensor):
            return False
        if tensor.is_cuda:
            below = self.eager_below
            if self.infer_below is not None and not torch.is_grad_enabled():
                below = self.infer_below  # a forward alone: no backward's host time to hide
            return tensor.dim() > 0 and tensor.numel() * tensor.shape[-1] < below
        # a CPU call would run the generated torch path, the derived formulas as many torch
        # ops, where torch's expression is its own fused CPU op
        return without_kernels(tensor)

    @contextlib.contextmanager
    def override(self, mode: str | None = None, *, eager_below: int | None = None,
                 compiled: str | None = None, own_below: int | None = None,
                 infer_below: int | None = None):
        """Within the block, `mode` ("kernels", "torch") decides every call of this op (and
        every patch_model route through it), or `eager_below` / `compiled` / `own_below` /
        `infer_below` replace its measurements; restored on exit."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"override(): mode must be one of {MODES} or None, got {mode!r}")
        if compiled is not None and compiled not in COMPILED:
            raise ValueError(f"override(): compiled must be one of {COMPILED} or None, "
                             f"got {compiled!r}")
        saved = (self.forced, self.eager_below, self.compiled, self.own_below, self.infer_below)
        self.forced = mode
        if eager_below is not None:
            self.eager_below = int(eager_below)
        if compiled is not None:
            self.compiled = compiled
        if own_below is not None:
            self.own_below = int(own_below)
        if infer_below is not None:
            self.infer_below = int(infer_below)
        try:
            yield self
        finally:
            (self.forced, self.eager_below, self.compiled, self.own_below,
             self.infer_below) = saved

    def __repr__(self) -> str:
        return (f"Dispatch({self.op!r}, eager_below={self.eager_below}, "
                f"compiled={self.compiled!r}, own_below={self.own_below}, "
                f"infer_below={self.infer_below})")


def without_kernels(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a CPU tensor outside Triton's interpreter (`TRITON_INTERPRET=1`),
    where no generated kernel runs: a call takes the generated torch path instead."""
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"


def keeps_own(tensor: torch.Tensor, work: int = 0, route: Dispatch | None = None) -> bool:
    """Whether a swap of `patch_model` whose fused ops replace a stretch of the model's own
    code (a fused dropout + add + norm, a loss from the hidden states) runs that code instead
    for a call on `tensor`: where the dispatch is forced to torch (`VJPFORGE_DISPATCH=torch`),
    where no kernel would run the fused ops (`without_kernels`), and for a CUDA call whose
    `work` (the route's measure of the work around it that hides host time) is below the
    `own_below` that `route` (the called op's `Dispatch`) measured. Never under
    `torch.compile` (the callers decide there) or forced to the kernels."""
    forced = (route.forced if route is not None else None) or FORCED
    if forced is not None:
        return forced == "torch"
    if torch.compiler.is_compiling():
        return False
    if tensor.is_cuda:
        return route is not None and work < route.own_below
    return without_kernels(tensor)


def of(function) -> Dispatch | None:
    """The `Dispatch` of the generated module that defines `function`, or None."""
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    found = getattr(module, "DISPATCH", None)
    return found if isinstance(found, Dispatch) else None


@contextlib.contextmanager
def forcing(mode: str | None):
    """Within the block, `mode` ("kernels", "torch", or None: each op's measurements) decides
    for every op, as VJPFORGE_DISPATCH does for the process; restored on exit."""
    global FORCED
    if mode is not None and mode not in MODES:
        raise ValueError(f"forcing(): mode must be one of {MODES} or None, got {mode!r}")
    saved, FORCED = FORCED, mode
    try:
        yield
    finally:
        FORCED = saved


def added(*tensors):
    """The sum of the tensors that are not None, left to right (torch's promotion); a new
    tensor even when only one is given, as the generated op's result is."""
    present = [tensor for tensor in tensors if tensor is not None]
    total = present[0].clone() if len(present) == 1 else present[0]
    for tensor in present[1:]:
        total = total + tensor
    return total


def same_dtype(*tensors) -> bool:
    """Whether the tensors that are not None share one dtype (torch's CUDA layer norm refuses
    parameters of another dtype than its input, which the kernels take)."""
    dtype = tensors[0].dtype
    for tensor in tensors:  # a loop, no set: host time on every call that may dispatch
        if tensor is not None and tensor.dtype is not dtype:
            return False
    return True


def normalized(norm, total, *arguments, prenorm: bool = False):
    """`norm(total, *arguments)`, and with `prenorm` the sum `total` too (what a fused add +
    norm returns)."""
    output = norm(total, *arguments)
    return (output, total) if prenorm else output

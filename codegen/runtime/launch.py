"""The host path that generated launchers share: dtypes, row views, launch plans, column sums.

A launch plan keeps what launches the kernel Triton compiled for an earlier call with the same
key, so that later calls skip the JIT's per-call argument binding, specialization and cache
look-up: a launcher computes its key from the shapes, dtypes, strides and alignment of its
arguments (everything its schedule and Triton's compile depend on) and calls the plan's launch
function directly.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
import sys
import threading
from collections import namedtuple

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from codegen.runtime import checks, triton_helpers
from codegen.runtime.schedules import CACHE_SIZE, Schedule

#: the accumulator's Triton dtype per torch accumulator dtype
TRITON_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in fp32, or in fp64 for fp64 tensors."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=256)
def fp32_pair(value: float) -> tuple[float, float]:
    """A Python float as (its fp32 rounding, the rest): Triton passes floats as fp32, and the
    kernels add the two at the accumulator's precision."""
    value = float(value)
    high = struct.unpack("f", struct.pack("f", value))[0] if abs(value) < 3.0e38 else value
    return (high, value - high) if math.isfinite(high) else (value, 0.0)


def use_triton(tensor: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run them only under TRITON_INTERPRET=1;
    meta and fake tensors (FakeTensorMode) never: they have no memory for a kernel, and the
    torch path gives their results' shapes and dtypes."""
    if not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or tensor.is_meta:
        return False
    # the common tensor first: host time on every call
    return type(tensor) is torch.Tensor or not is_fake(tensor)


def ieee(device: torch.device):
    """The context a kernel runs in on `device`. On the CPU, Triton's interpreter evaluates
    every lane with NumPy, as the GPU does, the lanes past a row's or a block's end and a
    select's other branch included: there the kernels compute and discard IEEE specials (log 0
    of a masked row's empty sum, 0/0), which the GPU does silently and NumPy would warn about,
    each time; it computes them silently too. On a GPU: nothing."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    import numpy  # the interpreter's own dependency: the GPU path never needs it

    return numpy.errstate(all="ignore")


def rows(shape, tensor: torch.Tensor) -> torch.Tensor:
    """An (M, N) view whose last dim has stride 1, copying only when it must."""
    if tensor.dim() == 2 and tensor.shape[1] == shape[1] and tensor.stride(1) == 1:
        return tensor  # already rows (same number of elements): no reshape, no host time
    viewed = tensor.reshape(shape)
    return viewed if viewed.stride(-1) == 1 or viewed.numel() == 0 else viewed.contiguous()


def memory_order(first: torch.Tensor, *others) -> tuple[int, ...] | None:
    """The order of `first`'s dims (its last one last) in which its rows lie densely in memory,
    where that is not the order they have (attention's q, a (B, T, H, D) buffer seen as
    (B, H, T, D)), and every tensor of `others` (None, or of `first`'s shape) has its strides:
    an op run over the permuted rows reads them in place, and its result, permuted back, keeps
    the input's layout as torch's elementwise ops do. None: run in the order given."""
    if first.dim() < 3 or first.is_contiguous() or first.stride(-1) != 1:
        return None
    strides = first.stride()
    order = checks.remembered(_dense_order, strides, first.shape)
    if order is None or any(other is not None and other.stride() != strides
                            for other in others):
        return None
    return order


@functools.lru_cache(maxsize=1024)
def _dense_order(strides, sizes) -> tuple[int, ...] | None:
    """`memory_order` of one tensor, from its strides and sizes (a pure function of them,
    remembered: every layer of a model calls with the same ones)."""
    # the leading dims by decreasing stride, equal ones in their order: an insertion sort of
    # comparisons, which torch.compile traces over symbolic strides (sorted's keys it cannot)
    leading = []
    for dim in range(len(sizes) - 1):
        at = len(leading)
        while at and strides[leading[at - 1]] < strides[dim]:
            at -= 1
        leading.insert(at, dim)
    order = (*leading, len(sizes) - 1)
    expected = 1  # the permuted view's contiguity, from the sizes and strides (no view taken)
    for dim in reversed(order):
        if sizes[dim] != 1 and strides[dim] != expected:
            return None
        expected *= sizes[dim]
    return order


def permuted_shape(shape: torch.Size, order: tuple[int, ...]) -> torch.Size:
    """The shape of a tensor of `shape` with its dims in `order`, without taking the view."""
    return torch.Size([shape[dim] for dim in order])


def unpermuted(tensor: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """A result computed over inputs whose dims were put in `order`, its dims back in the
    caller's order."""
    if order is None:
        return tensor
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tensor.permute(inverse)


def layout(order: tuple[int, ...] | None, shape, columns: int) -> tuple:
    """How an autograd Function's dense tensors map to the (M, N) rows its kernels take: the
    dims' `order` (None: as given), the `shape` they have in that order, and (M, N). The
    Function makes its rows and shapes its results itself, where autograd records nothing:
    each view taken outside would be a node of the graph, paid for in host time twice (once
    recorded, once run backward)."""
    return order, shape, (shape.numel() // columns if columns else 0, columns)


def row_layout(rows: torch.Tensor) -> tuple:
    """The layout of (M, N) rows taken as they are (a custom op's, which takes rows)."""
    return None, rows.shape, rows.shape


def to_rows(tensor: torch.Tensor | None, layout: tuple) -> torch.Tensor | None:
    """`tensor` (None, or a tensor of the layout's shape before `order`) as the layout's rows."""
    if tensor is None:
        return None
    if layout[0] is not None:
        tensor = tensor.permute(layout[0])
    return rows(layout[2], tensor)


def from_rows(tensor: torch.Tensor, layout: tuple) -> torch.Tensor:
    """(M, N) rows as a tensor of the layout's shape, its dims back in the caller's order: a
    view of `tensor` (a gradient the Function's backward returns)."""
    return unpermuted(shaped(tensor, layout[1]), layout[0])


def returned(tensor: torch.Tensor | None, layout: tuple) -> torch.Tensor | None:
    """A Function's result, computed as rows, in the layout's shape. Where that takes a view,
    the view is detached from the rows it was taken of: autograd forbids modifying in place a
    view a custom Function made (it could not rebase the Function's backward), which a
    tensor torch's own ops return allows; this one, of memory nothing else holds, is as
    torch's result."""
    if tensor is None:
        return None
    shaped_ = from_rows(tensor, layout)
    return shaped_ if shaped_ is tensor else shaped_.detach()


def returned_dense(tensor: torch.Tensor | None, layout: tuple) -> torch.Tensor | None:
    """A norm's result, computed as rows: in the layout's shape and contiguous, as torch's
    norms return theirs, where the rows lay in another order (a copy; else `returned`)."""
    if tensor is None or layout[0] is None:
        return returned(tensor, layout)
    return from_rows(tensor, layout).contiguous()


def overwritable(tensor: torch.Tensor | None, shape, dtype: torch.dtype) -> bool:
    """Whether a backward may write its result into `tensor`, an upstream gradient: autograd
    handed it to this backward alone (not a gradient that also flows into another branch, as
    the two inputs of an add share one, nor one the caller passed and keeps, nor one a node's
    post hook reads), it is no view into another tensor's memory, not differentiated itself,
    and it holds exactly the result's contiguous rows of the result's dtype.

    "Alone" is counted as `reusable` counts: against the holders of the probe Function's
    upstream gradient, which autograd hands over alone (`_calibrated`, once a process and
    interpreter state). The engine's own references differ between torch versions (2.11's
    keeps the list it passes a backward alive through the call; 2.13's moves it), never its
    references to a gradient it reads afterwards, which add one. Called from a generated
    backward (`backward(ctx, dy, ...)`, this call in its body), as the probe calls it."""
    if (tensor is None or not hasattr(tensor, "_use_count") or tensor.requires_grad
            or tensor._base is not None or torch.compiler.is_compiling()):
        return False
    return _alone(tensor, "upstream") and tensor.dtype == dtype and _whole_rows(tensor, shape)


def _whole_rows(tensor: torch.Tensor, shape) -> bool:
    """Whether `tensor` is exactly contiguous rows of `shape`'s size and the whole of its
    memory: a kernel's output written there touches nothing else."""
    return (tensor.is_contiguous() and tensor.numel() == math.prod(shape)
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


#: torch's "is the running backward's graph kept" (retain_graph / create_graph); absent from
#: a torch without it, where no backward reuses a saved input's memory
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _holders(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Who holds `tensor` (called through `_alone` from `reusable` and `overwritable` alone,
    whose frames the counts include):
    Python references to its object, C++ references to its TensorImpl, TensorImpls on its
    storage."""
    return (sys.getrefcount(tensor), tensor._use_count(),
            torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def reusable(tensor: torch.Tensor | None, rows, dtype: torch.dtype) -> bool:
    """Whether a backward may write the gradient of `tensor`, an input its Function saved,
    over that input's memory: autograd frees the saved input once this backward returns (the
    graph is not kept: no retain_graph, no create_graph), and nothing else holds it.

    "Nothing else" is counted, against the counts of a probe Function's saved input that
    nothing else holds (`_calibrated`, once a process and interpreter state): a Python
    reference (the caller kept the tensor, asked for its gradient), a C++ one (another node
    saved it, the same tensor saved twice, a leaf's gradient accumulator) or another tensor on
    its memory (a view, a detached alias) each adds one. The tensor is a non-leaf of
    autograd's graph, no view, and exactly the backward's contiguous rows of the gradient's
    dtype. Each element is read before it is written, by the program that writes it
    (elementwise backwards only)."""
    # a backward traced by torch.compile (compiled autograd) asks nothing of the running one
    if (tensor is None or _KEEP_GRAPH is None or torch.is_grad_enabled()
            or torch.compiler.is_compiling() or _KEEP_GRAPH() or tensor.grad_fn is None
            or tensor._base is not None or tensor.dtype != dtype):
        return False
    return _alone(tensor, "saved") and _whole_rows(tensor, rows)


def _alone(tensor: torch.Tensor, kind: str) -> bool:
    """Whether `tensor`'s holders are those the probe counted for its `kind` of tensor
    ("saved", "upstream"); while the probe runs, its count, and False."""
    holders = _holders(tensor)
    probed = getattr(_PROBING, "counts", None)
    if probed is not None:
        probed.append((kind, holders))
        return False
    return holders == _calibrated(_call_references()).get(kind)


def _passed(value) -> int:
    return sys.getrefcount(value)


def _call_references() -> int:
    """The Python references an object passed down one call level has there: what each frame
    between the backward and `_holders` adds to the counts. It changes within a process:
    CPython moves a call's arguments into the callee's frame, but holds them twice while
    an interpreter-wide frame evaluator is installed (PEP 523, as torch.compile installs and
    may leave), so the probe is counted again for each value."""
    value = object()
    return _passed(value)


#: the probe's counts, while `_calibrated` runs it on this thread (a CPU backward runs on the
#: thread that calls it)
_PROBING = threading.local()


class _Probe(torch.autograd.Function):
    """Saves its input and, in its backward, counts its holders and those of its upstream
    gradient as a generated backward does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        reusable(x, dy.shape, dy.dtype)
        overwritable(dy, dy.shape, dy.dtype)
        return dy


@functools.cache
def _calibrated(call_references: int) -> dict[str, tuple[int, int, int]]:
    """The holders of a saved input that nothing but autograd's saved value holds ("saved"),
    and of an upstream gradient autograd hands over alone ("upstream"), counted in a probe's
    backward on the CPU: torch's own references differ between versions, and the
    interpreter's per call (`call_references`, `_call_references()`, the key it is counted
    under). Empty where the probe counted anything else: then no memory is reused."""
    _PROBING.counts = counts = []
    try:
        with torch.enable_grad(), torch.inference_mode(False):
            leaf = torch.zeros(2, requires_grad=True, device="cpu")
            # a product's gradient: a tensor of its own, no view
            (_Probe.apply(leaf * 1) * 2).sum().backward()
        kinds = [kind for kind, _ in counts]
        return dict(counts) if kinds == ["saved", "upstream"] else {}
    finally:
        _PROBING.counts = None


#: the calls `each` keeps, while it runs its callables on this thread
_EACH = threading.local()


class _Kept:
    """What a call inside `each` returns in place of its Function's result: the index of the
    Function and arguments it kept."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class RowFunction(torch.autograd.Function):
    """A generated op's autograd Function (one for all its memory modes). Under torch.func
    transforms it applies the op's `functional` Function instead: the same results and
    derivatives as plain torch ops, which the transforms can wrap and vmap can batch (the
    kernels take whole tensors)."""

    #: set by the generated module
    functional: type[torch.autograd.Function]

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return cls.functional.apply(*args)
        return super().apply(*args)


def apply(function, *args):
    """`function.apply(*args)`. Autograd saves no inference tensor (one made under
    torch.inference_mode) for a backward: where it refuses one of `args`, the call is made again
    with such tensors copied, as torch's own ops save intermediates of their own beside an
    operand that needs grad. An inference tensor never requires grad: no gradient is lost."""
    try:
        return function.apply(*args)
    except RuntimeError:
        if not any(isinstance(arg, torch.Tensor) and arg.is_inference() for arg in args):
            raise
    return function.apply(*(arg.clone() if isinstance(arg, torch.Tensor) and arg.is_inference()
                            else arg for arg in args))


def applied(function, args: tuple):
    """`apply(function, *args)`, or, inside `each`, the call kept, to be applied with the others
    in one node of autograd's graph."""
    kept = getattr(_EACH, "calls", None)
    if kept is None or "apply" in vars(function) or torch._C._are_functorch_transforms_active():
        # a Function with its own apply, or one under torch.func transforms: as it is
        return apply(function, *args)
    kept.append((function, args))
    return _Kept(len(kept) - 1)


def each(*calls):
    """The results of `calls` (callables of no arguments, each one generated op's call), whose
    autograd Functions, where they are one class, become one node of autograd's graph
    (`_Each`): a node is host time in the forward and again in the backward. Rotary
    embeddings apply one op to q and to k, with the same tables. Under torch.compile the calls
    run as they are (each an opaque op there)."""
    if torch.compiler.is_compiling():
        return tuple(call() for call in calls)
    outer = getattr(_EACH, "calls", None)  # an `each` around this one keeps its own
    _EACH.calls = kept = []
    try:
        results = [call() for call in calls]
    finally:
        _EACH.calls = outer
    if not kept:
        return tuple(results)
    if len(kept) == 1 or any(function is not kept[0][0] for function, _ in kept):
        outputs = [apply(function, *args) for function, args in kept]
    else:
        counts = tuple(len(args) for _, args in kept)
        outputs = apply(_Each, kept[0][0], counts, *(a for _, args in kept for a in args))
    return tuple(outputs[r.index] if isinstance(r, _Kept) else r for r in results)


class _Part:
    """The ctx a generated Function's forward and backward see for one call inside `_Each`:
    the saved tensors, `needs_input_grad` and attributes of its own; the node's ctx marks
    what it marks."""

    def __init__(self, ctx, needs_input_grad):
        self.ctx, self.needs_input_grad = ctx, needs_input_grad
        self.saved = self.saved_for_forward = ()

    def save_for_backward(self, *tensors):
        self.saved = tensors

    def save_for_forward(self, *tensors):
        self.saved_for_forward = tensors

    @property
    def saved_tensors(self):
        return self.saved

    def set_materialize_grads(self, value):
        # the node's: off (each backward takes a None gradient as its Function does)
        pass

    def mark_non_differentiable(self, *tensors):
        self.ctx.mark_non_differentiable(*tensors)


class _Each(torch.autograd.Function):
    """Several calls of one generated Function as one node: its forward and backward run per
    call on the call's own arguments, each with a `_Part` for a ctx. Each call returns one
    tensor."""

    @staticmethod
    def forward(ctx, function, counts, *arguments):
        parts, outputs, saved, start = [], [], [], 0
        for count in counts:
            part = _Part(ctx, ctx.needs_input_grad[2 + start : 2 + start + count])
            output = function.forward(part, *arguments[start : start + count])
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"{function.__name__}: `each` takes Functions of one result")
            outputs.append(output)
            saved += part.saved
            part.count = len(part.saved)
            parts.append(part)
            start += count
        ctx.function, ctx.parts = function, parts
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*(t for part in parts for t in part.saved_for_forward))
        ctx.set_materialize_grads(False)
        for part in parts:
            # autograd holds the saved tensors now (and frees them after the backward); a part
            # holding them too, or the node (a reference cycle), would keep them until the
            # garbage collector breaks the cycle
            part.forward_count = len(part.saved_for_forward)
            part.saved, part.saved_for_forward, part.ctx = (), (), None
        return tuple(outputs)

    @staticmethod
    def jvp(ctx, _function, _counts, *tangents):
        saved, at, start, results = ctx.saved_tensors, 0, 0, []
        for part in ctx.parts:
            count = len(part.needs_input_grad)
            part.saved = saved[at : at + part.forward_count]
            at += part.forward_count
            results.append(ctx.function.jvp(part, *tangents[start : start + count]))
            part.saved = ()
            start += count
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        saved, at = ctx.saved_tensors, 0
        results = [None, None]
        for part, grad in zip(ctx.parts, grads, strict=True):
            part.saved = saved[at : at + part.count]
            at += part.count
            results += ctx.function.backward(part, grad)
            part.saved = ()
        return tuple(results)


def shaped(tensor: torch.Tensor, shape) -> torch.Tensor:
    """tensor.reshape(shape), skipped when it has that shape already (host time)."""
    return tensor if tensor.shape == shape else tensor.reshape(shape)


def partials(
    needed: bool, schedule: Schedule, N: int, acc: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Per-program fp32 column partials, summed once at the end: deterministic, no atomics.
    A persistent kernel writes every row of them; a looped one accumulates into them; the
    programs of a split kernel's group write one row, each its slab of it."""
    if not needed:
        return None
    count = schedule.programs // schedule.split if schedule.split else schedule.programs
    return torch.empty((count, N), dtype=acc, device=device)


def refused(error: BaseException) -> bool:
    """Whether a launch error is a refused cooperative launch (nothing ran; CUDA's error is not
    sticky)."""
    return "cooperative" in str(error)


#: a launch plan: the schedule, and how to launch the kernel Triton compiled for the call that
#: made it (`launch(grid, 1, 1, stream, *head, *arguments, *tail)`, tail: the constexprs' values)
Plan = namedtuple("Plan", "schedule launch grid head tail")

_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)
_VERSION = tuple(map(int, triton.__version__.split(".")[:2]))
#: Triton versions whose compiled kernels launch as plans call them (the JIT's own call: grid,
#: stream, function, packed metadata, launch metadata and hooks, then every argument)
_DIRECT = _RUNTIME is not None and (3, 6) <= _VERSION <= (3, 9)
#: triton 3.6, whose launcher object only allocates scratch memory in Python before its C
#: function: a kernel that takes none is launched through the C function itself
_C_LAUNCH = _VERSION == (3, 6)


def specializations(args) -> list:
    """Kernel arguments as a launch key at least as fine as what Triton's JIT compiles a kernel
    apart for (an int's being 1, a multiple of 16 or within int32; a tensor's dtype and 16-byte
    alignment; floats all fp32): ints, bools and None as themselves, any float as float, a
    tensor as its dtype and address modulo 16."""
    return [
        a
        if (kind := a.__class__) is int or kind is bool or a is None
        else float
        if kind is float
        else (a.dtype, a.data_ptr() & 15)
        for a in args
    ]


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a callable, or a chain that holds some."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct() -> bool:
    """Whether a CUDA call may launch through a plan: a Triton version whose launcher plans
    call, and no launch hooks (profilers), which only the JIT's path calls."""
    # every launcher asks once per call: the common case (no hook at all) is two reads
    if not _DIRECT:
        return False
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    if enter is None and leave is None:
        return True
    return not (_hooked(enter) or _hooked(leave))


def make_plan(
    schedule: Schedule | None, kernel, compiled, grid, positional: int, constexprs: dict
) -> Plan | None:
    """What launches `compiled` again, or None where it cannot: only where the call gave every
    parameter after its `positional` arguments by name (`constexprs`, in any order: the plan
    passes their values in the kernel's signature order, as the launcher takes them). Triton's
    options (debug, ...) are those of this call."""
    if not isinstance(kernel, triton.runtime.JITFunction):
        return None
    names = kernel.arg_names[positional:]
    if len(names) != len(constexprs) or set(names) != set(constexprs):
        return None
    run = compiled.run
    if _C_LAUNCH and not run.global_scratch_size and not run.profile_scratch_size:
        launch_function, head = (
            run.launch,
            (
                compiled.function,
                run.launch_cooperative_grid,
                run.launch_pdl,
                None,
                None,
                compiled.packed_metadata,
                None,
                None,
                None,
            ),
        )
    else:
        launch_function, head = run, (compiled.function, compiled.packed_metadata, None, None, None)
    return Plan(schedule, launch_function, grid, head, tuple(constexprs[name] for name in names))


#: plans of `launch`, keyed by kernel
PLANS: dict = {}


def launch(kernel, grid, warps, maxnreg, *args, **constexprs):
    """kernel[grid](*args, **constexprs, num_warps=warps, maxnreg=maxnreg), keyed by
    `specializations`: a CUDA call keyed as an earlier one launches the kernel Triton compiled
    then without the JIT's per-call binding and checks."""
    if not (args[0].is_cuda and direct()):
        with ieee(args[0].device):
            return kernel[grid](*args, **constexprs, num_warps=warps, maxnreg=maxnreg)
    device = torch._C._cuda_getDevice()
    key = (id(kernel), device, warps, maxnreg, *constexprs.values(), *specializations(args))
    plan = PLANS.get(key)
    if plan is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=warps, maxnreg=maxnreg)
        made = make_plan(None, kernel, compiled, grid, len(args), constexprs)
        if made is not None:
            if len(PLANS) >= CACHE_SIZE:
                PLANS.clear()
            PLANS[key] = made
        return compiled
    plan.launch(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        1,
        torch._C._cuda_getCurrentRawStream(device),
        *plan.head,
        *args,
        *plan.tail,
    )


#: the column sums of the partials: a program sums BLOCK_C columns over BLOCK_P partial rows
#: at a time (wider under the interpreter, which runs its programs one after another)
COLUMN_SUM_BLOCK_P, COLUMN_SUM_BLOCK_C, INTERPRETER_COLUMN_SUM_BLOCK_C = 256, 32, 4096

#: launch plans of the column sums, keyed by device, partial rows, columns, partial and result
#: dtypes
SUM_PLANS: dict = {}


def column_sums(*stores):
    """Each (partials of shape (P, N) or None, a tensor of the result's dtype) summed over its P
    rows and cast: one launch for up to three of them instead of a sum and a cast each."""
    needed = [(partial, like) for partial, like in stores if partial is not None]
    if not needed:
        return (None,) * len(stores)
    first = needed[0][0]
    P, N = first.shape
    device = first.device
    sums = [torch.empty(N, dtype=like.dtype, device=device) for _, like in needed]
    if len(needed) <= 3 and first.is_cuda and direct():
        # a backward's every call sums the same shapes: launch the kernel compiled for the first
        # one through its plan, with no per-call argument binding
        pointers = []
        for (partial, _), total in zip(needed, sums, strict=True):
            pointers += (partial.data_ptr(), total.data_ptr())
        # the partials' dtype (the accumulator's) is part of the compiled kernel as much as the
        # results' is: an fp64 input's partials under an fp32 input's plan read garbage
        key = (device.index, P, N, *(partial.dtype for partial, _ in needed),
               *(total.dtype for total in sums))
        plan = SUM_PLANS.get(key)
        aligned = not functools.reduce(int.__or__, pointers) & 15
        if plan is not None and aligned:
            plan.launch(
                plan.grid[0], plan.grid[1], 1, torch._C._cuda_getCurrentRawStream(device.index),
                *plan.head, *pointers, *(None, None) * (3 - len(needed)), P, N, *plan.tail,
            )
        else:
            made = _sum_launch(needed, sums, P, N)
            if aligned and made is not None:
                if len(SUM_PLANS) >= CACHE_SIZE:
                    SUM_PLANS.clear()
                SUM_PLANS[key] = made
    else:
        for first_store in range(0, len(needed), 3):
            _sum_launch(
                needed[first_store : first_store + 3], sums[first_store : first_store + 3], P, N
            )
    found = iter(sums)
    return tuple(next(found) if partial is not None else None for partial, _ in stores)


def _sum_launch(needed, sums, P, N) -> Plan | None:
    """One launch of the column sums kernel through Triton's JIT, for up to three pairs; the
    plan that launches the same compiled kernel again."""
    pairs = []
    for (partial, _), total in zip(needed, sums, strict=True):
        pairs += (partial, total)
    count = len(pairs) // 2
    # plain integer arithmetic: triton.cdiv and next_power_of_2 cost µs of host time each
    block_p = min(COLUMN_SUM_BLOCK_P, 1 << (P - 1).bit_length())
    block_c = COLUMN_SUM_BLOCK_C if pairs[0].is_cuda else INTERPRETER_COLUMN_SUM_BLOCK_C
    grid = (-(-N // block_c), count)
    arguments = (*pairs, *(None, None) * (3 - count), P, N)
    constexprs = {"COUNT": count, "BLOCK_P": block_p, "BLOCK_C": block_c}
    with ieee(pairs[0].device):
        compiled = triton_helpers.column_sums_kernel[grid](*arguments, **constexprs, num_warps=4)
    if not pairs[0].is_cuda:
        return None
    return make_plan(None, triton_helpers.column_sums_kernel, compiled, grid, len(arguments),
                     constexprs)

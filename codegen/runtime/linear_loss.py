"""A row loss of a linear layer's outputs, `loss(input @ weight.T + bias, target)`, computed
chunk by chunk over the rows so that the (rows, classes) logits never exist whole: a language
model's last projection and its cross-entropy, where the logits of a long batch over a large
vocabulary would take more memory than the rest of the step.

Each chunk's logits are one matmul (cuBLAS, accumulating in fp32) into one buffer reused by
every chunk; the generated loss kernels then give the chunk's per-row losses and, where a
gradient is wanted, d loss / d logits, from which two more matmuls give the chunk's rows of
d input and its term of d weight (and a column sum its term of d bias). A generated module
supplies those kernels as `Kernels` (codegen/templates/api_linear_loss.py.j2); this module
checks the linear layer's arguments and runs the chunks.

Where d weight is wanted and the loss's backward kernels take a window of the row (a block of
the classes, `Kernels.windowed`), the forward keeps each row's statistics and the backward
goes over the classes a block at a time: the block's logits for the rows again, their
gradient given the statistics, then d weight of the block as one matmul over all the rows
(accumulated in fp32 by cuBLAS and rounded once, as torch's own d weight), d input summed
over the blocks in fp32. No (classes, features) fp32 accumulator then exists: the price is
the logits computed twice, one matmul more than the row chunks take.

Otherwise (no d weight wanted, or kernels without windows), with reduction "mean" or "sum" the
gradients are computed in the forward, while the chunk's logits are at hand, at d loss = 1
(the mean's 1 / count per row), and the backward scales them by the incoming gradient: the
logits are computed once. With "none" the incoming gradient is one per row, known only in the
backward, which computes each chunk's logits again.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from codegen.runtime import amp, checks, launch, losses
from codegen.runtime.checks import DeviceError, DtypeError, OptionError, ShapeError


class Kernels(NamedTuple):
    """A row loss's generated kernels, its options bound. `forward(x, target, saving,
    wanted=())`: the forward launcher's outputs for the (rows, classes) logits x, the per-row
    loss first, then the outputs returned on request (`RowLossAPI.returns`: one a flag of
    `wanted`, None where not wanted) and, with `saving`, the row statistics the backward
    reads; `backward(x, target, outputs,
    dloss, col_start=0, row_length=None)`: d loss / d x (x's dtype, written over x) for the
    per-row upstream gradients dloss; with `windowed`, x may be a block of the classes,
    columns col_start .. col_start + x.shape[1] of rows of row_length."""

    forward: Callable
    backward: Callable
    windowed: bool = False


class Plan(NamedTuple):
    """How one call runs: its name (for errors), kernels, reduction, rows per chunk, the
    dtype of the loss it returns, and whether each output returned on request is wanted."""

    function: str
    kernels: Kernels
    reduction: str
    chunk: int
    dtype: torch.dtype
    wanted: tuple[bool, ...] = ()


def check_linear(function, input, weight, bias):
    """torch.nn.functional.linear's arguments: `input` (..., H) and `weight` (V, H) of one
    floating dtype, `bias` None or (V,) of that dtype, all on one device. Under autocast they
    are cast to its dtype, as F.linear's are. Returns them, and the dtype of the loss: the
    input's, float32 under autocast (which computes cross-entropy in float32)."""
    checks.check_input(function, input, "input")
    if input.dim() == 0:
        raise ShapeError(
            f"{function}(): argument 'input' must have at least 1 dim (the features), got a "
            "0-d tensor"
        )
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{function}(): argument 'weight' must be a torch.Tensor, got {type(weight).__name__}"
        )
    features = input.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != features:
        raise ShapeError(
            f"{function}(): argument 'weight' must have shape (classes, {features}) (the "
            f"features of 'input' last), got {list(weight.shape)}"
        )
    tensors = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(
                f"{function}(): argument 'bias' must be a torch.Tensor or None, got "
                f"{type(bias).__name__}"
            )
        if bias.shape != weight.shape[:1]:
            raise ShapeError(
                f"{function}(): argument 'bias' must have shape ({weight.shape[0]},) (one per "
                f"class, the rows of 'weight'), got {list(bias.shape)}"
            )
    for name, tensor in tensors:
        if tensor.device != input.device:
            raise DeviceError(
                f"{function}(): argument '{name}' must be on the device of 'input' "
                f"({input.device}), got {tensor.device}"
            )
    dtype = input.dtype
    if amp.enabled(input.device.type):
        # F.linear runs in autocast's dtype, cross-entropy in float32
        cast = torch.get_autocast_dtype(input.device.type)
        input, weight = input.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
        return input, weight, bias, torch.float32
    for name, tensor in tensors:
        if tensor.dtype != dtype:  # F.linear does not promote
            raise DtypeError(
                f"{function}(): argument '{name}' must have the dtype of 'input' ({dtype}), "
                f"got {tensor.dtype}"
            )
    return input, weight, bias, dtype


def logits_like(input, weight):
    """A stand-in for the logits, of their shape (..., V), dtype and device, holding no
    memory (every stride 0): what the target's checks compare with."""
    return input.new_empty(()).expand(*input.shape[:-1], weight.shape[0])


def check_class_weight(function, class_weight, logits):
    """Class weights as cross_entropy's `weight` (`losses.check_weight`), named as this
    function takes them."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, torch.Tensor):
        raise TypeError(
            f"{function}(): argument 'class_weight' must be a torch.Tensor or None, got "
            f"{type(class_weight).__name__}"
        )
    classes = logits.shape[-1]
    if class_weight.shape != (classes,):
        raise ShapeError(
            f"{function}(): argument 'class_weight' must have shape ({classes},) (a weight per "
            f"class, the rows of 'weight'), got {list(class_weight.shape)}"
        )
    if class_weight.device != logits.device:
        raise DeviceError(
            f"{function}(): argument 'class_weight' must be on the device of 'input' "
            f"({logits.device}), got {class_weight.device}"
        )
    if class_weight.dtype not in checks.FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument 'class_weight' must have dtype float16, bfloat16, float32 "
            f"or float64, got {class_weight.dtype}"
        )
    if class_weight.requires_grad and torch.is_grad_enabled():
        raise OptionError(
            f"{function}(): argument 'class_weight' is not differentiated (as cross_entropy's "
            "weight) and must not require grad; pass class_weight.detach()"
        )
    return class_weight.contiguous()


def check_chunk_size(function, chunk_size):
    """None, or a number of rows of at least 1 (an int)."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(
            f"{function}(): argument 'chunk_size' must be an int or None, got "
            f"{type(chunk_size).__name__}"
        )
    if chunk_size < 1:
        raise OptionError(
            f"{function}(): argument 'chunk_size' must be at least 1, got {chunk_size}"
        )
    return int(chunk_size)


#: the least memory a default chunk's logits take: a chunk of few rows makes a skinny matmul
#: and, in the blocked backward, narrow blocks of classes. Forward + backward of 4096 rows,
#: bf16, H100 (`python -m benchmarks.linear_loss`): a 1536 x 151936 head 13.2 ms in 256-row
#: chunks (78 MB of logits), 12.0 in 512 (156 MB), 12.1 in 1024; a 2048 x 32000 head 9.7 ms in
#: 256-row chunks (16 MB), 5.4 in 512, 4.0 in 1024 (66 MB); torch's logits-whole 17.9, 4.6
MIN_CHUNK_BYTES = 128 << 20
#: a floor's rows are a multiple of this
CHUNK_ROWS_STEP = 128


def chunk_rows(function, rows, features, classes, chunk_size, itemsize=2):
    """Rows per chunk. By default a chunk's logits take about the input's memory (the rows over
    ceil(classes / features), rounded up to a power of two, so that calls of nearby sizes
    share the kernels' compiled plans), but at least MIN_CHUNK_BYTES of `itemsize`-byte
    logits; `chunk_size` sets it."""
    chunk_size = check_chunk_size(function, chunk_size)
    if chunk_size is not None:
        return max(1, min(chunk_size, rows))
    factor = triton.cdiv(classes, max(features, 1))
    floor = triton.cdiv(triton.cdiv(MIN_CHUNK_BYTES, max(classes * itemsize, 1)),
                        CHUNK_ROWS_STEP) * CHUNK_ROWS_STEP
    chunk = max(triton.next_power_of_2(triton.cdiv(rows, max(factor, 1))), floor)
    return max(1, min(chunk, rows))


def linear_loss(function, input, weight, bias, target, counted, reduction, chunk_size, dtype,
                kernels, returns=(), ignore_index=None):
    """The loss of `input @ weight.T + bias` against `target` (checked: `check_linear`,
    `losses.check_target`), chunk by chunk. `counted`: the mean's divisor (the count of the
    counted rows, or the sum of their class weights), used with reduction "mean".

    `returns`: for each output the loss's kernels return on request (`RowLossAPI.returns`),
    how it is reduced (`RowLossAPI.returns_as`: "loss", "fraction", "index"), or None where it
    is not wanted. Where any is, the result is (loss, each wanted one): their per-row values
    are taken from each chunk's kernels beside its losses, never differentiated."""
    features = input.shape[-1]
    shape = input.shape[:-1]
    x = launch.rows((-1, features), input)
    target = target.reshape(-1).contiguous()
    chunk = chunk_rows(function, x.shape[0], features, weight.shape[0], chunk_size,
                       x.element_size())
    plan = Plan(function, kernels, reduction, chunk, dtype,
                tuple(how is not None for how in returns))
    extras = [None] * len(returns)  # the per-row values of the wanted ones, filled by the sweep
    if checks.needs_grad(input, weight, bias):
        loss = launch.apply(_LinearLoss, x, weight, bias, target, counted, plan, extras)
    else:
        loss = _reduce(plan, _sweep(plan, x, weight, bias, target, None, (), extras=extras)[0],
                       counted)
    loss = loss.reshape(shape) if reduction == "none" else loss
    if not any(plan.wanted):
        return loss
    results = [loss]
    for how, values in zip(returns, extras, strict=True):
        if how == "loss":  # reduced as the loss, in its dtype
            reduced = _reduce(plan, values, counted)
            results.append(reduced.reshape(shape) if reduction == "none" else reduced)
        elif how is not None:
            results.append(losses.reduce_returned(how, values, reduction,
                                                  (*shape, weight.shape[0]), target,
                                                  ignore_index))
    return tuple(results)


def _reduce(plan, loss, counted):
    """The per-row losses (fp32, fp64 for fp64 logits) as the reduction asks, in plan.dtype."""
    if plan.reduction == "none":
        return loss.to(plan.dtype)
    if plan.reduction == "sum":
        return loss.sum().to(plan.dtype)
    # NaN where no row counts, as torch's mean
    return losses.mean_and_scale(loss, counted)[0].to(plan.dtype)


def _mean_scale(counted, dtype, device):
    """d mean / d (a counted row's loss): `losses.mean_and_scale`'s rule (1 / max(count, 1);
    1 / the sum of class weights, NaN where it is 0, as torch)."""
    return losses.mean_and_scale(torch.zeros(1, dtype=dtype, device=device), counted)[1]


def _sweep(plan, x, weight, bias, target, dloss, needs, loss=True, extras=None):
    """One pass over the chunks: the per-row losses (None unless `loss`) and, where `dloss`
    (0-d: every row's, or one per row) is given, the gradients `needs` asks for (d x, d weight,
    d bias: None where not asked). `extras`: a list that gets the per-row values of the
    outputs returned on request that `plan.wanted` asks for."""
    rows, features = x.shape
    classes = weight.shape[0]
    acc = launch.accumulator(x.dtype)
    device = x.device
    grads = dloss is not None
    losses_ = torch.empty(rows, dtype=acc, device=device) if loss else None
    wanted = plan.wanted if extras is not None else (False,) * len(plan.wanted)
    if extras is not None:
        extras[:] = [torch.empty(rows, dtype=acc, device=device) if want else None
                     for want in wanted]
    grad_x = torch.empty_like(x) if grads and needs[0] else None
    # d weight and d bias sum over every chunk: at the accumulator's precision
    grad_weight = torch.zeros((classes, features), dtype=acc, device=device) \
        if grads and needs[1] else None
    grad_bias = torch.zeros(classes, dtype=acc, device=device) \
        if grads and bias is not None and needs[2] else None
    buffer = torch.empty((min(plan.chunk, rows), classes), dtype=x.dtype, device=device)
    transposed = weight.t()
    with amp.disabled(device.type):  # the dtypes are autocast's already
        _chunks(plan, x, weight, bias, target, dloss, buffer, transposed, losses_, grad_x,
                grad_weight, grad_bias, extras if any(wanted) else None)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return losses_, (grad_x, grad_weight, grad_bias)


def _chunks(plan, x, weight, bias, target, dloss, buffer, transposed, losses_, grad_x,
            grad_weight, grad_bias, extras=None):
    """`_sweep`'s loop: each chunk's logits into `buffer`, its losses, gradients and the
    outputs returned on request (`extras`) into the buffers given (None: not wanted)."""
    wanted = plan.wanted if extras is not None else (False,) * len(plan.wanted)
    rows = x.shape[0]
    grads = dloss is not None
    for start in range(0, rows, plan.chunk):
        stop = min(start + plan.chunk, rows)
        h, t = x[start:stop], target[start:stop]
        logits = buffer[: stop - start]
        if bias is None:
            torch.mm(h, transposed, out=logits)
        else:  # F.linear's own addmm: the bias added before the one rounding
            torch.addmm(bias, h, transposed, out=logits)
        outputs = plan.kernels.forward(logits, t, grads, wanted)
        if losses_ is not None:
            losses_[start:stop] = outputs[0]
        for i, want in enumerate(wanted):
            if want:
                extras[i][start:stop] = outputs[1 + i]
        if not grads:
            continue
        upstream = dloss.expand(stop - start) if dloss.dim() == 0 else dloss[start:stop]
        dlogits = plan.kernels.backward(logits, t, outputs, upstream.contiguous())
        if grad_x is not None:
            torch.mm(dlogits, weight, out=grad_x[start:stop])
        if grad_weight is not None:
            _accumulate(grad_weight, dlogits.t(), h)
        if grad_bias is not None:
            grad_bias.add_(dlogits.sum(0, dtype=grad_bias.dtype))
        del dlogits, outputs


def _accumulate(total, a, b):
    """total += a @ b, total at a higher precision than a and b where they are 16-bit: on a
    CUDA GPU of compute capability 8 or more one matmul accumulating into it (torch's out_dtype
    addmm), elsewhere the product rounded to a and b's dtype, then added."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif total.is_cuda and torch.cuda.get_device_capability(total.device)[0] >= 8:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(torch.mm(a, b))


#: the fewest classes a block of the blocked backward takes (its matmuls stay large)
MIN_BLOCK_CLASSES = 1024
#: the most memory a block of the blocked backward's logits takes by default: the backward
#: runs while every activation of the step is held, so its buffers make the step's peak (with
#: d weight and d x's fp32 sums). At a 4096-row, 2048-wide Llama head, 16 MiB blocks hold
#: the backward's peak to the one Liger-Kernel's forward reaches with its gradients
BLOCK_BYTES = 16 << 20


def _statistics(plan, x, weight, bias, target, extras):
    """The blocked path's forward: one pass over the row chunks for the per-row losses and the
    row statistics the loss's backward reads (each output of the forward kernels, whole); the
    outputs returned on request that `plan.wanted` asks for into `extras`."""
    rows, classes = x.shape[0], weight.shape[0]
    buffer = torch.empty((min(plan.chunk, rows), classes), dtype=x.dtype, device=x.device)
    transposed = weight.t()
    parts = []
    with amp.disabled(x.device.type):
        # no rows: one chunk of none, whose outputs are the empty ones of each
        for start in range(0, rows, plan.chunk) or (0,):
            stop = min(start + plan.chunk, rows)
            logits = buffer[: stop - start]
            _logits(x[start:stop], transposed, bias, logits)
            parts.append(plan.kernels.forward(logits, target[start:stop], True, plan.wanted))
    outputs = [None if part[0] is None else torch.cat(part) for part in zip(*parts, strict=True)]
    extras[:] = outputs[1:1 + len(plan.wanted)]
    return outputs[0], outputs


def _logits(h, transposed, bias, out):
    if bias is None:
        torch.mm(h, transposed, out=out)
    else:  # F.linear's own addmm: the bias added before the one rounding
        torch.addmm(bias, h, transposed, out=out)


def _blocked(plan, x, weight, bias, target, outputs, dloss, needs):
    """The blocked path's backward: (d x, d weight, d bias) for the per-row upstream gradients
    `dloss`, the classes a block at a time (module doc)."""
    rows, features = x.shape
    classes = weight.shape[0]
    acc = launch.accumulator(x.dtype)
    device = x.device
    # a block's logits for every row take at most the memory of a forward chunk's and
    # BLOCK_BYTES (at least MIN_BLOCK_CLASSES, a multiple of 128 where it is more), and as
    # many rows as then fit that memory
    elements = min(plan.chunk * classes, BLOCK_BYTES // x.element_size())
    block = max(elements // max(rows, 1), min(MIN_BLOCK_CLASSES, classes))
    if block >= classes:
        block = classes
    elif block >= 128:
        block = block // 128 * 128
    chunk = max(1, min(rows, elements // block))
    grad_x = torch.zeros((rows, features), dtype=acc, device=device) if needs[0] else None
    # every block writes its rows of it; with no rows no block runs: zeros, as torch's
    grad_weight = torch.empty_like(weight) if rows else torch.zeros_like(weight)
    grad_bias = torch.zeros(classes, dtype=acc, device=device) \
        if bias is not None and needs[2] else None
    buffer = torch.empty((chunk, min(block, classes)), dtype=x.dtype, device=device)
    # d weight of a block summed over row chunks (where one chunk does not hold every row)
    partial = torch.empty((min(block, classes), features), dtype=acc, device=device) \
        if chunk < rows else None
    with amp.disabled(device.type):
        for first in range(0, classes, block):
            last = min(first + block, classes)
            w = weight[first:last]
            b = bias[first:last] if bias is not None else None
            for start in range(0, rows, chunk):
                stop = min(start + chunk, rows)
                h = x[start:stop]
                logits = buffer[: stop - start, : last - first]
                _logits(h, w.t(), b, logits)
                dlogits = plan.kernels.backward(
                    logits, target[start:stop], [o[start:stop] if o is not None else None
                                                 for o in outputs],
                    dloss[start:stop], first, classes)
                if grad_x is not None:
                    _accumulate(grad_x[start:stop], dlogits, w)
                if partial is None:
                    torch.mm(dlogits.t(), h, out=grad_weight[first:last])
                elif start == 0:
                    _product(partial[: last - first], dlogits.t(), h)
                else:
                    _accumulate(partial[: last - first], dlogits.t(), h)
                if grad_bias is not None:
                    grad_bias[first:last] += dlogits.sum(0, dtype=acc)
            if partial is not None:
                grad_weight[first:last] = partial[: last - first]
    # the blocks' memory goes before the cast of d x allocates: never both at once
    buffer = partial = logits = dlogits = None
    return (grad_x.to(x.dtype) if grad_x is not None else None,
            grad_weight if needs[1] else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None)


def _product(out, a, b):
    """out = a @ b, out at a higher precision than a and b where they are 16-bit."""
    out.zero_()
    _accumulate(out, a, b)


class _LinearLoss(torch.autograd.Function):
    """The chunked loss, differentiable in x, weight and bias (the target and the class weights
    get no gradient, as cross_entropy's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, counted, plan, extras):
        needs = ctx.needs_input_grad[:3]
        ctx.plan = plan
        ctx.blocked = needs[1] and plan.kernels.windowed
        if ctx.blocked:
            loss, outputs = _statistics(plan, x, weight, bias, target, extras)
            ctx.outputs = outputs
            ctx.save_for_backward(x, weight, bias, target, counted)
            return _reduce(plan, loss, counted)
        ctx.now = plan.reduction != "none"
        dloss = None
        if ctx.now:
            acc = launch.accumulator(x.dtype)
            dloss = (_mean_scale(counted, acc, x.device) if plan.reduction == "mean"
                     else torch.ones((), dtype=acc, device=x.device))
        loss, grads = _sweep(plan, x, weight, bias, target, dloss, needs, extras=extras)
        if ctx.now:
            # not saved tensors: the backward scales them in place and hands them over (a
            # weight's gradient as large as the weight, never copied)
            ctx.grads = list(grads)
        else:
            ctx.save_for_backward(x, weight, bias, target)
        return _reduce(plan, loss, counted)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"{ctx.plan.function}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, "
            "jacfwd) is not supported: its logits are never held whole, and their tangents "
            "would be; take the forward-mode derivative of cross_entropy of the linear layer's "
            "logits instead"
        )

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{ctx.plan.function}: double backward (create_graph=True) is not supported: "
                "its gradients are computed chunk by chunk by the loss kernels, through which "
                "autograd cannot differentiate; compute the loss of the linear layer's logits "
                "instead"
            )
        needs = ctx.needs_input_grad[:3]
        if ctx.blocked:
            x, weight, bias, target, counted = ctx.saved_tensors
            plan = ctx.plan
            acc = launch.accumulator(x.dtype)
            grad = grad.to(acc)
            if plan.reduction == "none":
                dloss = grad.reshape(-1)
            elif plan.reduction == "sum":
                dloss = grad.expand(x.shape[0])
            else:
                dloss = (grad * _mean_scale(counted, acc, x.device)).expand(x.shape[0])
            grads = _blocked(plan, x, weight, bias, target, ctx.outputs, dloss.contiguous(),
                             needs)
            return *grads, None, None, None, None
        if ctx.now:
            if ctx.grads is None:
                raise RuntimeError(
                    f"{ctx.plan.function}: backward through the same loss a second time "
                    "(retain_graph=True) is not supported with reduction 'mean' or 'sum': the "
                    "gradients it computes in the forward are scaled in place and handed over "
                    "by the first backward; use reduction='none' and reduce the losses, whose "
                    "backward recomputes them"
                )
            grads, ctx.grads = ctx.grads, None
            grads = [g.mul_(grad.to(g.dtype)) if g is not None and need else None
                     for g, need in zip(grads, needs, strict=True)]
        else:
            x, weight, bias, target = ctx.saved_tensors
            _, grads = _sweep(ctx.plan, x, weight, bias, target, grad.reshape(-1), needs,
                              loss=False)
        return *grads, None, None, None, None


def check_out_dtype(function, out_dtype, dtype):
    """The dtype of the returned loss: `dtype` (the input's) where None, else a floating
    dtype."""
    if out_dtype is None:
        return dtype
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in checks.FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument 'out_dtype' must be None or one of float16, bfloat16, "
            f"float32, float64, got {out_dtype}"
        )
    return out_dtype

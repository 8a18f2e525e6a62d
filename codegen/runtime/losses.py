"""The helpers of per-row losses with a class target: torch's layout and legacy arguments, the
target's and the class weights' checks, the count (or weight) of the counted rows, and the mean
over them."""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from codegen.runtime import launch
from codegen.runtime.checks import (
    FLOAT_DTYPES,
    ClassIndexError,
    DeviceError,
    DimError,
    DtypeError,
    OptionError,
    ShapeError,
    check_mode,
    concrete,
)

#: targets a step of `target_stats`' one program reads
TARGET_STATS_BLOCK = 4096


@triton.jit
def target_stats(target_ptr, M, classes, ignore_index, weight_ptr, counted_ptr, valid_ptr,
                 WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """One program over the M targets: counted = the targets other than ignore_index (WEIGHTED:
    the sum of their class weights, in counted's dtype), valid = whether each of them is a class
    in [0, classes). One launch where torch takes eight small kernels for the check and two for
    the count, each a few microseconds of GPU time."""
    if WEIGHTED:
        counted = tl.zeros([BLOCK], counted_ptr.dtype.element_ty)
    else:
        counted = tl.zeros([BLOCK], tl.int64)
    invalid = tl.zeros([BLOCK], tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        kept = target != ignore_index
        outside = (target < 0) | (target >= classes)
        if WEIGHTED:
            weight = tl.load(weight_ptr + target, mask=kept & ~outside, other=0.0)
            counted += weight.to(counted_ptr.dtype.element_ty)
        else:
            counted += kept.to(tl.int64)
        invalid += (kept & outside).to(tl.int32)
    tl.store(counted_ptr, tl.sum(counted, axis=0))
    tl.store(valid_ptr, tl.sum(invalid, axis=0) == 0)


#: losses a step of `counted_mean`'s one program reads
COUNTED_MEAN_BLOCK = 4096


@triton.jit
def counted_mean(loss_ptr, counted_ptr, M, mean_ptr, scale_ptr, WEIGHTED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One program: mean = the sum of the M losses over counted (NaN where counted is 0, as
    torch), stored in mean's dtype, and scale, the backward's factor: 1 / max(counted, 1) for a
    count, 1 / counted for a sum of weights (NaN where it is 0: torch's gradient then is NaN on
    the counted rows; the ignored ones get 0 whatever the factor)."""
    total = tl.zeros([BLOCK], loss_ptr.dtype.element_ty)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + rows, mask=rows < M, other=0.0)
    counted = tl.load(counted_ptr)
    if WEIGHTED:
        nonzero = counted != 0
        denominator = tl.where(nonzero, counted, 1.0).to(loss_ptr.dtype.element_ty)
        scale = tl.where(nonzero, 1.0 / denominator, float("nan"))
    else:
        nonzero = counted > 0
        denominator = tl.maximum(counted, 1).to(loss_ptr.dtype.element_ty)
        scale = 1.0 / denominator
    mean = tl.where(nonzero, tl.sum(total, axis=0) / denominator, float("nan"))
    tl.store(mean_ptr, mean.to(mean_ptr.dtype.element_ty))
    tl.store(scale_ptr, scale)


def mean_and_scale(loss, counted):
    """`counted_mean` in torch ops, at the losses' precision: (mean, scale)."""
    if counted.dtype.is_floating_point:
        nonzero = counted != 0
        denominator = torch.where(nonzero, counted, 1.0).to(loss.dtype)
        scale = torch.where(nonzero, 1.0 / denominator, float("nan"))
    else:
        nonzero = counted > 0
        denominator = counted.clamp_min(1).to(loss.dtype)
        scale = 1.0 / denominator
    return torch.where(nonzero, loss.sum() / denominator, float("nan")), scale


class CountedMean(torch.autograd.Function):
    """The mean of per-row losses (fp32, or fp64) over the counted rows, in `dtype`: NaN where
    no row is counted, as torch, with a finite gradient (the ignored rows' gradients are 0).
    `counted` is their count (int64), or the sum of their class weights (floating), which the
    mean divides by, as torch's weighted mean. One small kernel forward where torch takes six
    (the sum, the count's guard, the division, the NaN select, the cast), one backward (the
    product with the saved scale)."""

    @staticmethod
    def forward(ctx, loss, counted, dtype):
        if launch.use_triton(loss):
            mean = torch.empty((), dtype=dtype, device=loss.device)
            scale = torch.empty((), dtype=loss.dtype, device=loss.device)
            launch.launch(
                counted_mean,
                (1,),
                4,
                None,
                loss,
                counted,
                loss.numel(),
                mean,
                scale,
                WEIGHTED=counted.dtype.is_floating_point,
                BLOCK=COUNTED_MEAN_BLOCK,
            )
        else:
            mean, scale = mean_and_scale(loss, counted)
            mean = mean.to(dtype)
        ctx.save_for_backward(scale)
        ctx.save_for_forward(scale)
        ctx.rows, ctx.dtype = loss.shape, dtype
        return mean

    @staticmethod
    def jvp(ctx, loss_dot, _counted, _dtype):
        (scale,) = ctx.saved_tensors
        return torch.mul(loss_dot.sum(), scale).to(ctx.dtype)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return torch.mul(grad, scale).expand(ctx.rows), None, None


def reduce_rows(loss, reduction, shape, counted, target, ignore_index, weight, dtype):
    """Per-row losses (fp32, or fp64) reduced as torch's loss: "none" in the rows' shape
    (`shape` without its class dim), "sum", or "mean" over the counted rows (`counted`: their
    count or weight sum, None under torch.compile or for no rows, then counted here); in
    `dtype`."""
    if reduction == "none":
        return loss.reshape(shape[:-1]).to(dtype)
    if reduction == "sum":
        return loss.sum().to(dtype)
    if counted is None or torch._C._are_functorch_transforms_active():
        # under torch.compile or torch.func transforms, or no rows: torch's ops
        counted = count_rows(target, ignore_index, weight, loss.dtype)
        # all rows ignored: a NaN mean, as torch, but zero (not NaN) gradients, as torch
        return mean_and_scale(loss, counted)[0].to(dtype)
    return CountedMean.apply(loss, counted, dtype)


def reduce_returned(how, values, reduction, shape, target, ignore_index):
    """A per-row output returned besides the loss (`RowLossAPI.returns_as`), from the kernels'
    per-row values (fp32, or fp64): "fraction", a 0/1 per row (0 in ignored rows) reduced as
    `reduction` says, "mean" over the counted rows' count (NaN where none is, as a mean of no
    rows), in the values' precision; "index", a class per row, int64 in the rows' shape
    whatever the reduction. The kernels carry a class as a float, exact below 2^24
    classes in fp32 (a vocabulary of 16.7 million)."""
    rows = shape[:-1]
    if how == "index":
        if values.dtype == torch.float32 and shape[-1] > 1 << 24:
            raise ValueError(
                f"a class index is returned only for at most {1 << 24} classes (exact in "
                f"float32), got {shape[-1]}"
            )
        return values.reshape(rows).to(torch.int64)
    if reduction == "none":
        return values.reshape(rows)
    if reduction == "sum":
        return values.sum()
    counted = (target != int(ignore_index)).sum()
    return torch.where(counted > 0, values.sum() / counted.clamp_min(1), float("nan"))


def check_flag(function, name, value):
    """A bool argument (return_z_loss): 0, 1 and other truthy values are refused, as torch's
    bool arguments refuse them."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{function}(): argument '{name}' must be a bool, got {type(value).__name__}"
        )
    return value


def legacy_reduction(size_average, reduce):
    """torch's reading of the legacy `size_average` and `reduce` arguments (either not None):
    the reduction they mean, with torch's deprecation warning."""
    return torch.nn._reduction.legacy_get_string(size_average, reduce)


def check_reduction(function, reduction, choices=("none", "mean", "sum")):
    if reduction not in choices:
        raise ValueError(
            f"{function}(): argument 'reduction' must be one of {', '.join(map(repr, choices))}, "
            f"got {reduction!r}"
        )
    return reduction


def classes_last(function, input, target, target_name, class_dim):
    """torch's layout of a class-target loss: the classes along dim 1 of an input of 2 or more
    dims ((N, C), (N, C, d1, ...)), along dim 0 of a 1-d input (the target then 0-d), or along
    `class_dim` where one is given (-1: the last, (..., C)). Returns the input with its class
    dim last (a view: the kernels copy it only where its classes are not adjacent in memory)
    and the target, whose shape must be the input's without its class dim."""
    dims = input.dim()
    if dims == 0:
        raise ShapeError(
            f"{function}(): argument 'input' must have at least 1 dim (the classes), got a 0-d "
            "tensor"
        )
    if class_dim is None:
        dim = 1 if dims >= 2 else 0
    else:
        if isinstance(class_dim, bool) or not isinstance(class_dim, numbers.Integral):
            raise TypeError(
                f"{function}(): argument 'class_dim' must be an int or None, got "
                f"{type(class_dim).__name__}"
            )
        if not -dims <= class_dim < dims:
            raise DimError(
                f"{function}(): argument 'class_dim' must be in [{-dims}, {dims - 1}] (a dim of "
                f"'input', of shape {list(input.shape)}), got {class_dim}"
            )
        dim = int(class_dim) % dims
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{target_name}' must be a torch.Tensor, got "
            f"{type(target).__name__}"
        )
    if target.dtype.is_floating_point and target.shape == input.shape:
        raise NotImplementedError(
            f"{function}(): argument '{target_name}' holds class probabilities (a floating "
            f"tensor of the input's shape {list(input.shape)}), which this loss does not take: "
            "pass class indices (int64), one per row"
        )
    rows = input.shape[:dim] + input.shape[dim + 1 :]
    if dims == 1 and target.shape == (1,):
        target = target.reshape(())  # torch takes a 1-element target for a 1-d input too
    if target.shape != rows:
        layout = (
            f"input.shape without its class dim {dim}"
            if class_dim is None or dim != dims - 1
            else "input.shape[:-1]"
        )
        raise ShapeError(
            f"{function}(): argument '{target_name}' must have shape {layout} = {list(rows)}, "
            f"got {list(target.shape)}"
        )
    if dim != dims - 1:
        input = input.movedim(dim, -1)
    return input, target


def check_weight(function, weight, input):
    """Class weights: None, or a 1-d tensor of one floating weight per class (the input's last
    dim), read at the loss's precision. Not differentiated: as torch, one that requires grad is
    refused where autograd records."""
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{function}(): argument 'weight' must be a torch.Tensor or None, got "
            f"{type(weight).__name__}"
        )
    classes = input.shape[-1]
    if weight.shape != (classes,):
        raise ShapeError(
            f"{function}(): argument 'weight' must have shape ({classes},) (a weight per class), "
            f"got {list(weight.shape)}"
        )
    if weight.device != input.device:
        raise DeviceError(
            f"{function}(): argument 'weight' must be on the device of 'input' ({input.device}), "
            f"got {weight.device}"
        )
    if weight.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument 'weight' must have dtype float16, bfloat16, float32 or "
            f"float64, got {weight.dtype}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        raise OptionError(
            f"{function}(): argument 'weight' is not differentiated (as torch's) and must not "
            f"require grad; pass weight.detach()"
        )
    return weight if weight.is_contiguous() else weight.contiguous()


def check_target(function, name, target, input, ignore_index, weight=None):
    """Integer class indices, one per row of `input`, each in [0, N) or ignore_index: returns
    them as int64, and the count of those other than ignore_index (the sum of their class
    weights where `weight` is given, at the loss's precision): a 0-d tensor on their device;
    None for no rows or where the values cannot be read (`concrete`), where the caller counts."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor, got {type(target).__name__}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise DtypeError(
            f"{function}(): argument '{name}' must hold integer class indices (int64), got "
            f"{target.dtype}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ShapeError(
            f"{function}(): argument '{name}' must have shape input.shape[:-1] = "
            f"{list(input.shape[:-1])}, got {list(target.shape)}"
        )
    if target.device != input.device:
        raise DeviceError(
            f"{function}(): argument '{name}' must be on the device of 'input' ({input.device}), "
            f"got {target.device}"
        )
    target = target.to(torch.int64)
    if not target.numel() or not concrete(target):
        # no values to check (torch.compile's tracing, meta or fake tensors): the caller counts
        return target, None
    if target.is_cuda and target.device.index != torch._C._cuda_getDevice():
        with torch.cuda.device(target.device):  # Triton launches on the current device
            return check_target(function, name, target, input, ignore_index, weight)
    # an out-of-range class would silently read no logit
    classes = input.shape[-1]
    # torch.func transforms wrap what is made inside them: the kernels take plain tensors only
    if launch.use_triton(target) and not torch._C._are_functorch_transforms_active():
        flat = target.reshape(-1).contiguous()
        dtype = launch.accumulator(input.dtype) if weight is not None else torch.int64
        counted = torch.empty((), dtype=dtype, device=target.device)
        valid = torch.empty((), dtype=torch.bool, device=target.device)
        launch.launch(
            target_stats,
            (1,),
            4,
            None,
            flat,
            flat.numel(),
            classes,
            int(ignore_index),
            weight if weight is not None else flat,
            counted,
            valid,
            WEIGHTED=weight is not None,
            BLOCK=TARGET_STATS_BLOCK,
        )
    else:
        kept = target != int(ignore_index)
        counted = _counted(target, kept, weight, launch.accumulator(input.dtype))
        valid = ~(kept & ((target < 0) | (target >= classes))).any()
    if target.is_cuda:
        # no host sync, which would stall the launch queue behind the GPU: a device-side
        # assert, as torch's own CUDA losses raise, fails the next synchronising call
        torch._assert_async(
            valid,
            f"{function}(): argument '{name}' must hold class "
            f"indices in [0, {classes}) or ignore_index ({int(ignore_index)})",
        )
    elif not bool(valid):
        bad = ((target < 0) | (target >= classes)) & (target != int(ignore_index))
        raise ClassIndexError(
            f"{function}(): argument '{name}' must hold class indices in [0, {classes}) or "
            "ignore_index "
            f"({int(ignore_index)}), got {int(target[bad][0])}"
        )
    return target, counted


def _counted(target, kept, weight, dtype):
    """The count of the kept targets (int64), or the sum of their class weights (`dtype`)."""
    if weight is None:
        return kept.sum()
    # a class out of range (refused after this, or not on CUDA) reads weight 0, not past the end
    inside = kept & (target >= 0) & (target < weight.shape[0])
    picked = weight.to(dtype)[torch.where(inside, target, 0)]
    return torch.where(inside, picked, 0.0).sum()


#: the means `RowLossAPI.count_means` offers for a term an option scales
COUNT_MEANS = ("weight_sum", "row_count")


def check_count_mean(function, name, value):
    """A `RowLossAPI.count_means` argument: one of COUNT_MEANS."""
    return check_mode(function, name, value, {mean: mean for mean in COUNT_MEANS})


def count_mean(value, how, reduction, counted, target, ignore_index, weight, dtype):
    """`value`, an option that scales a per-row term of the loss linearly, for the mean `how`
    asks of that term: "weight_sum", as the rest of the loss (the value as given), or
    "row_count", the term's sum divided by the count of the counted rows where class weights
    divide the rest by their weight sum (Liger-Kernel's z-loss): the value times weight sum /
    count. Only then are both read on the host (one device sync): with no weights, another
    reduction, or the option off, the two means are one. `counted` is `check_target`'s weight
    sum, or None where it counts here."""
    if how == "weight_sum" or weight is None or reduction != "mean" or value == 0:
        return value
    target = target.reshape(-1)
    count = int((target != int(ignore_index)).sum())
    if count == 0:
        return value  # no counted row: the term is 0 in every row
    if counted is None:
        counted = count_rows(target, ignore_index, weight, dtype)
    return value * float(counted) / count


def count_rows(target, ignore_index, weight, dtype):
    """`check_target`'s count in torch ops (under torch.compile, or for no rows)."""
    return _counted(target, target != int(ignore_index), weight, dtype)

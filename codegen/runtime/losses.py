"""The helpers of per-row losses with a class target: the target's check and count, and the
mean over the counted rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.runtime import launch

#: targets a step of `target_stats`' one program reads
TARGET_STATS_BLOCK = 4096


@triton.jit
def target_stats(target_ptr, M, classes, ignore_index, counted_ptr, valid_ptr, BLOCK: tl.constexpr):
    """One program over the M targets: counted = the targets other than ignore_index, valid =
    whether each of them is a class in [0, classes). One launch where torch takes eight small
    kernels for the check and two for the count, each a few microseconds of GPU time."""
    counted = tl.zeros([BLOCK], tl.int64)
    invalid = tl.zeros([BLOCK], tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        kept = target != ignore_index
        counted += kept.to(tl.int64)
        invalid += (kept & ((target < 0) | (target >= classes))).to(tl.int32)
    tl.store(counted_ptr, tl.sum(counted, axis=0))
    tl.store(valid_ptr, tl.sum(invalid, axis=0) == 0)


#: losses a step of `counted_mean`'s one program reads
COUNTED_MEAN_BLOCK = 4096


@triton.jit
def counted_mean(loss_ptr, counted_ptr, M, mean_ptr, scale_ptr, BLOCK: tl.constexpr):
    """One program: mean = the sum of the M losses over counted (NaN where counted is 0, as
    torch), stored in mean's dtype, and scale = 1 / max(counted, 1), the backward's factor."""
    total = tl.zeros([BLOCK], loss_ptr.dtype.element_ty)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + rows, mask=rows < M, other=0.0)
    counted = tl.load(counted_ptr)
    denominator = tl.maximum(counted, 1).to(loss_ptr.dtype.element_ty)
    mean = tl.where(counted > 0, tl.sum(total, axis=0) / denominator, float("nan"))
    tl.store(mean_ptr, mean.to(mean_ptr.dtype.element_ty))
    tl.store(scale_ptr, 1.0 / denominator)


class CountedMean(torch.autograd.Function):
    """The mean of per-row losses (fp32, or fp64) over the counted rows, in `dtype`: NaN where
    no row is counted, as torch, with a finite gradient (the ignored rows' gradients are 0).
    One small kernel forward where torch takes six (the sum, the count's guard, the division,
    the NaN select, the cast), one backward (the product with the saved scale)."""

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
                BLOCK=COUNTED_MEAN_BLOCK,
            )
        else:
            denominator = counted.clamp_min(1).to(loss.dtype)
            mean = torch.where(counted > 0, loss.sum() / denominator, float("nan")).to(dtype)
            scale = 1.0 / denominator
        ctx.save_for_backward(scale)
        ctx.rows = loss.shape
        return mean

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return torch.mul(grad, scale).expand(ctx.rows), None, None


def check_target(function, name, target, input, ignore_index):
    """Integer class indices, one per row of `input`, each in [0, N) or ignore_index: returns
    them as int64, and the count of those other than ignore_index (a 0-d int64 tensor on their
    device; None for no rows or under torch.compile, where the caller counts)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor, got {type(target).__name__}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"{function}(): argument '{name}' must hold integer class indices (int64), got "
            f"{target.dtype}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"{function}(): argument '{name}' must have shape input.shape[:-1] = "
            f"{list(input.shape[:-1])}, got {list(target.shape)}"
        )
    if target.device != input.device:
        raise ValueError(
            f"{function}(): argument '{name}' must be on the device of 'input' ({input.device}), "
            f"got {target.device}"
        )
    target = target.to(torch.int64)
    if torch.compiler.is_compiling() or not target.numel():
        return target, None
    if target.is_cuda and target.device.index != torch._C._cuda_getDevice():
        with torch.cuda.device(target.device):  # Triton launches on the current device
            return check_target(function, name, target, input, ignore_index)
    # an out-of-range class would silently read no logit
    classes = input.shape[-1]
    if launch.use_triton(target):
        flat = target.reshape(-1).contiguous()
        counted = torch.empty((), dtype=torch.int64, device=target.device)
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
            counted,
            valid,
            BLOCK=TARGET_STATS_BLOCK,
        )
    else:
        kept = target != int(ignore_index)
        counted = kept.sum()
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
        raise ValueError(
            f"{function}(): argument '{name}' must hold class indices in [0, {classes}) or "
            "ignore_index "
            f"({int(ignore_index)}), got {int(target[bad][0])}"
        )
    return target, counted

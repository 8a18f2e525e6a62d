"""The schedule layer: the measured table reaches the generated modules, the pipeline's
shared-memory guard, and the one-launch column sums of the partials."""

import pytest
import torch

from codegen.schedule import DEFAULT, load_measured
from generated import add_layernorm, layernorm


def test_measured_table_reaches_the_module():
    table = load_measured()
    assert table["ops"], "codegen/schedule_table.json has no measurements"
    expected = {(kind, int(width)): tuple(config)
                for kind, widths in table["ops"]["layernorm"].items()
                for width, config in widths.items()}
    assert layernorm.MEASURED_SCHEDULES == expected
    # borrowed: an op without measurements of its own takes its sibling's
    assert table["borrow"]["add_layernorm"] == "layernorm"
    assert add_layernorm.MEASURED_SCHEDULES == expected
    assert DEFAULT.measured("no_such_op") == []


def test_measured_schedule_is_used():
    (kind, width), (rows, warps, per_sm, stages) = next(iter(layernorm.MEASURED_SCHEDULES.items()))
    layernorm._schedule.cache_clear()
    schedule = layernorm._schedule(4096, width, kind == "bwd", kind, 2, 2, torch.device("cpu"),
                                   layernorm.PERSISTENT_MAX_BLOCK_N)
    assert (schedule.block_n, schedule.rows, schedule.warps) == (width, rows, warps)
    assert schedule.stages == stages
    # no program count on the CPU: the interpreter's few programs, or one per row block
    row_blocks = -(-4096 // rows)
    assert schedule.programs == (min(row_blocks, layernorm.INTERPRETER_PROGRAMS)
                                 if per_sm or kind == "bwd" else row_blocks)


def test_wide_elements_drop_the_pipeline():
    pipelined = [(key, config) for key, config in layernorm.MEASURED_SCHEDULES.items()
                 if config[3] > 1]
    assert pipelined, "no measured schedule is pipelined"
    (kind, width), (rows, _warps, _per_sm, stages) = max(pipelined, key=lambda item: item[0][1])
    fits = layernorm.PIPELINE_SHARED_BYTES // ((stages - 1) * rows * width * 2)
    device = torch.device("cpu")
    layernorm._schedule.cache_clear()
    narrow = layernorm._schedule(64, width, True, kind, 1, 2, device,
                                 layernorm.PERSISTENT_MAX_BLOCK_N)
    wide = layernorm._schedule(64, width, True, kind, fits + 1, 2, device,
                               layernorm.PERSISTENT_MAX_BLOCK_N)
    assert narrow.stages == stages
    assert wide.stages == 1


# the pairs the launchers make: fp32 partials of 16- or 32-bit parameters (float32 parameters
# may go with a 16-bit input), fp64 partials of fp64 parameters
OUTPUT_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16, torch.float32, torch.float16),
    torch.float64: (torch.float64,) * 4,
}


@pytest.mark.parametrize("accumulator", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("programs", [1, 5, 300])
def test_column_sums(accumulator, count, programs):
    # a helper of the Triton launchers only: the GPU, or the interpreter (conftest sets it)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(programs * 10 + count)
    partials = [torch.randn(programs, 37, generator=generator, dtype=accumulator).to(device)
                for _ in range(count)]
    likes = [torch.empty(0, dtype=dtype, device=device)
             for dtype in OUTPUT_DTYPES[accumulator][:count]]
    stores = [(partial, like) for partial, like in zip(partials, likes, strict=True)]
    stores.insert(1, (None, None))
    sums = layernorm._column_sums(*stores)
    assert sums[1] is None
    sums = [s for index, s in enumerate(sums) if index != 1]
    for partial, like, total in zip(partials, likes, sums, strict=True):
        assert total.dtype == like.dtype and total.shape == (37,)
        # the kernel sums in the partials' precision in its own order, then casts
        torch.testing.assert_close(total, partial.sum(dim=0).to(like.dtype))


def test_looped_rows_pipeline_only_where_it_fits():
    # measured on the H100: a bf16 layer-norm backward over 32768-wide rows compiles with 3
    # stages; in fp32 the same schedule asked for 320 KiB of shared memory (227 KiB there)
    device = torch.device("cpu")
    layernorm._schedule.cache_clear()
    half = layernorm._schedule(64, 32768, True, "bwd", 2, 2, device,
                               layernorm.PERSISTENT_MAX_BLOCK_N)
    single = layernorm._schedule(64, 32768, True, "bwd", 2, 4, device,
                                 layernorm.PERSISTENT_MAX_BLOCK_N)
    assert half.looped and single.looped
    assert half.stages == layernorm.LOOPED_STAGES > 1
    assert single.stages == 1


def _check_launches(module, monkeypatch):
    """Make every launch of `module` also ask Triton's own dispatch which compiled kernel it
    picks for the same arguments, and require the direct launch to have used that one."""
    launch = module._launch
    checked = []

    def checking(kernel, grid, warps, *args, **constexprs):
        used = launch(kernel, grid, warps, *args, **constexprs)
        picked = kernel[grid](*args, **constexprs, num_warps=warps)  # the kernels are idempotent
        assert used is picked, f"{kernel.__name__}: direct launch used another compiled kernel"
        checked.append(kernel.__name__)
        return used

    monkeypatch.setattr(module, "_launch", checking)
    return checked


def _misaligned(shape, dtype):
    """A tensor of `shape` whose data starts one element past a 16-byte boundary."""
    flat = torch.randn(shape[0] * shape[1] + 1, device="cuda", dtype=dtype)
    return flat[1:].view(shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch is CUDA-only")
def test_direct_launch_uses_the_kernel_triton_picks(monkeypatch):
    # the direct launch keys on what Triton specializes arguments on (alignment, ints that are 1
    # or multiples of 16, dtypes): every call below must land on the kernel Triton itself picks
    checked = _check_launches(layernorm, monkeypatch)
    pairs = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
             (torch.float32, torch.float32))
    for N in (1, 3, 16, 17, 1000, 1024, 4104):
        for dtype, param_dtype in pairs:
            for x in (torch.randn(8, N, device="cuda", dtype=dtype), _misaligned((8, N), dtype),
                      torch.randn(1, N, device="cuda", dtype=dtype)):
                weight = torch.randn(N, device="cuda", dtype=param_dtype)
                for bias in (None, torch.randn(N, device="cuda", dtype=param_dtype)):
                    for _ in range(2):  # the second call is the direct launch
                        leaf = x.detach().requires_grad_()
                        w = weight.detach().requires_grad_()
                        y = layernorm.layer_norm(leaf, (N,), w, bias)
                        y.backward(torch.ones_like(y))
    expected = {"_layernorm_fwd_per", "_layernorm_bwd_default_per", "_column_sums_kernel"}
    assert expected <= set(checked)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch is CUDA-only")
def test_direct_launch_with_seeds_masks_and_absent_inputs(monkeypatch):
    # a seed tensor, broadcast strides (0 or not), None in place of absent inputs
    from generated import bias_dropout_add, masked_softmax

    checked_add = _check_launches(bias_dropout_add, monkeypatch)
    checked_softmax = _check_launches(masked_softmax, monkeypatch)
    for N in (16, 33, 1024):
        x = torch.randn(4, 8, N, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            for residual in (None, torch.randn_like(x)):
                for bias in (None, torch.randn(N, device="cuda", dtype=torch.bfloat16)):
                    leaf = x.detach().requires_grad_()
                    y = bias_dropout_add.bias_dropout_add(leaf, residual, bias=bias, p=0.25, seed=3)
                    y.backward(torch.ones_like(y))
            keep = torch.rand(8, N, device="cuda") < 0.9
            masks = (None, keep, torch.randn(4, 1, N, device="cuda"))
            for mask in masks:
                leaf = x.detach().requires_grad_()
                y = masked_softmax.masked_softmax(leaf, mask, dropout_p=0.1, seed=4)
                y.backward(torch.ones_like(y))
    assert any(name.startswith("_bias_dropout_add") for name in checked_add)
    assert any(name.startswith("_masked_softmax") for name in checked_softmax)

"""The schedule layer as the generated modules hold it (each module's `SCHEDULES`): the measured
table reaches them, the pipeline's shared-memory guard, the per-op constants, and the one-launch
column sums of the partials. Schedules are changed only through `SCHEDULES.override`."""

import inspect

import pytest
import torch
from reference import splits

from codegen.runtime import checks, launch
from codegen.runtime.schedules import SPLIT_REFUSED, Schedule, fixed_n, forget_all, maxnreg
from codegen.schedule import default_table, load_measured
from generated import (
    add_layernorm,
    add_rmsnorm,
    bias_dropout_add,
    cross_entropy,
    geglu,
    gelu,
    gelu_tanh,
    layernorm,
    masked_softmax,
    rmsnorm,
    softmax,
    swiglu,
)


def test_measured_table_reaches_the_module():
    table = load_measured()
    assert table["ops"], "codegen/schedule_table.json has no measurements"
    # entries of four numbers predate looped rows: whole rows (a fifth number, 0); a sixth, the
    # sweep form measured, is -1 (the rule decides) where the entry has none; a seventh, the
    # kernel form measured, is 1 (the rule's) where the entry has none
    defaults = (0, 0, 0, 0, 0, -1, 1)
    expected = {(kind, int(width)): (*config, *defaults[len(config):])
                for kind, widths in table["ops"]["layernorm"].items()
                for width, config in widths.items()}
    assert layernorm.SCHEDULES.measured == expected
    # borrowed: an op takes its sibling's entries at the kinds and widths it has none of its own
    assert table["borrow"]["add_layernorm"] == "layernorm"
    own = {(kind, int(width)): (*config, *defaults[len(config):])
           for kind, widths in table["ops"].get("add_layernorm", {}).items()
           for width, config in widths.items()}
    assert add_layernorm.SCHEDULES.measured == expected | own
    assert default_table().measured("no_such_op") == []


def test_an_op_s_own_entries_take_precedence_over_the_ones_it_borrows():
    from codegen.schedule import ScheduleTable

    measured = {"ops": {"norm": {"fwd": {"1024": [4, 4, 0, 1], "2048": [2, 8, 0, 1]},
                                 "bwd": {"1024": [8, 8, 1, 3]}},
                        "add_norm": {"fwd": {"2048": [1, 2, 0, 1, 0]},
                                     "fwd_fp32": {"2048": [1, 4, 0, 1, 0]}}},
                "borrow": {"add_norm": "norm"}}
    table = ScheduleTable(measured_table=measured)
    assert table.measured("add_norm") == [
        ("bwd", 1024, (8, 8, 1, 3, 0, -1, 1)),
        ("fwd", 1024, (4, 4, 0, 1, 0, -1, 1)),
        ("fwd", 2048, (1, 2, 0, 1, 0, -1, 1)),
        ("fwd_fp32", 2048, (1, 4, 0, 1, 0, -1, 1)),
    ]
    # the sibling keeps its own
    assert ("fwd", 2048, (2, 8, 0, 1, 0, -1, 1)) in table.measured("norm")


CPU = torch.device("cpu")


def _whole(module):
    return [(key, config) for key, config in module.SCHEDULES.measured.items()
            if not config[4] and not key[0].endswith("_looped")]


def test_measured_schedule_is_used():
    (kind, width), (rows, warps, per_sm, stages, _step, _sweep, _form) = _whole(layernorm)[0]
    schedule = layernorm.SCHEDULES.choose(4096, width, kind == "bwd", kind, 2, 2, CPU)
    assert (schedule.block_n, schedule.rows, schedule.warps) == (width, rows, warps)
    assert schedule.stages == stages and schedule.chunks == 1 and not schedule.looped
    # no program count on the CPU: the interpreter's few programs, or one per row block
    row_blocks = -(-4096 // rows)
    assert schedule.programs == (min(row_blocks, layernorm.SCHEDULES.constants.interpreter_programs)
                                 if per_sm or kind == "bwd" else row_blocks)


def test_measured_looped_schedule_is_used():
    # a width whose fastest measured forward loops over the row: the kernel takes the
    # measured step, and a compile-time count of steps that covers N (padded rows too)
    limit = layernorm.SCHEDULES.constants.persistent_max_block_n
    looped = [(key, config) for key, config in layernorm.SCHEDULES.measured.items()
              if key[0] == "fwd" and config[4] and key[1] <= limit
              and key[1] & (key[1] - 1) == 0]  # a power of two: its entry serves padded rows
    assert looped, "no measured forward below persistent_max_block_n loops"
    (kind, width), (rows, warps, _per_sm, _stages, step, _sweep, _form) = looped[0]
    for n in (width, width * 3 // 4 + 1):
        schedule = layernorm.SCHEDULES.choose(4096, n, False, kind, 1, 2, CPU)
        assert schedule.looped and (schedule.block_n, schedule.rows, schedule.warps) == (
            step, rows, warps)
        assert schedule.chunks == -(-n // step) and (schedule.chunks - 1) * step < n


@pytest.mark.parametrize(("sweep", "n", "one_sweep"), [(1, 32768, True), (0, 65536, False),
                                                        (-1, 32768, False), (-1, 65536, True)])
def test_an_entry_s_measured_sweep_form_overrides_the_rule(sweep, n, one_sweep):
    assert layernorm.SCHEDULES.constants.one_sweep_min_n == 65536
    width = 1 << (n - 1).bit_length()
    entry = {("fwd", width): (1, 16, 0, 1, 8192, sweep, 1)}
    with layernorm.SCHEDULES.override(measured=entry):
        found = layernorm.SCHEDULES.choose(4096, n, False, "fwd", 1, 2, CPU)
    assert found.looped and found.one_sweep is one_sweep


def test_fp32_rows_take_fp32_entries_where_there_are_some():
    table = {("fwd", 8192): (1, 8, 0, 1, 0, -1, 1), ("fwd_fp32", 8192): (1, 16, 0, 1, 2048, -1, 1),
             ("fwd_looped", 32768): (1, 16, 0, 1, 8192, -1, 1),
             ("fwd_fp32_looped", 32768): (1, 8, 0, 1, 4096, -1, 1)}

    def schedule(n, element_size):
        found = layernorm.SCHEDULES.choose(4096, n, False, "fwd", 1, element_size, CPU)
        return found.looped, found.block_n, found.warps

    with layernorm.SCHEDULES.override(measured=table):
        assert schedule(8192, 2) == (False, 8192, 8)
        assert schedule(8192, 4) == (True, 2048, 16)
        assert schedule(32768, 2) == (True, 8192, 16)
        assert schedule(32768, 4) == (True, 4096, 8)
    # a width with no fp32 entry: the 16-bit one
    del table[("fwd_fp32_looped", 32768)]
    with layernorm.SCHEDULES.override(measured=table):
        assert schedule(32768, 4) == (True, 8192, 16)


@pytest.mark.parametrize(("n", "element_size"), [(32768, 2), (65536, 2), (32768, 4),
                                                   (262144, 4), (4096, 4)])
def test_one_sweep_is_chosen_by_the_row_length(n, element_size):
    # looped rows of one_sweep_min_n columns and more join their dependent reductions in one
    # sweep (codegen/fuse.py); shorter rows and whole rows keep a pass each
    schedule = layernorm.SCHEDULES.choose(4096, n, False, "fwd", 1, element_size, CPU)
    long_row = n >= layernorm.SCHEDULES.constants.one_sweep_min_n
    assert schedule.one_sweep == (schedule.looped and long_row)
    limit = layernorm.SCHEDULES.constants.persistent_max_block_n
    assert schedule.looped == (n > limit or schedule.block_n < n)


@pytest.mark.parametrize(("n", "element_size"), [(32768, 2), (65536, 2), (65536, 4),
                                                   (262144, 2), (131072, 4), (4096, 4)])
def test_looped_rows_are_kept_in_l2_up_to_the_row_bytes(n, element_size):
    # a looped row's earlier sweeps load `evict_last` (KEEP) where one tensor's row is at most
    # keep_max_row_bytes; wider rows and whole rows keep the default policy
    schedule = softmax.SCHEDULES.choose(4096, n, False, "bwd", 2, element_size, CPU)
    assert softmax.SCHEDULES.constants.keep_max_row_bytes == 262144
    assert schedule.keep == (schedule.looped and n * element_size <= 262144)
    assert schedule.looped or n < 65536


def test_only_a_looped_row_read_again_loads_evict_last():
    # softmax backward, looped: the sweep for sum(dp * p) reads dp and p, read again by the
    # epilogue (evict_last under KEEP); the epilogue's reads are their last (evict_first)
    source = inspect.getsource(softmax._softmax_bwd_default_red.fn)
    sweep, epilogue = source.split("for chunk in")[1:3]
    for name in ("dp", "p"):
        load = f"{name} = tl.load({name}_ptr + offsets * {name}_row_stride + cols"
        assert (f'{load}, mask=mask, other=0.0, eviction_policy="evict_last" if KEEP else "")'
                in sweep)
        assert (f'{load}, mask=mask, other=0.0, eviction_policy="evict_first" if KEEP else "")'
                in epilogue)
    whole = inspect.getsource(softmax._softmax_bwd_default_per.fn)
    assert "eviction_policy" not in whole


def test_forwards_take_their_own_elements_a_program_where_an_op_sets_them():
    # bias-dropout-add: forwards 4096 elements a program, the backward (bias-gradient partials)
    # the shared 8192; ops that set none take row_block_elements both ways
    assert bias_dropout_add.SCHEDULES.constants.fwd_row_block_elements == 4096
    assert bias_dropout_add.SCHEDULES.constants.row_block_elements == 8192
    rows = {}
    for kind, grid_stride in (("fwd", False), ("bwd", True)):
        schedule = bias_dropout_add.SCHEDULES.choose(4096, 1024, grid_stride, kind, 2, 4, CPU)
        rows[kind] = (schedule.rows, schedule.block_n)
    assert rows == {"fwd": (4, 1024), "bwd": (8, 1024)}
    assert gelu.SCHEDULES.constants.fwd_row_block_elements == 0
    schedule = gelu.SCHEDULES.choose(4096, 1024, False, "fwd", 1, 4, CPU)
    assert schedule.rows == gelu.SCHEDULES.constants.row_block_elements // 1024


def test_gelu_forward_steps_run_at_eight_warps():
    # GELU's looped forward (4096 columns a step) at 512 elements a warp; tanh GELU keeps 256
    found = {}
    for module in (gelu, gelu_tanh):
        schedule = module.SCHEDULES.choose(8192, 16384, False, "fwd", 1, 2, CPU)
        found[module.__name__] = (schedule.looped, schedule.block_n, schedule.warps)
    assert found == {"generated.gelu": (True, 4096, 8), "generated.gelu_tanh": (True, 4096, 16)}


def test_rows_that_must_loop_take_the_measured_looped_entry():
    # fp32 layer-norm backward rows of 16384 are 64 KiB: too wide to hold whole next to the
    # column partials, so the fastest measured looped entry of the width is used
    entry = layernorm.SCHEDULES.measured.get(("bwd_looped", 16384))
    assert entry is not None
    schedule = layernorm.SCHEDULES.choose(4096, 16384, True, "bwd", 2, 4, CPU)
    assert schedule.looped and (schedule.rows, schedule.warps, schedule.block_n) == (
        entry[0], entry[1], entry[4])
    # a padded row that must loop (10240 in a 16384 block) keeps the constants: the entry was
    # measured at 16384 and ran slower at 12288 on the H100
    padded = layernorm.SCHEDULES.choose(4096, 10240, True, "bwd", 2, 2, CPU)
    rows = layernorm.SCHEDULES.constants.looped_grid_stride_rows
    assert padded.looped and (padded.rows, padded.block_n) == (
        rows, layernorm.SCHEDULES.constants.looped_block_n // rows)
    assert padded.chunks == -(-10240 // padded.block_n)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_a_padded_width_measured_as_itself_takes_its_own_entry(kind):
    # 12288 was measured at 12288 (tune files it under 12288): its entry, only at that width
    entry = layernorm.SCHEDULES.measured[(kind, 12288)]
    rows, warps, _per_sm, stages, step, _sweep, _form = entry
    grid_stride = kind == "bwd"
    schedule = layernorm.SCHEDULES.choose(4096, 12288, grid_stride, kind, 2, 2, CPU)
    assert (schedule.rows, schedule.warps, schedule.stages) == (rows, warps, stages)
    assert schedule.block_n == (step or 16384) and schedule.looped == bool(step)
    assert schedule.chunks == -(-12288 // schedule.block_n)
    # a neighbouring padded width in the same block does not borrow it
    other = layernorm.SCHEDULES.choose(4096, 12352, grid_stride, kind, 2, 2, CPU)
    assert (kind, 12352) not in layernorm.SCHEDULES.measured
    assert other != layernorm.SCHEDULES.choose(4096, 12288, grid_stride, kind, 2, 2,
                                        CPU)


def test_wide_elements_drop_the_pipeline():
    # a pipelined 16-bit entry that fp32 rows borrow (no "_fp32" entry at its width)
    pipelined = [(key, config) for key, config in _whole(layernorm) if config[3] > 1
                 and (key[0] + "_fp32", key[1]) not in layernorm.SCHEDULES.measured]
    assert pipelined, "no measured 16-bit schedule that fp32 borrows is pipelined"
    (kind, width), (rows, _warps, _per_sm, stages, _step, _sweep, _form) = min(pipelined,
                                                                key=lambda item: item[0][1])
    # an entry measured at this element size runs as measured; a 16-bit entry used for fp32
    # falls back to one stage where the buffers of the wider elements would not fit
    fits = layernorm.SCHEDULES.constants.pipeline_shared_bytes // ((stages - 1) * rows * width * 4)
    device = CPU
    measured = layernorm.SCHEDULES.choose(64, width, True, kind, fits + 1, 2, device)
    narrow = layernorm.SCHEDULES.choose(64, width, True, kind, 1, 4, device)
    wide = layernorm.SCHEDULES.choose(64, width, True, kind, fits + 1, 4, device)
    assert measured.stages == stages
    assert narrow.stages == stages
    assert wide.stages == 1


def test_an_entry_holds_for_the_loads_it_was_measured_with():
    """A kernel reading more element tensors than the measured one (a borrowed table's op with
    its extra input given) takes the shared-memory guard: add_layer_norm's prenorm backward at
    65536 columns asked the H100 for 233472 bytes with the layer-norm entry's 3 stages."""
    device = CPU
    module = add_layernorm
    loads = module.SCHEDULES.measured_loads["bwd"]
    measured = module.SCHEDULES.choose(64, 65536, True, "bwd", loads, 2, device)
    more = module.SCHEDULES.choose(64, 65536, True, "bwd", loads + 1, 2, device)
    entry = module.SCHEDULES.measured[measured.entry]
    assert entry[3] > 1 and measured.stages == entry[3]
    assert (entry[3] * measured.rows * measured.block_n * 2 * (loads + 1)
            > module.SCHEDULES.constants.pipeline_shared_bytes)
    assert more.stages == 1 and more.block_n == measured.block_n


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
    sums = launch.column_sums(*stores)
    assert sums[1] is None
    sums = [s for index, s in enumerate(sums) if index != 1]
    for partial, like, total in zip(partials, likes, sums, strict=True):
        assert total.dtype == like.dtype and total.shape == (37,)
        # the kernel sums in the partials' precision in its own order, then casts
        torch.testing.assert_close(total, partial.sum(dim=0).to(like.dtype))


def test_looped_rows_pipeline_only_where_it_fits():
    # measured on the H100: a bf16 layer-norm backward over 32768-wide rows compiles with 3
    # stages at 2 x 4096 columns a step; in fp32 the same schedule asked for 320 KiB of
    # shared memory (227 KiB there). The fallback looped schedule, without the table:
    with layernorm.SCHEDULES.override(measured={}):
        half = layernorm.SCHEDULES.choose(64, 32768, True, "bwd", 2, 2, CPU)
        single = layernorm.SCHEDULES.choose(64, 32768, True, "bwd", 2, 4, CPU)
    assert half.looped and single.looped
    assert half.stages == layernorm.SCHEDULES.constants.looped_stages > 1
    assert single.stages == 1


def _looped(module, N, grid_stride, kind, element_size=2):
    return module.SCHEDULES.choose(4096, N, grid_stride, kind, 2, element_size, CPU).looped


def test_padded_rows_with_column_partials_loop():
    # 10240 pads to a 16384-wide block: looped; exactly 16384 takes what its entry says;
    # below the padded threshold (6144 -> 8192) whole rows stay (12288 has entries of its own)
    assert (("bwd", 10240) not in layernorm.SCHEDULES.measured
            and ("fwd", 10240) not in layernorm.SCHEDULES.measured)
    assert _looped(layernorm, 10240, True, "bwd")
    assert _looped(layernorm, 16384, True, "bwd") == bool(
        layernorm.SCHEDULES.measured[("bwd", 16384)][4])
    assert not _looped(layernorm, 6144, True, "bwd")
    # without column partials the padding rule does not apply
    assert not _looped(layernorm, 10240, False, "fwd")


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_wide_rows_stay_whole_only_where_measured(kind):
    limit = f"persistent_max_{kind}_row_bytes"
    assert getattr(softmax.SCHEDULES.constants, limit) == \
        default_table().constants("softmax")[limit]
    # 64 KiB of bf16 may stay whole: the entry decides (the backward's loops, as measured)
    entry = softmax.SCHEDULES.measured[(kind, 32768)]
    assert _looped(softmax, 32768, False, kind) == bool(entry[4])
    without = {key: entry for key, entry in softmax.SCHEDULES.measured.items() if key[1] != 32768}
    with softmax.SCHEDULES.override(measured=without):
        assert not _looped(softmax, 32768, False, kind)  # no entry: the rule keeps it whole
    assert _looped(softmax, 65536, False, kind)  # 128 KiB: looped
    assert _looped(softmax, 32768, False, kind, element_size=4)  # fp32 32768: 128 KiB
    assert (getattr(cross_entropy.SCHEDULES.constants, limit)
            == getattr(layernorm.SCHEDULES.constants, limit) == 0)
    assert _looped(cross_entropy, 32768, False, kind)
    assert _looped(layernorm, 32768, False, kind)


@pytest.mark.parametrize(("m", "n", "grid_stride"), [(4096, 512, False), (4095, 512, False),
                                                     (4096, 500, False), (4096, 1024, True),
                                                     (4096, 65536, False), (4096, 12288, True)])
def test_even_and_strided_follow_the_shape(m, n, grid_stride):
    # EVEN: the row blocks tile the tensor exactly (no masks); STRIDED: fewer programs than row
    # blocks, so each steps over several (else its row-block loop is of one step)
    schedule = layernorm.SCHEDULES.choose(m, n, grid_stride, "bwd" if grid_stride else "fwd", 2,
                                          2, CPU)
    # ... as the table entry's measured form allows (bit 1: no masks, bit 2: the loop anyway)
    form = 1 if schedule.entry is None else layernorm.SCHEDULES.measured[schedule.entry][6]
    tiles = m % schedule.rows == 0 and n % schedule.block_n == 0
    assert schedule.even == (tiles and bool(form & 1))
    assert schedule.strided == (schedule.programs < -(-m // schedule.rows) or bool(form & 2))
    if m == 4095 or n == 500:
        assert not schedule.even  # a partial row block, a padded row
    if n in (512, 1024) and form & 1:
        assert schedule.even == (m == 4096)


def _forced(module, schedule):
    """A context manager within which the module's launchers take `schedule` (its
    `SCHEDULES.override` with a fixed choice; plans are forgotten on entry and exit, so that a
    CUDA call keyed as an earlier one does not launch that one's plan)."""
    return module.SCHEDULES.override(choose=lambda *_args: schedule)


# (rows, columns, rows a step, block_n, programs): each (EVEN, STRIDED) pair, whole and looped
FORCED = [(8, 64, 2, 64, 4), (8, 64, 2, 64, 2), (7, 60, 2, 64, 4), (7, 60, 2, 64, 2),
          (8, 64, 2, 32, 4), (8, 64, 2, 32, 3), (7, 60, 2, 32, 4), (7, 60, 2, 32, 2)]


@pytest.mark.parametrize(("m", "n", "rows", "block_n", "programs", "reverse", "last_first",
                          "fixed"),
                         [(*case, False, False, False) for case in FORCED]
                         + [(*case, True, False, False) for case in FORCED if case[3] < case[1]]
                         + [(*case, False, True, False) for case in FORCED]
                         + [(*case, False, False, True) for case in FORCED if case[3] >= case[1]])
def test_kernels_match_the_torch_path_with_and_without_masks(m, n, rows, block_n, programs,
                                                             reverse, last_first, fixed):
    # the generated kernels against the generated torch path, in fp64, for every combination of
    # EVEN (no masks) and STRIDED (grid-stride row-block loop), whole rows and looped rows, and
    # looped rows with every other sweep run backwards (REVERSE); whole rows that programs loop
    # over take the register budget (REGS: maxnreg on a GPU, dropped by the interpreter); the
    # row blocks walked from the last (LAST_FIRST), a partial row block (7 rows) first; whole
    # rows compiled for their width (FIXED_N)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(m * n + programs)
    x, dy = (torch.randn(m, n, generator=generator, dtype=torch.float64).to(device)
             for _ in range(2))
    weight, bias = (torch.randn(n, generator=generator, dtype=torch.float64).to(device)
                    for _ in range(2))
    looped = block_n < n
    chunks = -(-n // block_n)
    row_blocks = -(-m // rows)
    schedule = Schedule(looped, block_n, rows, 1, programs, 1, chunks, False, False,
                        m % rows == 0 and n % block_n == 0, programs < row_blocks,
                        reverse, not looped and programs < row_blocks, fixed,
                        last_first=last_first)
    assert fixed_n(schedule, m, n, n) == (n if fixed else 0)
    assert (schedule.even, schedule.strided) in {(True, True), (True, False), (False, True),
                                                 (False, False)}
    with _forced(layernorm, schedule):
        y, mean, rstd = layernorm._layernorm_fwd(x, weight, bias, 1e-5, 0.0, True, True)
        grads = layernorm._layernorm_bwd_default(dy, x, weight, bias, mean, rstd, 0.0, True, True)
    expected = layernorm._layernorm_fwd_torch(x, weight, bias, 1e-5, 0.0, True, True)
    for got, want in zip((y, mean, rstd), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    expected = layernorm._layernorm_bwd_default_torch(dy, x, weight, bias, mean, rstd, 0.0, True,
                                                      True)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rows_compile_for_their_width_only_where_the_launch_allows_it():
    """FIXED_N (form bit 16): the width, contiguous rows' strides and 32-bit offsets compiled in;
    a launch with a row stride other than N, or of 2^31 elements or more, keeps them run-time."""
    fixed = Schedule(False, 1024, 1, 1, 4096, 1, 1, False, False, True, False, False, False,
                     True)
    assert fixed_n(fixed, 4096, 1024, 1024, 1024) == 1024
    assert fixed_n(fixed, 4096, 1024, 1024, 2048) == 0  # a strided input
    assert fixed_n(fixed, 2**21, 1024, 1024) == 0  # 2^31 elements
    assert fixed_n(fixed._replace(fixed=False), 4096, 1024, 1024) == 0
    # strided rows through the public call: the kernels take the run-time strides
    x = torch.randn(16, 128, dtype=torch.float64)[:, :64]
    weight = torch.randn(64, dtype=torch.float64)
    with _forced(layernorm, fixed._replace(block_n=64, programs=16)):
        y, mean, rstd = layernorm._layernorm_fwd(x, weight, None, 1e-5, 0.0, True, True)
    expected = layernorm._layernorm_fwd_torch(x, weight, None, 1e-5, 0.0, True, True)
    for got, want in zip((y, mean, rstd), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("module", [geglu, swiglu, gelu])
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_elementwise_rows_loop_where_measured(module, kind):
    """GLU forwards and backwards, and GELU's forward, step over 4096 columns of an LLM's MLP
    row (11008) instead of a padded whole row of 16384 (codegen/schedule_table.json: H100,
    GeGLU backward 4096x11008 2069 against 2838 GB/s); GELU's backward, with its bias gradient's
    column partials, keeps the rule of kernels with partials (whole rows up to 16 KiB). GELU's
    forward steps run at 8 warps, the GLUs' at 16 (codegen/schedule_table.json)."""
    grid_stride = module is gelu and kind == "bwd"
    n = 11008 if module is not gelu else 4096 + 2048
    schedule = module.SCHEDULES.choose(4096, n, grid_stride, kind, 2, 2, CPU)
    loops = not grid_stride
    assert schedule.looped == loops
    if loops:
        warps = 8 if module is gelu else 16
        assert (schedule.block_n, schedule.warps, schedule.stages) == (4096, warps, 3)
    # the other ops keep the common limit in both directions
    constants = layernorm.SCHEDULES.constants
    assert constants.persistent_max_fwd_block_n == constants.persistent_max_block_n
    assert constants.persistent_max_bwd_block_n == constants.persistent_max_block_n


def _backward_schedule(module, m, n, device, element_size=2):
    return module.SCHEDULES.choose(m, n, True, "bwd", 2, element_size, device, True)


@pytest.mark.parametrize(("module", "min_n", "element_size"), [
    (layernorm, 12288, 2), (layernorm, 12288, 4), (rmsnorm, 32768, 2), (rmsnorm, 16384, 4),
    (add_layernorm, 12288, 2), (add_layernorm, 12288, 4), (add_rmsnorm, 16384, 2),
    (add_rmsnorm, 16384, 4)])
def test_norm_backwards_split_rows_from_the_measured_width(module, min_n, element_size):
    """codegen/schedule_table.json: layer-norm backwards split rows of 12288 columns and more,
    RMS-norm backwards rows of 64 KiB and more, add_rms_norm's of 16384 columns and more (H100,
    `benchmarks.split`, bf16: layer norm 4096x12288 1966 split vs 1551 looped; RMS norm
    4096x16384 2003 split vs 2262 whole, fp32 2294 vs 2026 looped; add_layer_norm 4096x12288
    2298 vs 1718; add_rms_norm 4096x16384 2170 vs 1889, 4096x12288 2020 vs 2452).
    Under the interpreter one program takes a whole row; kernels without a split form, and ops
    without the rule, never split."""
    split = _backward_schedule(module, 64, min_n, CPU, element_size)
    assert (split.split, split.block_n, split.looped) == (1, 1 << (min_n - 1).bit_length(), False)
    assert _backward_schedule(module, 64, min_n - 1, CPU, element_size).split == 0
    whole = module.SCHEDULES.choose(64, min_n, True, "bwd", 2, element_size, CPU)
    assert whole.split == 0
    assert splits(module) and splits(softmax) and not splits(cross_entropy)  # reads a column
    # forwards have no split form: an exchange per pass and row costs more than the row
    assert not any(name.endswith("_fwd_split") for name in vars(module))


@pytest.mark.parametrize("module", [gelu, gelu_tanh])
@pytest.mark.parametrize(("element_size", "block_n"), [(2, 2048), (4, 1024)])
def test_bias_gradients_split_rows_into_column_slabs_of_4_kib(module, element_size, block_n,
                                                              monkeypatch):
    """codegen/schedule_table.json: GELU backwards split rows of 4096 columns and more into
    slabs of 4 KiB, 16 bytes a thread, 4 programs an SM (H100, a probe of the public backward:
    bf16 8192x16384 2206 -> 2649 GB/s, fp32 2555 -> 2867). Their split kernels exchange nothing
    (no row reductions), so the programs need no register budget and no cooperative launch."""
    from collections import namedtuple

    properties = namedtuple("Properties", "multi_processor_count max_threads_per_multi_processor "
                                          "regs_per_multiprocessor")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda _device: properties(132, 2048, 65536))
    module.SCHEDULES.forget()  # nothing chosen on a real device's properties
    cuda = torch.device("cuda", 0)
    for n in (4096, 11008, 16384):
        schedule = _backward_schedule(module, 8192, n, cuda, element_size)
        assert (schedule.split, schedule.block_n) == (-(-n // block_n), block_n)
        assert schedule.warps == 8 and not schedule.regs
        assert schedule.programs == 132 * 4 // schedule.split * schedule.split
    assert _backward_schedule(module, 8192, 2048, cuda, element_size).split == 0
    module.SCHEDULES.forget()  # nor on these
    assert not module.SCHEDULES.split_exchange
    assert layernorm.SCHEDULES.split_exchange and softmax.SCHEDULES.split_exchange
    source = inspect.getsource(getattr(module, f"_{module.__name__.split('.')[-1]}_bwd_default"))
    assert "launch_cooperative_grid" not in source
    assert "launch_cooperative_grid" in inspect.getsource(layernorm._layernorm_bwd_default)


@pytest.mark.parametrize(("module", "n", "element_size", "split"), [
    (add_layernorm, 262144, 2, 1), (add_layernorm, 262144, 4, 0), (add_layernorm, 131072, 4, 1),
    (add_rmsnorm, 262144, 2, 1), (add_rmsnorm, 262144, 4, 0), (layernorm, 262144, 4, 1)])
def test_residual_add_norms_split_rows_of_at_most_512_kib(module, n, element_size, split):
    """The residual-add norms' backwards keep rows of more than 512 KiB looped (H100,
    `benchmarks.split`, fp32 1024x262144: add_layer_norm 1619 GB/s split vs 1815 looped,
    add_rms_norm 1782 vs 1911; bf16 2239 vs 1555 and 2298 vs 1733); the plain norms have no
    bound (layer norm fp32 1024x262144 2402 split vs 1604)."""
    schedule = _backward_schedule(module, 64, n, CPU, element_size)
    assert schedule.split == split


@pytest.mark.parametrize(("element_size", "n", "split"), [
    (2, 131072, 1), (2, 65536, 0), (4, 65536, 1), (4, 32768, 0)])
def test_the_softmax_backward_splits_rows_of_256_kib(element_size, n, split):
    """codegen/schedule_table.json: the softmax backward (no column partials) splits rows of
    256 KiB and more (H100, `benchmarks.split`: fp32 4096x65536 2753 split vs 2157 GB/s, bf16
    4096x65536 2278 vs 2824)."""
    schedule = softmax.SCHEDULES.choose(64, n, False, "bwd", 2, element_size, CPU, True)
    assert schedule.split == split


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the SM count of a CUDA device")
@pytest.mark.parametrize(("module", "m", "n", "block_n", "warps", "per_sm"), [
    (layernorm, 4096, 32768, 4096, 8, 2), (layernorm, 1024, 262144, 8192, 16, 1),
    (rmsnorm, 4096, 32768, 8192, 8, 1), (rmsnorm, 4096, 65536, 8192, 8, 1),
    (add_layernorm, 4096, 32768, 4096, 8, 2), (add_rmsnorm, 4096, 32768, 8192, 8, 1)])
def test_split_rows_fill_the_gpu_at_once(module, m, n, block_n, warps, per_sm):
    """Slabs of split_block_n columns, wider where a row would take more than 32 programs;
    as many groups as fit on the GPU at once (the measured configurations)."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    schedule = _backward_schedule(module, m, n, device)
    members = n // block_n
    assert (schedule.split, schedule.block_n, schedule.warps, schedule.rows) == (
        members, block_n, warps, 1)
    assert schedule.programs == sms * per_sm // members * members
    budget = min(255, 65536 // (32 * warps * per_sm))
    assert maxnreg(schedule.warps, schedule.programs, device) == budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cooperative launch on a CUDA device")
def test_a_refused_cooperative_launch_runs_unsplit():
    """Where the device will not hold every program of the split groups at once (here: a group
    for every row, far more programs than an H100 holds), CUDA refuses the cooperative launch;
    the call then runs unsplit, leaving no trace of the refused launch, and the device's rows
    stop splitting."""
    device = torch.device("cuda", torch.cuda.current_device())  # as a tensor's device names it
    m, n = 4096, 32768
    gen = torch.Generator(device).manual_seed(0)
    x, dy = (torch.randn((m, n), generator=gen, device=device, dtype=torch.bfloat16)
             for _ in range(2))
    weight, bias = (torch.randn((n,), generator=gen, device=device, dtype=torch.bfloat16)
                    for _ in range(2))
    _, mean, rstd = layernorm._layernorm_fwd(x, weight, bias, 1e-5, 0.0, True, True)
    seam = layernorm.SCHEDULES

    def every_row_a_group(M, *args):
        # the rule's split rows (none once the device refused), each row a group of its own
        schedule = seam.rule(M, *args)
        return schedule._replace(programs=schedule.split * M, regs=False) if schedule.split \
            else schedule

    try:
        with seam.override(choose=every_row_a_group):
            assert _backward_schedule(layernorm, m, n, device).split  # the rule splits these rows
            got = layernorm._layernorm_bwd_default(dy, x, weight, bias, mean, rstd, 0.0, True, True)
            assert device.index in SPLIT_REFUSED
            assert _backward_schedule(layernorm, m, n, device).split == 0
            with seam.override(split_min_n=0):
                want = layernorm._layernorm_bwd_default(dy, x, weight, bias, mean, rstd, 0.0,
                                                        True, True)
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"output {k} of the refused call differs from an unsplit call"
    finally:
        SPLIT_REFUSED.discard(device.index)
        forget_all()


@pytest.mark.parametrize("module", [layernorm, softmax, geglu])
def test_backwards_walk_their_rows_from_the_last(module):
    # a backward's inputs were last touched in row order (the forward, the output gradient's
    # writer), so backwards start on the last rows; forwards walk from the first
    assert module.SCHEDULES.constants.backward_last_first == 1
    for kind, last_first in (("fwd", False), ("bwd", True)):
        assert module.SCHEDULES.choose(64, 256, False, kind, 1, 2, CPU).last_first is last_first
    with module.SCHEDULES.override(backward_last_first=0):
        assert module.SCHEDULES.choose(64, 256, False, "bwd", 1, 2, CPU).last_first is False
    assert module.SCHEDULES.choose(64, 256, False, "bwd", 1, 2, CPU).last_first is True


def test_the_masked_softmax_backward_walks_its_rows_from_the_first():
    # measured per op (codegen/schedule_table.json "constants"): from the last it ran 7% slower
    # on the H100
    assert masked_softmax.SCHEDULES.constants.backward_last_first == default_table().constants(
        "masked_softmax")["backward_last_first"] == 0
    for module, last_first in ((masked_softmax, False), (softmax, True)):
        schedule = module.SCHEDULES.choose(64, 256, False, "bwd", 1, 2, CPU)
        assert schedule.last_first is last_first


@pytest.mark.parametrize("fixed", [False, True])
def test_dropout_draws_the_same_values_in_rows_compiled_for_their_width(fixed):
    """The random counter of a dropout kernel (`helpers.uniform`: row * ceil(N / 4) + col // 4,
    split into two 32-bit words) from 32-bit row offsets (FIXED_N) as from 64-bit ones: the masked
    softmax's forward and backward with dropout against the generated torch path. (The counter
    was built in the offsets' 32 bits with FIXED_N, whose backward then failed to compile on the
    H100: its 0xFFFFFFFF mask is out of int32's range.)"""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, n, rows = 12, 64, 2
    generator = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(m, n, generator=generator, dtype=torch.float64).to(device)
             for _ in range(2))
    row_shape = [1, 3, 4]
    seed = checks.seed("masked_softmax", 1234, device)
    scale, window, dropout_p = 0.5, float("inf"), 0.25
    schedule = Schedule(False, n, rows, 1, m // rows, 1, 1, False, False, True, False, False,
                        False, fixed)
    assert fixed_n(schedule, m, n, n, n) == (n if fixed else 0)
    with _forced(masked_softmax, schedule):
        y, p = masked_softmax._masked_softmax_fwd(x, None, scale, window, dropout_p, seed,
                                                  row_shape, store_p=True)
        dx, = masked_softmax._masked_softmax_bwd_default(dy, p, scale, window, dropout_p, seed,
                                                         row_shape)
    y_torch, p_torch = masked_softmax._masked_softmax_fwd_torch(
        x, None, scale, window, dropout_p, seed, row_shape, True)
    dx_torch, = masked_softmax._masked_softmax_bwd_default_torch(dy, p_torch, scale, window,
                                                                 dropout_p, seed, row_shape)
    assert (y == 0).any() and (y != 0).any()  # dropout drew both ways
    for got, want in ((y, y_torch), (p, p_torch), (dx, dx_torch)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

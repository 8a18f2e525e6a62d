"""The hand-written runtime (codegen/runtime) on its own, with no generated module: the schedule
rules of `Schedules` and its one seam `override`, split rows, the kernel forms, the launch
helpers, the argument checks and the helpers whose torch twins the torch path must match (the
Triton ones run under the interpreter where there is no GPU: tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from reference import HAS_CUDA

from codegen.runtime import checks, launch, triton_helpers
from codegen.runtime.schedules import (
    SPLIT_REFUSED,
    Constants,
    Schedule,
    Schedules,
    fixed_n,
    forget_all,
    form_of,
    maxnreg,
)

CPU = torch.device("cpu")
#: where the Triton helpers run: the GPU, or the interpreter (conftest sets TRITON_INTERPRET)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _choose(seam, M, N, kind="fwd", grid_stride=False, element_size=2, loads=1, split=False):
    return seam.choose(M, N, grid_stride, kind, loads, element_size, CPU, split)


# Schedules.choose: the rules


def test_narrow_rows_stay_whole_several_rows_a_program():
    # 8192 elements a step: 8 rows of 1024, 32 warps' worth of elements capped at 16 warps; one
    # program per row block; the row blocks tile the tensor (no masks) with no row-block loop
    schedule = _choose(Schedules("test"), 64, 1024)
    assert schedule == Schedule(False, 1024, 8, 16, 8, 1, 1, False, False, True, False, False,
                                False, False, None, 0, False)


@pytest.mark.parametrize(("n", "looped", "block_n", "chunks", "stages"), [
    (16384, False, 16384, 1, 1), (16385, True, 8192, 3, 3), (65536, True, 8192, 8, 3)])
def test_rows_past_persistent_max_block_n_loop(n, looped, block_n, chunks, stages):
    c = Constants()
    schedule = _choose(Schedules("test"), 64, n)
    assert (schedule.looped, schedule.block_n, schedule.chunks, schedule.stages) == (
        looped, block_n, chunks, stages)
    assert schedule.rows == 1 and schedule.warps == c.max_warps
    # looped rows: one sweep from one_sweep_min_n columns, kept in L2 up to keep_max_row_bytes
    assert schedule.one_sweep == (looped and n >= c.one_sweep_min_n)
    assert schedule.keep == (looped and n * 2 <= c.keep_max_row_bytes)


def test_an_op_s_row_bytes_keep_wide_rows_whole_in_its_direction_only():
    seam = Schedules("test", Constants(persistent_max_fwd_row_bytes=65536))
    assert not _choose(seam, 64, 32768).looped  # 64 KiB of 16-bit elements: whole
    assert _choose(seam, 64, 32768, element_size=4).looped  # 128 KiB: looped
    assert _choose(seam, 64, 32768, kind="bwd").looped  # the backward's limit is 0
    seam = Schedules("test", Constants(persistent_max_fwd_block_n=4096))
    assert _choose(seam, 64, 8192).looped and not _choose(seam, 64, 8192, kind="bwd").looped


@pytest.mark.parametrize(("n", "element_size", "looped"), [
    (8192, 4, False), (16384, 2, False), (16384, 4, True), (10000, 2, True), (6000, 2, False)])
def test_rows_with_column_partials_loop_past_their_row_bytes_and_when_padded(n, element_size,
                                                                             looped):
    # 32 KiB of row next to the partials at most; a padded row of a 16384-wide block loops
    schedule = _choose(Schedules("test"), 64, n, kind="bwd", grid_stride=True,
                       element_size=element_size)
    assert schedule.looped == looped
    # column partials: a program per SM, or the interpreter's few programs
    assert schedule.programs == min(-(-64 // schedule.rows), Constants().interpreter_programs)
    if looped:
        assert (schedule.rows, schedule.block_n) == (2, 4096)  # looped_grid_stride_rows


def test_backwards_walk_from_the_last_row_block_unless_the_op_says_otherwise():
    assert not _choose(Schedules("test"), 64, 256).last_first
    assert _choose(Schedules("test"), 64, 256, kind="bwd").last_first
    assert not _choose(Schedules("test", Constants(backward_last_first=0)), 64, 256,
                       kind="bwd").last_first


def test_measured_entries_take_precedence_over_the_constants():
    measured = {("fwd", 1024): (2, 8, 0, 1, 0, -1, 1), ("fwd", 1000): (4, 4, 0, 1, 0, -1, 1)}
    seam = Schedules("test", measured=measured)
    schedule = _choose(seam, 64, 1024)
    assert (schedule.rows, schedule.warps, schedule.programs, schedule.entry) == (
        2, 8, 32, ("fwd", 1024))
    # a padded width measured as itself takes its own entry; other padded widths their block's
    assert _choose(seam, 64, 1000).entry == ("fwd", 1000)
    padded = _choose(seam, 64, 1001)
    assert padded.entry == ("fwd", 1024) and padded.block_n == 1024 and not padded.even
    # rows a step no more than the tensor's rows (to a power of two)
    assert _choose(Schedules("test", measured={("fwd", 1024): (64, 8, 0, 1, 0, -1, 1)}), 3,
                   1024).rows == 4
    # a kind without entries keeps the constants
    assert _choose(seam, 64, 1024, kind="bwd").entry is None


def test_fp32_rows_take_fp32_entries_where_there_are_some():
    measured = {("fwd", 1024): (2, 8, 0, 1, 0, -1, 1), ("fwd_fp32", 1024): (4, 2, 0, 1, 0, -1, 1)}
    seam = Schedules("test", measured=measured)
    assert _choose(seam, 64, 1024, element_size=4).entry == ("fwd_fp32", 1024)
    assert _choose(seam, 64, 1024, element_size=4).warps == 2
    assert _choose(seam, 64, 1024, element_size=2).entry == ("fwd", 1024)
    del measured[("fwd_fp32", 1024)]
    assert _choose(Schedules("test", measured=measured), 64, 1024,
                   element_size=4).entry == ("fwd", 1024)


def test_looped_entries():
    # a measured step loops a row the rule keeps whole, in the measured sweep form
    seam = Schedules("test", measured={("fwd", 2048): (1, 4, 0, 1, 512, 1, 1)})
    schedule = _choose(seam, 64, 2048)
    assert (schedule.looped, schedule.block_n, schedule.chunks, schedule.warps,
            schedule.one_sweep) == (True, 512, 4, 4, True)
    # a row that must loop takes the fastest looped entry of its width, measured at that width:
    # a padded row keeps the constants
    seam = Schedules("test", measured={("fwd_looped", 32768): (1, 16, 0, 1, 4096, 0, 1)})
    schedule = _choose(seam, 64, 32768)
    assert (schedule.entry, schedule.block_n, schedule.chunks, schedule.one_sweep) == (
        ("fwd_looped", 32768), 4096, 8, False)
    padded = _choose(seam, 64, 30000)
    assert padded.looped and padded.entry is None and padded.block_n == Constants().looped_block_n


def test_the_pipeline_is_dropped_where_its_buffers_would_not_fit():
    # a 16-bit entry of 3 stages borrowed by 4-byte rows: 2 buffered steps of 8 x 8192 x 4 bytes
    seam = Schedules("test", measured={("bwd", 8192): (8, 16, 1, 3, 0, -1, 1)})
    assert _choose(seam, 64, 8192, kind="bwd", grid_stride=True).stages == 3
    assert _choose(seam, 64, 8192, kind="bwd", grid_stride=True, element_size=4).stages == 1


def test_choose_keeps_what_it_chose_until_forgotten():
    calls = []
    seam = Schedules("test")

    def counted(*args):
        calls.append(args)
        return seam.rule(*args)

    with seam.override(choose=counted):
        first = _choose(seam, 64, 1024)
        assert _choose(seam, 64, 1024) is first and len(calls) == 1
        # the replaced rule takes choose's arguments, `split` last
        assert calls[0] == (64, 1024, False, "fwd", 1, 2, CPU, False)
        seam.forget()
        _choose(seam, 64, 1024)
        assert len(calls) == 2


# Schedules.override: the one seam


def test_override_replaces_the_constants_and_restores_them():
    seam = Schedules("test", Constants(split_min_n=12288), measured={("fwd", 1024): (2, 8, 0, 1,
                                                                                   0, -1, 1)})
    constants, measured = seam.constants, seam.measured
    seam.keep(("key",), "plan")
    assert _choose(seam, 64, 32768).looped
    with seam.override(persistent_max_block_n=65536, persistent_max_fwd_block_n=65536,
                       measured={}) as inside:
        assert inside is seam
        assert seam.plans == {}  # forgotten on entry
        assert seam.constants.persistent_max_block_n == 65536
        assert seam.constants.split_min_n == 12288  # the op's others kept
        assert seam.measured == {}
        assert not _choose(seam, 64, 32768).looped  # not the schedule chosen before
        seam.keep(("key",), "plan")
    assert seam.constants is constants and seam.measured is measured
    assert seam.plans == {}  # forgotten on exit
    assert _choose(seam, 64, 32768).looped  # nor the one chosen within


def test_override_restores_after_an_error_and_nests():
    seam = Schedules("test")
    with pytest.raises(RuntimeError, match="inside"):
        with seam.override(max_warps=8):
            raise RuntimeError("inside")
    assert seam.constants == Constants()
    with seam.override(max_warps=8, form_bits=4):
        with seam.override(min_warps=2, form_bits=16):
            assert (seam.constants.max_warps, seam.constants.min_warps) == (8, 2)
            assert seam.form_bits == 20
        assert (seam.constants.max_warps, seam.constants.min_warps) == (8, 4)
        assert seam.form_bits == 4
    assert seam.constants == Constants() and seam.form_bits == 0


def test_override_names_an_unknown_constant():
    seam = Schedules("test")
    with pytest.raises(TypeError, match="no_such_constant"):
        with seam.override(no_such_constant=1):
            pass  # pragma: no cover - never entered
    assert seam.constants == Constants()
    # the frozen constants change only through the seam
    with pytest.raises(AttributeError):
        seam.constants.max_warps = 8


def test_form_bits_reach_every_schedule():
    seam = Schedules("test")
    with seam.override(form_bits=4):  # REVERSE: only where the row loops
        assert _choose(seam, 64, 32768).reverse
        assert not _choose(seam, 64, 1024).reverse
    assert not _choose(seam, 64, 32768).reverse
    with seam.override(form_bits=16):  # FIXED: whole rows only
        assert _choose(seam, 64, 1024).fixed and not _choose(seam, 64, 32768).fixed


def test_forget_all_reaches_every_op():
    ops = [Schedules("first"), Schedules("second")]
    for seam in ops:
        seam.keep(("key",), "plan")
        seam.keep(None, "plan")  # nothing kept without a key
    forget_all()
    assert all(seam.plans == {} for seam in ops)


# split rows


def test_split_rows_on_the_cpu():
    c = Constants(split_min_n=1024)
    # no exchange between a group's programs: rows split under the interpreter too
    seam = Schedules("test", c)
    split = _choose(seam, 64, 4096, kind="bwd", grid_stride=True, split=True)
    assert (split.split, split.block_n, split.programs, split.warps) == (1, 4096, 4, 8)
    assert split.strided and not split.regs and not split.looped
    with seam.override(split_block_n=1024):
        slabs = _choose(seam, 64, 4096, kind="bwd", grid_stride=True, split=True)
        # 4 slabs a row, 4 groups (interpreter_programs) of them
        assert (slabs.split, slabs.block_n, slabs.programs, slabs.warps) == (4, 1024, 16, 4)
        assert seam.split_rows(64, 4096, CPU, 2) == slabs
    # a group that exchanges row sums runs as one program under the interpreter: a whole row
    exchanging = Schedules("test", c, split_exchange=True)
    with exchanging.override(split_block_n=1024):
        whole = _choose(exchanging, 64, 4096, kind="bwd", grid_stride=True, split=True)
    assert (whole.split, whole.block_n, whole.programs) == (1, 4096, 4)
    # kernels without a split form, rows below the rule's width, and past its bound do not split
    assert _choose(seam, 64, 4096, kind="bwd", grid_stride=True).split == 0
    assert _choose(seam, 64, 1023, kind="bwd", grid_stride=True, split=True).split == 0
    with seam.override(split_max_row_bytes=4096):
        assert _choose(seam, 64, 4096, kind="bwd", grid_stride=True, split=True).split == 0
    # kernels without column partials split by row bytes
    other = Schedules("test", Constants(split_other_min_row_bytes=8192))
    assert _choose(other, 64, 4096, kind="bwd", split=True).split == 1
    assert _choose(other, 64, 4096, kind="bwd", split=True, element_size=1).split == 0


def test_a_refused_device_splits_no_rows():
    seam, other = Schedules("test", Constants(split_min_n=1)), Schedules("other")
    device = torch.device("cuda", 7)  # never asked for its properties: refused first
    other.keep(("key",), "plan")
    try:
        seam.refuse_split(7)
        assert 7 in SPLIT_REFUSED and other.plans == {}  # every op forgets
        assert seam.split_rows(64, 4096, device, 2) is None
    finally:
        SPLIT_REFUSED.discard(7)


# kernel forms


def test_form_of_sets_each_flag_where_it_applies():
    # (EVEN, STRIDED, REVERSE, REGS, FIXED) of 8 rows of 64, 2 rows a step
    assert form_of(8, 64, 2, 64, 4, 1) == (True, False, False, False, False)
    assert form_of(7, 64, 2, 64, 4, 1)[0] is False  # a partial row block keeps its masks
    assert form_of(8, 60, 2, 64, 4, 1)[0] is False  # and a padded row
    assert form_of(8, 64, 2, 64, 4, 0)[0] is False  # the form may keep them anyway
    assert form_of(8, 64, 2, 64, 2, 0)[1] is True  # fewer programs than row blocks: the loop
    assert form_of(8, 64, 2, 64, 4, 2)[1] is True  # bit 2: the loop anyway
    assert form_of(8, 64, 2, 32, 4, 4)[2] is True  # bit 4: looped rows only
    assert form_of(8, 64, 2, 64, 4, 4)[2] is False
    assert form_of(8, 64, 2, 64, 2, 8)[3] is True  # bit 8: whole rows that programs loop over
    assert form_of(8, 64, 2, 64, 4, 8)[3] is False
    assert form_of(8, 64, 2, 32, 2, 8)[3] is False
    assert form_of(8, 64, 2, 64, 4, 16)[4] is True  # bit 16: whole rows only
    assert form_of(8, 64, 2, 32, 4, 16)[4] is False


def test_fixed_n_only_where_the_launch_allows_it():
    fixed = Schedule(False, 1024, 1, 4, 64, 1, 1, False, False, True, False, False, False, True)
    assert fixed_n(fixed, 64, 1024, 1024, 1024) == 1024
    assert fixed_n(fixed, 64, 1024, 1024, 2048) == 0  # a strided tensor
    assert fixed_n(fixed, 2**21, 1024) == 0  # 2^31 elements: 64-bit offsets
    assert fixed_n(fixed._replace(fixed=False), 64, 1024, 1024) == 0


def test_maxnreg_is_none_off_cuda():
    assert maxnreg(8, 132, CPU) is None


# launch helpers


@pytest.mark.parametrize("value", [0.1, 1e-5, 1.0 / 3.0, -2.5e-40, 123456789.123])
def test_fp32_pair_splits_a_float_into_fp32_and_the_rest(value):
    high, low = launch.fp32_pair(value)
    assert high == float(torch.tensor(value, dtype=torch.float32))
    assert high + low == value


@pytest.mark.parametrize("value", [1e39, -1e300, math.inf, -math.inf])
def test_fp32_pair_keeps_what_fp32_cannot_hold_whole(value):
    assert launch.fp32_pair(value) == (value, 0.0)
    high, low = launch.fp32_pair(math.nan)
    assert math.isnan(high) and low == 0.0


def test_rows_views_without_copying_where_it_can():
    x = torch.randn(4, 8)
    assert launch.rows((4, 8), x) is x
    batched = torch.randn(2, 2, 8)
    viewed = launch.rows((4, 8), batched)
    assert viewed.shape == (4, 8) and viewed.data_ptr() == batched.data_ptr()
    for strided in (torch.randn(8, 4).t(), torch.randn(4, 16)[:, ::2]):
        copied = launch.rows((4, 8), strided)
        assert copied.stride(-1) == 1 and torch.equal(copied, strided)
    assert launch.rows((0, 8), torch.empty(0, 8)).shape == (0, 8)


def test_shaped_and_the_accumulator():
    x = torch.randn(4, 8)
    assert launch.shaped(x, x.shape) is x
    assert launch.shaped(x, (32,)).shape == (32,)
    assert launch.accumulator(torch.float64) == torch.float64
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert launch.accumulator(dtype) == torch.float32
    assert launch.TRITON_ACC[torch.float32] == tl.float32


def test_use_triton_follows_the_device_and_the_interpreter(monkeypatch):
    x = torch.ones(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.use_triton(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not launch.use_triton(x)


def test_partials_have_a_row_a_program_or_a_group():
    whole = Schedule(False, 64, 1, 4, 6, 1, 1, False, False, True, False, False, False, False)
    assert launch.partials(False, whole, 64, torch.float32, CPU) is None
    assert launch.partials(True, whole, 64, torch.float32, CPU).shape == (6, 64)
    split = whole._replace(split=3)
    assert launch.partials(True, split, 64, torch.float64, CPU).shape == (2, 64)


@pytest.mark.parametrize("rows", [1, 300])
def test_column_sums(rows):
    # four stores (two launches of up to three), one absent; fp64 partials sum to fp64 and to a
    # 16-bit result; P past the column-sum kernel's block of partial rows at 300
    generator = torch.Generator().manual_seed(rows)
    partials = [torch.randn(rows, 45, generator=generator, dtype=torch.float64).to(DEVICE)
                for _ in range(4)]
    likes = [torch.empty(0, dtype=dtype, device=DEVICE)
             for dtype in (torch.float64, torch.float32, torch.float64, torch.float64)]
    stores = [*zip(partials, likes, strict=True)]
    stores.insert(2, (None, None))
    sums = launch.column_sums(*stores)
    assert len(sums) == 5 and sums[2] is None
    for (partial, like), total in zip(stores[:2] + stores[3:], sums[:2] + sums[3:], strict=True):
        assert total.dtype == like.dtype and total.shape == (45,)
        torch.testing.assert_close(total, partial.sum(dim=0).to(like.dtype), rtol=1e-6,
                                   atol=1e-6 if like.dtype == torch.float32 else 1e-12)
    assert launch.column_sums((None, None)) == (None,)


# argument checks: each error names the function, the argument, what was expected and got


def test_checks_name_the_argument():
    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"f\(\): argument 'input' must be a torch.Tensor, got int"):
        checks.check_input("f", 3)
    with pytest.raises(TypeError, match="argument 'gate' must have dtype .* got torch.int32"):
        checks.check_input("f", torch.ones(2, dtype=torch.int32), "gate")
    with pytest.raises(ValueError, match=r"argument 'weight' must have shape \(4,\)"):
        checks.check_param("f", "weight", torch.ones(3, dtype=torch.float64), (4,), x)
    with pytest.raises(TypeError, match="argument 'bias' must have the dtype of 'input'"):
        checks.check_param("f", "bias", torch.ones(4, dtype=torch.float32), (4,), x)
    half = x.to(torch.bfloat16)
    strided = torch.ones(8)[::2]
    kept = checks.check_param("f", "weight", strided, (4,), half)  # fp32 for a 16-bit input
    assert kept.is_contiguous() and torch.equal(kept, strided)
    assert checks.check_param("f", "weight", None, (4,), x) is None
    with pytest.raises(ValueError, match="argument 'up' must have the shape of 'gate'"):
        checks.check_like_input("f", "up", torch.ones(2, 5), x, reference="gate")
    with pytest.raises(ValueError, match="argument 'scale' must hold one value"):
        checks.check_scalar_param("f", "scale", torch.ones(2), x)


def test_checks_of_shapes_and_numbers():
    x = torch.randn(2, 3, 4)
    assert checks.check_normalized_shape("f", 4, x) == ((4,), 4)
    assert checks.check_normalized_shape("f", [3, 4], x) == ((3, 4), 12)
    with pytest.raises(ValueError, match=r"'normalized_shape' \[3\] must match"):
        checks.check_normalized_shape("f", (3,), x)
    with pytest.raises(TypeError, match="'normalized_shape' must be an int or a sequence"):
        checks.check_normalized_shape("f", 4.0, x)
    with pytest.raises(ValueError, match="at least one dimension"):
        checks.check_normalized_shape("f", (), x)
    assert checks.check_eps("f", None, torch.float32) == torch.finfo(torch.float32).eps
    assert checks.check_eps("f", 1, torch.float32) == 1.0
    with pytest.raises(ValueError, match="argument 'eps' must be finite and >= 0, got -1.0"):
        checks.check_eps("f", -1, torch.float32)
    with pytest.raises(TypeError, match="argument 'eps' must be a real number or None, got bool"):
        checks.check_eps("f", True, torch.float32)
    with pytest.raises(ValueError, match="argument 'scale' must be finite"):
        checks.check_real("f", "scale", math.inf)
    with pytest.raises(ValueError, match=r"argument 'p' must be a probability in \[0, 1\)"):
        checks.check_option("f", "p", 1.0, "probability")
    with pytest.raises(TypeError, match="argument 'k' must be an int, got 1.5"):
        checks.check_option("f", "k", 1.5, "integer")
    # None is an op's positive option off; a layer's has no off value
    assert checks.check_option("f", "cap", None, "positive") is None
    with pytest.raises(TypeError, match="argument 'eps' must be a real number, got NoneType"):
        checks.check_option("f", "eps", None, "positive", off=False)
    with pytest.raises(checks.OptionError, match=r"'eps' must be a finite number > 0, got 0.0$"):
        checks.check_option("f", "eps", 0, "positive", off=False)
    assert checks.check_size("f", "n", 3) == 3 and checks.check_flag("f", "on", True) is True
    with pytest.raises(checks.OptionError, match="argument 'n' must be > 0, got 0"):
        checks.check_size("f", "n", 0)
    for value, kind in ((4.0, "float"), (True, "bool")):
        with pytest.raises(TypeError, match=f"argument 'n' must be an int, got {kind}"):
            checks.check_size("f", "n", value)
    with pytest.raises(TypeError, match="argument 'on' must be a bool, got int"):
        checks.check_flag("f", "on", 1)


def test_seeds_and_rows():
    seed = checks.seed("f", 5, CPU)
    assert seed.dtype == torch.int64 and seed.shape == () and int(seed) == 5
    assert checks.seed("f", None, CPU).dtype == torch.int64
    with pytest.raises(ValueError, match=r"argument 'seed' must be in \[0, 2\*\*63\)"):
        checks.seed("f", -1, CPU)
    with pytest.raises(TypeError, match="argument 'seed' must be an int or None, got float"):
        checks.seed("f", 1.5, CPU)
    with pytest.raises(ValueError, match="argument 'seed' as a tensor must hold one int64"):
        checks.seed("f", torch.ones(1), CPU)
    assert checks.row_shape([2, 3, 4, 5, 6]) == [6, 4, 5]
    assert checks.row_shape([7]) == [1, 1, 1]
    mask = torch.randn(1, 3, 1, 5)
    rows = checks.broadcast_rows(mask, (2, 3, 4, 5), checks.row_shape((2, 3, 4, 5)))
    assert rows.shape == (2, 3, 4, 5) and rows.stride(0) == 0  # read in place
    assert torch.equal(rows, mask.expand(2, 3, 4, 5))
    x = torch.randn(2, 5)
    additive = checks.check_broadcast("f", "mask", torch.tensor([True, False] * 2 + [True]), x,
                                      True)
    assert torch.equal(additive, torch.tensor([0.0, -math.inf, 0.0, -math.inf, 0.0]))
    with pytest.raises(ValueError, match="argument 'mask' must be broadcastable"):
        checks.check_broadcast("f", "mask", torch.ones(3), x, True)
    with pytest.raises(ValueError, match="argument 'mask' is not differentiated here"):
        checks.check_broadcast("f", "mask", torch.ones(5, requires_grad=True), x, True)
    assert not checks.needs_grad(x, None) and checks.needs_grad(x.requires_grad_())


# the Triton helpers and their torch twins


@triton.jit
def _uniform_kernel(seed_ptr, out_ptr, N, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) + tl.zeros((1, 1), tl.int64)
    seed = tl.load(seed_ptr)
    for col0 in range(0, N, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)[None, :]
        values = triton_helpers.uniform(seed, rows, col0, N, BLOCK_N)
        tl.store(out_ptr + rows * N + cols, values, mask=cols < N)


@triton.jit
def _guarded_reciprocal_kernel(v_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offsets, mask=offsets < N, other=1.0)
    tl.store(out_ptr + offsets, triton_helpers.guarded_reciprocal(v), mask=offsets < N)


def test_uniform_torch_is_deterministic_and_uniform():
    values = triton_helpers.uniform_torch(1234, 64, 37)
    assert values.shape == (64, 37) and values.dtype == torch.float32
    assert torch.equal(values, triton_helpers.uniform_torch(1234, 64, 37))
    assert not torch.equal(values, triton_helpers.uniform_torch(1235, 64, 37))
    assert 0.0 <= values.min() and values.max() < 1.0
    assert abs(values.mean().item() - 0.5) < 0.02
    # a row drawn alone is that row of the whole tensor's draw; a 64-bit seed's high word counts
    assert torch.equal(triton_helpers.uniform_torch(1234, 1, 37, first_row=5)[0], values[5])
    assert not torch.equal(triton_helpers.uniform_torch(1234 + 2**40, 64, 37), values)


@pytest.mark.parametrize(("n", "block_n"), [(37, 16), (37, 2), (64, 64)])
def test_uniform_draws_what_its_torch_twin_draws(n, block_n):
    # bit for bit: the torch path's dropout masks are the kernels'; steps of 4 or more columns
    # draw a Philox call per four columns, narrower ones a word per column
    seed = 2**40 + 77
    out = torch.empty(5, n, device=DEVICE)
    _uniform_kernel[(5,)](torch.tensor(seed, device=DEVICE), out, n, BLOCK_N=block_n)
    assert torch.equal(out.cpu(), triton_helpers.uniform_torch(seed, 5, n))


def test_guarded_reciprocal_clamps_the_magnitude_and_keeps_nan():
    guard = triton_helpers.INVERSION_GUARD
    v = torch.tensor([2.0, -4.0, 0.0, -0.0, 1e-9, -1e-9, math.inf, math.nan])
    got = triton_helpers.guarded_reciprocal_torch(v)
    want = torch.tensor([0.5, -0.25, 1 / guard, 1 / guard, 1 / guard, -1 / guard, 0.0, math.nan])
    torch.testing.assert_close(got, want, equal_nan=True)
    assert triton_helpers.guarded_reciprocal_torch(0.0) == 1 / guard  # a Python number too
    out = torch.empty_like(v, device=DEVICE)
    _guarded_reciprocal_kernel[(1,)](v.to(DEVICE), out, v.numel(), BLOCK=8)
    torch.testing.assert_close(out.cpu(), got, equal_nan=True)


def test_inversion_guard_is_the_engines():
    """The runtime clamps recovered values' divisors at the engine's GuardedReciprocal.guard."""
    from derive.algebra import GuardedReciprocal

    assert triton_helpers.INVERSION_GUARD == float(GuardedReciprocal.guard)


def _reference_rows(tensor, shape, order):
    """broadcast_rows by tensor ops: align, permute, make the last dim real, expand, merge."""
    tensor = checks.leading_ones(tensor, len(shape))
    if order is not None:
        tensor = tensor.permute(order)
    tensor = tensor.expand(*tensor.shape[:-1], shape[-1]).contiguous() if (
        tensor.shape[-1] != shape[-1] or tensor.stride(-1) != 1) else tensor
    return tensor.expand(shape).reshape(*checks.row_shape(shape), shape[-1])


#: (table shape, or a callable making the table; the rows' shape in `order`; order): a
#: rotary table unsqueezed over the heads, in attention's layout, 5-d rows whose leading dims
#: merge and do not, a broadcast and a strided last dim (taken by tensor ops), 1-d and 2-d rows
BROADCAST_ROWS = [
    ((2, 1, 5, 8), (2, 3, 5, 8), None),
    ((2, 5, 1, 8), (2, 1, 5, 8), (0, 2, 1, 3)),
    ((2, 5, 1, 8), (2, 3, 5, 8), (0, 2, 1, 3)),
    ((3, 2, 4, 1, 8), (3, 2, 4, 5, 8), None),
    ((3, 1, 4, 1, 8), (3, 2, 4, 5, 8), None),
    ((1, 2, 4, 1, 8), (3, 2, 4, 5, 8), None),
    ((2, 5, 1), (2, 5, 8), None),
    (lambda: torch.arange(160.0).reshape(2, 5, 16)[..., ::2], (2, 5, 8), None),
    ((8,), (8,), None),
    ((1, 8), (6, 8), None),
    ((5, 8), (4, 5, 8), None),
]


@pytest.mark.parametrize("table, shape, order", BROADCAST_ROWS)
def test_broadcast_rows_views_of_any_table(table, shape, order):
    """A broadcast operand's (D0, D1, D2, N) rows are those of the tensor ops that define them,
    and read in place (no copy) wherever those are a view."""
    tensor = table() if callable(table) else torch.randn(table)
    shape = torch.Size(shape)
    rows = checks.broadcast_rows(tensor, shape, checks.row_shape(shape), order)
    want = _reference_rows(tensor, shape, order)
    assert rows.shape == want.shape and torch.equal(rows, want)
    in_place = want.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert (rows.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()) == in_place


def test_remembered_row_geometry_views_each_tensor_at_its_own_offset():
    """The rows' sizes and strides are remembered per geometry (`checks._row_geometry`, every
    layer passes the same tables): a second table of the same sizes and strides is viewed at
    its own storage offset, with its own values."""
    shape = torch.Size((2, 8, 4, 6))
    base = torch.randn(3, 2, 1, 4, 6)
    first, second = base[0], base[2]  # one geometry, two offsets
    rows = [checks.broadcast_rows(t, shape, checks.row_shape(shape)) for t in (first, second)]
    for got, table in zip(rows, (first, second), strict=True):
        assert torch.equal(got, _reference_rows(table, shape, None))
        assert got.storage_offset() == table.storage_offset()
    assert checks._row_geometry.cache_info().hits >= 1


def test_remembered_memory_order_checks_the_other_tensors_each_call():
    """The order of a tensor's dims in memory is remembered per strides and sizes; whether the
    other tensors share those strides is asked on every call."""
    q = torch.randn(2, 5, 3, 4).transpose(1, 2)  # (B, H, T, D) over a (B, T, H, D) buffer
    assert launch.memory_order(q) == (0, 2, 1, 3)
    assert launch.memory_order(q, torch.randn(2, 3, 5, 4)) is None
    assert launch.memory_order(q, torch.randn(2, 5, 3, 4).transpose(1, 2)) == (0, 2, 1, 3)
    assert launch.memory_order(torch.randn(2, 3, 5, 4)) is None

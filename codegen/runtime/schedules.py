"""Schedules: HOW a kernel walks its rows, chosen per call shape, kept apart from WHAT it computes.

Per (M, N, kernel kind, element size) a `Schedules` object picks persistent rows (whole rows in
registers, several rows a program for narrow ones), looped rows (a sweep over the row per pass)
or split rows (a row's column slabs over a group of programs), the warps, the programs and the
kernel's compile-time form. Its op's measured table (`codegen/schedule_table.json`, written by
`benchmarks.tune`) decides wherever it has the op and the row width; the op's `Constants`
decide the rest. docs/design.md ("Schedules") explains the rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator

import torch
import triton

#: `looped`: one sweep over the row per pass (else whole rows in registers)
#: `block_n`: columns a step; `rows`: rows a step; `warps`; `programs`: the grid
#: `stages`: software-pipeline stages; `chunks`: steps of a looped row's sweep
#: `one_sweep`: a looped row's dependent reductions carried in one sweep
#: `keep`: a looped row's earlier sweeps keep what later ones read again in L2
#: `even`, `strided`, `reverse`, `regs`, `fixed`: the kernel form (`form`)
#: `entry`: the measured-table key the schedule came from (None: the constants)
#: `split`: the programs a row is split over (0: rows are not split)
#: `last_first`: the row blocks walked from the last
Schedule = namedtuple(
    "Schedule",
    "looped block_n rows warps programs stages chunks one_sweep "
    "keep even strided reverse regs fixed entry split last_first",
    defaults=(False, None, 0, False),
)


@dataclasses.dataclass(frozen=True)
class Constants:
    """The rules' constants. The defaults hold for every op; an op's own values (measured on a
    GPU, `codegen/schedule_table.json` "constants") replace some of them."""

    #: rows whose next power of two is at most this keep the whole row in registers
    persistent_max_block_n: int = 16384
    #: kernels with column partials loop over rows wider than this many bytes (the partials
    #: held next to a whole row spill)
    persistent_max_partial_row_bytes: int = 32768
    #: ... and over padded rows (N between powers of two) from this block width
    padded_partial_looped_block_n: int = 16384
    #: backward kernels without column partials keep whole rows of up to this many bytes past
    #: persistent_max_block_n (0: none)
    persistent_max_bwd_row_bytes: int = 0
    #: ... and forward kernels likewise
    persistent_max_fwd_row_bytes: int = 0
    #: forward kernels loop over rows wider than this
    persistent_max_fwd_block_n: int = 16384
    #: ... and backward kernels likewise
    persistent_max_bwd_block_n: int = 16384
    #: elementwise-only kernels read contiguous rows whose width is not a multiple of this as
    #: rows of this width, where the tensor tiles into them (0: never)
    fold_block_n: int = 0
    #: kernels with column partials and row reductions split rows of at least this many
    #: columns over a group of programs that run at once (0: never)
    split_min_n: int = 0
    #: ... and of at least this many bytes
    split_min_row_bytes: int = 0
    #: ... and of at most this many bytes (0: no bound)
    split_max_row_bytes: int = 0
    #: kernels without column partials (a softmax backward) split rows of at least this many
    #: bytes (0: never)
    split_other_min_row_bytes: int = 0
    #: columns of a split program's slab, widened where a row would need more than
    #: split_max_members programs
    split_block_n: int = 4096
    split_max_members: int = 32
    #: slab columns an SM holds: split_sm_elements // slab columns programs an SM
    split_sm_elements: int = 8192
    split_elements_per_thread: int = 16
    #: rows a split program takes a step
    split_rows: int = 1
    #: 1: the three split counts above are of 2-byte elements, and wider elements take as many
    #: bytes, fewer columns (0: columns)
    split_by_bytes: int = 0
    #: software-pipeline stages of a looped row's column sweeps
    looped_stages: int = 3
    #: elements per step of a looped row (split over its rows)
    looped_block_n: int = 8192
    #: looped rows of at least this many columns carry two dependent reductions in one sweep;
    #: shorter rows are re-read from L2 cheaply and keep a pass each
    one_sweep_min_n: int = 65536
    #: looped rows of at most this many bytes a tensor keep their earlier sweeps' reads in L2
    keep_max_row_bytes: int = 262144
    #: rows a step of a looped kernel that accumulates column partials (they share each step's
    #: read-modify-write of the partials)
    looped_grid_stride_rows: int = 2
    #: backward kernels walk their row blocks from the last (1): what a backward reads was last
    #: touched in row order, so the last rows are the likeliest still in L2
    backward_last_first: int = 1
    #: elements a program step takes where N is small (several rows a program)
    row_block_elements: int = 8192
    #: ... and for forward kernels, where it differs (0: row_block_elements)
    fwd_row_block_elements: int = 0
    max_rows: int = 64
    #: kernels with column partials launch this many programs an SM
    programs_per_sm: int = 1
    #: programs where no GPU is there to count SMs (the Triton interpreter)
    interpreter_programs: int = 4
    min_warps: int = 4
    max_warps: int = 16
    elements_per_warp: int = 256
    #: most shared memory a software pipeline may claim for its buffered loads
    pipeline_shared_bytes: int = 160 * 1024


#: a measured-table entry: (rows a step, warps, programs an SM or 0 for one program per row
#: block, pipeline stages, columns a step of a looped row or 0 for whole rows, one sweep as
#: measured (1 or 0; -1: the rule decides), the kernel form (`form`'s bits))
Measured = tuple[int, int, int, int, int, int, int]

#: every `Schedules` made, so that `forget_all` reaches each
_EVERY: weakref.WeakSet[Schedules] = weakref.WeakSet()
#: CUDA devices that refused a cooperative launch of split rows (more programs than they hold
#: at once: another process's work, a partitioned GPU): their rows no longer split
SPLIT_REFUSED: set[int] = set()
#: most schedules and plans one op keeps before it starts over (each distinct shape adds some)
CACHE_SIZE = 4096


class Schedules:
    """One op's schedule choice, its caches and its launch plans.

    `choose` returns the `Schedule` of a call; `plans` holds the launch plans its launchers
    made (`codegen.runtime.launch.Plan`). `override` changes the constants, the measured
    table, the form or the choice itself for the duration of a `with` block, and forgets
    every schedule and plan on entry and exit: it is the one way to change a schedule.
    """

    def __init__(
        self,
        op: str,
        constants: Constants = Constants(),
        measured: dict[tuple[str, int], Measured] | None = None,
        split_exchange: bool = False,
        measured_loads: dict[str, int] | None = None,
    ) -> None:
        self.op = op
        self.constants = constants
        #: (kind, row width) -> `Measured`; kinds "fwd", "bwd", with "_fp32" for entries
        #: measured on 4-byte elements and "_looped" for the fastest looped entry
        self.measured = dict(measured or {})
        #: whether the split kernels exchange partial row sums within a group (row
        #: reductions), so that a group's programs must run at once (a cooperative launch)
        self.split_exchange = split_exchange
        #: element tensors the measured kernels read, per kind: an entry holds as measured for
        #: calls that read no more
        self.measured_loads = dict(measured_loads or {})
        #: bits OR'd into every schedule's form (tests force a form with `override`)
        self.form_bits = 0
        self.plans: dict = {}
        self._chosen: dict = {}
        self._choose: Callable[..., Schedule] | None = None
        _EVERY.add(self)

    def __repr__(self) -> str:
        return f"Schedules({self.op!r}, {len(self.measured)} measured entries)"

    def choose(
        self,
        M: int,
        N: int,
        grid_stride: bool,
        kind: str,
        loads: int,
        element_size: int,
        device: torch.device,
        split: bool = False,
    ) -> Schedule:
        """The schedule of a kernel of `kind` ("fwd"/"bwd") over M rows of N elements of
        `element_size` bytes, reading `loads` element tensors; `grid_stride`: it keeps column
        partials (programs scale with the SMs); `split`: it has a split form."""
        key = (M, N, grid_stride, kind, loads, element_size, device, split)
        schedule = self._chosen.get(key)
        if schedule is None:
            if len(self._chosen) >= CACHE_SIZE:
                self._chosen.clear()
            rule = self._choose or self.rule
            schedule = self._chosen[key] = rule(*key)
        return schedule

    def keep(self, key, plan) -> None:
        """Keep a launch plan under `key` (None: keep nothing)."""
        if key is None or plan is None:
            return
        if len(self.plans) >= CACHE_SIZE:
            self.plans.clear()
        self.plans[key] = plan

    def forget(self) -> None:
        """Drop the schedules and plans made so far: the next call of each launcher chooses its
        schedule and kernel again."""
        self.plans.clear()
        self._chosen.clear()

    def refuse_split(self, device_index: int) -> None:
        """A device refused a cooperative launch: its rows no longer split, for every op."""
        SPLIT_REFUSED.add(device_index)
        forget_all()

    @contextlib.contextmanager
    def override(
        self,
        *,
        measured: dict | None = None,
        form_bits: int = 0,
        choose: Callable[..., Schedule] | None = None,
        **constants: int,
    ) -> Iterator[Schedules]:
        """Within the block: `constants` (Constants' field names) replace the op's, `measured`
        replaces its table, `form_bits` are OR'd into every form, and `choose` (called with
        `choose`'s arguments) replaces the rule. Schedules and plans are forgotten on entry and
        on exit."""
        saved = (self.constants, self.measured, self.form_bits, self._choose)
        known = [field.name for field in dataclasses.fields(Constants)]
        unknown = sorted(set(constants) - set(known))
        if unknown:
            raise TypeError(
                f"Schedules.override: unknown constant(s) {unknown}; expected some of: "
                f"{', '.join(known)}"
            )
        self.constants = dataclasses.replace(self.constants, **constants)
        if measured is not None:
            self.measured = dict(measured)
        self.form_bits |= form_bits
        self._choose = choose or self._choose
        self.forget()
        try:
            yield self
        finally:
            self.constants, self.measured, self.form_bits, self._choose = saved
            self.forget()

    def entry(self, *keys):
        """The first of `keys` that the measured table has, or None."""
        return next((key for key in keys if key in self.measured), None)

    def rule(self, M, N, grid_stride, kind, loads, element_size, device, split=False) -> Schedule:
        """The schedule `choose` returns where nothing overrides it."""
        c = self.constants
        if (
            split
            and (
                0 < c.split_min_n <= N and N * element_size >= c.split_min_row_bytes
                if grid_stride
                else 0 < c.split_other_min_row_bytes <= N * element_size
            )
            and (not c.split_max_row_bytes or N * element_size <= c.split_max_row_bytes)
        ):
            schedule = self.split_rows(M, N, device, element_size)
            if schedule is not None:
                return schedule
        persistent_max_block_n = min(
            c.persistent_max_block_n,
            c.persistent_max_fwd_block_n if kind == "fwd" else c.persistent_max_bwd_block_n,
        )
        block_n = triton.next_power_of_2(N)
        row_bytes = block_n * element_size
        if grid_stride:
            # column partials held in registers next to a whole row spill past this many row
            # bytes, and a padded row from a wide enough block is faster looped
            must_loop = (
                block_n > persistent_max_block_n
                or row_bytes > c.persistent_max_partial_row_bytes
                or (N < block_n and block_n >= c.padded_partial_looped_block_n)
            )
        elif kind == "bwd":
            must_loop = (
                block_n > persistent_max_block_n and row_bytes > c.persistent_max_bwd_row_bytes
            )
        else:
            must_loop = (
                block_n > persistent_max_block_n and row_bytes > c.persistent_max_fwd_row_bytes
            )
        # 4- and 8-byte rows take the entries measured on 4-byte ones where there are some.
        # An entry ran as measured only at its own element size (`exact`): 16-bit entries for
        # 2-byte rows, "_fp32" ones for 4-byte rows; fp64 rows, measured on neither, and rows
        # taking another size's entry keep the shared memory bound below
        wide = "_fp32" if element_size >= 4 else ""
        # a padded row measured at its own width takes that width's entries; other padded rows
        # take their power-of-two width's
        width = N if (kind + wide, N) in self.measured or (kind, N) in self.measured else block_n
        entry = self.entry((kind + wide, width), (kind, width))
        exact = element_size == 2 or (element_size == 4 and (kind + wide, width) in self.measured)
        if must_loop and (entry is None or not self.measured[entry][4]):
            # looped entries were measured at N == width: a padded row that must loop keeps the
            # constants
            entry = self.entry((kind + wide + "_looped", width), (kind + "_looped", width))
            exact = element_size == 2 or (
                element_size == 4 and (kind + wide + "_looped", width) in self.measured)
            entry = entry if N == width else None
        if grid_stride and N < width and block_n >= c.padded_partial_looped_block_n:
            # a padded row with column partials takes the constants whatever its width's entry
            entry = None
        measured = None if entry is None else self.measured[entry]
        looped = must_loop or (measured is not None and measured[4] > 0)
        stages, per_sm = (c.looped_stages if looped else 1), 0
        sweep, form = -1, 1
        if measured is not None:
            rows, warps, per_sm, stages, step, sweep, form = measured
            rows = max(1, min(rows, triton.next_power_of_2(M)))
            block_n = step or block_n
        elif looped:
            rows = c.looped_grid_stride_rows if grid_stride else 1
            block_n = min(c.looped_block_n // rows, persistent_max_block_n)
        else:
            elements = (
                c.fwd_row_block_elements
                if kind == "fwd" and c.fwd_row_block_elements
                else c.row_block_elements
            )
            rows = max(1, min(c.max_rows, elements // block_n, triton.next_power_of_2(M)))
        if measured is None:
            warps = max(c.min_warps, min(c.max_warps, rows * block_n // c.elements_per_warp))
        # the pipeline buffers every element load in shared memory: stages - 1 steps ahead in
        # the row-block loop, about `stages` steps in each sweep of a looped row. An entry
        # measured at this element size ran as it is; others drop the pipeline where it would
        # not fit
        buffered = stages if looped else stages - 1
        exact = exact and loads <= self.measured_loads.get(kind, loads)
        if not (measured is not None and exact) and (
            buffered * rows * block_n * element_size * loads > c.pipeline_shared_bytes
        ):
            stages = 1
        if grid_stride and not per_sm:
            per_sm = (
                c.programs_per_sm
            )  # column partials have a row a program: never one per row block
        row_blocks = triton.cdiv(M, rows)
        programs = row_blocks
        if per_sm:
            if device.type == "cuda":
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                programs = min(row_blocks, sms * per_sm)
            else:
                programs = min(row_blocks, c.interpreter_programs)
        # the sweep form measured with the entry, else the rule
        one_sweep = looped and (sweep == 1 if sweep >= 0 else N >= c.one_sweep_min_n)
        keep = looped and N * element_size <= c.keep_max_row_bytes
        last_first = bool(c.backward_last_first) and kind != "fwd"
        return Schedule(
            looped,
            block_n,
            rows,
            triton.next_power_of_2(warps),
            programs,
            stages,
            triton.cdiv(N, block_n),
            one_sweep,
            keep,
            *form_of(M, N, rows, block_n, programs, form | self.form_bits),
            entry,
            0,
            last_first,
        )

    def split_rows(self, M, N, device, element_size=2) -> Schedule | None:
        """Split rows: slabs of split_block_n columns (wider where a row would take more than
        split_max_members programs), a program a slab, the programs of a row's slabs a group;
        split_sm_elements slab columns an SM, split_elements_per_thread a thread, each program
        at the register budget of the programs an SM runs (so that a cooperative launch fits).
        Under the interpreter, which runs programs one after another, one program takes a whole
        row where the group exchanges sums. None where a row's programs would not all fit on
        the GPU at once, or where the device refused a cooperative launch before. Where the
        split kernels exchange nothing (column partials and no row reductions), the programs
        need not run at once: no register budget, and the interpreter splits rows too."""
        c = self.constants
        if device.type == "cuda" and device.index in SPLIT_REFUSED:
            return None
        scale = max(1, element_size // 2) if c.split_by_bytes else 1
        block_n = max(
            c.split_block_n // scale, triton.next_power_of_2(triton.cdiv(N, c.split_max_members))
        )
        rows = max(1, min(c.split_rows, triton.next_power_of_2(M)))
        per_thread = max(1, c.split_elements_per_thread // scale)
        warps = triton.next_power_of_2(
            max(c.min_warps, min(c.max_warps, rows * block_n // (32 * per_thread)))
        )
        if device.type == "cuda":
            # no more programs an SM than its threads hold at once
            properties = torch.cuda.get_device_properties(device)
            threads = getattr(properties, "max_threads_per_multi_processor", 2048)
            per_sm = max(1, min(c.split_sm_elements // scale // block_n, threads // (32 * warps)))
            slots = properties.multi_processor_count * per_sm
        elif self.split_exchange:
            block_n, slots = triton.next_power_of_2(N), c.interpreter_programs
        else:
            slots = c.interpreter_programs * triton.cdiv(N, block_n)
        members = triton.cdiv(N, block_n)
        groups = min(triton.cdiv(M, rows), slots // members)
        if groups < 1:
            return None
        return Schedule(
            False,
            block_n,
            rows,
            warps,
            groups * members,
            1,
            1,
            False,
            False,
            False,
            True,
            False,
            device.type == "cuda" and self.split_exchange,
            False,
            None,
            members,
        )


def forget_all() -> None:
    """`Schedules.forget` for every op: after a change that reaches all of them."""
    for schedules in list(_EVERY):
        schedules.forget()


def form_of(
    M: int, N: int, rows: int, block_n: int, programs: int, form: int
) -> tuple[bool, bool, bool, bool, bool]:
    """(EVEN, STRIDED, REVERSE, REGS, FIXED) of a schedule from its form's bits: no masks where
    the row blocks tile the tensor exactly (bit 1), the row-block loop where fewer programs than
    row blocks run or the form keeps it anyway (bit 2), every other sweep of a looped row run
    backwards (bit 4), whole rows that programs loop over compiled to the register budget of
    the programs an SM runs (bit 8, `maxnreg`), whole rows compiled for their width (bit 16,
    `fixed_n`). Which is faster depends on the entry: `benchmarks.tune --forms` measures them."""
    loops = programs < -(-M // rows)
    even = M % rows == 0 and N % block_n == 0
    return (
        bool(form & 1) and even,
        bool(form & 2) or loops,
        bool(form & 4) and block_n < N,
        bool(form & 8) and block_n >= N and loops,
        bool(form & 16) and block_n >= N,
    )


def fixed_n(schedule: Schedule, M: int, N: int, *strides: int) -> int:
    """FIXED_N of a launch: N where the schedule compiles whole rows for their width (form bit
    16) and the launch allows it (every element tensor's rows contiguous, fewer than 2^31
    elements: 32-bit offsets), else 0. Such a kernel has the width, the strides and the offsets'
    type compiled in and takes the approximate reciprocal square root."""
    fits = M * N < 2**31 and all(stride == N for stride in strides)
    return N if schedule.fixed and fits else 0


@functools.lru_cache(maxsize=256)
def maxnreg(warps: int, programs: int, device: torch.device) -> int | None:
    """The registers a thread may take where a persistent schedule's programs share the SMs
    evenly: the SM's register file over the threads of the programs it runs (at most 255; None
    off CUDA). Left to itself ptxas may take far fewer and spill."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    per_sm = -(-programs // properties.multi_processor_count)
    registers = getattr(properties, "regs_per_multiprocessor", 65536)
    return min(255, registers // (32 * warps * per_sm))

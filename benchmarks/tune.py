"""Measure schedules directly: every (rows, warps, programs) a kernel could run with, per shape.

    python -m benchmarks.tune --out DIR [--ops layernorm,rmsnorm,softmax,cross_entropy,...]
                              [--dtype bf16] [--budget-s 500] [--looped]

Unlike `benchmarks.sweep` (which varies the heuristic's constants), this fixes the schedule
itself: the generated module's schedule choice is replaced (`SCHEDULES.override(choose=...)`)
by one that returns the configuration under test, the forward and backward launchers are timed
with the harness's clock (a GPU sleep queues the launch, a 256 MiB write empties L2, CUDA
events time only the kernels), and the compiled kernel's registers, spills and shared memory
are recorded. The search is a grid: rows per step (1, or 512 to 16384 elements a step), warps
(8 to 32 elements a thread), 1 or 3 software-pipeline stages, and one program per row block or
1, 2, 4 or 8 programs per SM looping over row blocks; kernels with column partials (a
backward's parameter gradients) are measured again at the register budget of the programs an SM
runs (form bit 8), and every kernel against the table's entry for the width where that entry
loops. `--looped` measures looped rows instead (LOOPED_SHAPES): columns per step (1024 to
16384), rows per step, warps (4 to 16 elements a thread), programs, 1 or 3 stages, each (for
kernels with a joined sweep) in both forms of it (the table entry records the faster form),
against the table's whole-row entry for the width measured in the same run. `--ops
cross_entropy` measures the cross-entropy kernels too (bytes: the logits read, and in the
backward their gradient written);
`--ops add_layernorm,add_rmsnorm` the residual-add norms' and `--ops masked_softmax` the
masked softmax's (attention's mask, scale and dropout; bytes: 4 and 3 activation-sized tensors
each way), filed as their own entries, which take precedence over those they otherwise borrow.
Results go to DIR/tune.json, written after every shape, so a run cut short keeps what it
measured. `--write-table` then turns DIR/tune.json into codegen/schedule_table.json: the fastest
measured configuration per op, kernel kind and width (and the fastest looped one), merged into
the table's entries for widths the run did not measure.

    python -m benchmarks.tune --out DIR --forms --shapes MxN,... [--dtype bf16]

times each op's own schedule (its table entry as it stands) at each shape in every kernel form:
masks dropped where the row blocks tile exactly or kept, the row-block loop kept or compiled away
where each program has one row block, for looped rows every other sweep run forwards or
backwards, and for whole rows the registers left to ptxas or set to the SM's budget. Which is
faster depends on the entry (H100: the looped layer-norm forward at fp32 4096x32768 is 16%
faster masked with the loop, at bf16 4096x65536 13% faster unmasked with the loop, than in the
rule's form), so
`--write-table` files the form measured fastest over every shape and dtype that used the entry,
where it beats the rule's by FORM_MARGIN.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time
from pathlib import Path

import torch
import triton

from benchmarks.ops import OPS, OpSpec, bytes_moved
from benchmarks.sweep import DTYPES, launcher_calls, module_constants
from benchmarks.timing import CudaClock, Workload, measure
from codegen.runtime.schedules import Schedule, form_of

SHAPES = (
    (32768, 256),
    (16384, 512),
    (8192, 1024),
    (8192, 2048),
    (4096, 4096),
    (8192, 8192),
    (4096, 16384),
)
#: one shape per power-of-two width where looped rows are worth measuring
LOOPED_SHAPES = (
    (4096, 4096),
    (8192, 8192),
    (4096, 16384),
    (4096, 32768),
    (4096, 65536),
    (1024, 262144),
)
LOOPED_STEPS = (1024, 2048, 4096, 8192, 16384)
LOOPED_WARPS = (4, 8, 16, 32)
#: rows per step of looped kernels with column partials: each step reads, adds to and writes
#: back the program's fp32 partial row, so more rows a step share that traffic (`--looped`,
#: H100, 2026-11-22, bf16 layer-norm backward 4096x32768, fastest per rows a step: 1 row 687
#: GB/s, 2 rows 960, 4 rows 1163, 8 rows 1278, 16 rows 1314), at up to this many elements a thread
LOOPED_PARTIAL_ROWS = (1, 2, 4, 8, 16)
LOOPED_PARTIAL_MAX_ELEMENTS_PER_THREAD = 64
LOOPED_PARTIAL_MAX_STEP_ELEMENTS = 16384
LOOPED_MIN_ELEMENTS_PER_THREAD = 4
LOOPED_MAX_ELEMENTS_PER_THREAD = 16
REP_MS = 15.0
MAX_ELEMENTS_PER_THREAD = 32
MIN_ELEMENTS_PER_THREAD = 8
#: elements a program's row block may hold (rows x width): torch.compile's persistent reductions
#: for narrow rows take 1024 in one warp (H100, torch 2.11, bf16 layer norm 32768x256: 4 rows,
#: 1 warp; 4096x1024: 1 row, 1 warp)
STEP_ELEMENTS = (512, 1024, 2048, 4096, 8192, 16384)
STAGE_CHOICES = (1, 3)
#: kernel forms of a table entry (`codegen.runtime.schedules.form_of`): bit 1 drops the masks
#: where the row blocks tile the tensor exactly (EVEN), bit 2 keeps the row-block loop with one
#: program per row block (STRIDED), bit 4 runs every other sweep of a looped row backwards
#: (REVERSE: it starts on the columns the sweep before ended on, the likeliest still in L2), bit
#: 8 compiles whole rows to the register budget of the programs an SM runs (REGS: ptxas left to
#: itself may take far fewer registers and spill), bit 16 compiles whole rows for their width
#: (FIXED: the width and the row strides constants, 32-bit offsets, the approximate rsqrt;
#: `fixed_n`); the searches above measure the rule's form (whole rows with column partials: and
#: the rule's with REGS), `--forms` every form (whole rows: the sixteen of bits 1, 2, 8 and 16;
#: looped rows: the eight of bits 1, 2 and 4)
FORMS = tuple(range(32))
REGS_FORM = 8
FIXED_FORM = 16
RULE_FORM = 1
#: `--forms` measures each form this many times, interleaved, and keeps its fastest
FORM_REPEATS = 2
#: a form other than the rule's is written only where, at the slowest of the entry's measured
#: shapes, it is this much (of that shape's fastest form) ahead of the rule
FORM_MARGIN = 0.01


#: ops tune measures besides benchmarks.ops.OPS: cross-entropy's kernels read the logits
#: (forward: a loss per row; backward: and write their gradient)
ROW_LOSSES = {"cross_entropy": OpSpec("cross_entropy", 0, lambda fn, x, params: fn(x))}
#: ... and the residual-add norms (benchmarks.sweep.ADD_NORMS: their launchers as a pre-norm
#: block runs them), whose kernels move one activation-sized tensor more than their norm's: the
#: forward reads the residual and writes the sum, the backward reads the sum's gradient
ADD_NORM_SPECS = {name: OpSpec(name, OPS[norm].n_params, OPS[norm].call_torch_style)
                  for name, norm in (("add_layernorm", "layernorm"), ("add_rmsnorm", "rmsnorm"))}
ADD_NORM_EXTRA = {"fwd": 2, "bwd": 1}
#: ... and the masked softmax (benchmarks.sweep.MASKED_SOFTMAX: attention's mask, scale and
#: dropout), whose forward also stores p for the backward (its mask is one row a batch, not
#: counted); the backward reads p where the softmax's reads y
EXTRA_SPECS = ADD_NORM_SPECS | {
    "masked_softmax": OpSpec("masked_softmax", 0, OPS["softmax"].call_torch_style)}
EXTRA = {name: ADD_NORM_EXTRA for name in ADD_NORM_SPECS} | {
    "masked_softmax": {"fwd": 1, "bwd": 0}}


def _op(name: str) -> OpSpec:
    return ROW_LOSSES.get(name) or EXTRA_SPECS.get(name) or OPS[name]


def _moved(op: OpSpec, mode: str, m: int, n: int, element_size: int) -> int:
    """Bytes a kernel must move: benchmarks.ops.bytes_moved (for a residual-add norm with
    ADD_NORM_EXTRA activation-sized tensors more: 4 each way, for the masked softmax 3 each way,
    as benchmarks.transformer_ops charges them), or for a row loss the logits read (and,
    backward, their gradient written)."""
    if op.name in ROW_LOSSES:
        return m * n * element_size * (1 if mode == "fwd" else 2)
    extra = EXTRA[op.name][mode] * m * n * element_size if op.name in EXTRA else 0
    return bytes_moved(op, mode, m, n, element_size) + extra


def _pow2s(low: int, high: int) -> list[int]:
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return values


class _Recorder:
    """Within the block, keeps what Triton's JIT compiled for each launch of the named kernels
    (`compiled`: kernel name -> the last compiled kernel launched): `triton.runtime.JITFunction.run`
    wrapped until the block ends, the generated module left as it is. A launch plan launches
    past the JIT, so the block's calls must not have plans (`SCHEDULES.override` forgets them)."""

    def __init__(self, names):
        self.names = frozenset(names)
        self.compiled: dict = {}
        self._run = None

    def __enter__(self):
        self._run = run = triton.runtime.JITFunction.run
        names, compiled = self.names, self.compiled

        def recorded(kernel, *args, **kwargs):
            result = run(kernel, *args, **kwargs)
            if kernel.__name__ in names:
                compiled[kernel.__name__] = result
            return result

        triton.runtime.JITFunction.run = recorded
        return self

    def __exit__(self, *_exc):
        triton.runtime.JITFunction.run = self._run
        return False


def _kernel_stats(compiled) -> dict:
    if compiled is None:
        return {}
    metadata = getattr(compiled, "metadata", None)
    return {
        "regs": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None),
        "shared": getattr(metadata, "shared", None),
    }


def _tune_kernel(module, name, call, m, n, element_size, op, mode, clock, sms, looped=False,
                 partial_rows=LOOPED_PARTIAL_ROWS, most_per_thread=MAX_ELEMENTS_PER_THREAD,
                 fixed=False):
    """Schedules for one launcher at one shape, each measured: whole rows, or (`looped`)
    looped rows and the table's whole-row entry for this width; with `fixed`, every whole-row
    configuration also compiled for its width (form bit 16)."""
    block_n = 1 << (n - 1).bit_length()
    kernels = [key for key in vars(module) if key.startswith(f"_{op.name}_{name}_")
               and key.endswith(("_per", "_red"))]
    seam, constants = module.SCHEDULES, module.SCHEDULES.constants
    persistent = [key for key in kernels if key.endswith("_per")]
    partials = any(key.endswith("_partial_ptr") for key in
                   getattr(module, persistent[0]).arg_names) if persistent else False
    results = []

    # looped kernels with a joined sweep (codegen/fuse.py) run it where the module's rule
    # says (rows of one_sweep_min_n columns and more); the other form is measured next to each
    # configuration (marked against_rule) and competes for the table entry, which records the
    # form that won
    rule_one_sweep = rule_one(module, n, element_size)
    joined = any("ONE_SWEEP" in getattr(module, key).arg_names for key in kernels)

    def run(rows, warps, programs, stages=1, step=0, one_sweep=None, form=RULE_FORM):
        per_sm = programs // sms
        row_blocks = -(-m // rows)
        programs = min(programs, row_blocks) if programs else row_blocks
        width = step or block_n
        chunks = -(-n // width)
        one_sweep = bool(step) and (rule_one_sweep if one_sweep is None else one_sweep)
        # looped rows keep their earlier sweeps' reads in L2 and backwards walk their row
        # blocks from the last as the rule has them (`Schedules.rule`)
        keep = bool(step) and n * element_size <= constants.keep_max_row_bytes
        last_first = bool(constants.backward_last_first) and mode != "fwd"
        schedule = Schedule(bool(step), width, rows, warps, programs, stages, chunks, one_sweep,
                            keep, *form_of(m, n, rows, width, programs, form),
                            last_first=last_first)
        config = {"rows": rows, "warps": warps, "programs": programs, "per_sm": per_sm,
                  "stages": stages, "step": step}
        if form != RULE_FORM:
            config["form"] = form
        if joined and step:
            config["one_sweep"] = one_sweep
            if one_sweep != rule_one_sweep:
                config["against_rule"] = True
        # the schedule fixed for the launchers (plans forgotten on entry and exit: a plan would
        # launch past both the schedule and the recorder)
        try:
            with seam.override(choose=lambda *_args: schedule), _Recorder(kernels) as recorder:
                call()  # compile outside the timed loop
                stats = measure(clock, Workload(lambda _state: call()), REP_MS)
        except Exception as error:  # noqa: BLE001 - a config that does not compile is data
            record = config | {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        else:
            gbps = _moved(op, mode, m, n, element_size) / stats.median_ms / 1e6
            record = config | {"ms": stats.median_ms, "gbps": gbps}
            for compiled in recorder.compiled.values():
                record.update(_kernel_stats(compiled))
        results.append(record)
        return record.get("gbps", 0.0)

    # kernels with column partials loop over row blocks (a partial row per program); the
    # others may also take one program per row block (0)
    if looped:
        whole = seam.measured.get((mode, block_n))
        if whole is not None and not whole[4] and block_n <= constants.persistent_max_block_n:
            rows, warps, per_sm, stages = whole[:4]
            run(min(rows, m), warps, sms * per_sm, stages)
        most = (LOOPED_PARTIAL_MAX_ELEMENTS_PER_THREAD if partials
                else LOOPED_MAX_ELEMENTS_PER_THREAD)
        # every configuration in every pipeline depth and sweep form: a screen at one stage in
        # the rule's form missed the fastest (H100, bf16 cross-entropy forward 4096x32000: one
        # sweep at 2048 columns, 4 warps, 3 stages 2489 GB/s in a probe; the screen's best 2213)
        forms = (None, not rule_one_sweep) if joined else (None,)
        for step in (s for s in LOOPED_STEPS if s < block_n):
            for rows in (partial_rows if partials else (1,)):
                if rows * step > (LOOPED_PARTIAL_MAX_STEP_ELEMENTS if partials else step):
                    continue
                for warps in LOOPED_WARPS:
                    if not LOOPED_MIN_ELEMENTS_PER_THREAD <= rows * step / (32 * warps) <= most:
                        continue
                    # programs per SM: 1 or 2 (partials: their read-modify-write grows with 2),
                    # or one program per row (0) or 1, 2 or 4 per SM for kernels without
                    # partials (fewer rows in flight: a row read twice may still be in L2)
                    for per_sm in ((1, 2) if rows <= 2 else (1,)) if partials else (0, 1, 2, 4):
                        for stages in STAGE_CHOICES:
                            for one_sweep in forms:
                                run(rows, warps, sms * per_sm, stages, step, one_sweep)
        return results

    def warps_for(rows):
        elements = rows * block_n
        return [w for w in (1, 2, 4, 8, 16, 32)
                if MIN_ELEMENTS_PER_THREAD <= elements / (32 * w) <= most_per_thread]

    # the table's entry for this width where it loops competes in the same run (as --looped
    # measures the whole-row entry), so --write-table keeps it where whole rows are slower
    wide = "_fp32" if element_size == 4 else ""
    entry = next((seam.measured[key] for key in ((mode + wide, n), (mode, n))
                  if key in seam.measured), None)
    if entry is not None and entry[4]:
        rows, warps, per_sm, stages, step = entry[:5]
        run(min(rows, m), warps, sms * per_sm if per_sm else 0, stages, step,
            None if len(entry) < 6 or entry[5] < 0 else bool(entry[5]))
    row_choices = [r for r in _pow2s(1, 64)
                   if r <= m and (r == 1 or r * block_n in STEP_ELEMENTS)]
    per_sm_choices = (1, 2, 4, 8) if partials else (0, 2, 4, 8)
    for rows in row_choices:
        for warps in warps_for(rows):
            for stages in STAGE_CHOICES:
                for per_sm in per_sm_choices:
                    if per_sm == 0 and stages > 1:
                        continue  # one row block per program: nothing to pipeline
                    forms = [RULE_FORM]
                    if partials and sms * per_sm < -(-m // rows):
                        # the partial rows held next to a whole row: ptxas may spill rather than
                        # take the registers the programs an SM runs leave (`maxnreg`; only
                        # where programs loop over row blocks, as `form_of` sets it)
                        forms.append(RULE_FORM | REGS_FORM)
                    for form in forms:
                        run(rows, warps, sms * per_sm, stages, form=form)
                        if fixed:
                            # compiled for the width: the configuration that is fastest that
                            # way need not be the fastest without (H100, bf16 layer-norm
                            # forward 4096x1024: the table's 4 rows at 4 warps 1540 GB/s, 1552
                            # compiled for the width; 2 rows at 2 warps so 1634)
                            run(rows, warps, sms * per_sm, stages, form=form | FIXED_FORM)
    return results


def rule_one(module, n: int, element_size: int) -> bool:
    """Whether the module's rule joins the sweeps of a looped row this wide."""
    return n >= module.SCHEDULES.constants.one_sweep_min_n


def _used_schedule(module, call):
    """The schedule the module's own rule picks for `call` (its first launch's), with the
    constants and the measured table in force."""
    seam, used = module.SCHEDULES, []

    def spy(*args):
        used.append(seam.rule(*args))
        return used[-1]

    with seam.override(choose=spy):  # forgets the plans, which would not ask for a schedule
        call()
    return used[0]


def _as_config(schedule, m: int, sms: int, form: int = RULE_FORM) -> dict:
    """A module schedule as a tune record: programs per SM 0 when it is one per row block;
    `form`, the kernel form its table entry holds (the searches run the rule's)."""
    row_blocks = -(-m // schedule.rows)
    per_sm = 0 if schedule.programs >= row_blocks else max(1, schedule.programs // sms)
    return {"rows": schedule.rows, "warps": schedule.warps, "programs": schedule.programs,
            "per_sm": per_sm, "stages": schedule.stages,
            "step": schedule.block_n if schedule.looped else 0, "one_sweep": schedule.one_sweep,
            "form": form}


def _open_report(out: Path):
    """The GPU's properties, a clock, and DIR/tune.json: as an earlier run left it, or new."""
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    clock = CudaClock(device, getattr(properties, "L2_cache_size", 50 * 2**20))
    path = out / "tune.json"
    report = json.loads(path.read_text()) if path.exists() else {
        "device": properties.name, "sms": properties.multi_processor_count,
        "torch": torch.__version__, "triton": importlib.import_module("triton").__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": [],
    }
    return properties, clock, path, report


#: the schedule constants that turn split rows off (benchmarks.split forces them too)
SPLIT_NOWHERE = {"split_min_n": 0, "split_other_min_row_bytes": 0}


def _unsplit(ops):
    """The ops' modules with split rows off (SPLIT_NOWHERE) until the block ends: the table
    holds whole and looped rows, which split rows replace at the widths the split rules give
    them, before the table is read; measured here, a split schedule would be filed as whole or
    looped rows (a softmax backward's too: its rule is split_other_min_row_bytes)."""
    return module_constants([importlib.import_module(f"generated.{op}") for op in ops],
                            SPLIT_NOWHERE)


def measure_forms(ops, dtype, shapes, out: Path, budget_s: float) -> None:
    """`--forms`: see `_measure_forms` (split rows off)."""
    with _unsplit(ops):
        _measure_forms(ops, dtype, shapes, out, budget_s)


def _measure_forms(ops, dtype, shapes, out: Path, budget_s: float) -> None:
    """`--forms`: each op's own schedule at each shape, timed in every kernel form that differs
    there (masks or none, the row-block loop or none, looped sweeps all forwards or every other
    one backwards, whole rows at ptxas's registers or the SM's budget), FORM_REPEATS times
    interleaved; each
    record names the table entry the schedule came from, so `--write-table` can file the
    fastest form under it."""
    properties, clock, path, report = _open_report(out)
    report.setdefault("forms", [])
    began = time.perf_counter()
    for op_name in ops:
        module = importlib.import_module(f"generated.{op_name}")
        for m, n in shapes:
            if time.perf_counter() - began > budget_s:
                print(f"budget spent; stopped before {op_name} {m}x{n}", flush=True)
                path.write_text(json.dumps(report, indent=1))
                return
            forward, backward, element_size = launcher_calls(op_name, module, m, n, dtype)
            for mode, call in (("fwd", forward), ("bwd", backward)):
                used = _used_schedule(module, call)
                flags = {form: form_of(m, n, used.rows, used.block_n, used.programs, form)
                         for form in FORMS}
                moved = _moved(_op(op_name), mode, m, n, element_size)
                speeds: dict = {}
                for _repeat in range(FORM_REPEATS):
                    for even, strided, reverse, regs, fixed in sorted(set(flags.values())):
                        formed = used._replace(even=even, strided=strided, reverse=reverse,
                                               regs=regs, fixed=fixed)
                        with module.SCHEDULES.override(choose=lambda *_args, formed=formed: formed):
                            call()  # compile outside the timed loop
                            work = Workload(lambda _state, call=call: call())
                            stats = measure(clock, work, REP_MS)
                        gbps = moved / stats.median_ms / 1e6
                        flag = (even, strided, reverse, regs, fixed)
                        speeds[flag] = max(speeds.get(flag, 0.0), gbps)
                entry = used.entry
                record = {"op": op_name, "mode": mode, "m": m, "n": n, "dtype": str(dtype),
                          "entry": None if entry is None else list(entry),
                          "config": (None if entry is None
                                     else list(module.SCHEDULES.measured[entry][:6])),
                          "stages": used.stages,
                          "gbps": {str(form): speeds[flags[form]] for form in FORMS}}
                report["forms"].append(record)
                shown = " ".join(f"{form}:{gbps:.0f}" for form, gbps in record["gbps"].items())
                print(f"{op_name} {mode} {m}x{n} entry {entry}: forms {shown} GB/s", flush=True)
            path.write_text(json.dumps(report, indent=1))


def tune(ops, dtype, shapes, out: Path, budget_s: float, looped: bool = False,
         modes=("fwd", "bwd"), partial_rows=LOOPED_PARTIAL_ROWS,
         most_per_thread=MAX_ELEMENTS_PER_THREAD, fixed: bool = False) -> None:
    """Measure the schedules of each op at each shape into out/tune.json (split rows off)."""
    with _unsplit(ops):
        _tune(ops, dtype, shapes, out, budget_s, looped, modes, partial_rows, most_per_thread,
              fixed)


def _tune(ops, dtype, shapes, out, budget_s, looped, modes, partial_rows, most_per_thread,
          fixed=False):
    properties, clock, path, report = _open_report(out)
    began = time.perf_counter()
    for op_name in ops:
        module = importlib.import_module(f"generated.{op_name}")
        for m, n in shapes:
            if time.perf_counter() - began > budget_s:
                print(f"budget spent; stopped before {op_name} {m}x{n}", flush=True)
                path.write_text(json.dumps(report, indent=1))
                return
            forward, backward, element_size = launcher_calls(op_name, module, m, n, dtype)
            for name, mode, call in (("fwd", "fwd", forward), ("bwd_default", "bwd", backward)):
                if mode not in modes:
                    continue
                results = _tune_kernel(module, name, call, m, n, element_size, _op(op_name), mode,
                                       clock, properties.multi_processor_count, looped,
                                       partial_rows, most_per_thread, fixed)
                moved = _moved(_op(op_name), mode, m, n, element_size)
                # the module's own schedule, with its table and with its rules alone, is a
                # candidate too (rules no search covers: the softmax backward's whole rows
                # past 16384, say)
                table = module.SCHEDULES.measured
                for source, schedules in (("rules", {}), ("default", table)):
                    with module.SCHEDULES.override(measured=schedules):
                        used = _used_schedule(module, call)
                        form = RULE_FORM if used.entry is None else schedules[used.entry][6]
                        stats = measure(clock, Workload(lambda _state, call=call: call()), REP_MS)
                    gbps = moved / stats.median_ms / 1e6
                    results.append(_as_config(used, m, properties.multi_processor_count, form)
                                   | {"ms": stats.median_ms, "gbps": gbps, source: True})
                    default = gbps
                best = max((r for r in results if "gbps" in r),
                           key=lambda r: r["gbps"])
                print(f"{op_name} {mode} {m}x{n}: default {default:.0f} GB/s, "
                      f"best {best['gbps']:.0f}"
                      f" at rows {best['rows']} warps {best['warps']} programs {best['programs']}"
                      f" stages {best['stages']} step {best['step']}"
                      f" (regs {best.get('regs')}, spills {best.get('spills')},"
                      f" shared {best.get('shared')})", flush=True)
                sweeps = {flag: max((r["gbps"] for r in results if "gbps" in r
                                     and r.get("one_sweep") is flag), default=None)
                          for flag in (True, False)}
                if None not in sweeps.values():
                    rule = rule_one(module, n, element_size)
                    print(f"  fastest looped with one sweep {sweeps[True]:.0f} GB/s, with a pass "
                          f"each {sweeps[False]:.0f} (the rule: one sweep {rule})", flush=True)
                report["results"].append({"op": op_name, "mode": mode, "m": m, "n": n,
                                          "dtype": str(dtype), "default_gbps": default,
                                          "looped": looped, "configs": results})
            path.write_text(json.dumps(report, indent=1))


BORROW = {"add_layernorm": "layernorm", "add_rmsnorm": "rmsnorm", "masked_softmax": "softmax"}
"""Ops that take a sibling's measurements where they have none of their own (per kernel kind
and width: codegen.schedule.ScheduleTable.measured): the same reductions with one more element
input (the residual) or output (the residual stream), or the additive mask."""


def _entry_op(ops: dict, op: str, kind: str, width: str) -> str:
    """The op whose table entry (kind, width) served `op`: its own, else the one it borrows."""
    return op if width in ops.get(op, {}).get(kind, {}) else BORROW.get(op, op)


def _merged(paths: list[Path]) -> dict:
    """The reports of several runs as one: the configurations measured at the same op, mode,
    shape and dtype are pooled, so the fastest is taken over all of them."""
    reports = [json.loads(path.read_text()) for path in paths]
    pooled: dict = {}
    for report in reports:
        for result in report["results"]:
            key = (result["op"], result["mode"], result["m"], result["n"], result["dtype"])
            if key in pooled:
                pooled[key]["configs"] = pooled[key]["configs"] + result["configs"]
            else:
                pooled[key] = dict(result)
    dates = sorted(report["date"] for report in reports)
    return reports[-1] | {"date": dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}",
                          "results": list(pooled.values()),
                          "forms": [record for report in reports
                                    for record in report.get("forms", [])]}


#: an entry's fields where the table leaves them out: step (whole rows), the sweep (the rule's)
ENTRY_DEFAULTS = (0, 0, 0, 0, 0, -1)


def best_form(records: list[dict]) -> int:
    """The kernel form to file for one entry from its `--forms` records (every shape and dtype
    that took it): the form whose slowest shape, as a share of that shape's fastest form, is
    highest; the rule's form unless another is FORM_MARGIN ahead of it."""
    best = max(FORMS, key=lambda form: (_score(records, form), form == RULE_FORM))
    return RULE_FORM if _score(records, RULE_FORM) >= _score(records, best) - FORM_MARGIN else best


def _with_forms(ops: dict, records: list[dict]) -> None:
    """File each entry's best form (`best_form`) in it, from the records of the configuration
    it holds now: records of an entry the same write replaced, or of the rules' constants, are
    set aside (and said so). A 16-bit entry that fp32 rows borrow takes the form best on 16-bit
    tensors; where fp32 runs FORM_MARGIN faster in another, the same configuration is filed for
    fp32 under "<kind>_fp32" with that form (at the pipeline stages fp32 ran with: its own
    entry is taken as it stands, with no fallback for wider elements)."""
    grouped: dict = {}
    for record in records:
        if record.get("entry") is not None:
            kind, width = record["entry"]
            op = _entry_op(ops, record["op"], kind, str(width))
            grouped.setdefault((op, kind, str(width)), []).append(record)
    for (op, kind, width), group in sorted(grouped.items()):
        entry = ops.get(op, {}).get(kind, {}).get(width)
        held = None if entry is None else list((*entry, *ENTRY_DEFAULTS[len(entry):])[:6])
        current = [record for record in group if record["config"] == held]
        if not current:
            print(f"tune --write-table: {op} {kind} {width}: its --forms records measured "
                  f"another configuration than the entry now holds; form left out")
            continue
        wide = [record for record in current if record["dtype"] == "torch.float32"]
        narrow = [record for record in current if record not in wide]
        form = best_form(narrow or wide) if narrow or "_fp32" in kind else _held_form(entry)
        ops[op][kind][width] = _formed(entry, form)
        if not wide or not narrow or "_fp32" in kind:
            continue
        own = best_form(wide)
        if _score(wide, form) >= _score(wide, own) - FORM_MARGIN:
            continue
        stages = {record.get("stages", held[3] if held[3] == 1 else None) for record in wide}
        if len(stages) != 1 or None in stages:
            print(f"tune --write-table: {op} {kind} {width}: fp32 runs faster in form {own}, "
                  f"but its records do not say at which pipeline stages; no fp32 entry filed")
            continue
        fp32_kind = kind.replace("_looped", "") + "_fp32" + ("_looped" if "_looped" in kind else "")
        fields = list(entry[:6])
        fields[3] = stages.pop()
        ops[op].setdefault(fp32_kind, {})[width] = _formed(fields, own)


def _score(records: list[dict], form: int) -> float:
    """The form's speed at the slowest of `records` (a share of that record's fastest form); 0
    where a record has no time for it (runs before bit 4 measured four forms, before bit 8
    eight)."""
    return min(r["gbps"].get(str(form), 0.0) / max(r["gbps"].values()) for r in records)


def _held_form(entry: list) -> int:
    return entry[6] if len(entry) > 6 else RULE_FORM


def _formed(entry: list, form: int) -> list:
    """An entry's fields with `form` filed: none past the sweep for the rule's form."""
    fields = list(entry[:6])
    return fields if form == RULE_FORM else [*fields, *ENTRY_DEFAULTS[len(fields):], form]


def _joined(op: str, mode: str) -> bool:
    """Whether the op's looped kernel for `mode` has a joined sweep (a ONE_SWEEP constexpr)."""
    module = importlib.import_module(f"generated.{op}")
    name = "fwd" if mode == "fwd" else "bwd_default"
    return any("ONE_SWEEP" in getattr(kernel, "arg_names", ())
               for key, kernel in vars(module).items() if key.startswith(f"_{op}_{name}_"))


def _signature(config: dict) -> tuple:
    return (*(config.get(k) for k in ("rows", "warps", "per_sm", "stages", "step", "one_sweep")),
            config.get("form", RULE_FORM))


def _pooled(group: list[dict], combine) -> list[dict]:
    """The configurations measured in every result of `group`, each at `combine` of its
    speeds there (its fastest in each result, where a result measured it more than once)."""
    speeds: dict = {}
    for index, result in enumerate(group):
        for config in result["configs"]:
            if "gbps" in config:
                best = speeds.setdefault(_signature(config), {})
                if index not in best or config["gbps"] > best[index]["gbps"]:
                    best[index] = config
    return [next(iter(found.values())) | {"gbps": combine([c["gbps"] for c in found.values()])}
            for found in speeds.values() if len(found) == len(group)]


def _shared(results: list[dict], key, combine) -> list[dict]:
    """Results grouped by `key`; a group of several becomes one, of its pooled configurations."""
    grouped: dict = {}
    for result in results:
        grouped.setdefault(key(result), []).append(result)
    return [group[0] if len(group) == 1 else group[0] | {"configs": _pooled(group, combine)}
            for group in grouped.values()]


def _shared_16bit(results: list[dict]) -> list[dict]:
    """fp16 and bf16 share their entries: where both were measured at one op, mode and shape,
    each configuration measured in both counts at its slower speed, so the entry holds up for
    either (H100, layer-norm backward 4096x16384 whole rows: bf16 1414 GB/s, fp16 392, which
    spills more; 8 rows of 2048 columns a step: 1340 and 1341)."""
    return _shared(results, lambda r: (r["op"], r["mode"], r["m"], r["n"],
                                       r["dtype"] == "torch.float32"), min)


def _shared_rows(results: list[dict]) -> list[dict]:
    """One entry serves every row count of its width: where one op, mode and dtype group was
    measured at several row counts of one width (16384x512 and 4096x512, say), each
    configuration measured at all of them counts at the geometric mean of its speeds, so the
    entry is the fastest over those shapes rather than at one (H100, bf16 softmax backward,
    width 512: the fastest at 16384 rows, 2 rows a warp, ran 1311 GB/s at 4096 rows, where 4
    rows on 4 warps ran 1351)."""
    return _shared(results, lambda r: (r["op"], r["mode"], r["n"], r["dtype"] == "torch.float32"),
                   lambda speeds: math.prod(speeds) ** (1 / len(speeds)))


def write_table(measurements: list[Path], command: str) -> Path:
    """codegen/schedule_table.json from DIR/tune.json (of one or several runs, pooled): per
    op, kind and width, the fastest measured configuration and, under "<kind>_looped", the
    fastest looped one. Widths the runs did not measure keep the table's entries, and its
    record of how they were measured."""
    from codegen.schedule import MEASURED_TABLE, load_measured, write_measured

    report = _merged(measurements)
    previous = load_measured(MEASURED_TABLE)
    ops = {op: {kind: dict(widths) for kind, widths in kinds.items()}
           for op, kinds in previous.get("ops", {}).items()}
    for result in _shared_rows(_shared_16bit(report["results"])):
        # both sweep forms are candidates: the entry records the one measured fastest
        measured = [r for r in result["configs"] if "gbps" in r]
        # a width that is not a power of two is an entry of its own, used only at that width
        # (codegen/runtime/schedules.py: Schedules.rule)
        width = str(result["n"])
        kinds = ops.setdefault(result["op"], {})
        looped = [r for r in measured if r.get("step")]
        # fp32 runs get entries of their own ("<mode>_fp32"); 16-bit dtypes share theirs
        mode = result["mode"] + ("_fp32" if result["dtype"] == "torch.float32" else "")
        for kind, candidates in ((mode, measured), (mode + "_looped", looped)):
            if candidates:
                best = max(candidates, key=lambda r: r["gbps"])
                entry = [best["rows"], best["warps"], best["per_sm"], best["stages"],
                         best.get("step", 0)]
                if best.get("step") and _joined(result["op"], result["mode"]):
                    entry.append(int(best["one_sweep"]))
                # the module's own schedule competes in the form its entry holds
                kinds.setdefault(kind, {})[width] = _formed(entry, best.get("form", RULE_FORM))
    _with_forms(ops, report["forms"])
    measured = report["results"] + report["forms"]
    run = {key: report[key] for key in ("device", "sms", "torch", "triton", "date")} | {
        "dtype": sorted({r["dtype"] for r in measured}), "command": command,
        "shapes": sorted({f"{r['m']}x{r['n']}" for r in measured},
                         key=lambda shape: tuple(int(v) for v in shape.split("x")[::-1]))}
    runs = previous.get("runs") or ([previous["measured"]] if "measured" in previous else [])
    runs = [entry for entry in runs if entry.get("command") != command]  # a rerun replaces
    table = {
        "runs": runs + [run],
        "note": "Written by benchmarks/tune.py --write-table: for each op, kernel kind and "
                "row width, the fastest configuration measured (one tune run per "
                "entry of 'runs', shapes in benchmarks/tune.py SHAPES and LOOPED_SHAPES; a later "
                "run replaces the widths it measured; a width not a power of two is used only "
                "at that width). Entries are [rows per step, warps, "
                "programs per SM (0: one program per row block), software-pipeline stages, "
                "columns per step of a looped row (0: whole rows), and for looped rows with a "
                "joined sweep 1 (one sweep) or 0 (a pass each), the form measured faster "
                "(-1: the rule), and where --forms measured another kernel form faster than "
                "the rule's, that form (bit 1: no masks where the row blocks tile, bit 2: the "
                "row-block loop kept with one program per row block, bit 4: every other "
                "sweep of a looped row run backwards, bit 8: whole rows compiled to the "
                "register budget of the programs an SM runs, bit 16: whole rows compiled "
                "for their width)]; "
                "'<kind>_looped' holds the fastest looped entry, used where rows may not be "
                "whole; '<kind>_fp32' entries were measured on fp32 tensors (--dtype fp32, or "
                "--forms: a 16-bit entry's configuration that fp32 ran faster in another form) "
                "and serve them, 16-bit dtypes share the others. Ops under 'borrow' "
                "use the named op's entries at the kinds and widths they have none of their "
                "own for. 'constants' holds, per op, the schedule rules' constants "
                "(codegen/runtime/schedules.py Constants) that differ from their defaults, each "
                "measured on the GPU.",
        "constants": previous.get("constants", {}),
        "ops": {op: {kind: dict(sorted(widths.items(), key=lambda item: int(item[0])))
                     for kind, widths in sorted(kinds.items())}
                for op, kinds in sorted(ops.items())},
        "borrow": BORROW,
        # written by benchmarks.crossover
        "dispatch": previous.get("dispatch", {}),
    }
    return write_measured(table, MEASURED_TABLE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", default="layernorm,rmsnorm,softmax",
                        help="generated modules: layernorm, rmsnorm, softmax, cross_entropy, "
                             "add_layernorm, add_rmsnorm, masked_softmax")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--budget-s", type=float, default=500.0)
    parser.add_argument("--looped", action="store_true",
                        help="measure looped rows at LOOPED_SHAPES against the table's whole rows")
    parser.add_argument("--shapes", default=None,
                        help="MxN,MxN,... instead of SHAPES (LOOPED_SHAPES with --looped)")
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--partial-rows", default=None,
                        help="rows per step of looped kernels with partials (LOOPED_PARTIAL_ROWS)")
    parser.add_argument("--max-elements-per-thread", type=int, default=MAX_ELEMENTS_PER_THREAD,
                        help="whole rows: the most elements a thread holds (64 lets a row of "
                             "65536 take 32 warps)")
    parser.add_argument("--fixed", action="store_true",
                        help="whole rows: measure every configuration also compiled for its "
                             "width (form bit 16)")
    parser.add_argument("--forms", action="store_true",
                        help="time each op's own schedule at --shapes in every kernel form "
                             "(masks or none, the row-block loop or none), for --write-table")
    parser.add_argument("--write-table", action="store_true",
                        help="write codegen/schedule_table.json from OUT/tune.json; no GPU")
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="with --write-table: more DIRs whose tune.json is pooled with OUT's")
    parser.add_argument("--command", default="python -m benchmarks.tune --out OUT",
                        help="the measuring command, recorded in the table")
    args = parser.parse_args()
    if args.write_table:
        print(write_table([d / "tune.json" for d in (args.out, *args.merge)], args.command))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = LOOPED_SHAPES if args.looped else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    partial_rows = (tuple(int(r) for r in args.partial_rows.split(",")) if args.partial_rows
                    else LOOPED_PARTIAL_ROWS)
    if args.forms:
        measure_forms(args.ops.split(","), DTYPES[args.dtype], shapes, args.out, args.budget_s)
        return
    tune(args.ops.split(","), DTYPES[args.dtype], shapes, args.out, args.budget_s, args.looped,
         tuple(args.modes.split(",")), partial_rows, args.max_elements_per_thread, args.fixed)


if __name__ == "__main__":
    main()

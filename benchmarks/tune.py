"""Measure schedules directly: every (rows, warps, programs) a kernel could run with, per shape.

    python -m benchmarks.tune --out DIR [--ops layernorm,rmsnorm,softmax] [--dtype bf16]
                              [--budget-s 500]

Unlike `benchmarks.sweep` (which varies the heuristic's constants), this fixes the schedule
itself: the generated module's `_schedule` is replaced by one that returns the configuration
under test, the forward and backward launchers are timed with the harness's clock (a GPU sleep
queues the launch, a 256 MiB write empties L2, CUDA events time only the kernels), and the
compiled kernel's registers, spills and shared memory are recorded. The search is a grid:
rows per step (1, or 2048 to 16384 elements a step), warps (8 to 32 elements a thread),
1 or 3 software-pipeline stages, and one program per row block or 1, 2, 4 or 8 programs per SM
looping over row blocks. Results go to DIR/tune.json, written after every shape, so a run cut
short keeps what it measured. `--write-table` then turns DIR/tune.json into
codegen/schedule_table.json: the fastest measured configuration per op, kernel kind and width.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import time
from pathlib import Path

import torch

from benchmarks.ops import OPS, bytes_moved
from benchmarks.sweep import DTYPES, launcher_calls
from benchmarks.timing import CudaClock, Workload, measure

SHAPES = (
    (32768, 256),
    (16384, 512),
    (8192, 1024),
    (8192, 2048),
    (4096, 4096),
    (8192, 8192),
    (4096, 16384),
)
REP_MS = 15.0
MAX_ELEMENTS_PER_THREAD = 32
MIN_ELEMENTS_PER_THREAD = 8
STEP_ELEMENTS = (2048, 4096, 8192, 16384)
STAGE_CHOICES = (1, 3)


def _pow2s(low: int, high: int) -> list[int]:
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return values


class _Recorder:
    """Stands in for a @triton.jit kernel in the module: launches it, keeps what it compiled."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.compiled = launch(*args, **kwargs)
            return self.compiled

        return run


def _kernel_stats(compiled) -> dict:
    if compiled is None:
        return {}
    metadata = getattr(compiled, "metadata", None)
    return {
        "regs": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None),
        "shared": getattr(metadata, "shared", None),
    }


def _tune_kernel(module, name, call, m, n, element_size, op, mode, clock, sms):
    """Best schedules for one launcher at one shape; every measurement is returned."""
    block_n = 1 << (n - 1).bit_length()
    kernels = [key for key in vars(module) if key.startswith(f"_{op.name}_{name}_")]
    persistent = [key for key in kernels if key.endswith("_per")]
    recorders = {key: _Recorder(getattr(module, key)) for key in persistent}
    originals = {key: getattr(module, key) for key in persistent}
    original_schedule = module._schedule
    partials = any(key.endswith("_partial_ptr") for key in
                   getattr(module, persistent[0]).arg_names) if persistent else False
    results = []

    def run(rows, warps, programs, stages=1):
        per_sm = programs // sms
        row_blocks = -(-m // rows)
        programs = min(programs, row_blocks) if programs else row_blocks
        schedule = module._Schedule(False, block_n, rows, warps, programs, stages)
        module._schedule = lambda *_args, **_kwargs: schedule
        for key, recorder in recorders.items():
            setattr(module, key, recorder)
        try:
            call()  # compile outside the timed loop
            stats = measure(clock, Workload(lambda _state: call()), REP_MS)
        except Exception as error:  # noqa: BLE001 - a config that does not compile is data
            record = {"rows": rows, "warps": warps, "programs": programs, "per_sm": per_sm,
                      "stages": stages, "error": f"{type(error).__name__}: {str(error)[:200]}"}
        else:
            gbps = bytes_moved(op, mode, m, n, element_size) / stats.median_ms / 1e6
            record = {"rows": rows, "warps": warps, "programs": programs, "per_sm": per_sm,
                      "stages": stages, "ms": stats.median_ms, "gbps": gbps}
            for recorder in recorders.values():
                record.update(_kernel_stats(recorder.compiled))
        finally:
            module._schedule = original_schedule
            for key, kernel in originals.items():
                setattr(module, key, kernel)
        results.append(record)
        return record.get("gbps", 0.0)

    def warps_for(rows):
        elements = rows * block_n
        return [w for w in (1, 2, 4, 8, 16, 32)
                if MIN_ELEMENTS_PER_THREAD <= elements / (32 * w) <= MAX_ELEMENTS_PER_THREAD]

    row_choices = [r for r in _pow2s(1, 64)
                   if r <= m and (r == 1 or r * block_n in STEP_ELEMENTS)]
    # kernels with column partials loop over row blocks (a partial row per program); the
    # others may also take one program per row block (0)
    per_sm_choices = (1, 2, 4, 8) if partials else (0, 2, 4, 8)
    for rows in row_choices:
        for warps in warps_for(rows):
            for stages in STAGE_CHOICES:
                for per_sm in per_sm_choices:
                    if per_sm == 0 and stages > 1:
                        continue  # one row block per program: nothing to pipeline
                    run(rows, warps, sms * per_sm, stages)
    return results


def tune(ops, dtype, shapes, out: Path, budget_s: float) -> None:
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    clock = CudaClock(device, getattr(properties, "L2_cache_size", 50 * 2**20))
    began = time.perf_counter()
    path = out / "tune.json"
    report = json.loads(path.read_text()) if path.exists() else {
        "device": properties.name, "sms": properties.multi_processor_count,
        "torch": torch.__version__, "triton": importlib.import_module("triton").__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": [],
    }
    for op_name in ops:
        module = importlib.import_module(f"generated.{op_name}")
        for m, n in shapes:
            if time.perf_counter() - began > budget_s:
                print(f"budget spent; stopped before {op_name} {m}x{n}", flush=True)
                path.write_text(json.dumps(report, indent=1))
                return
            forward, backward, element_size = launcher_calls(op_name, module, m, n, dtype)
            for name, mode, call in (("fwd", "fwd", forward), ("bwd_default", "bwd", backward)):
                results = _tune_kernel(module, name, call, m, n, element_size, OPS[op_name], mode,
                                       clock, properties.multi_processor_count)
                module._schedule.cache_clear()
                stats = measure(clock, Workload(lambda _state, call=call: call()), REP_MS)
                moved = bytes_moved(OPS[op_name], mode, m, n, element_size)
                default = moved / stats.median_ms / 1e6
                best = max((r for r in results if "gbps" in r), key=lambda r: r["gbps"])
                print(f"{op_name} {mode} {m}x{n}: default {default:.0f} GB/s, "
                      f"best {best['gbps']:.0f}"
                      f" at rows {best['rows']} warps {best['warps']} programs {best['programs']}"
                      f" stages {best['stages']}"
                      f" (regs {best.get('regs')}, spills {best.get('spills')},"
                      f" shared {best.get('shared')})", flush=True)
                report["results"].append({"op": op_name, "mode": mode, "m": m, "n": n,
                                          "dtype": str(dtype), "default_gbps": default,
                                          "configs": results})
            path.write_text(json.dumps(report, indent=1))


BORROW = {"add_layernorm": "layernorm", "add_rmsnorm": "rmsnorm", "masked_softmax": "softmax"}
"""Ops without their own measurements that take those of a sibling: the same reductions with
one more element input (the residual sum) or output (the additive mask)."""


def write_table(measurements: Path, command: str) -> Path:
    """codegen/schedule_table.json from DIR/tune.json: per op, kind and width, the fastest."""
    from codegen.schedule import MEASURED_TABLE

    report = json.loads(measurements.read_text())
    ops: dict = {}
    for result in report["results"]:
        measured = [r for r in result["configs"] if "gbps" in r]
        best = max(measured, key=lambda r: r["gbps"])
        block_n = str(1 << (result["n"] - 1).bit_length())
        ops.setdefault(result["op"], {}).setdefault(result["mode"], {})[block_n] = [
            best["rows"], best["warps"], best["per_sm"], best["stages"]]
    table = {
        "measured": {key: report[key] for key in ("device", "sms", "torch", "triton", "date")}
        | {"dtype": sorted({r["dtype"] for r in report["results"]}), "command": command},
        "note": "Written by benchmarks/tune.py --write-table: for each op, kernel kind and "
                "power-of-two width, the fastest configuration measured (shapes in "
                "benchmarks/tune.py SHAPES). Entries are [rows per step, warps, programs per SM "
                "(0: one program per row block), software-pipeline stages]. Ops under 'borrow' "
                "were not measured; they use the named op's entries.",
        "ops": {op: {kind: dict(sorted(widths.items(), key=lambda item: int(item[0])))
                     for kind, widths in sorted(kinds.items())}
                for op, kinds in sorted(ops.items())},
        "borrow": BORROW,
    }
    text = json.dumps(table, indent=1)
    text = re.sub(r"\[\s+([^\[\]]*?)\s+\]",
                  lambda match: "[" + " ".join(match.group(1).split()) + "]", text)
    MEASURED_TABLE.write_text(text + "\n")
    return MEASURED_TABLE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", default="layernorm,rmsnorm,softmax")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--budget-s", type=float, default=500.0)
    parser.add_argument("--write-table", action="store_true",
                        help="write codegen/schedule_table.json from OUT/tune.json; no GPU")
    parser.add_argument("--command", default="python -m benchmarks.tune --out OUT",
                        help="the measuring command, recorded in the table")
    args = parser.parse_args()
    if args.write_table:
        print(write_table(args.out / "tune.json", args.command))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    tune(args.ops.split(","), DTYPES[args.dtype], SHAPES, args.out, args.budget_s)


if __name__ == "__main__":
    main()

"""Split rows against the module's other schedules: each backward launcher timed with its rows
split over groups of programs (`Schedules.split_rows`) and without (whole or looped rows), per
shape.

    python -m benchmarks.split --shapes 4096x12288,4096x32768 [--ops layernorm,rmsnorm,softmax,
                               add_layernorm,add_rmsnorm]
                               [--dtypes bf16,fp32] [--out DIR]

The split rule's constants (split_min_n and split_min_row_bytes for kernels with column
partials, split_other_min_row_bytes for the others, split_max_row_bytes for both) are forced to
split every row, then to split none (`SCHEDULES.override`); the launchers are timed with the
harness's clock (L2 emptied before each call) and GB/s counts the backward's activation-sized
tensors: 3 (4 for the residual-add norms, whose backward also reads the residual stream's
gradient: `benchmarks.sweep.launcher_calls`). The tests of codegen/schedule_table.json's per-op
constants cite these numbers.
CUDA only.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from benchmarks.sweep import ADD_NORMS, DTYPES, launcher_calls
from benchmarks.timing import CudaClock, Workload, measure
from benchmarks.tune import SPLIT_NOWHERE, _used_schedule

#: the schedule constants that decide where rows split, and the values that split every row
SPLIT_EVERYWHERE = {"split_min_n": 1, "split_min_row_bytes": 0, "split_max_row_bytes": 0,
                    "split_other_min_row_bytes": 1}
REP_MS = 25.0
#: the ops whose backward kernels have a split form
SPLIT_OPS = ("layernorm", "rmsnorm", "softmax", *ADD_NORMS)


def _forced(module, constants: dict, call, clock: CudaClock) -> float:
    """Median ms of `call` with the module's schedule constants set to `constants` (then
    restored)."""
    with module.SCHEDULES.override(**constants):
        call()  # compile outside the timed loop
        return measure(clock, Workload(lambda _state: call()), REP_MS).median_ms


def compare(ops, dtypes, shapes) -> list[dict]:
    properties = torch.cuda.get_device_properties(0)
    clock = CudaClock(torch.device("cuda"), getattr(properties, "L2_cache_size", 50 << 20))
    results = []
    for op in ops:
        module = importlib.import_module(f"generated.{op}")
        for dtype in dtypes:
            for m, n in shapes:
                _, backward, element_size = launcher_calls(op, module, m, n, DTYPES[dtype])
                moved = (4 if op in ADD_NORMS else 3) * m * n * element_size
                speeds = {label: moved / _forced(module, constants, backward, clock) / 1e6
                          for label, constants in (("split", SPLIT_EVERYWHERE),
                                                   ("unsplit", SPLIT_NOWHERE))}
                default = _used_schedule(module, backward).split  # the module's own rule
                results.append({"op": op, "dtype": dtype, "m": m, "n": n, **speeds,
                                "rule_splits": bool(default)})
                print(f"{op} backward {dtype} {m}x{n}: split {speeds['split']:.0f} GB/s, "
                      f"whole or looped {speeds['unsplit']:.0f} (the rule "
                      f"{'splits' if default else 'does not split'})", flush=True)
                del backward
                torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", required=True, help="MxN,...")
    parser.add_argument("--ops", default="layernorm,rmsnorm,softmax")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--out", type=Path, help="write DIR/split.json")
    args = parser.parse_args()
    for op in args.ops.split(","):
        if op not in SPLIT_OPS:
            parser.error(f"--ops: expected some of {', '.join(SPLIT_OPS)}, got {op!r}")
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            parser.error(f"--dtypes: expected some of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: expected MxN,... (4096x32768), got {args.shapes!r}")
    if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        parser.error(f"--shapes: expected MxN,... of positive sizes, got {args.shapes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.split: needs a CUDA device")
    results = compare(args.ops.split(","), args.dtypes.split(","), shapes)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "split.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Why a kernel runs at the speed it does: its schedule, the compiler's resource report and
the hardware counters (Nsight Compute) of one launch, per op, mode and shape.

    python -m benchmarks.counters --out DIR [--ops layernorm,rmsnorm,softmax,cross_entropy]
                                  [--shapes 4096x32768,...] [--modes fwd,bwd] [--dtype bf16]

For every case the generated launcher runs with the module's own schedule (table and rules, as
the API would): timed with the harness's clock (CUDA events, L2 flushed, the median) as GB/s of
the bytes model (benchmarks.ops.bytes_moved; cross-entropy: the logits read, and backward their
gradient written) and as a share of the copy bandwidth measured in the same run, of 1 GiB and of
one (M, N) tensor of the case's dtype (the ceiling at that size, where a short kernel's launch
and ramp weigh); the compiled kernel's registers, spills and shared memory are recorded. Then
one child process runs every case once more under `ncu` (clocks left alone, `--clock-control
none`), which reads, for that one launch of the main kernel: the DRAM bytes read and written
(the bytes actually moved, against the model), the L2 hit rate, DRAM and SM throughput as shares
of their peaks, the achieved occupancy and what limits it, the share of issue slots used and of
the transcendental (XU) pipe, and the stall reasons per issued instruction. Column sums of
backward partials (a second, small kernel) are not profiled. Results: DIR/counters.json and a
table on stdout. Without ncu on the PATH the counters are left out, the rest is still measured.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.sweep import DTYPES, launcher_calls

#: the grid's shapes of 8M elements and more (the issue's targets), and its small-N shapes
SHAPES = ((32768, 256), (4096, 1024), (4096, 4096), (16384, 4096), (8192, 8192),
          (4096, 16384), (4096, 32768), (4096, 65536), (1024, 262144))
CROSS_ENTROPY_SHAPES = ((4096, 32000), (8192, 128256), (2048, 256000))
#: (label, ncu metric): what each column of the table reads
METRICS = (
    ("time_us", "gpu__time_duration.sum"),
    ("dram_read", "dram__bytes_read.sum"),
    ("dram_write", "dram__bytes_write.sum"),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("l2_hit", "lts__t_sector_hit_rate.pct"),
    ("occupancy", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("issue_pct", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("xu_pct", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("waves", "launch__waves_per_multiprocessor"),
    ("limit_regs", "launch__occupancy_limit_registers"),
    ("limit_shared", "launch__occupancy_limit_shared_mem"),
    ("limit_warps", "launch__occupancy_limit_warps"),
    ("limit_blocks", "launch__occupancy_limit_blocks"),
)
STALLS = ("long_scoreboard", "barrier", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "short_scoreboard", "wait", "not_selected", "selected", "drain", "membar",
          "no_instruction", "branch_resolving", "dispatch_stall", "tex_throttle", "sleeping")


def _stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def _moved(op_name: str, mode: str, m: int, n: int, element_size: int) -> int:
    from benchmarks import tune

    return tune._moved(tune._op(op_name), mode, m, n, element_size)


def cases(ops: list[str], shapes, modes: list[str]) -> list[tuple[str, str, int, int]]:
    out = []
    for op in ops:
        for m, n in (shapes or (CROSS_ENTROPY_SHAPES if op == "cross_entropy" else SHAPES)):
            out += [(op, mode, m, n) for mode in modes]
    return out


def _calls(op: str, mode: str, m: int, n: int, dtype: torch.dtype):
    module = importlib.import_module(f"generated.{op}")
    forward, backward, element_size = launcher_calls(op, module, m, n, dtype)
    return module, (forward if mode == "fwd" else backward), element_size


def child(case_list, dtype: torch.dtype) -> None:
    """Run under ncu: each case's launcher once to compile, then once between
    cudaProfilerStart and Stop, so exactly one launch of its main kernel is profiled."""
    for op, mode, m, n in case_list:
        _module, call, _size = _calls(op, mode, m, n, dtype)
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        del call
        torch.cuda.empty_cache()
        print(f"profiled {op} {mode} {m}x{n}", flush=True)


def _ncu(case_list, dtype_name: str, out: Path) -> list[dict] | str:
    ncu = shutil.which("ncu")
    if ncu is None:
        return "ncu is not on the PATH"
    metrics = [metric for _label, metric in METRICS] + [_stall_metric(s) for s in STALLS]
    spec = ",".join(f"{op}:{mode}:{m}x{n}" for op, mode, m, n in case_list)
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv",
               "--page", "raw", "--kernel-name", r"regex:^_[a-z_]+_(fwd|bwd_[a-z]+)_(per|red)$",
               "--metrics", ",".join(metrics), "--log-file", str(out / "ncu.csv"),
               sys.executable, "-m", "benchmarks.counters", "--out", str(out),
               "--dtype", dtype_name, "--child", spec]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    (out / "ncu.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 or not (out / "ncu.csv").exists():
        return f"ncu exited {result.returncode}: {(result.stdout + result.stderr)[-500:]}"
    return parse((out / "ncu.csv").read_text(), len(case_list))


def parse(text: str, cases_run: int) -> list[dict] | str:
    """ncu's `--csv --page raw` log: one record per profiled launch, in launch order (the
    counters of METRICS and the stall reasons, most first), or why it can't be read."""
    lines = text[text.index('"ID"'):] if '"ID"' in text else text
    rows = list(csv.DictReader(io.StringIO(lines)))
    rows = [row for row in rows if row.get("ID", "").isdigit()]  # the units row has none
    if len(rows) != cases_run:
        return f"ncu profiled {len(rows)} launches for {cases_run} cases; see ncu.log"
    profiled = []
    for row in rows:
        record = {"kernel": row.get("Kernel Name")}
        for label, metric in METRICS:
            record[label] = _number(row.get(metric))
        stalls = {reason: _number(row.get(_stall_metric(reason))) for reason in STALLS}
        record["stalls"] = {k: v for k, v in sorted(stalls.items(), key=lambda kv: -(kv[1] or 0))
                            if v}
        profiled.append(record)
    return profiled


def _number(text: str | None) -> float | None:
    if text is None or text.strip() in ("", "n/a"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _copy_here(env, elements: int, dtype: torch.dtype) -> float:
    """GB/s of `dst.copy_(src)` for one (M, N) tensor of the case (read + write): the ceiling
    at this size, where launch and the ramp of a short kernel weigh on the 1 GiB copy's."""
    from benchmarks.timing import Workload, measure
    from benchmarks.tune import REP_MS

    src = torch.randn(elements, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    stats = measure(env.clock, Workload(lambda _state: dst.copy_(src)), REP_MS)
    return 2 * src.numel() * src.element_size() / stats.median_ms / 1e6


def run(case_list, dtype_name: str, out: Path) -> dict:
    from benchmarks.environment import create_environment, measure_copy_bandwidth
    from benchmarks.timing import Workload, measure
    from benchmarks.tune import REP_MS, _kernel_stats, _Recorder, _used_schedule

    dtype = DTYPES[dtype_name]
    env = create_environment(cpu_smoke=False)
    copy = measure_copy_bandwidth(env, 1 << 30, 50.0)
    results = []
    for op, mode, m, n in case_list:
        module, call, element_size = _calls(op, mode, m, n, dtype)
        name = "fwd" if mode == "fwd" else "bwd_default"
        keys = [k for k in vars(module) if k.startswith(f"_{op}_{name}_")
                and k.endswith(("_per", "_red", "_split"))]
        with _Recorder(keys) as recorder:
            schedule = _used_schedule(module, call)  # forgets the launch plans before and after
        stats = {}
        for compiled in recorder.compiled.values():
            stats = _kernel_stats(compiled)
        timing = measure(env.clock, Workload(lambda _state, call=call: call()), REP_MS)
        model = _moved(op, mode, m, n, element_size)
        gbps = model / timing.median_ms / 1e6
        results.append({"op": op, "mode": mode, "m": m, "n": n, "dtype": dtype_name,
                        "schedule": schedule._asdict(), **stats, "ms": timing.median_ms,
                        "model_bytes": model, "gbps": gbps, "pct_copy": 100 * gbps / copy.gbps,
                        "copy_here_gbps": _copy_here(env, m * n, dtype)})
        del call
        torch.cuda.empty_cache()
    profiled = _ncu(case_list, dtype_name, out)
    if isinstance(profiled, str):
        note = profiled
    else:
        note = None
        for result, counters in zip(results, profiled, strict=True):
            result["ncu"] = counters
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "copy_gbps": copy.gbps, "ncu_note": note, "results": results}


def table(report: dict) -> str:
    lines = [f"{report['device']}, torch {report['torch']}, triton {report['triton']}, "
             f"{report['date']}; copy {report['copy_gbps']:.0f} GB/s"
             + (f"; counters: {report['ncu_note']}" if report["ncu_note"] else ""),
             "| op | mode | shape | schedule | regs/spills | GB/s | % copy | % copy at size "
             "| DRAM bytes / model "
             "| DRAM % | L2 hit % | SM % | occupancy % (limit: regs, smem, warps) | issue % "
             "| XU % | top stalls (warps per issue) |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in report["results"]:
        s = r["schedule"]
        kind = (f"looped {s['block_n']}{' one sweep' if s['one_sweep'] else ''}"
                f"{' reversed' if s.get('reverse') else ''}" if s["looped"] else "whole")
        sched = (f"{kind}, rows {s['rows']}, warps {s['warps']}, programs {s['programs']}, "
                 f"stages {s['stages']}")
        c = r.get("ncu") or {}

        def f(key, fmt="{:.0f}", c=c):
            return fmt.format(c[key]) if c.get(key) is not None else "—"

        moved = ((c.get("dram_read") or 0) + (c.get("dram_write") or 0)) if c else None
        ratio = f"{moved / r['model_bytes']:.2f}" if moved else "—"
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in list(c.get("stalls", {}).items())[:3])
        limits = f"{f('limit_regs')}, {f('limit_shared')}, {f('limit_warps')}"
        lines.append(
            f"| {r['op']} | {r['mode']} | {r['m']}x{r['n']} | {sched} | {r.get('regs')}/"
            f"{r.get('spills')} | {r['gbps']:.0f} | {r['pct_copy']:.0f}% | "
            f"{100 * r['gbps'] / r['copy_here_gbps']:.0f}% of {r['copy_here_gbps']:.0f} | "
            f"{ratio} | "
            f"{f('dram_pct')} | {f('l2_hit')} | {f('sm_pct')} | {f('occupancy')} ({limits}) | "
            f"{f('issue_pct')} | {f('xu_pct')} | {stalls or '—'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", default="layernorm,rmsnorm,softmax,cross_entropy")
    parser.add_argument("--shapes", default=None, help="MxN,MxN,... (default: SHAPES, and "
                        "CROSS_ENTROPY_SHAPES for cross_entropy)")
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        case_list = [(op, mode, *map(int, shape.split("x")))
                     for op, mode, shape in (item.split(":") for item in args.child.split(","))]
        child(case_list, DTYPES[args.dtype])
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.counters needs a CUDA device")
    shapes = ([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
              if args.shapes else None)
    case_list = cases(args.ops.split(","), shapes, args.modes.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(case_list, args.dtype, args.out)
    (args.out / "counters.json").write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()

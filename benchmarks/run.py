"""Benchmark vjpforge's generated kernels against torch eager, torch.compile and Liger.

    python -m benchmarks.run --out DIR [--quick] [--cpu-smoke] [--ops layernorm,rmsnorm,softmax]
                             [--dtypes bf16,fp16,fp32]
                             [--providers vjpforge,torch,compile,liger[,helion]]

Writes DIR/results.json, DIR/benchmarks.md and a few PNG plots. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from benchmarks.environment import (
    Environment,
    create_environment,
    measure_copy_bandwidth,
)
from benchmarks.grid import DTYPES, PRESETS, Preset, Shape
from benchmarks.ops import (
    MODES,
    OPS,
    TOLERANCE,
    Inputs,
    OpFn,
    OpSpec,
    bytes_moved,
    forward_and_input_grad,
    make_inputs,
    make_workload,
    max_relative_error,
)
from benchmarks.providers import (
    BASELINE_PROVIDER,
    DEFAULT_PROVIDERS,
    PROVIDERS,
    Provider,
    ProviderCache,
    ProviderUnavailable,
    raise_recompile_limits,
)
from benchmarks.records import (
    ERROR,
    OK,
    OOM,
    SKIP,
    UNAVAILABLE,
    HostOverhead,
    Measurement,
    RunRecord,
)
from benchmarks.report import write_markdown
from benchmarks.timing import Stats, Workload, host_overhead_us, measure, pooled

MEMORY_FACTOR = 10
"""Activation-sized tensors one shape may need at once (x, dy, y, dx, saved, reference, ...)."""
ROUNDS = 2
"""Rounds in which each shape's providers are timed, in alternating order (`bench_providers`)."""
Reference = tuple[torch.Tensor, torch.Tensor]
"""torch eager's output and input gradient for one (op, dtype, shape)."""
FATAL_CUDA_ERRORS = (
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert",
    "misaligned address",
)


@dataclass(frozen=True)
class Plan:
    preset_name: str
    preset: Preset
    ops: tuple[OpSpec, ...]
    dtypes: tuple[str, ...]
    providers: tuple[Provider, ...]
    rep_ms: float
    budget_s: float
    out: Path
    command: str
    shape_names: tuple[str, ...] = ()
    """Empty: every shape of the preset; otherwise only these (MxN)."""
    resume: bool = False
    """Continue `out`'s results.json: measure only what it lacks."""

    def shapes_for(self, op: OpSpec) -> tuple[Shape, ...]:
        return tuple(shape for shape in self.preset.shapes if shape.applies_to(op.name)
                     and (not self.shape_names or shape.name in self.shape_names))

    @property
    def measurement_count(self) -> int:
        shapes = sum(len(self.shapes_for(op)) for op in self.ops)
        return len(self.dtypes) * shapes * len(self.providers) * len(MODES)


def _csv(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (got {text!r})")
        return items

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="bf16, 3 shapes, 50 s budget: a GPU smoke test",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU with wall-clock timing",
    )
    parser.add_argument("--ops", type=_csv(tuple(OPS)), default=tuple(OPS))
    parser.add_argument(
        "--dtypes",
        type=_csv(tuple(DTYPES)),
        default=None,
        help="default: bf16,fp16,fp32 (bf16 with --quick / --cpu-smoke)",
    )
    parser.add_argument(
        "--providers", type=_csv(tuple(PROVIDERS)), default=DEFAULT_PROVIDERS,
        help=f"default: {','.join(DEFAULT_PROVIDERS)}; also helion (benchmarks/README.md)",
    )
    parser.add_argument(
        "--shapes",
        type=_csv(tuple(shape.name for preset in PRESETS.values() for shape in preset.shapes)),
        default=(),
        help="MxN,... of the preset's shapes (default: all of them)",
    )
    parser.add_argument(
        "--rep-ms",
        type=float,
        default=None,
        help="timed ms per measurement (default 25; 10 with --quick)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no measurement after this many seconds (default 480; 50 with --quick)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue OUT/results.json: measure only the cells it lacks (those a spent budget "
        "skipped), keep the rest, and say so in its notes",
    )
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace, argv: Sequence[str]) -> Plan:
    preset_name = "cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    return Plan(
        preset_name=preset_name,
        preset=preset,
        ops=tuple(OPS[name] for name in args.ops),
        dtypes=args.dtypes or preset.default_dtypes,
        providers=tuple(PROVIDERS[name] for name in args.providers),
        rep_ms=args.rep_ms or preset.rep_ms,
        budget_s=args.budget_s or preset.budget_s,
        out=args.out,
        command=shlex.join(["python", "-m", "benchmarks.run", *argv]),
        shape_names=args.shapes,
        resume=args.resume,
    )


T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What an attempted action gave: its value, or the status and message of its failure."""

    value: T | None
    status: str = OK
    message: str = ""


def describe_error(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] != detail:
        detail = f"{detail} ... {lines[-1]}"
    return f"{type(exc).__name__}: {detail}"[:400]


def error_status(exc: BaseException) -> str:
    return OOM if isinstance(exc, torch.cuda.OutOfMemoryError) else ERROR


class BenchmarkRun:
    """One benchmark run: measures, records, saves after every shape."""

    def __init__(self, plan: Plan, env: Environment) -> None:
        self.plan = plan
        self.env = env
        self.cache = ProviderCache()
        self.started = time.perf_counter()
        self.stop_reason = ""
        self.done = 0
        self.wall_by_provider: dict[str, float] = defaultdict(float)
        self.record = RunRecord(
            meta={
                **env.info,
                "command": plan.command,
                "preset": plan.preset_name,
                "rep_ms": plan.rep_ms,
                "budget_s": plan.budget_s,
                "ops": [op.name for op in plan.ops],
                "dtypes": list(plan.dtypes),
                "providers": {provider.name: provider.description for provider in plan.providers},
                "planned_measurements": plan.measurement_count,
            }
        )
        self.copy_gbps: float | None = None
        """This call's copy bandwidth: the 100% of the cells it measures."""
        self.kept: set[tuple[str, str, str, str]] = set()
        """(dtype, op, shape, provider) of a resumed record, every mode measured or failed."""
        self.resuming = False
        self.resumed_from = 0
        if plan.resume and (plan.out / "results.json").exists():
            self.resume(RunRecord.load(plan.out / "results.json"))

    def resume(self, previous: RunRecord) -> None:
        """Keep what `previous` measured (or failed at): skipped cells are measured again."""
        self.record, self.resuming = previous, True
        self.record.meta["planned_measurements"] = self.plan.measurement_count
        def cell(row: Measurement) -> tuple[str, str, str, str]:
            return row.dtype, row.op, row.shape, row.provider

        done = [row for row in previous.measurements if row.status != SKIP]
        modes: dict[tuple[str, str, str, str], int] = defaultdict(int)
        for row in done:
            modes[cell(row)] += 1
        # a provider is measured again at a shape where any of its modes was skipped
        self.kept = {key for key, count in modes.items() if count == len(MODES)}
        kept = [row for row in done if cell(row) in self.kept]
        self.record.measurements = kept
        self.done = len(kept)
        self.resumed_from = len(kept)
        self.record.meta.setdefault("resumed", []).append(
            {"date": self.env.info.get("date"), "command": self.plan.command}
        )

    # ----------------------------------------------------------------- plumbing
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)

    def should_stop(self) -> bool:
        if not self.stop_reason and self.elapsed() > self.plan.budget_s:
            self.stop_reason = f"time budget of {self.plan.budget_s:.0f} s used up"
            self.log(f"STOP: {self.stop_reason}; writing what was measured")
        return bool(self.stop_reason)

    def note_failure(self, exc: BaseException) -> None:
        if any(marker in str(exc) for marker in FATAL_CUDA_ERRORS):
            self.stop_reason = f"CUDA context corrupted ({describe_error(exc)})"
            self.log(f"STOP: {self.stop_reason}")
        if error_status(exc) == OOM:
            gc.collect()
            self.env.release_memory()

    def attempt(self, action: Callable[[], T]) -> Outcome[T]:
        """Run ``action``; a failure is returned (and noted), never raised."""
        try:
            return Outcome(action())
        except Exception as exc:  # noqa: BLE001 - any provider failure is recorded; the run goes on
            self.note_failure(exc)
            return Outcome(None, error_status(exc), describe_error(exc))

    def note(self, text: str) -> None:
        if text not in self.record.notes:
            self.record.notes.append(text)
            self.log(f"NOTE: {text}")

    def save(self) -> None:
        self.plan.out.mkdir(parents=True, exist_ok=True)
        self.record.meta.update(
            elapsed_s=round(self.elapsed(), 1),
            stop_reason=self.stop_reason,
            completed_measurements=self.done,
            provider_wall_s={
                name: round(seconds, 1) for name, seconds in self.wall_by_provider.items()
            },
        )
        self.record.save(self.plan.out / "results.json")
        write_markdown(self.record, self.plan.out / "benchmarks.md")

    def load(self, provider: Provider, op: OpSpec) -> OpFn | None:
        try:
            return self.cache.get(provider, op)
        except ProviderUnavailable as exc:
            self.note(f"{provider.name} unavailable for {op.name}: {exc}")
            return None

    def missing_status(self, provider: Provider, op: OpSpec) -> tuple[str, str]:
        """Status and message for a provider that was not loaded (unavailable or stopped)."""
        unavailable = self.cache.unavailable.get((provider.name, op.name))
        return (UNAVAILABLE, unavailable) if unavailable else (SKIP, self.stop_reason)

    # ----------------------------------------------------------------- phases
    def run(self) -> None:
        """All phases; whatever happens, the results so far are written."""
        raise_recompile_limits()
        planned = self.plan.measurement_count
        self.log(f"device: {self.env.info['device_name']}; plan: {planned} measurements")
        try:
            self.bench_copy()
            self.bench_host_overhead()
            self.bench_grid()
        except BaseException as exc:
            self.stop_reason = self.stop_reason or f"aborted: {describe_error(exc)}"
            raise
        finally:
            self.save()
            self.write_plots()
            spent = ", ".join(f"{name} {sec:.0f} s" for name, sec in self.wall_by_provider.items())
            self.log(
                f"done: {self.done}/{planned} measurements ({spent}); output in {self.plan.out}"
            )

    def bench_copy(self) -> None:
        copy = measure_copy_bandwidth(self.env, self.plan.preset.copy_bytes, 4 * self.plan.rep_ms)
        self.copy_gbps = copy.gbps
        if self.resuming and self.record.copy:
            gib = copy.buffer_bytes / 2**30
            self.log(f"copy bandwidth of this call: {copy.gbps:.0f} GB/s ({gib:.2f} GiB)")
            return  # a resumed record keeps its first call's copy; cells say their own
        self.record.copy = {
            "buffer_bytes": copy.buffer_bytes,
            "moved_bytes": copy.moved_bytes,
            "median_ms": copy.stats.median_ms,
            "iterations": copy.stats.iterations,
            "gbps": copy.gbps,
        }
        gib = copy.buffer_bytes / 2**30
        self.log(f"copy bandwidth: {copy.gbps:.0f} GB/s (dst.copy_(src) of {gib:.2f} GiB)")

    def bench_host_overhead(self) -> None:
        if self.resuming and self.record.host_overhead:
            return  # measured by the call this one resumes
        dtype_name = self.plan.dtypes[0]
        for op in self.plan.ops:
            for shape in self.plan.preset.host_shapes:
                inputs = make_inputs(op, shape.m, shape.n, DTYPES[dtype_name], self.env.device)
                for provider in self.plan.providers:
                    fn = None if self.should_stop() else self.load(provider, op)
                    for mode in self.plan.preset.host_modes:
                        row = HostOverhead(
                            op.name, mode, dtype_name, shape.name, provider.name, SKIP
                        )
                        if fn is None:
                            row.status, row.message = self.missing_status(provider, op)
                        else:
                            self.time_host_overhead(row, make_workload(fn, inputs, mode))
                        self.record.host_overhead.append(row)

    def time_host_overhead(self, row: HostOverhead, work: Workload) -> None:
        outcome = self.attempt(
            lambda: host_overhead_us(self.env.clock, work, self.plan.preset.host_calls)
        )
        row.us_per_call, row.status, row.message = (
            outcome.value,
            outcome.status,
            outcome.message,
        )
        shown = f"{row.us_per_call:.1f} us/call" if row.status == OK else row.message
        self.log(
            f"host overhead {row.dtype} {row.op} {row.shape} {row.provider} {row.mode}: {shown}"
        )

    def bench_grid(self) -> None:
        for dtype_name in self.plan.dtypes:
            for op in self.plan.ops:
                for shape in self.plan.shapes_for(op):
                    providers = tuple(
                        provider for provider in self.plan.providers
                        if (dtype_name, op.name, shape.name, provider.name) not in self.kept
                    )
                    if not providers:
                        continue  # a resumed record has all of it
                    if self.should_stop():
                        return
                    self.bench_shape(op, dtype_name, shape, providers)
                    self.save()
        added = self.done - self.resumed_from
        if self.resuming and added:
            self.note(
                f"Resumed on {self.env.info.get('date')} by `{self.plan.command}`: {added} "
                f"measurements added to the {self.resumed_from} kept; copy bandwidth in that call "
                f"{self.copy_gbps:,.0f} GB/s, against which those cells give their % of copy."
            )

    def new_measurement(
        self, op: OpSpec, dtype_name: str, shape: Shape, provider: Provider, mode: str
    ) -> Measurement:
        element_size = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
        return Measurement(
            op=op.name,
            mode=mode,
            dtype=dtype_name,
            shape=shape.name,
            m=shape.m,
            n=shape.n,
            label=shape.label,
            provider=provider.name,
            status=SKIP,
            bytes=bytes_moved(op, mode, shape.m, shape.n, element_size),
        )

    def record_all(
        self,
        op: OpSpec,
        dtype_name: str,
        shape: Shape,
        status: str,
        message: str,
        providers: tuple[Provider, ...],
    ) -> None:
        for provider in providers:
            for mode in MODES:
                row = self.new_measurement(op, dtype_name, shape, provider, mode)
                row.status, row.message = status, message
                self.record.measurements.append(row)
                self.done += 1
        self.log(f"{dtype_name} {op.name} {shape.name}: {status}: {message}")

    def bench_shape(
        self, op: OpSpec, dtype_name: str, shape: Shape, providers: tuple[Provider, ...]
    ) -> None:
        dtype = DTYPES[dtype_name]
        activation = shape.m * shape.n * torch.empty((), dtype=dtype).element_size()
        free = self.env.free_bytes()
        if free is not None and MEMORY_FACTOR * activation > free:
            need = MEMORY_FACTOR * activation / 2**30
            self.record_all(
                op,
                dtype_name,
                shape,
                SKIP,
                f"needs ~{need:.1f} GiB, {free / 2**30:.1f} GiB free",
                providers,
            )
            return
        prepared = self.attempt(lambda: self.prepare_shape(op, dtype, shape))
        if prepared.value is None:
            self.record_all(op, dtype_name, shape, prepared.status, prepared.message, providers)
            return
        inputs, reference = prepared.value
        del prepared
        self.bench_providers(op, dtype_name, shape, providers, inputs, reference)
        del inputs, reference
        gc.collect()
        self.env.release_memory()

    def prepare_shape(
        self, op: OpSpec, dtype: torch.dtype, shape: Shape
    ) -> tuple[Inputs, Reference]:
        """Inputs and torch eager's output and input gradient on them."""
        inputs = make_inputs(op, shape.m, shape.n, dtype, self.env.device)
        reference = forward_and_input_grad(PROVIDERS[BASELINE_PROVIDER].load(op), inputs)
        return inputs, reference

    def check(self, fn: OpFn, inputs: Inputs, reference: Reference) -> Outcome[str]:
        """Compare output and input gradient with torch eager: "ok" or "mismatch: ..."."""
        return self.attempt(lambda: self.compare(fn, inputs, reference))

    def compare(self, fn: OpFn, inputs: Inputs, reference: Reference) -> str:
        y, dx = forward_and_input_grad(fn, inputs)
        errors = (
            max_relative_error(y, reference[0]),
            max_relative_error(dx, reference[1]),
        )
        tolerance = TOLERANCE[inputs.x.dtype]
        if max(errors) <= tolerance:
            return OK
        return f"mismatch: rel. err. y {errors[0]:.1e}, dx {errors[1]:.1e} > {tolerance:.0e}"

    def bench_providers(
        self,
        op: OpSpec,
        dtype_name: str,
        shape: Shape,
        providers: tuple[Provider, ...],
        inputs: Inputs,
        reference: Reference,
    ) -> None:
        """Every provider's modes at one shape: each loaded and checked, then timed in ROUNDS
        rounds, the providers in alternating order (first to last, then last to first), each
        round a share of the timed milliseconds; a cell's statistics pool its rounds' samples.
        A provider measured right after a JIT or torch.compile pause is not always the same
        one, so a slower GPU after it is shared (H100, softmax backward bf16 4096x4096, a grid
        timing each provider once, vjpforge first: 2517 GB/s against torch.compile's 2643 and
        Liger's 2643; each warmed up, then timed in alternating order: 2745, 2693, 2743)."""
        loaded: dict[str, tuple[OpFn | None, Outcome[str]]] = {}
        for provider in providers:
            began = time.perf_counter()
            fn = None if self.should_stop() else self.load(provider, op)
            checked = (
                Outcome("")
                if fn is None or provider.name == BASELINE_PROVIDER
                else self.check(fn, inputs, reference)
            )
            loaded[provider.name] = (fn, checked)
            self.wall_by_provider[provider.name] += time.perf_counter() - began
        parts: dict[tuple[str, str], list[Stats]] = defaultdict(list)
        failed: dict[tuple[str, str], Outcome[Stats]] = {}
        wall: dict[tuple[str, str], float] = defaultdict(float)
        for round_ in range(ROUNDS):
            for provider in providers if round_ % 2 == 0 else providers[::-1]:
                fn, _checked = loaded[provider.name]
                for mode in MODES:
                    key = (provider.name, mode)
                    if fn is None or key in failed or self.should_stop():
                        continue
                    began = time.perf_counter()
                    work = make_workload(fn, inputs, mode)
                    outcome = self.attempt(
                        lambda work=work: measure(self.env.clock, work, self.plan.rep_ms / ROUNDS)
                    )
                    if outcome.value is None:
                        failed[key] = outcome
                    else:
                        parts[key].append(outcome.value)
                    wall[key] += time.perf_counter() - began
                    self.wall_by_provider[provider.name] += time.perf_counter() - began
        for provider in providers:
            fn, checked = loaded[provider.name]
            for mode in MODES:
                key = (provider.name, mode)
                row = self.new_measurement(op, dtype_name, shape, provider, mode)
                row.check = (
                    checked.value
                    if checked.value is not None
                    else f"{checked.status}: {checked.message}"
                )
                if fn is None:
                    row.status, row.message = self.missing_status(provider, op)
                elif key in failed:
                    row.status, row.message = failed[key].status, failed[key].message
                elif parts[key]:
                    self.record_stats(row, pooled(parts[key]))
                elif checked.value is None and self.should_stop():  # its failure stopped us
                    row.status, row.message = checked.status, checked.message
                else:
                    row.message = self.stop_reason
                row.wall_s = round(wall[key], 3)
                self.record.measurements.append(row)
                self.done += 1
                self.log(f"[{self.done}/{self.plan.measurement_count}] {_describe(row)}")

    def record_stats(self, row: Measurement, stats: Stats) -> None:
        row.status = OK
        row.median_ms, row.p20_ms, row.p80_ms, row.min_ms = (
            stats.median_ms,
            stats.p20_ms,
            stats.p80_ms,
            stats.min_ms,
        )
        row.iterations = stats.iterations
        row.dropped = stats.dropped
        row.host_us = stats.host_ms * 1e3
        row.gbps = row.bytes / (stats.median_ms * 1e6)
        copy_gbps = self.copy_gbps
        row.pct_of_copy = 100.0 * row.gbps / copy_gbps if copy_gbps else None

    def write_plots(self) -> None:
        try:
            from benchmarks.plots import write_plots
        except ImportError as exc:
            self.log(f"no plots: {exc}")
            return
        for path in write_plots(self.record, self.plan.out):
            self.log(f"wrote {path}")


def _describe(row: Measurement) -> str:
    where = f"{row.dtype} {row.op} {row.shape} {row.provider} {row.mode}"
    if row.status != OK:
        return f"{where}: {row.status}: {row.message}"
    percent = f" ({row.pct_of_copy:.0f}% of copy)" if row.pct_of_copy is not None else ""
    check = "" if row.check in ("", OK) else f" [{row.check}]"
    timing = f"{row.median_ms * 1e3:.1f} us, {row.gbps:.0f} GB/s{percent}, n={row.iterations}"
    return f"{where}: {timing}{check}"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    plan = make_plan(parse_args(arguments), arguments)
    torch.manual_seed(0)
    if plan.preset_name == "cpu-smoke":
        torch.set_num_threads(1)  # two-core CI machines: thread wake-ups dominate tiny ops
    BenchmarkRun(plan, create_environment(plan.preset_name == "cpu-smoke")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

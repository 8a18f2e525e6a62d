"""The machine the benchmark runs on: device, clock, versions, memory, copy bandwidth."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.timing import Clock, CudaClock, Stats, WallClock, Workload, measure

DEFAULT_L2_BYTES = 50 * 2**20
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Environment:
    device: torch.device
    clock: Clock
    info: dict[str, object]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def free_bytes(self) -> int | None:
        """Free device memory, or None where it is not tracked (CPU)."""
        if not self.is_cuda:
            return None
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free)

    def release_memory(self) -> None:
        if self.is_cuda:
            torch.cuda.empty_cache()


def _package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_revision() -> str:
    try:
        completed = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            check=False,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return completed.stdout.strip() or "unknown"


def _software_info() -> dict[str, object]:
    import triton

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": triton.__version__,
        "liger_kernel": _package_version("liger-kernel"),
        "helion": _package_version("helion"),
        "vjpforge_git": _git_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "hostname": platform.node(),
    }


def _cuda_info(device: torch.device) -> dict[str, object]:
    props = torch.cuda.get_device_properties(device)
    return {
        "device_name": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": int(getattr(props, "L2_cache_size", DEFAULT_L2_BYTES)),
    }


def _cpu_info() -> dict[str, object]:
    return {
        "device_name": f"CPU {platform.processor() or platform.machine()} (smoke test, wall clock)",
        "sm_count": os.cpu_count(),
        "compute_capability": "n/a",
        "memory_gib": "n/a",
        "l2_bytes": 0,
    }


def create_environment(cpu_smoke: bool) -> Environment:
    if cpu_smoke:
        return Environment(torch.device("cpu"), WallClock(), {**_cpu_info(), **_software_info()})
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; use --cpu-smoke for a CPU smoke test")
    device = torch.device("cuda", torch.cuda.current_device())
    info = _cuda_info(device)
    return Environment(
        device, CudaClock(device, int(info["l2_bytes"])), {**info, **_software_info()}
    )


@dataclass(frozen=True)
class CopyBandwidth:
    buffer_bytes: int
    moved_bytes: int
    stats: Stats

    @property
    def gbps(self) -> float:
        return self.moved_bytes / (self.stats.median_ms * 1e6)


def _copy_stats(env: Environment, buffer_bytes: int, rep_ms: float) -> Stats:
    src = torch.empty(buffer_bytes // 2, dtype=torch.bfloat16, device=env.device)
    src.normal_()
    dst = torch.empty_like(src)
    return measure(env.clock, Workload(call=lambda _state: dst.copy_(src)), rep_ms)


def measure_copy_bandwidth(env: Environment, buffer_bytes: int, rep_ms: float) -> CopyBandwidth:
    """``dst.copy_(src)`` of one buffer: reads and writes ``buffer_bytes`` each."""
    stats = _copy_stats(env, buffer_bytes, rep_ms)
    env.release_memory()
    moved = 2 * (buffer_bytes // 2) * torch.empty((), dtype=torch.bfloat16).element_size()
    return CopyBandwidth(buffer_bytes=buffer_bytes, moved_bytes=moved, stats=stats)


#: the --dtype values of the user-level benchmarks (host, layers_step)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def names(parser, flag: str, value: str, known) -> list[str]:
    """The comma-separated names of `flag`, each one of `known` (else the parser's error)."""
    chosen = [name for name in value.split(",") if name]
    if unknown := sorted(set(chosen) - set(known)):
        what = flag.lstrip("-").rstrip("s")
        parser.error(f"{flag}: no such {what} {', '.join(unknown)} "
                     f"({flag.lstrip('-')}: {', '.join(known)})")
    return chosen


def user_level_setup(cpu_smoke: bool, dtype: str | None):
    """(environment, dtype) of a user-level benchmark: `--cpu-smoke` runs the generated torch
    path (not the interpreter) on one thread in fp32; otherwise bf16 unless `dtype` says."""
    if cpu_smoke:
        os.environ.pop("TRITON_INTERPRET", None)  # the generated torch path, not the interpreter
        torch.set_num_threads(1)  # tiny tensors: threads cost more than they share
    return create_environment(cpu_smoke), DTYPES[dtype or ("fp32" if cpu_smoke else "bf16")]


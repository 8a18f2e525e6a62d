"""Timing: CUDA events with an L2 flush before every timed call (wall clock on CPU).

Each timed iteration is ``state = setup(); prepare(); start; call(state); stop``:

* ``setup`` is untimed work the call needs (the backward mode runs a fresh forward here),
* ``prepare`` (CUDA only) enqueues a GPU sleep (150 us, or 1.5x the slowest host time of
  the estimate calls when that is longer) and then overwrites a buffer of at least 256 MiB (> 5x the
  H100's 50 MB L2): the timed call starts with a cold L2 and with its launches already
  queued, so neither L2 hits nor host overhead are timed. (This replaces rotating
  among input copies: it works for any working-set size.)
* events around ``call`` time only the call's kernels. A call whose host time outran the
  sleep was partly waited for by the GPU: its sample is dropped (``Stats.dropped``); where
  that is most of them, the run is repeated once with a sleep twice as long.

The result is the median over as many iterations as fit in ``rep_ms`` (at least
``MIN_ITERATIONS``), after a warm-up that also triggers JIT / torch.compile.
benchmarks.run times each shape's providers in rounds (``ROUNDS``), the providers in
alternating order (first to last, then last to first), each round a share of ``rep_ms``; a
cell's statistics are those of all its rounds' samples (``pooled``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

MIN_ITERATIONS = 10
MAX_ITERATIONS = 2000
WARMUP_CALLS = 2
ESTIMATE_ITERATIONS = 3
FLUSH_BYTES_MIN = 256 * 2**20
GPU_SLACK_US = 150.0
"""Least GPU sleep before each timed call."""
HOST_SLACK_FACTOR = 1.5
"""The sleep also covers this multiple of the call's host (enqueue) time."""
MAX_SLACK_US = 5000.0


def _no_setup() -> None:
    return None


@dataclass(frozen=True)
class Workload:
    """``call(setup())`` is one iteration; only ``call`` is timed."""

    call: Callable[[object], object]
    setup: Callable[[], object] = _no_setup


@dataclass(frozen=True)
class Stats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    iterations: int
    host_ms: float
    """Host (CPU) time to issue one call, median of the estimate iterations."""
    dropped: int = 0
    """Timed calls whose host time outran the GPU sleep before them: left out of the
    statistics (all of them kept, and counted here, where none was covered)."""
    samples_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)
    """The samples the statistics are of (`pooled` joins measurements of one workload)."""

    @classmethod
    def from_samples(cls, samples_ms: list[float], host_ms: float, dropped: int = 0) -> Stats:
        ordered = sorted(samples_ms)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(
            statistics.median(ordered),
            quantile(0.2),
            quantile(0.8),
            ordered[0],
            len(ordered),
            host_ms,
            dropped,
            tuple(ordered),
        )


def pooled(parts: Sequence[Stats]) -> Stats:
    """One workload's measurements taken apart (rounds interleaved with other workloads) as one:
    the statistics of all their samples."""
    if not parts:
        raise ValueError(f"pooled() needs at least one Stats, got {parts!r}")
    samples = [sample for part in parts for sample in part.samples_ms]
    return Stats.from_samples(samples, statistics.median(part.host_ms for part in parts),
                              sum(part.dropped for part in parts))


class Clock(Protocol):
    def sync(self) -> None: ...
    def cover_host_time(self, host_ms: float) -> float:
        """Make ``prepare`` leave the host at least this long to issue the call; return the
        host milliseconds it leaves (a call slower than that is partly timed)."""
        ...

    def prepare(self) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def collect_ms(self) -> list[float]:
        """Wait for the device; return and forget the intervals recorded so far."""
        ...


class WallClock:
    """CPU: ops run synchronously, so ``perf_counter`` brackets the work itself."""

    def __init__(self) -> None:
        self._opened = 0.0
        self._intervals: list[float] = []

    def sync(self) -> None:
        return None

    def cover_host_time(self, host_ms: float) -> float:
        return float("inf")  # the wall clock times host work anyway

    def prepare(self) -> None:
        return None

    def start(self) -> None:
        self._opened = time.perf_counter()

    def stop(self) -> None:
        self._intervals.append((time.perf_counter() - self._opened) * 1e3)

    def collect_ms(self) -> list[float]:
        intervals, self._intervals = self._intervals, []
        return intervals


def _sleep_cycles_per_us() -> float:
    """Calibrate ``torch.cuda._sleep`` (it spins for a number of SM clock cycles)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)
    start, stop = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    torch.cuda._sleep(cycles)
    stop.record()
    stop.synchronize()
    return cycles / (start.elapsed_time(stop) * 1e3)


class CudaClock:
    def __init__(self, device: torch.device, l2_bytes: int) -> None:
        self._flush = torch.empty(
            max(FLUSH_BYTES_MIN, 4 * l2_bytes), dtype=torch.int8, device=device
        )
        self._cycles_per_us = _sleep_cycles_per_us()
        self._slack_cycles = int(GPU_SLACK_US * self._cycles_per_us)
        self._opened: torch.cuda.Event | None = None
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def sync(self) -> None:
        torch.cuda.synchronize()

    def cover_host_time(self, host_ms: float) -> float:
        slack_us = min(MAX_SLACK_US, max(GPU_SLACK_US, HOST_SLACK_FACTOR * host_ms * 1e3))
        self._slack_cycles = int(slack_us * self._cycles_per_us)
        return slack_us / 1e3

    def prepare(self) -> None:
        torch.cuda._sleep(self._slack_cycles)
        self._flush.zero_()

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._opened = self._record()

    def stop(self) -> None:
        assert self._opened is not None, "stop() without start()"
        self._pairs.append((self._opened, self._record()))
        self._opened = None

    def collect_ms(self) -> list[float]:
        self.sync()
        intervals = [start.elapsed_time(stop) for start, stop in self._pairs]
        self._pairs = []
        return intervals


def _iterate(clock: Clock, work: Workload, iterations: int) -> tuple[list[float], list[float]]:
    """Device milliseconds of each call, and the host milliseconds to issue each."""
    host_ms: list[float] = []
    for _ in range(iterations):
        state = work.setup()
        clock.prepare()
        clock.start()
        issued = time.perf_counter()
        work.call(state)
        host_ms.append((time.perf_counter() - issued) * 1e3)
        clock.stop()
        del state
    return clock.collect_ms(), host_ms


def measure(clock: Clock, work: Workload, rep_ms: float) -> Stats:
    """Median time of ``work.call`` (see the module docstring)."""
    for _ in range(WARMUP_CALLS):
        work.call(work.setup())
    clock.collect_ms()  # waits, and drops intervals a failed measurement left behind
    clock.cover_host_time(0.0)
    began = time.perf_counter()
    _samples, estimate = _iterate(clock, work, ESTIMATE_ITERATIONS)
    iteration_ms = (time.perf_counter() - began) * 1e3 / ESTIMATE_ITERATIONS
    iterations = int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, rep_ms / max(iteration_ms, 1e-6))))
    slowest = max(estimate)
    for _attempt in range(2):
        covered = clock.cover_host_time(slowest)
        samples, host = _iterate(clock, work, iterations)
        kept = [sample for sample, issued in zip(samples, host, strict=True) if issued <= covered]
        if 2 * len(kept) >= len(samples):
            break
        slowest = 2 * max(slowest, statistics.median(host))
    # none covered (a host slower than MAX_SLACK_US): every sample, each counted as dropped
    return Stats.from_samples(kept or samples, statistics.median(estimate),
                              len(samples) - len(kept))


def host_overhead_us(clock: Clock, work: Workload, calls: int) -> float:
    """Wall-clock microseconds per call of back-to-back calls (synchronised at both ends)."""
    for _ in range(max(3, calls // 10)):
        work.call(work.setup())
    clock.sync()
    began = time.perf_counter()
    for _ in range(calls):
        work.call(work.setup())
    clock.sync()
    return (time.perf_counter() - began) * 1e6 / calls

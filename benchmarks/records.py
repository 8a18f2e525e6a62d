"""Result records and their JSON form (results.json)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

OK, ERROR, OOM, SKIP, UNAVAILABLE = "ok", "error", "oom", "skip", "unavailable"


@dataclass
class Measurement:
    """One (op, mode, dtype, shape, provider) timing."""

    op: str
    mode: str
    dtype: str
    shape: str
    m: int
    n: int
    label: str
    provider: str
    status: str
    message: str = ""
    bytes: int = 0
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    min_ms: float | None = None
    iterations: int = 0
    dropped: int = 0
    """Timed calls left out: their host time outran the GPU sleep (benchmarks.timing)."""
    host_us: float | None = None
    """Host time to issue one call (its launch overhead at this shape)."""
    gbps: float | None = None
    pct_of_copy: float | None = None
    check: str = ""
    """Agreement with torch eager: "ok", "mismatch: ...", or "" when not checked."""
    wall_s: float = 0.0
    """Wall time spent on this measurement, warm-up (JIT, torch.compile) included."""


@dataclass
class HostOverhead:
    op: str
    mode: str
    dtype: str
    shape: str
    provider: str
    status: str
    us_per_call: float | None = None
    message: str = ""


@dataclass
class RunRecord:
    meta: dict[str, object] = field(default_factory=dict)
    copy: dict[str, object] = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    host_overhead: list[HostOverhead] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def copy_gbps(self) -> float | None:
        value = self.copy.get("gbps")
        return float(value) if isinstance(value, (int, float)) else None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        raw = json.loads(path.read_text())
        return cls(
            meta=raw["meta"],
            copy=raw["copy"],
            measurements=[Measurement(**item) for item in raw["measurements"]],
            host_overhead=[HostOverhead(**item) for item in raw["host_overhead"]],
            notes=raw["notes"],
        )

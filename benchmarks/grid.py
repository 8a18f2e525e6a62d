"""What to run: shapes, dtypes and the presets (full, --quick, --cpu-smoke)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    label: str = ""
    only_ops: tuple[str, ...] = ()
    """Empty: every op; otherwise only these ops (e.g. the vocabulary softmax row)."""

    @property
    def name(self) -> str:
        return f"{self.m}x{self.n}"

    def applies_to(self, op: str) -> bool:
        return not self.only_ops or op in self.only_ops


DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

GRID_SHAPES: tuple[Shape, ...] = tuple(
    Shape(m, n)
    for m, n in (
        (4096, 512),
        (4096, 1024),
        (4096, 4096),
        (4096, 8192),
        (4096, 16384),
        (4096, 32768),
        (4096, 65536),
        (16384, 4096),
        (8192, 8192),
        (32768, 256),
        (1024, 262144),
    )
)
LLM_SHAPES: tuple[Shape, ...] = (
    Shape(8192, 4096, "Llama-7B hidden"),
    Shape(16384, 5120, "Llama-13B hidden"),
    Shape(4096, 12288, "GPT-3 hidden"),
    Shape(2048, 128256, "Llama-3 vocab", only_ops=("softmax",)),
)
QUICK_SHAPES: tuple[Shape, ...] = (
    Shape(4096, 1024),
    Shape(8192, 4096, "Llama-7B hidden"),
    Shape(4096, 32768),
)
CPU_SMOKE_SHAPES: tuple[Shape, ...] = (
    Shape(64, 256),
    Shape(128, 1024),
    Shape(16, 4096),
)
HOST_OVERHEAD_SHAPES: tuple[Shape, ...] = (Shape(1, 256), Shape(32, 1024))


@dataclass(frozen=True)
class Preset:
    shapes: tuple[Shape, ...]
    default_dtypes: tuple[str, ...]
    rep_ms: float
    """Timed milliseconds per measurement (the iteration count follows from it)."""
    budget_s: float
    """No measurement starts after this many seconds; what was measured is still written."""
    copy_bytes: int
    host_shapes: tuple[Shape, ...]
    host_modes: tuple[str, ...]
    host_calls: int


PRESETS: dict[str, Preset] = {
    "full": Preset(
        shapes=GRID_SHAPES + LLM_SHAPES,
        default_dtypes=("bf16", "fp16", "fp32"),
        rep_ms=25.0,
        budget_s=480.0,
        copy_bytes=2**30,
        host_shapes=HOST_OVERHEAD_SHAPES,
        host_modes=("fwd", "fwd+bwd"),
        host_calls=300,
    ),
    "quick": Preset(
        shapes=QUICK_SHAPES,
        default_dtypes=("bf16",),
        rep_ms=10.0,
        budget_s=50.0,
        copy_bytes=2**30,
        host_shapes=HOST_OVERHEAD_SHAPES[:1],
        host_modes=("fwd",),
        host_calls=200,
    ),
    "cpu-smoke": Preset(
        shapes=CPU_SMOKE_SHAPES,
        default_dtypes=("bf16",),
        rep_ms=5.0,
        budget_s=600.0,
        copy_bytes=64 * 2**20,
        host_shapes=HOST_OVERHEAD_SHAPES,
        host_modes=("fwd", "fwd+bwd"),
        host_calls=50,
    ),
}

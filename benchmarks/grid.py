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
    host_overhead_shapes: tuple[Shape, ...]
    rep_ms: float
    host_calls: int
    copy_bytes: int
    budget_s: float


PRESETS: dict[str, Preset] = {
    "full": Preset(
        GRID_SHAPES + LLM_SHAPES,
        ("bf16", "fp16", "fp32"),
        HOST_OVERHEAD_SHAPES,
        25.0,
        300,
        2**30,
        500.0,
    ),
    "quick": Preset(QUICK_SHAPES, ("bf16",), HOST_OVERHEAD_SHAPES[:1], 10.0, 200, 2**30, 50.0),
    "cpu-smoke": Preset(
        CPU_SMOKE_SHAPES, ("bf16",), HOST_OVERHEAD_SHAPES, 5.0, 50, 64 * 2**20, 600.0
    ),
}

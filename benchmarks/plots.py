"""PNG plots, one message each, drawn to be read at the docs page's width (about 700 px):

- `<op>.png`: a training step (forward+backward) of each op, GB/s by shape, vjpforge against
  each peer, the copy bandwidth dashed (in the first 16-bit dtype the run measured);
- `summary.png`: vjpforge's speed-up over the fastest peer, one bar per op, mode and dtype;
- `host.png`: host time per call of a tiny forward, vjpforge and each peer.

matplotlib is needed only here, imported lazily by run.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.analysis import ResultIndex, gbps, summarize
from benchmarks.ops import MODE_TITLES
from benchmarks.providers import PROJECT_PROVIDER
from benchmarks.records import OK, HostOverhead, RunRecord

DPI = 150
#: inches: 1,200 px at DPI, shown at about 700 px, so 13-point text reads as 15 px or more
WIDTH = 8.0
STYLE = {
    "font.size": 13,
    "axes.titlesize": 15,
    "axes.labelsize": 13,
    "xtick.labelsize": 12,
    "ytick.labelsize": 12,
    "legend.fontsize": 12,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
#: one color per provider, vjpforge the only saturated one
COLORS = {PROJECT_PROVIDER: "#1f5fbf", "torch": "#9a9a9a", "compile": "#e08a2c",
          "liger": "#3a9a5b", "helion": "#8e5ea2"}
#: the mode and dtypes each op's plot shows (the first present)
OP_MODE = "fwd+bwd"
OP_DTYPES = ("bf16", "fp16", "fp32")


def _color(provider: str) -> str:
    return COLORS.get(provider, "#555555")


def _plot_op(index: ResultIndex, op: str, copy_gbps: float | None, path: Path) -> Path | None:
    groups = {(group[1], group[2]): group for group in index.groups() if group[0] == op}
    mode = OP_MODE if any(key[0] == OP_MODE for key in groups) else next(iter(groups))[0]
    dtype = next((d for d in OP_DTYPES if (mode, d) in groups),
                 next(key[1] for key in groups if key[0] == mode))
    rows = index.rows[groups[(mode, dtype)]]
    shapes = list(rows)
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(figsize=(WIDTH, 6.4))
        positions = range(len(shapes))
        for provider in index.shown_providers:
            values = [gbps(rows[shape], provider) or math.nan for shape in shapes]
            ours = provider == PROJECT_PROVIDER
            axes.plot(positions, values, marker="o", markersize=7 if ours else 5,
                      linewidth=3.2 if ours else 1.6, color=_color(provider), label=provider,
                      zorder=3 if ours else 2)
        if copy_gbps:
            axes.axhline(copy_gbps, color="black", linestyle="--", linewidth=1.2,
                         label="copy (100%)")
        axes.set_xticks(list(positions), [shape.split(" ")[0] for shape in shapes],
                        rotation=50, ha="right")
        axes.set_ylabel("GB/s (higher is faster)")
        axes.set_ylim(bottom=0)
        axes.set_title(f"{op}, {MODE_TITLES[mode]}, {dtype}: GB/s by shape (M×N)")
        axes.grid(axis="y", alpha=0.35)
        axes.legend(ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
        figure.tight_layout()
        figure.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(figure)
    return path


def _plot_summary(index: ResultIndex, path: Path) -> Path:
    groups = index.groups()
    values = [summarize(index.rows[group], index.peers).versus_best or math.nan
              for group in groups]
    labels = [f"{op} {MODE_TITLES[mode]} {dtype}" for op, mode, dtype in groups]
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(figsize=(WIDTH, 1.4 + 0.3 * len(groups)))
        positions = list(range(len(groups)))[::-1]  # the first group on top
        colors = [_color(PROJECT_PROVIDER) if value >= 1 else "#c0392b" for value in values]
        axes.barh(positions, values, color=colors, height=0.72)
        for position, value in zip(positions, values, strict=True):
            if not math.isnan(value):
                axes.text(value + 0.01, position, f"{value:.2f}×", va="center", fontsize=11)
        axes.axvline(1.0, color="black", linewidth=1.2)
        axes.set_yticks(positions, labels, fontsize=11)
        axes.set_xlim(0, max([v for v in values if not math.isnan(v)], default=1.0) * 1.15)
        axes.set_xlabel(f"{PROJECT_PROVIDER} ÷ fastest peer (geomean over shapes)")
        axes.set_title("Speed-up over the fastest peer (> 1: faster)")
        axes.grid(axis="x", alpha=0.35)
        figure.tight_layout()
        figure.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(figure)
    return path


def _plot_host(rows: list[HostOverhead], path: Path) -> Path | None:
    forward = [row for row in rows if row.mode == "fwd" and row.status == OK and row.us_per_call]
    if not forward:
        return None
    cases = list(dict.fromkeys((row.op, row.shape) for row in forward))
    providers = list(dict.fromkeys(row.provider for row in forward))
    width = 0.8 / len(providers)
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(figsize=(WIDTH, 5.2))
        for offset, provider in enumerate(providers):
            by_case = {(row.op, row.shape): row.us_per_call for row in forward
                       if row.provider == provider}
            values = [by_case.get(case) or math.nan for case in cases]
            axes.bar([i + offset * width for i in range(len(cases))], values, width=width,
                     label=provider, color=_color(provider))
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))],
                        [f"{op}\n{shape}" for op, shape in cases])
        axes.set_ylabel("µs per call (lower is better)")
        axes.set_title("Host time of a tiny forward call")
        axes.legend(ncols=len(providers), loc="upper center", bbox_to_anchor=(0.5, -0.2),
                    frameon=False)
        axes.grid(axis="y", alpha=0.35)
        figure.tight_layout()
        figure.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(figure)
    return path


def write_plots(record: RunRecord, out: Path) -> list[Path]:
    """At most len(ops) + 2 PNG files (5 for the full grid)."""
    index = ResultIndex(record.measurements)
    paths = [_plot_op(index, op, record.copy_gbps, out / f"{op}.png") for op in index.ops()]
    paths += [_plot_summary(index, out / "summary.png"),
              _plot_host(record.host_overhead, out / "host.png")]
    return [path for path in paths if path is not None]

"""PNG plots: one per op (modes × dtypes subplots) and one summary; matplotlib is needed
only here, imported lazily by run.py."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from benchmarks.analysis import ResultIndex, gbps, summarize
from benchmarks.ops import MODE_TITLES
from benchmarks.providers import PROJECT_PROVIDER
from benchmarks.records import OK, HostOverhead, RunRecord

DPI = 110


def _plot_group(
    axes: Axes, index: ResultIndex, group: tuple[str, str, str], copy_gbps: float | None
) -> None:
    rows = index.rows.get(group, {})
    shapes = list(rows)
    positions = range(len(shapes))
    for provider in index.shown_providers:
        values = [gbps(rows[shape], provider) or math.nan for shape in shapes]
        emphasis = (
            {"linewidth": 2.4, "zorder": 3} if provider == PROJECT_PROVIDER else {"linewidth": 1.2}
        )
        axes.plot(positions, values, marker="o", markersize=3.5, label=provider, **emphasis)
    if copy_gbps:
        axes.axhline(copy_gbps, color="grey", linestyle="--", linewidth=1, label="copy")
    axes.set_xticks(list(positions), shapes, rotation=60, ha="right", fontsize=7)
    axes.set_title(f"{MODE_TITLES[group[1]]} · {group[2]}", fontsize=9)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)


def _plot_op(index: ResultIndex, op: str, copy_gbps: float | None, path: Path) -> Path:
    groups = [group for group in index.groups() if group[0] == op]
    modes = list(dict.fromkeys(group[1] for group in groups))
    dtypes = list(dict.fromkeys(group[2] for group in groups))
    figure, grid = plt.subplots(
        len(modes),
        len(dtypes),
        figsize=(5.5 * len(dtypes), 3.6 * len(modes)),
        squeeze=False,
        sharey="row",
    )
    for row, mode in enumerate(modes):
        for column, dtype in enumerate(dtypes):
            _plot_group(grid[row][column], index, (op, mode, dtype), copy_gbps)
        grid[row][0].set_ylabel("GB/s")
    grid[0][0].legend(fontsize=7, loc="best")
    figure.suptitle(f"{op}: effective bandwidth by shape (M×N)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _plot_ratios(axes: Axes, index: ResultIndex) -> None:
    groups = index.groups()
    values = [summarize(index.rows[group], index.peers).versus_best or math.nan for group in groups]
    colors = ["tab:green" if value >= 1 else "tab:red" for value in values]
    axes.bar(range(len(groups)), values, color=colors)
    axes.axhline(1.0, color="black", linewidth=1)
    labels = [f"{op} {MODE_TITLES[mode]} {dtype}" for op, mode, dtype in groups]
    axes.set_xticks(range(len(groups)), labels, rotation=70, ha="right", fontsize=7)
    axes.set_ylabel(f"{PROJECT_PROVIDER} / best peer (geomean)")
    axes.set_title("Speed-up over the fastest peer", fontsize=10)
    axes.grid(axis="y", alpha=0.3)


def _plot_host_overhead(axes: Axes, rows: list[HostOverhead]) -> None:
    forward = [row for row in rows if row.mode == "fwd" and row.status == OK and row.us_per_call]
    cases = list(dict.fromkeys((row.op, row.shape) for row in forward))
    providers = list(dict.fromkeys(row.provider for row in forward))
    width = 0.8 / max(1, len(providers))
    for offset, provider in enumerate(providers):
        by_case = {
            (row.op, row.shape): row.us_per_call for row in forward if row.provider == provider
        }
        values = [by_case.get(case) or math.nan for case in cases]
        axes.bar(
            [i + offset * width for i in range(len(cases))],
            values,
            width=width,
            label=provider,
        )
    axes.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(cases))],
        [f"{op}\n{shape}" for op, shape in cases],
        fontsize=7,
    )
    axes.set_ylabel("µs per call (forward)")
    axes.set_title("Host overhead, tiny shapes", fontsize=10)
    axes.legend(fontsize=7)
    axes.grid(axis="y", alpha=0.3)


def _plot_summary(index: ResultIndex, record: RunRecord, path: Path) -> Path:
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2, 1]}
    )
    _plot_ratios(left, index)
    _plot_host_overhead(right, record.host_overhead)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def write_plots(record: RunRecord, out: Path) -> list[Path]:
    """At most len(ops) + 1 PNG files (4 for the full grid)."""
    index = ResultIndex(record.measurements)
    paths = [_plot_op(index, op, record.copy_gbps, out / f"{op}.png") for op in index.ops()]
    return [*paths, _plot_summary(index, record, out / "summary.png")]

"""benchmarks.md: header, summary, host overhead and one table per (op, mode, dtype)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

from benchmarks import timing
from benchmarks.analysis import (
    ResultIndex,
    Row,
    best_peer,
    gbps,
    geomean,
    speedup,
    speedup_over_best,
    summarize,
)
from benchmarks.ops import MODE_TITLES, bytes_moved, make_workload
from benchmarks.providers import BASELINE_PROVIDER, PROJECT_PROVIDER
from benchmarks.records import OK, UNAVAILABLE, HostOverhead, Measurement, RunRecord

MESSAGE_CHARS = 70
MISMATCH_MARK = " ⚠"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines + [""]


def _number(value: float | None, digits: int = 0, suffix: str = "") -> str:
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def _gbps(value: float | None) -> str:
    """Whole GB/s on a GPU; three significant digits for the CPU smoke test's tiny rates."""
    if value is None or value >= 100:
        return _number(value)
    return f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _status_text(status: str, message: str) -> str:
    """A failed cell; "n/a" for an unavailable provider (its reason is in the notes)."""
    if status == UNAVAILABLE:
        return "n/a"
    if not message:
        return status
    short = message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 1] + "…"
    return f"{status}: {short}"


def _cell(item: Measurement | None) -> str:
    if item is None:
        return "—"
    if item.status != OK:
        return _status_text(item.status, item.message)
    mark = MISMATCH_MARK if item.check.startswith("mismatch") else ""
    return f"{_gbps(item.gbps)} ({_number(item.pct_of_copy, suffix='%')}){mark}"


def _header(record: RunRecord) -> list[str]:
    meta = record.meta
    stop_reason = meta.get("stop_reason")
    stopped = f" — stopped early: {stop_reason}" if stop_reason else ""
    l2_mib = int(str(meta.get("l2_bytes", 0))) / 2**20
    copy_gib = int(str(record.copy.get("buffer_bytes", 0))) / 2**30
    device = (
        f"{meta.get('device_name')}, {meta.get('sm_count')} SMs, compute capability "
        f"{meta.get('compute_capability')}, {meta.get('memory_gib')} GiB, L2 {l2_mib:.0f} MiB"
    )
    software = (
        f"torch {meta.get('torch')} (CUDA {meta.get('cuda_runtime')}), "
        f"triton {meta.get('triton')}, liger-kernel {meta.get('liger_kernel')}, "
        f"helion {meta.get('helion', 'not recorded')}, "
        f"Python {meta.get('python')}, vjpforge {meta.get('vjpforge_git')}"
    )
    copy = (
        f"**{_gbps(record.copy_gbps)} GB/s** — `dst.copy_(src)` of {copy_gib:.2f} GiB, "
        "read + write bytes counted"
    )
    run = (
        f"preset `{meta.get('preset')}`, {meta.get('completed_measurements')}/"
        f"{meta.get('planned_measurements')} measurements, {meta.get('elapsed_s')} s, "
        f"{meta.get('rep_ms')} ms timed per measurement{stopped}"
    )
    legend = (
        "Cells: effective bandwidth in GB/s (bytes model below ÷ median time) and, in "
        f"brackets, its share of the copy bandwidth.{MISMATCH_MARK}: output or input "
        "gradient differs from torch eager beyond tolerance (results.json `check`)."
    )
    return [
        "# vjpforge benchmarks",
        "",
        f"- **Device**: {device}",
        f"- **Software**: {software}",
        f"- **Date**: {meta.get('date')} on {meta.get('hostname')}",
        f"- **Command**: `{meta.get('command')}`",
        f"- **Copy bandwidth** (the 100% reference): {copy}",
        f"- **Run**: {run}",
        "",
        legend,
        "",
    ]


def _notes(record: RunRecord) -> list[str]:
    if not record.notes:
        return []
    return ["## Notes", "", *(f"- {note}" for note in record.notes), ""]


def _summary(index: ResultIndex) -> list[str]:
    peers = index.peers
    header = ["op", "mode", "dtype", f"{PROJECT_PROVIDER} GB/s", "% of copy"]
    header += [f"vs {peer}" for peer in peers] + ["vs best peer", "wins"]
    rows = []
    for group in index.groups():
        summary = summarize(index.rows[group], peers)
        rows.append(
            [
                *group,
                _gbps(summary.project_gbps),
                _number(summary.project_pct_of_copy, suffix="%"),
                *(_ratio(summary.versus[peer]) for peer in peers),
                _ratio(summary.versus_best),
                f"{summary.wins}/{summary.compared}",
            ]
        )
    intro = (
        f"Geometric means over shapes. `vs X` = {PROJECT_PROVIDER} GB/s ÷ X GB/s "
        f"(> 1: {PROJECT_PROVIDER} faster), over the shapes both ran; `wins` = shapes "
        "where it is at least as fast as the best peer."
    )
    return ["## Summary", "", intro, "", *_table(header, rows)]


def _host_overhead(rows: list[HostOverhead]) -> list[str]:
    if not rows:
        return []
    providers = list(dict.fromkeys(row.provider for row in rows if row.status != UNAVAILABLE))
    cells: dict[tuple[str, str, str, str], dict[str, str]] = {}
    for row in rows:
        value = (
            _number(row.us_per_call, 1)
            if row.status == OK
            else _status_text(row.status, row.message)
        )
        cells.setdefault((row.op, row.dtype, row.shape, row.mode), {})[row.provider] = value
    table = [
        [op, dtype, shape, MODE_TITLES[mode], *(by.get(p, "—") for p in providers)]
        for (op, dtype, shape, mode), by in cells.items()
    ]
    intro = (
        "Microseconds per call, wall clock over many back-to-back calls with a device sync "
        "at both ends: for these tiny shapes this is the host (launch) cost."
    )
    return [
        "## Host overhead (µs per call)",
        "",
        intro,
        "",
        *_table(["op", "dtype", "shape", "mode", *providers], table),
    ]


def _shape_cell(shape: str, label: str) -> str:
    return f"{shape} ({label})" if label else shape


def _comparison_cells(row: Row) -> list[str]:
    peer = best_peer(row)
    over_best = speedup_over_best(row)
    best = f"{_ratio(over_best)} ({peer})" if over_best is not None else "—"
    return [best, _ratio(speedup(row, BASELINE_PROVIDER))]


def _group_table(index: ResultIndex, group: tuple[str, str, str]) -> list[str]:
    op, mode, dtype = group
    providers = index.shown_providers
    rows = index.rows[group]
    body = [
        [
            _shape_cell(shape, index.labels[shape]),
            *(_cell(row.get(p)) for p in providers),
            *_comparison_cells(row),
        ]
        for shape, row in rows.items()
    ]
    ratios_best = geomean(ratio for row in rows.values() if (ratio := speedup_over_best(row)))
    ratios_torch = geomean(
        ratio for row in rows.values() if (ratio := speedup(row, BASELINE_PROVIDER))
    )
    geo = [geomean(value for row in rows.values() if (value := gbps(row, p))) for p in providers]
    body.append(
        [
            "**geomean**",
            *(_gbps(value) for value in geo),
            _ratio(ratios_best),
            _ratio(ratios_torch),
        ]
    )
    header = ["M×N", *(f"{p} GB/s (% copy)" for p in providers)]
    header += [
        f"{PROJECT_PROVIDER} / best peer",
        f"{PROJECT_PROVIDER} / {BASELINE_PROVIDER}",
    ]
    return [f"### {op} — {MODE_TITLES[mode]} — {dtype}", "", *_table(header, body)]


def _text_block(title: str, text: str | None) -> list[str]:
    return [f"**{title}**", "", "```text", inspect.cleandoc(text or ""), "```", ""]


def _method() -> list[str]:
    return [
        "## Method",
        "",
        *_text_block("Bytes model (benchmarks.ops.bytes_moved)", bytes_moved.__doc__),
        *_text_block("Modes (benchmarks.ops.make_workload)", make_workload.__doc__),
        *_text_block("Timing (benchmarks.timing)", timing.__doc__),
    ]


def render_markdown(record: RunRecord) -> str:
    index = ResultIndex(record.measurements)
    lines = (
        _header(record) + _notes(record) + _summary(index) + _host_overhead(record.host_overhead)
    )
    for op in index.ops():
        lines += [f"## {op}", ""]
        for group in index.groups():
            if group[0] == op:
                lines += _group_table(index, group)
    return "\n".join(lines + _method())


def write_markdown(record: RunRecord, path: Path) -> None:
    path.write_text(render_markdown(record))

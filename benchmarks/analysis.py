"""Grouping results and comparing vjpforge with its peers (shared by report and plots)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.ops import MODES
from benchmarks.providers import PROJECT_PROVIDER
from benchmarks.records import OK, UNAVAILABLE, Measurement

Group = tuple[str, str, str]
"""(op, mode, dtype)."""
Row = dict[str, Measurement]
"""provider -> measurement, for one shape of one group."""


def geomean(values: Iterable[float]) -> float | None:
    logs = [math.log(value) for value in values if value > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def gbps(row: Row, provider: str) -> float | None:
    measurement = row.get(provider)
    return measurement.gbps if measurement is not None and measurement.status == OK else None


def speedup(row: Row, peer: str) -> float | None:
    """vjpforge GB/s over ``peer`` GB/s (> 1: vjpforge is faster)."""
    ours, theirs = gbps(row, PROJECT_PROVIDER), gbps(row, peer)
    return ours / theirs if ours and theirs else None


def best_peer(row: Row) -> str | None:
    """The fastest provider other than vjpforge on this shape."""
    peers = [
        (value, name) for name in row if name != PROJECT_PROVIDER and (value := gbps(row, name))
    ]
    return max(peers)[1] if peers else None


def speedup_over_best(row: Row) -> float | None:
    peer = best_peer(row)
    return speedup(row, peer) if peer else None


class ResultIndex:
    """Measurements by group and shape, in the order they were taken."""

    def __init__(self, measurements: Iterable[Measurement]) -> None:
        self.rows: dict[Group, dict[str, Row]] = {}
        self.labels: dict[str, str] = {}
        self.providers: list[str] = []
        self._unavailable_everywhere: dict[str, bool] = {}
        for item in measurements:
            group = (item.op, item.mode, item.dtype)
            self.rows.setdefault(group, {}).setdefault(item.shape, {})[item.provider] = item
            self.labels[item.shape] = item.label
            if item.provider not in self.providers:
                self.providers.append(item.provider)
            previous = self._unavailable_everywhere.get(item.provider, True)
            self._unavailable_everywhere[item.provider] = previous and item.status == UNAVAILABLE

    @property
    def shown_providers(self) -> list[str]:
        """Providers that ran somewhere (a provider that never loaded gets no column)."""
        return [name for name in self.providers if not self._unavailable_everywhere[name]]

    @property
    def peers(self) -> list[str]:
        return [name for name in self.shown_providers if name != PROJECT_PROVIDER]

    def groups(self) -> list[Group]:
        """Grouped by op (in order of appearance), then mode (forward first), then dtype."""
        op_rank = {op: rank for rank, op in enumerate(self.ops())}
        mode_rank = {mode: rank for rank, mode in enumerate(MODES)}
        first_seen = {group: rank for rank, group in enumerate(self.rows)}
        return sorted(
            self.rows,
            key=lambda group: (
                op_rank[group[0]],
                mode_rank.get(group[1], 99),
                first_seen[group],
            ),
        )

    def ops(self) -> list[str]:
        return list(dict.fromkeys(group[0] for group in self.rows))

    def dtypes(self) -> list[str]:
        return list(dict.fromkeys(group[2] for group in self.rows))


@dataclass(frozen=True)
class GroupSummary:
    """Geometric means over the shapes of one (op, mode, dtype)."""

    project_gbps: float | None
    project_pct_of_copy: float | None
    versus: dict[str, float | None]
    versus_best: float | None
    wins: int
    compared: int


def summarize(rows: dict[str, Row], peers: list[str]) -> GroupSummary:
    ours = [row[PROJECT_PROVIDER] for row in rows.values() if gbps(row, PROJECT_PROVIDER)]
    over_best = [ratio for row in rows.values() if (ratio := speedup_over_best(row))]
    return GroupSummary(
        project_gbps=geomean(item.gbps or 0.0 for item in ours),
        project_pct_of_copy=geomean(item.pct_of_copy or 0.0 for item in ours),
        versus={
            peer: geomean(ratio for row in rows.values() if (ratio := speedup(row, peer)))
            for peer in peers
        },
        versus_best=geomean(over_best),
        wins=sum(ratio >= 1.0 for ratio in over_best),
        compared=len(over_best),
    )

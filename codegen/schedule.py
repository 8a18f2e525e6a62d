"""The schedule table a generated module is emitted with: HOW its kernels walk their rows.

`codegen/schedule_table.json` (written by `python -m benchmarks.tune --write-table` from
measurements on a GPU) holds, per op, the fastest configurations measured per kernel kind and
row width, and the schedule rules' constants that the op measured faster away from their
defaults. The rules themselves, and what they do where the table has nothing, live in the
runtime (`codegen/runtime/schedules.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from codegen.runtime.schedules import Constants

MEASURED_TABLE = Path(__file__).with_name("schedule_table.json")
_CONSTANT_NAMES = {f.name for f in dataclasses.fields(Constants)}
#: what the table's "dispatch" entries may set (`codegen.runtime.dispatch.Dispatch` arguments)
DISPATCH_FIELDS = ("eager_below", "compiled", "own_below", "infer_below")


class MissingTable(FileNotFoundError):
    """The measured schedule table is not where the compiler reads it."""


def load_measured(path: Path | None = None) -> dict:
    """The measured table: "ops" (per op, kernel kind and row width, [rows, warps, programs an
    SM, stages, columns a looped step, one sweep, form]: `codegen.runtime.schedules.Measured`,
    trailing values optional), "borrow" (op -> the op whose entries it uses where it has none),
    "constants" (op -> the rules' constants it sets)."""
    path = path or MEASURED_TABLE  # looked up per call: tests point it elsewhere
    if not path.is_file():
        # without it every kernel would take the rules' defaults: different generated files,
        # slower kernels, and nothing to say so
        raise MissingTable(f"the measured schedule table {path} is missing: derive needs it "
                           f"to write the kernels it ships (reinstall vjpforge, or restore it "
                           f"with `git checkout -- codegen/{path.name}`)")
    return json.loads(path.read_text())


def write_measured(table: dict, path: Path | None = None) -> Path:
    """Write the measured table (to `MEASURED_TABLE` by default) as JSON, each innermost list on
    one line."""
    path = path or MEASURED_TABLE
    text = json.dumps(table, indent=1)
    text = re.sub(r"\[\s+([^\[\]]*?)\s+\]",
                  lambda match: "[" + " ".join(match.group(1).split()) + "]", text)
    path.write_text(text + "\n")
    return path


@dataclass(frozen=True)
class ScheduleTable:
    """The measured per-op table, as the generated modules take it."""

    measured_table: dict = field(default_factory=load_measured, compare=False, repr=False)

    def measured(self, op: str) -> list[tuple[str, int, tuple[int, ...]]]:
        """(kind, block_n, (rows, warps, programs per SM, stages, columns per looped step, one
        sweep, form)) of one op, sorted; an op listed under "borrow" uses the measurements of
        the op it names where it has none of its own (per kind and width). Missing trailing
        values take their defaults: a 0 step (whole rows), -1 one sweep (the rule decides), form
        1 (masks dropped where the blocks tile, the row-block loop only where needed)."""
        ops = self.measured_table["ops"]
        entries = {}
        for source in (self.measured_table["borrow"].get(op), op):
            for kind, by_width in ops.get(source, {}).items():
                entries.update({(kind, int(block_n)): config
                                for block_n, config in by_width.items()})
        defaults = (0, 0, 0, 0, 0, -1, 1)
        return sorted((kind, block_n, (*config, *defaults[len(config):]))
                      for (kind, block_n), config in entries.items())

    def constants(self, op: str) -> dict[str, int]:
        """The rules' constants one op sets (`Constants` field -> value), sorted by name."""
        own = self.measured_table.get("constants", {}).get(op, {})
        unknown = sorted(set(own) - _CONSTANT_NAMES)
        if unknown:
            raise ValueError(f"{MEASURED_TABLE.name}: constants of {op!r}: unknown {unknown}; "
                             f"expected fields of codegen.runtime.schedules.Constants")
        return dict(sorted(own.items()))


    def dispatch(self, op: str) -> dict[str, object]:
        """When one op runs torch's expression instead of its kernels
        (`codegen.runtime.dispatch.Dispatch` arguments: `eager_below`, `compiled`,
        `own_below`, `infer_below`), as measured by `python -m benchmarks.crossover --write`
        (`--routes` for `own_below`, `--inference` for `infer_below`); empty where nothing was
        measured."""
        own = self.measured_table.get("dispatch", {}).get(op, {})
        unknown = sorted(set(own) - set(DISPATCH_FIELDS))
        if unknown:
            raise ValueError(f"{MEASURED_TABLE.name}: dispatch of {op!r}: unknown {unknown}; "
                             f"expected {', '.join(DISPATCH_FIELDS)}")
        return dict(sorted(own.items()))


_DEFAULT: list[ScheduleTable] = []


def default_table() -> ScheduleTable:
    """The shipped measured table, read once, when first needed (importing the compiler does
    not need it)."""
    if not _DEFAULT:
        _DEFAULT.append(ScheduleTable())
    return _DEFAULT[0]

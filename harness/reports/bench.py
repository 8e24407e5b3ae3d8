"""Benchmark tables: what the run's bench items measured, for the terminal and the report's ``benchmarks`` section.

A bench item times the arms of its own case and records them here; rows merge by (table, case), so a run shows
exactly what it selected (``pytest -m bench -k cogview4`` measures and prints cogview4's rows only) and nothing is
timed twice. Every row can hold four arms, in seconds (the best of its rounds):

- ``fast``: the fast path as the harness runs it;
- ``stock``: its stock twin (what the fast path replaces);
- ``raw``: the limit the model itself gives the fast path: the model's (VAE's, kernel's) own calls that the fast
  path makes, replayed back to back without the harness around them;
- ``raw_stock``: the same for the stock path, where the stock time carries harness work of its own.

and the ideal fast/stock (1/B, 1/S, 1/W). The ratios say how much of the gap to the ideal is the model's and how
much the harness's: ``fast/raw`` is the harness's whole cost over the model's own calls, and ``vs raw`` compares
the fast path's speed-up with the model's own (fast/stock over raw/raw stock). Nothing here is asserted on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARMS", "BenchLog", "BenchRow", "BenchTable"]

ARMS = ("fast", "stock", "raw", "raw_stock")
_RATIO_LABELS = {"fast_over_stock": "fast/stock", "ideal": "ideal", "raw_over_stock": "raw ratio",
                 "fast_over_raw": "fast/raw", "vs_raw": "vs raw"}
Value = float | int | str | None


def _quotient(top: float | None, bottom: float | None) -> float | None:
    if top is None or bottom is None or not bottom:
        return None
    return top / bottom


@dataclass
class BenchRow:
    """One case of one table: the arms measured so far (seconds), the ideal fast/stock, and named extras."""

    case: dict[str, Value]
    seconds: dict[str, float] = field(default_factory=dict)
    ideal: float | None = None
    extra: dict[str, Value] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        """fast/stock; the model's own (raw over raw stock, or over stock where the stock arm runs no harness of
        its own); fast/raw; and the fast path's speed-up against the model's (``vs raw``, 1.0 = as good)."""
        fast, stock = self.seconds.get("fast"), self.seconds.get("stock")
        raw = self.seconds.get("raw")
        fast_over_stock = _quotient(fast, stock)
        raw_over_stock = _quotient(raw, self.seconds.get("raw_stock", stock))
        return {"fast_over_stock": fast_over_stock, "ideal": self.ideal, "raw_over_stock": raw_over_stock,
                "fast_over_raw": _quotient(fast, raw), "vs_raw": _quotient(fast_over_stock, raw_over_stock)}

    def to_json(self) -> dict[str, Any]:
        return {"case": dict(self.case), **{f"{arm}_s": self.seconds.get(arm) for arm in ARMS},
                "ideal": self.ideal, "ratios": {k: v for k, v in self.ratios().items() if k != "ideal"},
                "extra": dict(self.extra)}


@dataclass
class BenchTable:
    """A table of one path (or one aspect of it): its title says what the arms are, its rows what was run."""

    name: str
    title: str
    rows: dict[tuple[tuple[str, Value], ...], BenchRow] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.name.split(".", 1)[0]

    def lines(self) -> list[str]:
        """The table as aligned text: case columns, then the arms in ms and the ratios measured, then extras;
        a column no row has is left out, a cell a row lacks reads "-"."""
        rows = list(self.rows.values())
        case_keys = list(dict.fromkeys(k for row in rows for k in row.case))
        arms = [arm for arm in ARMS if any(arm in row.seconds for row in rows)]
        ratios = [key for key in _RATIO_LABELS if any(row.ratios()[key] is not None for row in rows)]
        extras = list(dict.fromkeys(k for row in rows for k in row.extra))
        header = [*case_keys, *(f"{arm.replace('_', ' ')} ms" for arm in arms),
                  *(_RATIO_LABELS[key] for key in ratios), *extras]
        body = []
        for row in rows:
            measured = row.ratios()
            body.append([*(_cell(row.case.get(k)) for k in case_keys),
                         *(_cell(row.seconds[arm] * 1e3 if arm in row.seconds else None, 2) for arm in arms),
                         *(_cell(measured[key], 3) for key in ratios),
                         *(_cell(row.extra.get(k), 3) for k in extras)])
        widths = [max(len(text) for text in column) for column in zip(header, *body, strict=True)]
        return [self.title, "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
                *("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in body)]


def _cell(value: Value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


class BenchLog:
    """The run's measurements, table by table, in the order the items recorded them."""

    def __init__(self) -> None:
        self.tables: dict[str, BenchTable] = {}

    def __bool__(self) -> bool:
        return any(table.rows for table in self.tables.values())

    def record(self, table: str, title: str, case: Mapping[str, Value], *, ideal: float | None = None,
               extra: Mapping[str, Value] | None = None, **seconds: float) -> BenchRow:
        """Merge what one item measured into its row (``seconds`` by arm: fast, stock, raw, raw_stock)."""
        unknown = sorted(set(seconds) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown bench arms {unknown}; the arms are {ARMS}")
        entry = self.tables.setdefault(table, BenchTable(table, title))
        entry.title = title
        key = tuple(case.items())
        row = entry.rows.setdefault(key, BenchRow(dict(case)))
        row.seconds.update({arm: float(value) for arm, value in seconds.items()})
        if ideal is not None:
            row.ideal = float(ideal)
        row.extra.update(extra or {})
        return row

    def to_json(self) -> dict[str, Any]:
        """``{table: {"path", "title", "rows": [{"case", "fast_s", "stock_s", "raw_s", "raw_stock_s", "ideal",
        "ratios": {"fast_over_stock", "raw_over_stock", "fast_over_raw", "vs_raw"}, "extra"}]}}``."""
        return {name: {"path": table.path, "title": table.title, "rows": [row.to_json() for row in table.rows.values()]}
                for name, table in self.tables.items() if table.rows}

    def lines(self) -> list[str]:
        out: list[str] = []
        for table in self.tables.values():
            if table.rows:
                out += [*([""] if out else []), *table.lines()]
        return out

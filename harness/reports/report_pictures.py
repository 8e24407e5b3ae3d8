"""Pictures of a parity report: per path, every check's margin, every ablation's kill margins, the growth curves.

A reviewer reads a few hundred rows of numbers faster as pictures: where each check sits against its tolerance
(``margin = error / tolerance`` on a log axis, with the stock floor's stated minimum and ceiling marked as
fractions of the bound they set), how far each ablation overshoots the checks it kills, and how the fast path's
per-step error grows against the stock control's over the steps of replay and ar.

Three renderings, because a picture has to show up where the report is read:

- SVG, drawn with matplotlib (the optional ``report`` extra: a plotting library made for log axes, markers and
  legends, rather than a hand-written SVG writer to maintain), inside the HTML report as ``data:`` URIs so the
  file stands alone as a CI artifact, opened in any browser. Rendering is byte-for-byte reproducible: a fixed
  ``svg.hashsalt`` (element ids), no ``Date`` metadata, text kept as text (no glyph outlines), and one order.
- Mermaid ``xychart-beta`` blocks in the markdown report: GitHub renders them itself, in a job summary, a
  pull request comment or a file. Neither a ``data:`` URI image nor inline ``<svg>`` survives GitHub's markdown
  sanitizer, and a job summary has no folder beside it for a relative image path to reach, so SVG files next to
  the markdown would show as broken images exactly where reviewers look.
- Plain text (log-scaled bars in a code block), the fallback that always renders: in the markdown report, and in
  the HTML report when matplotlib is not installed.

Standard library only until an SVG is drawn: scripts/compare-reports uses this module wherever reports land.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Scale", "available", "check_rows", "growth_curves", "html_document", "kill_rows", "markdown_section",
           "mermaid_section", "moves_svg", "svgs", "text_section"]

PASS_COLOR, FAIL_COLOR, SKIP_COLOR = "#2a9d4b", "#d62728", "#8c8c8c"
MIN_COLOR, CEILING_COLOR, MEASURED_COLOR = "#1f77b4", "#ff7f0e", "#555555"
SVG_RC = {"svg.hashsalt": "fastpath-parity", "svg.fonttype": "none", "font.family": "DejaVu Sans",
          "font.size": 8.0, "axes.titlesize": 9.0}
LOWEST_DECADE, HIGHEST_DECADE = -12, 6  # margins beyond these are drawn at the edge, their value still printed
TEXT_COLUMNS_PER_DECADE = 3


def available() -> bool:
    """Whether SVG pictures can be drawn here (matplotlib, the ``report`` extra, is importable)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------- what is drawn
def _number(value: Any) -> float | None:
    """A margin or metric as a float: "inf" and "nan" (how JSON carries them) included; None if not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return None


@dataclass(frozen=True)
class Scale:
    """Decades lo..hi of a log axis, with gutters for what a log axis cannot hold: an exact 0 and no number on the
    left, infinity and the non-numeric kill modes on the right. Positions are log10 of the value."""

    lo: int
    hi: int

    @classmethod
    def spanning(cls, values: Iterable[float]) -> Scale:
        logs = [math.log10(v) for v in values if math.isfinite(v) and v > 0]
        lo = math.floor(min(logs)) if logs else -6
        hi = math.ceil(max(logs)) if logs else 1
        return cls(max(LOWEST_DECADE, min(lo, -1)), min(HIGHEST_DECADE, max(hi, 1)))

    def at(self, value: float) -> float:
        if value == 0:
            return self.lo - 1.0
        if not math.isfinite(value):
            return self.hi + 1.0
        return min(max(math.log10(value), float(self.lo)), float(self.hi))

    def gutter(self, name: str) -> float:
        """Where a named gutter sits: "0" and "none" left of the axis, "inf" and the kill modes right of it."""
        left = {"0": 1, "none": 2}
        right = {"inf": 1, "fact": 2, "raises": 3, "hang": 4}
        return self.lo - left[name] if name in left else self.hi + right[name]


@dataclass(frozen=True)
class CheckRow:
    """One check as drawn: ``where`` is a number (its margin) or a gutter name ("0", "none", "inf")."""

    label: str
    status: str
    where: float | str
    marks: dict[str, float] = field(default_factory=dict)  # floor_minimum / floor_ceiling / floor_measured per bound


@dataclass(frozen=True)
class KillRow:
    """One ablation as drawn: each claimed pair as (its status, a margin or a gutter name)."""

    label: str
    status: str
    kills: tuple[tuple[str, float | str], ...]


def _short(name: str, path: str) -> str:
    return name[len(path) + 1:] if name.startswith(path + ".") else name


def _paths(report: Mapping[str, Any]) -> list[str]:
    """The paths in the report, in its own order."""
    seen = [row.get("path") or str(row.get("id", "")).partition(".")[0] for row in report.get("checks", [])]
    seen += [row.get("path") or str(row.get("name", "")).partition(".")[0] for row in report.get("ablations", [])]
    return list(dict.fromkeys(p for p in seen if p))


def _check_where(row: Mapping[str, Any]) -> float | str:
    margin = _number(row.get("margin"))
    if margin is None:
        return "inf" if row.get("status") == "failed" else "none"  # a raise or a failed fact; or facts that held
    if margin == 0:
        return "0"
    if not math.isfinite(margin):
        return "inf"
    return margin


def _marks(row: Mapping[str, Any]) -> dict[str, float]:
    """The floor's minimum, ceiling and measurement as fractions of the bound they set (``tolerance_bound``, which
    a verdict records beside them when it holds its tolerance to the floor), so they share the margin axis. A check
    that records a floor without that bound (its headline is another quantity: a bf16 KL against a log-prob
    floor) gets no marks: a fraction of an unrelated tolerance would mislead."""
    metrics = row.get("metrics") or {}
    bound = _number(metrics.get("tolerance_bound"))
    if bound is None or not (bound > 0 and math.isfinite(bound)):
        return {}
    marks = {}
    for name in ("floor_minimum", "floor_ceiling", "floor_measured"):
        value = _number(metrics.get(name))
        if value is not None and value > 0 and math.isfinite(value):
            marks[name] = value / bound
    return marks


def check_rows(report: Mapping[str, Any], path: str) -> list[CheckRow]:
    """The checks of ``path`` that ran (skipped ones hold no margin), in report order."""
    return [CheckRow(_short(str(row["id"]), path), str(row.get("status")), _check_where(row), _marks(row))
            for row in report.get("checks", [])
            if (row.get("path") or str(row["id"]).partition(".")[0]) == path and row.get("status") != "skipped"]


def _kill_where(kill: Mapping[str, Any]) -> float | str:
    if kill.get("status") in ("failed", "skipped"):
        return "none"
    margin = _number(kill.get("margin"))
    mode = str(kill.get("mode") or "")
    if kill.get("killed") and mode in ("fact", "raises", "hang"):
        return mode
    if margin is None:
        return "none"
    if margin == 0:
        return "0"
    return "inf" if not math.isfinite(margin) else margin


def kill_rows(report: Mapping[str, Any], path: str) -> list[KillRow]:
    """The ablations of ``path``, each with every pair it claims."""
    return [KillRow(_short(str(item["name"]), path), str(item.get("status")),
                    tuple((str(kill.get("status")), _kill_where(kill)) for kill in item.get("kills", [])))
            for item in report.get("ablations", [])
            if (item.get("path") or str(item["name"]).partition(".")[0]) == path]


@dataclass(frozen=True)
class Growth:
    """A per-step error curve of the fast path against the stock control's over the same steps."""

    label: str
    fast: tuple[float, ...]
    stock: tuple[float, ...]
    margin: float | None


def growth_curves(report: Mapping[str, Any], path: str) -> list[Growth]:
    """Every pair of per-step curves a check of ``path`` recorded: ``<x>error_curve`` (fast vs stock) beside
    ``<x>floor_curve`` (the stock control), of one length."""
    found = []
    for row in report.get("checks", []):
        if (row.get("path") or str(row["id"]).partition(".")[0]) != path:
            continue
        metrics = row.get("metrics") or {}
        for key in sorted(k for k in metrics if k.endswith("error_curve")):
            prefix = key[: -len("error_curve")]
            fast, stock = metrics.get(key), metrics.get(prefix + "floor_curve")
            if not (isinstance(fast, list) and isinstance(stock, list) and len(fast) == len(stock) and fast):
                continue
            values = [_number(v) for v in (*fast, *stock)]
            if any(v is None for v in values):
                continue
            label = _short(str(row["id"]), path) + (f" ({prefix.rstrip('_')})" if prefix else "")
            found.append(Growth(label, tuple(values[:len(fast)]), tuple(values[len(fast):]),
                                _number(row.get("margin"))))
    return found


def _scale(report: Mapping[str, Any], kills: bool = False) -> Scale:
    """One scale for the checks (or the kills) of every path of a report, so pictures compare at a glance."""
    values: list[float] = []
    for path in _paths(report):
        if kills:
            values += [where for item in kill_rows(report, path) for _, where in item.kills if isinstance(where, float)]
            continue
        for row in check_rows(report, path):
            values += [row.where] if isinstance(row.where, float) else []
            values += list(row.marks.values())
    return Scale.spanning(values)


def _fmt(value: float) -> str:
    return f"{value:.2e}"


def _where_text(where: float | str) -> str:
    return _fmt(where) if isinstance(where, float) else {"none": "-", "0": "0"}.get(where, where)


# ------------------------------------------------------------------------------------------------- plain text
def _bar(scale: Scale, where: float | str) -> str:
    """A log-scaled bar: "#" up to the value, "|" at the tolerance (margin 1), "!" past it."""
    columns = (scale.hi - scale.lo) * TEXT_COLUMNS_PER_DECADE
    tolerance = -scale.lo * TEXT_COLUMNS_PER_DECADE
    if isinstance(where, str):
        filled = columns if where == "inf" else 0
    else:
        filled = round((scale.at(where) - scale.lo) * TEXT_COLUMNS_PER_DECADE)
    cells = []
    for column in range(columns):
        if column == tolerance:
            cells.append("|")
        elif column < filled:
            cells.append("!" if column > tolerance else "#")
        else:
            cells.append(" ")
    return "".join(cells) + (">" if where == "inf" else " ")


def _curve_text(values: Sequence[float], lo: float, hi: float) -> str:
    """One character per step, darker for a larger log10 value within [lo, hi]."""
    shades = " .:-=+*#%@"
    span = (hi - lo) or 1.0
    return "".join(shades[min(len(shades) - 1, max(0, round((math.log10(v) - lo) / span * (len(shades) - 1))))]
                   if v > 0 and math.isfinite(v) else "?" for v in values)


def text_section(report: Mapping[str, Any]) -> str:
    """Every picture as plain text: per path, a log bar per check, each ablation's kill margins, the growth curves."""
    scale = _scale(report)
    lines = [f"margin = error / tolerance, log scale 1e{scale.lo} .. 1e{scale.hi} (3 columns a decade): "
             '"#" up to the margin, "|" the tolerance, "!" past it; 0 = exact, - = facts only, '
             "inf = infinite or a failure with no number"]
    for path in _paths(report):
        rows = check_rows(report, path)
        if rows:
            width = max(len(r.label) for r in rows)
            lines += ["", f"{path}: {len(rows)} checks"]
            lines += [f"  {r.label.ljust(width)} {_bar(scale, r.where)} {_where_text(r.where):>9} "
                      f"{'PASS' if r.status == 'passed' else r.status.upper()}" for r in rows]
        kills = kill_rows(report, path)
        if kills:
            width = max(len(k.label) for k in kills)
            lines += ["", f"{path}: {len(kills)} ablations, kill margin of every claimed check (a kill must exceed 1)"]
            for item in kills:
                shown = ", ".join(_where_text(where) + ("" if status == "killed" else f" ({status.upper()})")
                                  for status, where in item.kills)
                lines.append(f"  {item.label.ljust(width)} {item.status.upper():8} {shown}")
        for curve in growth_curves(report, path):
            values = [v for v in (*curve.fast, *curve.stock) if v > 0 and math.isfinite(v)]
            lo, hi = (math.log10(min(values)), math.log10(max(values))) if values else (0.0, 1.0)
            lines += ["", f"{path} growth {curve.label}: per-step error, log scale {min(values or [0]):.1e} .. "
                          f"{max(values or [0]):.1e} (' ' lowest .. '@' highest)",
                      f"  fast vs stock   [{_curve_text(curve.fast, lo, hi)}]",
                      f"  stock control   [{_curve_text(curve.stock, lo, hi)}]"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- mermaid
def _bins(scale: Scale, kills: bool) -> list[str]:
    """Histogram bins: a gutter each, then one per decade (named by its lower edge)."""
    decades = [f"1e{k}" for k in range(scale.lo, scale.hi)]
    return ["none", "0", *decades, "inf", *(("fact", "raises", "hang") if kills else ())]


def _bin_of(scale: Scale, where: float | str) -> str:
    if isinstance(where, str):
        return where
    return f"1e{min(max(math.floor(math.log10(where)), scale.lo), scale.hi - 1)}"


def _histogram(scale: Scale, wheres: Iterable[float | str], kills: bool) -> tuple[list[str], list[int]]:
    names = _bins(scale, kills)
    counts = dict.fromkeys(names, 0)
    for where in wheres:
        counts[_bin_of(scale, where)] = counts.get(_bin_of(scale, where), 0) + 1
    return names, [counts[n] for n in names]


def _xychart(title: str, x: Sequence[str], y_title: str, series: Sequence[tuple[str, Sequence[float]]],
             tight: bool = False) -> list[str]:
    """An xychart-beta block; ``tight`` fits the y axis to the values (log10 curves), else it starts at 0."""
    values = [v for _, data in series for v in data]
    low, high = min([0.0, *values]), max([1.0, *values])
    if tight and values:
        pad = max(0.05, 0.1 * (max(values) - min(values)))
        low, high = round(min(values) - pad, 2), round(max(values) + pad, 2)
    labels = ", ".join(f'"{name.replace(chr(34), chr(39))}"' for name in x)
    lines = ["```mermaid", "xychart-beta", f'    title "{title.replace(chr(34), chr(39))}"', f"    x-axis [{labels}]",
             f'    y-axis "{y_title}" {low:g} --> {high:g}']
    lines += [f"    {kind} [{', '.join(f'{v:g}' for v in data)}]" for kind, data in series]
    return [*lines, "```"]


def _wheres(report: Mapping[str, Any], path: str, kills: bool) -> list[float | str]:
    if kills:
        return [where for item in kill_rows(report, path) for _, where in item.kills]
    return [row.where for row in check_rows(report, path)]


def _both_scale(reports: Sequence[Mapping[str, Any]], kills: bool) -> Scale:
    scales = [_scale(data, kills) for data in reports]
    return Scale.spanning([10.0 ** edge for scale in scales for edge in (scale.lo, scale.hi)])


def mermaid_section(report: Mapping[str, Any], other: Mapping[str, Any] | None = None,
                    names: tuple[str, str] = ("base", "head")) -> str:
    """Charts GitHub draws itself: per path, checks counted by margin decade and pairs counted by kill margin,
    and each growth curve; with ``other``, both reports (bars: the first, line: the second)."""
    reports = [report] if other is None else [report, other]
    scales = {kills: _both_scale(reports, kills) for kills in (False, True)}
    lines: list[str] = []
    for path in dict.fromkeys(p for data in reports for p in _paths(data)):
        for kills in (False, True):
            found = [_wheres(data, path, kills) for data in reports]
            if not any(found):
                continue
            what = "ablation-check pairs by kill margin" if kills else "checks by margin (error / tolerance)"
            x, counts = _histogram(scales[kills], found[0], kills)
            series: list[tuple[str, Sequence[float]]] = [("bar", counts)]
            title = f"{path}: {len(found[0])} {what}"
            if other is not None:
                series.append(("line", _histogram(scales[kills], found[1], kills)[1]))
                title = f"{path}: {what}; bars {names[0]} ({len(found[0])}), line {names[1]} ({len(found[1])})"
            lines += [*_xychart(title, x, "count", series), ""]
        if other is None:
            for curve in growth_curves(report, path):
                logs = [[round(math.log10(v), 3) if v > 0 and math.isfinite(v) else 0.0 for v in data]
                        for data in (curve.stock, curve.fast)]
                lines += [*_xychart(f"{path} {curve.label}: log10 error per step (bars stock control, line fast)",
                                    [str(i) for i in range(len(curve.fast))], "log10 error",
                                    [("bar", logs[0]), ("line", logs[1])], tight=True), ""]
    return "\n".join(lines).rstrip("\n")


def markdown_section(report: Mapping[str, Any]) -> str:
    """The pictures for the markdown report: charts GitHub renders, the same as text in a collapsed block, and
    where the SVGs are (the HTML report)."""
    charts = mermaid_section(report)
    if not charts:
        return ""
    return "\n".join(["## Pictures", "",
                      "Margins are error / tolerance: a check passes at or below 1, a kill must exceed 1. Each bin "
                      "is a decade named by its lower edge (`1e-2`: 0.01 to 0.1); `none`: facts only (no number), "
                      "`0`: exact. The HTML report (`--parity-report=PATH.html`) draws every check and ablation on "
                      "a log axis with the stock floor's minimum and ceiling marked.", "", charts, "",
                      "<details><summary>the same as text</summary>", "", "```text", text_section(report), "```", "",
                      "</details>", ""])


# ------------------------------------------------------------------------------------------------------- SVG
def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _svg(figure: Any) -> str:
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context(SVG_RC):
        figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buffer.getvalue()


def _axis(ax: Any, scale: Scale, gutters: Sequence[str], rows: int) -> None:
    """Decade ticks, the gutters' names, the tolerance line and one row per entry, first at the top."""
    ticks = [(float(k), f"1e{k}") for k in range(scale.lo, scale.hi + 1)]
    ticks += [(scale.gutter(g), {"none": "no margin", "0": "0", "inf": "inf"}.get(g, g)) for g in gutters]
    ticks.sort()
    ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks], rotation=90)
    ax.set_xlim(min(t for t, _ in ticks) - 0.5, max(t for t, _ in ticks) + 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.axvline(0.0, color=FAIL_COLOR, linewidth=0.8, linestyle="--", label="tolerance (margin 1)")
    for edge in (scale.lo - 0.5, scale.hi + 0.5):
        ax.axvline(edge, color=SKIP_COLOR, linewidth=0.5)
    ax.grid(axis="x", color="#dddddd", linewidth=0.4)
    ax.set_axisbelow(True)


def _position(scale: Scale, where: float | str) -> float:
    return scale.at(where) if isinstance(where, float) else scale.gutter(where)


def _checks_svg(path: str, rows: list[CheckRow], scale: Scale) -> str:
    with _rc():
        figure = _figure(9.0, 2.6 + 0.16 * len(rows))
        ax = figure.add_subplot()
        _axis(ax, scale, ("none", "0", "inf"), len(rows))
        for name, color, marker in (("floor_minimum", MIN_COLOR, "|"), ("floor_ceiling", CEILING_COLOR, "|"),
                                    ("floor_measured", MEASURED_COLOR, ".")):
            ys = [i for i, r in enumerate(rows) if name in r.marks]
            if not ys:
                continue
            ax.scatter([scale.at(rows[i].marks[name]) for i in ys], ys, marker=marker, color=color, s=30,
                       linewidths=1.2, label=name.replace("_", " ") + " / bound", zorder=2)
        for status, color in (("passed", PASS_COLOR), ("failed", FAIL_COLOR)):
            ys = [i for i, r in enumerate(rows) if (r.status == "passed") == (status == "passed")]
            if not ys:
                continue
            ax.scatter([_position(scale, rows[i].where) for i in ys], ys, color=color, s=14, zorder=3,
                       label=f"check {status}")
        ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=6.5)
        ax.set_xlabel("margin = error / tolerance (log10)")
        ax.set_title(f"{path}: margins of {len(rows)} checks")
        figure.legend(loc="outside upper center", ncols=3, fontsize=6.5, frameon=False)
        return _svg(figure)


def _spread(points: list[tuple[float, str]]) -> list[tuple[float, float, str]]:
    """(x, y offset, status) per point: points at one x fan out over the row so none hides another."""
    counts: dict[float, int] = {}
    for x, _ in points:
        counts[x] = counts.get(x, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for x, status in points:
        index = seen.get(x, 0)
        seen[x] = index + 1
        total = counts[x]
        out.append((x, 0.0 if total == 1 else -0.3 + 0.6 * index / (total - 1), status))
    return out


def _kills_svg(path: str, rows: list[KillRow], scale: Scale) -> str:
    with _rc():
        figure = _figure(9.0, 2.4 + 0.2 * len(rows))
        ax = figure.add_subplot()
        _axis(ax, scale, ("none", "0", "inf", "fact", "raises", "hang"), len(rows))
        by_status: dict[str, tuple[list[float], list[float]]] = {}
        for y, row in enumerate(rows):
            points = [(_position(scale, where), status) for status, where in row.kills]
            for x, offset, status in _spread(points):
                xs, ys = by_status.setdefault(status, ([], []))
                xs.append(x)
                ys.append(y + offset)
        for status in ("killed", "survived", "failed", "skipped"):
            if status in by_status:
                color = {"killed": PASS_COLOR, "survived": FAIL_COLOR}.get(status, SKIP_COLOR)
                ax.scatter(*by_status[status], color=color, s=10, marker="o" if status == "killed" else "x",
                           label=f"pair {status}", zorder=3)
        ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=6.5)
        ax.set_xlabel("kill margin of each claimed check (log10; fact, raises, hang: caught by that mode)")
        ax.set_title(f"{path}: kill margins of {len(rows)} ablations")
        figure.legend(loc="outside upper center", ncols=4, fontsize=6.5, frameon=False)
        return _svg(figure)


def _growth_svg(path: str, curves: list[Growth]) -> str:
    from matplotlib.ticker import MaxNLocator

    columns = min(3, len(curves))
    lines = math.ceil(len(curves) / columns)
    with _rc():
        figure = _figure(3.4 * columns, 2.6 * lines)
        for index, curve in enumerate(curves):
            ax = figure.add_subplot(lines, columns, index + 1)
            steps = range(len(curve.fast))
            for data, color, style, width, label in (
                    (curve.stock, MEASURED_COLOR, "-", 3.0, "stock control"),
                    (curve.fast, FAIL_COLOR, "--", 1.0, "fast vs stock")):
                ax.plot(steps, [v if v > 0 and math.isfinite(v) else float("nan") for v in data], color=color,
                        linestyle=style, marker=".", linewidth=width, label=label)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            margin = "" if curve.margin is None else f", margin {curve.margin:.2g}"
            same = " (curves coincide)" if curve.fast == curve.stock else ""
            ax.set_title(f"{curve.label}{margin}{same}", fontsize=7.5)
            ax.set_xlabel("step")
            ax.set_ylabel("per-step error")
            ax.legend(fontsize=6.5, frameon=False)
        figure.suptitle(f"{path}: per-step error growth, fast vs the stock control")
        return _svg(figure)


def _rc() -> Any:
    import matplotlib

    return matplotlib.rc_context(SVG_RC)


# One core's seconds per drawn row or curve, measured on the CPU tier's report (368 check rows, 97 ablations and
# 18 growth curves drawn in 3.0, 1.2 and 3.1 s): what splits the drawing between two processes evenly.
SECONDS_PER_ROW = {"margins": 0.008, "kills": 0.012, "growth": 0.17}
SPLIT_ABOVE_S = 2.0  # past this much drawing a helper draws half (its start-up: about 0.6 s)
HELPER_GRACE_S = 30.0  # a helper past this (plus 4 x its drawing) is stopped and its half drawn here
_REPO = Path(__file__).resolve().parents[2]  # where ``python -m`` finds this module


@dataclass(frozen=True)
class _Plan:
    """One picture to draw: its file name, its drawer and that drawer's arguments, its estimated seconds."""

    name: str
    kind: str
    args: tuple[Any, ...]
    seconds: float


def _plans(report: Mapping[str, Any]) -> list[_Plan]:
    scale, kill_scale = _scale(report), _scale(report, kills=True)
    plans = []
    for path in _paths(report):
        rows, kills, curves = check_rows(report, path), kill_rows(report, path), growth_curves(report, path)
        for kind, items, args in (("margins", rows, (path, rows, scale)), ("kills", kills, (path, kills, kill_scale)),
                                  ("growth", curves, (path, curves))):
            if items:
                plans.append(_Plan(f"{kind}-{path}.svg", kind, args, SECONDS_PER_ROW[kind] * len(items)))
    return plans


def _draw(kind: str, args: tuple[Any, ...]) -> str:
    return {"margins": _checks_svg, "kills": _kills_svg, "growth": _growth_svg}[kind](*args)


def _halves(plans: list[_Plan]) -> tuple[list[_Plan], list[_Plan]]:
    """The pictures split in two of about equal drawing time: the longest first, each onto the lighter side."""
    sides: tuple[list[_Plan], list[_Plan]] = ([], [])
    load = [0.0, 0.0]
    for plan in sorted(plans, key=lambda p: (-p.seconds, p.name)):
        lighter = load.index(min(load))
        sides[lighter].append(plan)
        load[lighter] += plan.seconds
    return sides


def svgs(report: Mapping[str, Any]) -> dict[str, str]:
    """``{name: SVG text}`` for every picture of the report, in a fixed order; {} without matplotlib.

    A report that takes seconds to draw (drawn at a run's end, the checks done and the cores idle) is split with a
    helper: a fresh interpreter drawing the same bytes (the rc settings and the hash salt are fixed). Should the
    helper fail, its half is drawn here: the pictures never depend on it.
    """
    if not available():
        return {}
    plans = _plans(report)
    if sum(p.seconds for p in plans) <= SPLIT_ABOVE_S or (os.cpu_count() or 1) < 2:
        return {p.name: _draw(p.kind, p.args) for p in plans}
    mine, theirs = _halves(plans)
    with tempfile.TemporaryDirectory(prefix="parity-pictures-") as scratch:
        request = Path(scratch) / "request.json"
        request.write_text(json.dumps({"report": report, "names": [p.name for p in theirs]}))
        helper = subprocess.Popen([sys.executable, "-m", __name__, str(request)], cwd=_REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            drawn = {p.name: _draw(p.kind, p.args) for p in mine}
            helped = _helped(helper, timeout=HELPER_GRACE_S + 4 * sum(p.seconds for p in theirs))
        finally:  # an interrupt: the helper goes with this run
            if helper.poll() is None:
                helper.kill()
                helper.wait()
            helper.stdout.close()
    for plan in theirs:
        drawn[plan.name] = helped.get(plan.name) or _draw(plan.kind, plan.args)
    return {p.name: drawn[p.name] for p in plans}


def _helped(helper: subprocess.Popen, timeout: float) -> dict[str, str]:
    """What the helper drew; {} when it failed or overran ``timeout`` (its half is then drawn here)."""
    try:
        output, _ = helper.communicate(timeout=timeout)
        drawn = json.loads(output) if helper.returncode == 0 else {}
    except (subprocess.TimeoutExpired, ValueError):
        return {}
    return drawn if isinstance(drawn, dict) else {}


def _helper_main(request: str) -> None:
    """The helper: reads a report and the names of the pictures to draw, writes ``{name: SVG}`` as JSON."""
    asked = json.loads(Path(request).read_text())
    wanted = set(asked["names"])
    drawn = {p.name: _draw(p.kind, p.args) for p in _plans(asked["report"]) if p.name in wanted}
    sys.stdout.write(json.dumps(drawn))


def moves_svg(moves: Sequence[tuple[str, Any, Any]], names: tuple[str, str]) -> str:
    """Both reports' margins of the rows that moved most: one line per row from the first report's margin to the
    second's, on a log axis. Needs matplotlib."""
    rows = [(what, _number(a), _number(b)) for what, a, b in moves]
    values = [v for _, a, b in rows for v in (a, b) if v is not None]
    scale = Scale.spanning(values)

    def where(value: float | None) -> float:
        if value is None:
            return scale.gutter("none")
        return scale.at(value)

    with _rc():
        figure = _figure(9.0, 2.4 + 0.2 * len(rows))
        ax = figure.add_subplot()
        _axis(ax, scale, ("none", "0", "inf"), len(rows))
        for y, (_, a, b) in enumerate(rows):
            ax.plot([where(a), where(b)], [y, y], color=SKIP_COLOR, linewidth=1.0, zorder=1)
        ax.scatter([where(a) for _, a, _ in rows], range(len(rows)), facecolors="none", edgecolors=MIN_COLOR,
                   s=18, label=names[0], zorder=2)
        ax.scatter([where(b) for _, _, b in rows], range(len(rows)), color=CEILING_COLOR, s=12, label=names[1],
                   zorder=3)
        ax.set_yticks(range(len(rows)), [what for what, _, _ in rows], fontsize=6.5)
        ax.set_xlabel("margin (log10)")
        ax.set_title(f"largest margin moves, {names[0]} -> {names[1]}")
        figure.legend(loc="outside upper center", ncols=3, fontsize=6.5, frameon=False)
        return _svg(figure)


# ------------------------------------------------------------------------------------------------------- HTML
def _data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:12px}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}"
         "figure{margin:1em 0}img{max-width:100%;height:auto}pre{font-size:11px;overflow-x:auto}")


def html_document(title: str, lines: Sequence[str], pictures: Mapping[str, str], fallback: str,
                  tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[str]]]]) -> str:
    """A standalone HTML page: ``lines`` (plain sentences), every SVG as an image (a ``data:`` URI, so the one file
    is the whole report), or ``fallback`` text when there is none, then the ``tables`` (title, header, rows)."""
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
           f"<h1>{html.escape(title)}</h1>"]
    out += [f"<p>{html.escape(line)}</p>" for line in lines]
    if pictures:
        out.append("<h2>Pictures</h2>")
        for name, svg in pictures.items():
            alt = name.removesuffix(".svg").replace("-", " ")
            out.append(f'<figure id="{html.escape(name)}"><img alt="{html.escape(alt)}" src="{_data_uri(svg)}">'
                       f"<figcaption>{html.escape(alt)}</figcaption></figure>")
    elif fallback:
        out += ["<h2>Pictures (text: matplotlib, the report extra, is not installed)</h2>",
                f"<pre>{html.escape(fallback)}</pre>"]
    for heading, header, rows in tables:
        if not rows:
            continue
        out += [f"<h2>{html.escape(heading)}</h2>", "<table>",
                "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
        out += ["<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows]
        out.append("</table>")
    return "\n".join([*out, "</body>", "</html>", ""])


if __name__ == "__main__":
    _helper_main(sys.argv[1])

"""Two parity reports (JSON) from different hosts or dispatch lanes: the same verdicts, or a list of what differs.

A verdict is a property of the code under test, so every check must pass or fail alike on every lane, and every
(ablation, check) pair must be killed alike, in the same mode. Margins may move (a floor can be exactly zero on
one lane and not on another); the largest moves are listed so a reader sees how close a lane came to a bound.
Standard library only (matplotlib, where installed, draws the HTML's picture): it runs wherever the reports land.
``--md`` writes what a pull request changed for its job summary: the verdicts that changed, the largest margin
moves and charts of both reports' margins that GitHub draws itself; ``--html`` the same with an SVG of the moves.

    python -m harness.reports.report_diff A.json B.json [--top N] [--md OUT.md] [--html OUT.html]   (scripts/compare-reports)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.reports import report_pictures

__all__ = ["Comparison", "compare", "load", "main", "render_html", "render_markdown"]


@dataclass(frozen=True)
class Comparison:
    """What two reports disagree on (``differences``; ``changes``: the same as (what, in A, in B)) and how far their
    margins moved (``moves``)."""

    differences: list[str]
    moves: list[tuple[float, str, Any, Any]]  # (|log10 ratio| of the margins, what, margin A, margin B)
    compared_checks: int
    compared_kills: int
    changes: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def same_verdicts(self) -> bool:
        return not self.differences


def load(path: str | Path) -> dict[str, Any]:
    """A parity report JSON; anything else is a ValueError naming the file and what is wrong."""
    target = Path(path)
    try:
        data = json.loads(target.read_text())
    except OSError as err:
        raise ValueError(f"{path}: cannot read the report ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON parity report ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list) or \
            not isinstance(data.get("ablations"), list):
        raise ValueError(f"{path}: not a parity report (expected an object with 'checks' and 'ablations' lists, as "
                         "--parity-report=PATH.json writes)")
    return data


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("inf", "nan", "-inf"):
        return float(value)
    return None


def _move(a: Any, b: Any) -> float:
    """How far a margin moved, as |log10(b / a)|; 0 when both are equal or either is not a positive number."""
    x, y = _number(a), _number(b)
    if x is None or y is None or x == y:
        return 0.0
    if x <= 0 or y <= 0 or not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    return abs(math.log10(y / x))


def _checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in report["checks"]}


def _kills(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(item["name"], kill["check"]): kill for item in report["ablations"] for kill in item["kills"]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """Every check's pass/fail and every (ablation, check) pair's kill and mode must agree; margins may move."""
    changes: list[tuple[str, str, str]] = []
    moves: list[tuple[float, str, Any, Any]] = []
    checks_a, checks_b = _checks(a), _checks(b)
    changes += [(f"check {check}", "ran", "missing") for check in _unmatched(checks_a, checks_b)]
    changes += [(f"check {check}", "missing", "ran") for check in _unmatched(checks_b, checks_a)]
    common = sorted(set(checks_a) & set(checks_b))
    for check in common:
        left, right = checks_a[check], checks_b[check]
        if _status(left) != _status(right):
            changes.append((f"check {check}", _status(left), _status(right)))
        moves.append((_move(left.get("margin"), right.get("margin")), f"check {check}", left.get("margin"),
                      right.get("margin")))
    kills_a, kills_b = _kills(a), _kills(b)
    changes += [(f"ablation {name} -> {check}", "ran", "missing") for name, check in _unmatched(kills_a, kills_b)]
    changes += [(f"ablation {name} -> {check}", "missing", "ran") for name, check in _unmatched(kills_b, kills_a)]
    pairs = sorted(set(kills_a) & set(kills_b))
    for pair in pairs:
        left, right = kills_a[pair], kills_b[pair]
        name = f"ablation {pair[0]} -> {pair[1]}"
        if bool(left.get("killed")) != bool(right.get("killed")) or left.get("mode") != right.get("mode"):
            changes.append((name, _kill(left), _kill(right)))
        moves.append((_move(left.get("margin"), right.get("margin")), name, left.get("margin"), right.get("margin")))
    moves.sort(key=lambda move: (-move[0], move[1]))
    return Comparison([_difference(*change) for change in changes], moves, len(common), len(pairs), changes)


def _difference(what: str, left: str, right: str) -> str:
    if "missing" in (left, right):
        return f"{what} is in {'A' if right == 'missing' else 'B'} but not in {'B' if right == 'missing' else 'A'}"
    return f"{what}: {left} in A, {right} in B"


def _unmatched(here: dict[Any, dict[str, Any]], there: dict[Any, dict[str, Any]]) -> list[Any]:
    """Rows of one report the other lacks. A row skipped with a reason (a gpu-tier placeholder in a whole-suite
    report, compared with a CPU-tier lane's) holds no verdict, so its absence elsewhere is no difference."""
    return sorted(key for key in set(here) - set(there) if here[key].get("status") != "skipped")


def _status(row: dict[str, Any]) -> str:
    if row.get("status") == "skipped":
        return "SKIPPED"
    return "PASS" if row.get("passed") else "FAIL"


def _kill(kill: dict[str, Any]) -> str:
    return f"{'killed' if kill.get('killed') else 'NOT killed'} ({kill.get('mode')})"


def _host(report: dict[str, Any]) -> str:
    host = report.get("host")
    if not isinstance(host, dict):
        return "host not recorded"
    return (f"torch {host.get('torch')}, CPU capability {host.get('cpu_capability')}, MKL_CBWR "
            f"{host.get('mkl', {}).get('cbwr')}, {host.get('threads')} threads")


def render(result: Comparison, names: Sequence[str], hosts: Sequence[str], top: int) -> str:
    lines = [f"A: {names[0]} ({hosts[0]})", f"B: {names[1]} ({hosts[1]})",
             f"compared {result.compared_checks} checks and {result.compared_kills} ablation-check pairs"]
    if result.differences:
        lines.append(f"DIFFERENT VERDICTS ({len(result.differences)}):")
        lines += [f"  {line}" for line in result.differences]
    else:
        lines.append("same verdicts: every check and every ablation-check pair agree")
    moved = [move for move in result.moves if move[0] > 0][:top]
    if moved:
        lines.append(f"largest margin moves (|log10 B/A|, top {len(moved)}):")
        lines += [f"  {size:6.2f}  {what}: {a} -> {b}" for size, what, a, b in moved]
    else:
        lines.append("no margin moved")
    return "\n".join(lines)


def _margin(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "-"
    return f"{number:.3g}" if math.isfinite(number) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(result: Comparison, reports: Sequence[dict[str, Any]], names: Sequence[str], top: int) -> str:
    """What changed from A (the base) to B (the head), for a pull request's job summary."""
    base, head = names
    lines = ["# Parity report: what changed", "",
             f"**base** `{base}` ({_host(reports[0])})  ", f"**head** `{head}` ({_host(reports[1])})  ",
             f"compared {result.compared_checks} checks and {result.compared_kills} ablation-check pairs", ""]
    if result.changes:
        lines += [f"## Verdicts that changed ({len(result.changes)})", "", "| what | base | head |", "|---|---|---|"]
        lines += [f"| {_cell(what)} | {_cell(left)} | {_cell(right)} |" for what, left, right in result.changes]
    else:
        lines += ["## Verdicts that changed: none", "", "Every check and every ablation-check pair agrees."]
    moved = [move for move in result.moves if move[0] > 0][:top]
    lines.append("")
    if moved:
        lines += [f"## Largest margin moves (top {len(moved)})", "",
                  "| what | base margin | head margin | decades moved |", "|---|---|---|---|"]
        lines += [f"| {_cell(what)} | {_margin(a)} | {_margin(b)} | {'inf' if math.isinf(size) else f'{size:.2f}'} |"
                  for size, what, a, b in moved]
    else:
        lines.append("No margin moved.")
    charts = report_pictures.mermaid_section(reports[0], reports[1], names=("base", "head"))
    if charts:
        lines += ["", "## Margins of both", "",
                  "Per path, checks by margin decade and pairs by kill margin: bars the base, line the head.", "",
                  charts, "", "<details><summary>base, as text</summary>", "", "```text",
                  report_pictures.text_section(reports[0]), "```", "", "</details>", "",
                  "<details><summary>head, as text</summary>", "", "```text",
                  report_pictures.text_section(reports[1]), "```", "", "</details>"]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_html(result: Comparison, reports: Sequence[dict[str, Any]], names: Sequence[str], top: int) -> str:
    """The same as one page, the moves drawn on a log axis (text where matplotlib is missing)."""
    moved = [(what, a, b) for size, what, a, b in result.moves if size > 0][:top]
    changed = {what for what, _, _ in result.changes}
    rows = [(what, a, b) for _, what, a, b in result.moves if what in changed and what not in {m[0] for m in moved}]
    shown = [*rows, *moved]
    pictures = {"margin-moves.svg": report_pictures.moves_svg(shown, ("base", "head"))} \
        if shown and report_pictures.available() else {}
    fallback = "\n".join(f"{what}: {_margin(a)} -> {_margin(b)}" for what, a, b in shown)
    lines = [f"base: {names[0]} ({_host(reports[0])})", f"head: {names[1]} ({_host(reports[1])})",
             f"compared {result.compared_checks} checks and {result.compared_kills} ablation-check pairs",
             f"{len(result.changes)} verdicts changed" if result.changes else "every verdict agrees"]
    tables = [("Verdicts that changed", ["what", "base", "head"], result.changes),
              ("Largest margin moves", ["what", "base margin", "head margin"],
               [(what, _margin(a), _margin(b)) for what, a, b in moved])]
    return report_pictures.html_document(f"Parity report: what changed ({names[0]} -> {names[1]})", lines,
                                         pictures, fallback, tables)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/compare-reports", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="a parity report JSON (--parity-report=A.json): the base")
    parser.add_argument("b", help="another one, from another lane or host: the head")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest margin moves to list")
    parser.add_argument("--md", type=Path, default=None, metavar="OUT.md",
                        help="also write what changed as markdown (a pull request's job summary)")
    parser.add_argument("--html", type=Path, default=None, metavar="OUT.html",
                        help="also write it as one HTML page, with the margin moves drawn")
    args = parser.parse_args(argv)
    try:
        a, b = load(args.a), load(args.b)
    except ValueError as err:
        print(f"compare-reports: {err}", file=sys.stderr)
        return 2
    result = compare(a, b)
    print(render(result, (args.a, args.b), (_host(a), _host(b)), args.top))
    for target, writer in ((args.md, render_markdown), (args.html, render_html)):
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(writer(result, (a, b), (args.a, args.b), args.top))
    return 0 if result.same_verdicts else 1


if __name__ == "__main__":
    sys.exit(main())

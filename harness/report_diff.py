"""Two parity reports (JSON) from different hosts or dispatch lanes: the same verdicts, or a list of what differs.

A verdict is a property of the code under test, so every check must pass or fail alike on every lane, and every
(ablation, check) pair must be killed alike, in the same mode. Margins may move (a floor can be exactly zero on
one lane and not on another); the largest moves are listed so a reader sees how close a lane came to a bound.
Standard library only: it runs wherever the reports land.

    python -m harness.report_diff A.json B.json [--top N]     (scripts/compare-reports)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Comparison", "compare", "load", "main"]


@dataclass(frozen=True)
class Comparison:
    """What two reports disagree on (``differences``) and how far their margins moved (``moves``)."""

    differences: list[str]
    moves: list[tuple[float, str, Any, Any]]  # (|log10 ratio| of the margins, what, margin A, margin B)
    compared_checks: int
    compared_kills: int

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
    differences: list[str] = []
    moves: list[tuple[float, str, Any, Any]] = []
    checks_a, checks_b = _checks(a), _checks(b)
    for missing, there, here in ((_unmatched(checks_a, checks_b), "A", "B"),
                                 (_unmatched(checks_b, checks_a), "B", "A")):
        differences += [f"check {check} is in {there} but not in {here}" for check in missing]
    common = sorted(set(checks_a) & set(checks_b))
    for check in common:
        left, right = checks_a[check], checks_b[check]
        if _status(left) != _status(right):
            differences.append(f"check {check}: {_status(left)} in A, {_status(right)} in B")
        moves.append((_move(left.get("margin"), right.get("margin")), f"check {check}", left.get("margin"),
                      right.get("margin")))
    kills_a, kills_b = _kills(a), _kills(b)
    for missing, there, here in ((_unmatched(kills_a, kills_b), "A", "B"),
                                 (_unmatched(kills_b, kills_a), "B", "A")):
        differences += [f"ablation {name} -> {check} is in {there} but not in {here}" for name, check in missing]
    pairs = sorted(set(kills_a) & set(kills_b))
    for pair in pairs:
        left, right = kills_a[pair], kills_b[pair]
        name = f"ablation {pair[0]} -> {pair[1]}"
        if bool(left.get("killed")) != bool(right.get("killed")) or left.get("mode") != right.get("mode"):
            differences.append(f"{name}: {_kill(left)} in A, {_kill(right)} in B")
        moves.append((_move(left.get("margin"), right.get("margin")), name, left.get("margin"), right.get("margin")))
    moves.sort(key=lambda move: (-move[0], move[1]))
    return Comparison(differences, moves, len(common), len(pairs))


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/compare-reports", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="a parity report JSON (--parity-report=A.json)")
    parser.add_argument("b", help="another one, from another lane or host")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest margin moves to list")
    args = parser.parse_args(argv)
    try:
        a, b = load(args.a), load(args.b)
    except ValueError as err:
        print(f"compare-reports: {err}", file=sys.stderr)
        return 2
    result = compare(a, b)
    print(render(result, (args.a, args.b), (_host(a), _host(b)), args.top))
    return 0 if result.same_verdicts else 1


if __name__ == "__main__":
    sys.exit(main())

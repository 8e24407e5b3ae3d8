"""Whether the inputs a run was given (``--checkpoint``, ``--capture-dir``, ``--impl``) were judged by any check.

A run that is handed a checkpoint and then skips every item on it (a stack that cannot import the checkpoint's
code, a ``-m`` that deselects the gpu tier) judged nothing, and a lane that exits 0 on it reads green. The
plugin therefore files every item that consumes an input here, with how it ended: run (its call phase passed or
failed), skipped (with the reason), deselected (with why), failed before its check, or never reached. An input
none of whose items ran gets one line naming the option, its value and why, and the run fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["InputLedger", "ItemEnd"]

RAN, SKIPPED, DESELECTED, ERRORED, NOT_REACHED = "ran", "skipped", "deselected", "failed before its check", "not run"
NOT_REACHED_WHY = "the session stopped before them"
ORDER = (SKIPPED, ERRORED, NOT_REACHED, DESELECTED)  # among groups of one size: what ran furthest first


@dataclass
class ItemEnd:
    """How one item that consumes some inputs ended; ``inputs`` are their labels ("--checkpoint=/m/x")."""

    inputs: tuple[str, ...]
    how: str = NOT_REACHED
    reason: str = NOT_REACHED_WHY


@dataclass
class InputLedger:
    """The run's inputs (labels in command-line order) and how each item consuming one of them ended."""

    inputs: tuple[str, ...]
    items: dict[str, ItemEnd] = field(default_factory=dict)  # nodeid -> how it ended

    def expect(self, nodeid: str, inputs: Iterable[str]) -> None:
        """A selected item that consumes ``inputs``; it counts as not run until a report says otherwise."""
        used = tuple(i for i in inputs if i in self.inputs)
        if used:
            self.items.setdefault(nodeid, ItemEnd(used))

    def deselect(self, nodeid: str, inputs: Iterable[str], reason: str) -> None:
        used = tuple(i for i in inputs if i in self.inputs)
        if used:
            self.items[nodeid] = ItemEnd(used, DESELECTED, reason)

    def report(self, nodeid: str, when: str, outcome: str, reason: str) -> None:
        """One phase's outcome of an expected item: a call that passed or failed ran its check; a skip or a
        failed setup kept it from running (a later phase never undoes either)."""
        item = self.items.get(nodeid)
        if item is None or item.how in (RAN, SKIPPED, ERRORED):
            return
        if outcome == "skipped":
            item.how, item.reason = SKIPPED, reason
        elif when == "call":
            item.how, item.reason = RAN, ""
        elif when == "setup" and outcome == "failed":
            item.how, item.reason = ERRORED, reason

    def idle(self) -> dict[str, str]:
        """Each input no item ran on -> its line: ``--checkpoint=DIR: no check ran on it: 18 items skipped (why)``."""
        lines = {}
        for label in self.inputs:
            ends = [item for item in self.items.values() if label in item.inputs]
            if any(item.how == RAN for item in ends):
                continue
            lines[label] = f"{label}: no check ran on it: {_why(ends)}"
        return lines


def _why(ends: list[ItemEnd]) -> str:
    """How many items ended which way and why, one group per (how, reason), largest first."""
    if not ends:
        return "no item of this run uses it (none was collected: check the test paths and -m/-k)"
    groups: dict[tuple[str, str], int] = {}
    for item in ends:
        groups[(item.how, item.reason)] = groups.get((item.how, item.reason), 0) + 1
    ordered = sorted(groups.items(), key=lambda group: (-group[1], ORDER.index(group[0][0])))
    return "; ".join(f"{count} item{'s' if count != 1 else ''} {how}" + (f" ({reason})" if reason else "")
                     for (how, reason), count in ordered)

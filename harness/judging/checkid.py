"""A check id as a value: written once, selected by its parts, printed exactly as reports show it.

An id reads ``path[.subject][.case].what``: the fast path, what it runs on (a model, a family), the
case (cfg, world size, a fault) and the quantity judged. Catalogues build ids from their frozen case
objects and ablation claims select them by part (``CheckId.grid``, ``CheckId.matches``) instead of
re-writing the format by hand; ``str()`` is the report's id, so reports stay comparable.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass

__all__ = ["CheckId"]

Part = str | Collection[str] | None


def _fits(value: str, want: Part) -> bool:
    if want is None:
        return True
    return value == want if isinstance(want, str) else value in want


@dataclass(frozen=True, order=True)
class CheckId:
    """``path.subject.case.what``; an empty subject or case is left out of the string form."""

    path: str
    subject: str = ""
    case: str = ""
    what: str = ""

    def __post_init__(self) -> None:
        if not self.path or not self.what:
            raise ValueError(f"a check id needs a path and a what, got {self!r}")

    def __str__(self) -> str:
        return ".".join(part for part in (self.path, self.subject, self.case, self.what) if part)

    @classmethod
    def parse(cls, text: str) -> CheckId:
        """Read an id back from its string; the middle segments split as subject then case."""
        parts = text.split(".")
        if len(parts) < 3 or not all(parts):
            raise ValueError(f"check id {text!r} must read 'path.case.what' (dot-separated, no empty segment)")
        middle = parts[1:-1]
        subject, case = (middle[0], ".".join(middle[1:])) if len(middle) > 1 else ("", middle[0])
        return cls(parts[0], subject, case, parts[-1])

    def matches(self, *, path: Part = None, subject: Part = None, case: Part = None, what: Part = None) -> bool:
        """True when every given part equals (or is among) this id's; an omitted part matches anything."""
        return (_fits(self.path, path) and _fits(self.subject, subject) and _fits(self.case, case)
                and _fits(self.what, what))

    @classmethod
    def grid(cls, path: str, subjects: Iterable[str], cases: Iterable[str], whats: Iterable[str]) -> list[CheckId]:
        """Every subject x case x what under ``path``, in that order: an ablation's claim over a catalogue."""
        return [cls(path, s, c, w) for s, c, w in itertools.product(subjects, cases, whats)]

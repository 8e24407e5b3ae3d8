"""Reviewed equivalent mutants, keyed to the site they were reviewed at.

An entry names the file, the enclosing function (or constant), the operator, the source line as it read
when it was reviewed and the line as the mutant makes it, and says why no result can differ. Lines are
compared normalised (whitespace collapsed, a trailing comment dropped), so re-indenting or rewording a
comment keeps a review, while any change to the code of the line makes the entry stale: the line must be
reviewed again. A copy of a reviewed line elsewhere is never covered (the function is part of the key), and
an entry matches exactly ``count`` sites (default 1), so a second copy inside the same function makes the
entry stale too instead of whitelisting the copy silently.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from tools.mutation_score.operators import Mutant

__all__ = ["Equivalent", "load", "match", "normalise", "site_lines"]

FIELDS = ("file", "function", "operator", "line", "mutant", "reason")


@dataclass(frozen=True)
class Equivalent:
    """One reviewed entry of ``tools/mutation_score/equivalent_mutants.toml``."""

    file: str
    function: str
    operator: str
    line: str
    mutant: str
    reason: str
    count: int = 1

    def key(self) -> tuple[str, str, str, str, str]:
        return self.file, self.function, self.operator, normalise(self.line), normalise(self.mutant)

    def describe(self) -> str:
        return f"{self.file} {self.function} {self.operator}: `{self.line}` -> `{self.mutant}`"


def normalise(text: str) -> str:
    """Code text compared by content: whitespace runs collapsed, a trailing ``#`` comment dropped."""
    quote, out, position = "", [], 0
    while position < len(text):
        char = text[position]
        if quote:
            if char == "\\":
                out.append(text[position:position + 2])
                position += 2
                continue
            if text.startswith(quote, position):
                quote = ""
                out.append(char)
                position += 1
                continue
        elif char in "\"'":
            quote = text[position:position + 3] if text.startswith(char * 3, position) else char
            out.append(quote)
            position += len(quote)
            continue
        elif char == "#":
            break
        out.append(char)
        position += 1
    return " ".join("".join(out).split())


def site_lines(mutant: Mutant) -> tuple[str, str]:
    """The mutated source line(s) before and after, as the report's diff shows them (``- old`` / ``+ new``)."""
    old, new = mutant.diff.split("\n", 1)
    return old[2:], new[2:]


def _key(mutant: Mutant) -> tuple[str, str, str, str, str]:
    old, new = site_lines(mutant)
    return mutant.file, mutant.qualname, mutant.operator, normalise(old), normalise(new)


def load(path: Path) -> list[Equivalent]:
    """The reviewed entries; a malformed entry is a usage error naming it."""
    if not path.is_file():
        return []
    try:
        entries = tomllib.loads(path.read_text()).get("mutant", [])
    except tomllib.TOMLDecodeError as err:
        raise SystemExit(f"mutation-score: {path}: not valid TOML ({err})") from None
    loaded = []
    for number, entry in enumerate(entries, start=1):
        missing = [f for f in FIELDS if not str(entry.get(f, "")).strip()]
        unknown = sorted(set(entry) - {*FIELDS, "count"})
        count = entry.get("count", 1)
        if missing or unknown or not isinstance(count, int) or count < 1:
            raise SystemExit(f"mutation-score: {path}: entry {number} ({entry.get('file', '?')}) needs "
                             f"{', '.join(FIELDS)} (missing or empty: {missing or 'none'}; unknown keys: "
                             f"{unknown or 'none'}; count, when given, an integer >= 1)")
        loaded.append(Equivalent(**{f: str(entry[f]) for f in FIELDS}, count=count))
    return loaded


def match(mutants: list[Mutant], entries: list[Equivalent],
          files: set[str]) -> tuple[dict[Mutant, Equivalent], list[tuple[Equivalent, int]]]:
    """Which mutants the entries cover, and the stale entries: ``(entry, sites it matches)`` for every entry on
    one of ``files`` that does not match exactly ``count`` of ``mutants`` (the line changed or was copied).

    ``mutants`` must be every mutant of ``files`` (before any sample), so an entry's count is the truth."""
    by_key: dict[tuple[str, str, str, str, str], list[Mutant]] = {}
    for mutant in mutants:
        by_key.setdefault(_key(mutant), []).append(mutant)
    covered: dict[Mutant, Equivalent] = {}
    stale: list[tuple[Equivalent, int]] = []
    for entry in entries:
        if entry.file not in files:
            continue
        found = by_key.get(entry.key(), [])
        if len(found) != entry.count:
            stale.append((entry, len(found)))
            continue
        covered.update((mutant, entry) for mutant in found)
    return covered, stale

"""The corpus: publicly reported bugs of batched / sharded fast paths, each re-created inside one path's
conformance signature, for ``--impl PATH=corpus.<path>:NAME``.

The zoo (``zoo_<path>.py``) holds bugs a reviewer could plausibly write; the corpus holds bugs someone did
write and reported. Each entry is a ``Report``: the public GitHub issue or pull request, the project and
version it affected, a paragraph on the mechanism, the checks expected to catch it, and the zoo ``Flaws`` value
that re-creates the mechanism in the zoo's right implementation. None of the entries is the reported code:
each is this suite's right implementation of the path with that one flaw, so ``recreation`` says what was
carried over and what the signature changes. Entries whose flaw equals a zoo bug's share its conformance run
(``zoo.py --corpus``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PATHS", "Report"]

PATHS = ("replay", "ar", "decode", "attention")


@dataclass(frozen=True)
class Report:
    """One public bug report and its re-creation in this suite's signature of ``path``."""

    url: str  # the GitHub issue or pull request
    project: str
    version: str  # the release, or the branch and date the report describes
    mechanism: str  # what went wrong, in our words
    recreation: str  # how the flaw is expressed inside the path's signature
    checks: tuple[str, ...]  # check ids the conformance run must fail
    flaws: Any  # the zoo Flaws value the implementation carries

    def recreate(self, build: Callable[[Any, str], Callable[..., Any]]) -> Callable[..., Any]:
        """The zoo's right implementation with this report's flaw: ``build(flaws, doc)`` is the path's zoo builder."""
        return build(self.flaws, f"{self.url}: {self.recreation}")

    @property
    def summary(self) -> str:
        """One line for tables: the report and the flaw's first sentence."""
        return f"{self.url}: {self.recreation.split('. ')[0].rstrip('.')}"

"""What a distributed task carries besides its function: contexts captured in the parent, re-entered in each rank.

Ranks forked before a patch do not see it, and a spawned rank starts with nothing, so the state a task runs
under (an applied ablation, an implementation under test) must travel with the task. The process layer
(``harness.process.dist``) knows nothing of that state: any module registers a ``Carried`` here, and a world asks every
registered one to ``capture`` its state when it sends a task, ``enter`` it around the task inside the rank,
and ``absorb`` what the rank ``tally``-ed (calls made there, say) when the answer comes back. ``reset`` drops
what a forked rank inherited before its first task.

The functions of a ``Carried`` must be module-level: a task message pickles them by reference, so a spawned
rank imports their module when it reads the first task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from harness.registry import Registry

__all__ = ["CARRIED", "Carried", "absorb", "capture", "entered", "marks", "reset_all", "tallies"]


@dataclass(frozen=True)
class Carried:
    """One kind of state a task carries into its ranks.

    ``capture()`` runs in the parent and returns picklable state; ``enter(state)`` is a context manager the rank
    runs the task inside; ``reset()`` runs once when a rank starts. ``mark()`` (rank, before the task) and
    ``tally(mark)`` (rank, after it, whether it raised or not) measure what the task did there, and
    ``absorb(tally)`` takes that in in the parent.
    """

    name: str
    capture: Callable[[], Any]
    enter: Callable[[Any], AbstractContextManager[Any]]
    reset: Callable[[], Any] | None = None
    mark: Callable[[], Any] | None = None
    tally: Callable[[Any], Any] | None = None
    absorb: Callable[[Any], Any] | None = None


CARRIED: Registry[Carried] = Registry("carried context")


def capture() -> tuple[tuple[Carried, Any], ...]:
    """Every registered context with its state now (parent side, once per task)."""
    return tuple((item, item.capture()) for item in CARRIED.values())


def reset_all() -> None:
    """Drop what a forked rank inherited from its parent (rank side, before the first task)."""
    for item in CARRIED.values():
        if item.reset is not None:
            item.reset()


def marks(captured: tuple[tuple[Carried, Any], ...]) -> dict[str, Any]:
    """Rank side, before a task: each context's mark, for ``tallies`` to measure from."""
    return {item.name: item.mark() for item, _ in captured if item.mark is not None}


@contextlib.contextmanager
def entered(captured: tuple[tuple[Carried, Any], ...]) -> Iterator[None]:
    """Rank side: run a task inside every captured context, leaving them in reverse order."""
    with contextlib.ExitStack() as stack:
        for item, state in captured:
            stack.enter_context(item.enter(state))
        yield


def tallies(captured: tuple[tuple[Carried, Any], ...], marked: dict[str, Any]) -> dict[str, Any]:
    """Rank side, after a task (whether it raised or not): what each context measured since its mark."""
    return {item.name: item.tally(marked[item.name]) for item, _ in captured
            if item.tally is not None and item.name in marked}


def absorb(captured: tuple[tuple[Carried, Any], ...], tallies: dict[str, Any]) -> None:
    """Parent side: hand each context what its rank tallied."""
    for item, _ in captured:
        if item.absorb is not None and item.name in tallies:
            item.absorb(tallies[item.name])

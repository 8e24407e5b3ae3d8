"""Where a rank is inside a distributed task: the collectives it entered, so a peer that never arrives is named.

A rank stuck in Python (a deadlock, a stuck data loader, an endless loop) keeps its process and its heartbeat
alive, so no liveness watch sees it; its peers simply wait inside the next collective until the transport's own
timeout (gloo: 300 s) and then blame themselves. Every collective a task enters through ``torch.distributed`` is
counted here, per process group, so whoever watches the ranks (the parent of a forked world, or each rank's board
watch under torchrun) can tell a rank that never reached the collective its peers wait in from one that is merely
slow inside it, and name the first within the fault bound.

Every rank of a group runs the same sequence of collectives on it, so "rank r entered n - 1 collectives on group G
while its peers wait in the n-th" is a statement about r alone, whatever the timing.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["COLLECTIVES", "Abandoned", "Position", "Straggler", "abandoned", "begin", "end", "install", "note",
           "position", "stragglers"]

# every collective every rank of a group must enter (point-to-point send/recv are not: only a pair takes part)
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
               "scatter_object_list")
BEFORE_FIRST = "the task, before its first collective"

Group = tuple[int, ...]  # a process group by the global ranks in it


@dataclass(frozen=True)
class Position:
    """One rank's place in a task: collectives entered per group, the one it waits in now, where it was last seen.

    ``inside`` is (group, number on that group, name) while the rank sits in a blocking collective.
    """

    entered: Mapping[Group, int] = field(default_factory=dict)
    inside: tuple[Group, int, str] | None = None
    last: str = BEFORE_FIRST

    def to_json(self) -> dict[str, Any]:
        return {"entered": [[list(g), n] for g, n in self.entered.items()],
                "inside": None if self.inside is None else [list(self.inside[0]), self.inside[1], self.inside[2]],
                "last": self.last}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Position:
        inside = data["inside"]
        return cls({tuple(g): int(n) for g, n in data["entered"]},
                   None if inside is None else (tuple(inside[0]), int(inside[1]), str(inside[2])), str(data["last"]))


def describe(group: Group, number: int, name: str, world_size: int) -> str:
    """A collective as a person names it: ``all_gather #2`` (plus the group's ranks when it is not the world)."""
    where = "" if group == tuple(range(world_size)) else f" of the group {list(group)}"
    return f"{name} #{number}{where}"


@dataclass(frozen=True)
class Straggler:
    """A rank that has not reached the collective its peers have waited in for ``waited_s``."""

    rank: int
    collective: str  # as ``describe`` names it
    last: str
    waiting: tuple[int, ...]

    def cause(self, within_s: float) -> str:
        return f"did not reach {self.collective} within {within_s:g} s (last seen in {self.last})"

    def text(self, within_s: float) -> str:
        return f"rank {self.rank} {self.cause(within_s)}"


def stragglers(positions: Mapping[int, Position], finished: set[int] | frozenset[int], world_size: int,
               unseen: str = BEFORE_FIRST) -> list[Straggler]:
    """Ranks that are behind a collective some peer waits in: they entered fewer collectives on its group.

    ``finished`` ranks (their task came back) are not behind: a rank that returned without a collective its peers
    wait in broke the protocol, and the task's own time limit reports that. Timing is the caller's: this says who
    is behind now, and the caller names them once the wait has lasted its bound. A rank with no position yet was
    last seen ``unseen``.
    """
    found: dict[int, Straggler] = {}
    for waiter in sorted(positions):
        inside = positions[waiter].inside
        if inside is None:
            continue
        group, number, name = inside
        for rank in group:
            if rank == waiter or rank in finished or rank in found:
                continue
            seen = positions.get(rank, Position(last=unseen))
            if seen.entered.get(group, 0) < number:
                waiting = tuple(sorted(r for r, p in positions.items()
                                       if p.inside is not None and p.inside[:2] == (group, number)))
                # a rank behind while inside another collective waits there (mismatched collective orders)
                last = seen.last if seen.inside is None else f"{describe(*seen.inside, world_size)}, where it waits"
                found[rank] = Straggler(rank, describe(group, number, name, world_size), last, waiting)
    return [found[r] for r in sorted(found)]


@dataclass(frozen=True)
class Abandoned:
    """A rank waiting in a collective that every other rank of its group returned without entering."""

    rank: int
    collective: str
    returned: tuple[int, ...]

    def cause(self, within_s: float) -> str:
        return (f"waited {within_s:g} s alone in {self.collective}: ranks {list(self.returned)} returned without "
                "entering it")


def abandoned(positions: Mapping[int, Position], finished: set[int] | frozenset[int], world_size: int
              ) -> list[Abandoned]:
    """Ranks inside a collective whose group's other ranks have all returned from the task, having entered fewer
    collectives on that group: they left the protocol, and the waiting rank can never finish."""
    found = []
    for rank in sorted(positions):
        inside = positions[rank].inside
        if inside is None or rank in finished:
            continue
        group, number, name = inside
        others = [r for r in group if r != rank]
        if others and all(r in finished and positions.get(r, Position()).entered.get(group, 0) < number
                          for r in others):
            found.append(Abandoned(rank, describe(group, number, name, world_size), tuple(others)))
    return found


# ----------------------------------------------------------------------------------------------- the tracker


class _Tracker:
    """This process's position in the running task (None between tasks); ``listener`` hears every change."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered: dict[Group, int] = {}
        self.inside: tuple[Group, int, str] | None = None
        self.since = 0.0
        self.last = BEFORE_FIRST
        self.active = False
        self.depth = 0  # a collective built on others (all_gather_object) counts once
        self.listener: Callable[[Position], None] | None = None

    def snapshot(self) -> Position:
        return Position(dict(self.entered), self.inside, self.last)

    def changed(self) -> None:
        if self.listener is not None:
            self.listener(self.snapshot())


_TRACKER = _Tracker()
_INSTALLED: dict[str, Callable[..., Any]] = {}


def _group_ranks(group: Any) -> Group:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _tracked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        tracker = _TRACKER
        if not tracker.active or tracker.depth:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        group = _group_ranks(bound.get("group"))
        blocking = not bound.get("async_op", False)
        with tracker.lock:
            number = tracker.entered.get(group, 0) + 1
            tracker.entered[group] = number
            if blocking:
                tracker.inside, tracker.since = (group, number, name), time.monotonic()
            tracker.depth += 1
        tracker.changed()
        try:
            return original(*args, **kwargs)
        finally:
            with tracker.lock:
                tracker.depth -= 1
                tracker.inside = None
                tracker.last = f"{describe(group, number, name, dist.get_world_size())}, which it left"
            tracker.changed()

    return collective


def install() -> None:
    """Count the collectives of ``torch.distributed`` (idempotent; a no-op outside a task)."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or name in _INSTALLED:
            continue
        _INSTALLED[name] = original
        setattr(dist, name, _tracked(name, original))


def begin(listener: Callable[[Position], None] | None = None) -> None:
    """A task starts in this process: count from zero, tell ``listener`` of every change."""
    install()
    with _TRACKER.lock:
        _TRACKER.entered, _TRACKER.inside, _TRACKER.last, _TRACKER.depth = {}, None, BEFORE_FIRST, 0
        _TRACKER.listener, _TRACKER.active = listener, True


def end() -> None:
    """The task is over: stop counting and stop telling."""
    with _TRACKER.lock:
        _TRACKER.active, _TRACKER.listener = False, None


def note(where: str) -> None:
    """Say where this rank is between collectives (the words a straggler is reported with)."""
    if not _TRACKER.active:
        return
    with _TRACKER.lock:
        _TRACKER.last = where
    _TRACKER.changed()


def position() -> tuple[Position, float]:
    """This process's position and since when (monotonic) it has waited in its current collective."""
    with _TRACKER.lock:
        return _TRACKER.snapshot(), _TRACKER.since

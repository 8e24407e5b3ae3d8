"""Where a rank is inside a distributed task: the collectives it entered, so a peer that never arrives is named.

A rank stuck in Python (a deadlock, a stuck data loader, an endless loop) keeps its process and its heartbeat
alive, so no liveness watch sees it; its peers simply wait inside the next collective until the transport's own
timeout (gloo: 300 s) and then blame themselves. Every collective a task enters through ``torch.distributed`` is
counted here, per process group, so whoever watches the ranks (the parent of a forked world, or each rank's board
watch under torchrun) can tell a rank that never reached the collective its peers wait in from one that is merely
slow inside it, and name the first within the fault bound.

Every rank of a group runs the same sequence of collectives on it, so "rank r entered n - 1 collectives on group G
while its peers wait in the n-th" is a statement about r alone, whatever the timing.

Being behind is not being stuck: a rank with more work, or a slower share of a loaded machine, is behind while it
computes. A straggler is named only when its own progress stops (``stalled``): its position and the modules its task
runs stand still for the bound AND either its task thread's CPU time stands still too (asleep, blocked on a lock or
a socket, deadlocked), or it has burned more CPU time than ``SPIN_FACTOR`` times what its waiting peers needed to
reach the collective (a loop in Python that computes nothing). A rank that computes (runs modules, says where it
is, or needs less than that many times its peers' CPU time) is never named, however slowly.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "IDLE_CPU_SHARE", "SPIN_FACTOR", "Abandoned", "Pace", "PaceMeter", "Position", "Straggler",
           "WorkCounter", "abandoned", "begin", "end", "install", "note", "peers_cpu_s", "position",
           "proc_thread_cpu_s", "stalled", "stragglers", "task_cpu_s", "task_thread", "thread_cpu_s", "work_done"]

IDLE_CPU_SHARE = 0.02  # below this share of one core over the bound, a rank's task thread computes nothing
SPIN_FACTOR = 4.0  # a straggler burning this many times its peers' CPU time, with nothing to show, is looping

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
    cpu_s: float = field(default=0.0, compare=False)  # the task thread's CPU time when it got here

    def to_json(self) -> dict[str, Any]:
        return {"entered": [[list(g), n] for g, n in self.entered.items()],
                "inside": None if self.inside is None else [list(self.inside[0]), self.inside[1], self.inside[2]],
                "last": self.last, "cpu_s": self.cpu_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Position:
        inside = data["inside"]
        return cls({tuple(g): int(n) for g, n in data["entered"]},
                   None if inside is None else (tuple(inside[0]), int(inside[1]), str(inside[2])), str(data["last"]),
                   float(data.get("cpu_s", 0.0)))


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
    why: str = ""  # why it counts as stuck (``stalled``), once it does

    def cause(self, within_s: float) -> str:
        said = f"did not reach {self.collective} within {within_s:g} s (last seen in {self.last})"
        return f"{said}: {self.why}" if self.why else said

    def text(self, within_s: float) -> str:
        return f"rank {self.rank} {self.cause(within_s)}"


def stragglers(positions: Mapping[int, Position], finished: set[int] | frozenset[int], world_size: int,
               unseen: str = BEFORE_FIRST) -> list[Straggler]:
    """Ranks that are behind a collective some peer waits in: they entered fewer collectives on its group, and are not
    still inside an earlier one of that group (which the waiter has left: it completed everywhere).

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
            if seen.inside is not None and seen.inside[0] == group and seen.inside[1] < number:
                # still inside a collective of this group that the waiter has left: it completed, and this rank is
                # on its way out (its return lags under load), not behind
                continue
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


def deserted(positions: Mapping[int, Position], finished: set[int] | frozenset[int], world_size: int
             ) -> dict[int, str]:
    """Ranks inside a collective that some rank of its group left the task without entering (it raised or
    returned first), with why: that rank will never enter it, so the waiting rank can never return. Certain,
    not timed: a rank's positions reach its parent before its outcome does."""
    found = {}
    for rank in sorted(positions):
        inside = positions[rank].inside
        if inside is None or rank in finished:
            continue
        group, number, name = inside
        gone = [r for r in group if r != rank and r in finished
                and positions.get(r, Position()).entered.get(group, 0) < number]
        if gone:
            found[rank] = (f"waits in {describe(group, number, name, world_size)}, which rank(s) {gone} left the "
                           "task without entering")
    return found


# ----------------------------------------------------------------------------------------------- pace


@dataclass(frozen=True)
class Pace:
    """A rank's progress as its watcher measured it: how long nothing it does has moved, whether its task thread's CPU
    time stood still over the last bound, and that CPU time so far in the task."""

    still_s: float
    idle: bool
    cpu_s: float

    def to_json(self) -> dict[str, Any]:
        return {"still_s": self.still_s, "idle": self.idle, "cpu_s": self.cpu_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Pace:
        return cls(float(data["still_s"]), bool(data["idle"]), float(data["cpu_s"]))


class PaceMeter:
    """One rank's samples, taken by whoever watches it: what it has done (its position, the modules it ran) and its
    task thread's CPU time, over a sliding window as long as the bound."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._done: Any = None
        self._moved_at = 0.0
        self._samples: deque[tuple[float, float]] = deque()

    def sample(self, now: float, done: Any, cpu_s: float, busy: bool = False) -> Pace:
        """Take a sample: ``done`` is anything that changes when the rank does something (``busy``: a device still
        works for it); returns its pace now."""
        if done != self._done or busy or not self._samples:
            self._done, self._moved_at = done, now
        self._samples.append((now, cpu_s))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        since, cpu_then = self._samples[0]
        idle = now - since >= self.window_s and cpu_s - cpu_then < IDLE_CPU_SHARE * (now - since)
        return Pace(now - self._moved_at, idle, cpu_s)


def stalled(pace: Pace, peers_cpu_s: float, within_s: float) -> str:
    """Why a rank behind its peers' collective counts as stuck now ("" while it shows progress).

    Nothing it does moved for ``within_s`` AND either its CPU time stood still too, or it burned more than
    ``SPIN_FACTOR`` times the CPU time its waiting peers needed to reach the collective. Work that runs no module and
    enters no collective for the whole bound, beside peers that needed almost none, reads as a loop: such code can
    say where it is (``note``) to be seen computing. The words are fixed (no measured number), so the same run reads
    the same.
    """
    if pace.still_s < within_s:
        return ""
    if pace.idle:
        return ("no progress: its position, the modules it runs and its CPU time all stood still (asleep, blocked "
                "or deadlocked)")
    if pace.cpu_s >= SPIN_FACTOR * peers_cpu_s:
        return (f"busy without progress: it entered no collective and ran no module while it burned over "
                f"{SPIN_FACTOR:g}x the CPU time its peers needed to reach it (an endless loop)")
    return ""


def peers_cpu_s(positions: Mapping[int, Position], straggler: Straggler) -> float:
    """The most CPU time any rank waiting for ``straggler`` spent in its task before it entered that collective."""
    return max((positions[r].cpu_s for r in straggler.waiting if r in positions), default=0.0)


def thread_cpu_s(clock: int | None) -> float | None:
    """The CPU time of the thread whose CPU clock is ``clock`` (None once the thread is gone)."""
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


def proc_thread_cpu_s(pid: int, tid: int | None = None) -> float | None:
    """A local thread's CPU time read from /proc (its process's main thread by default); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid or pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class WorkCounter:
    """How many modules a task ran: a plain counter, or any object with an integer ``value`` (a forked rank's is
    shared memory its parent reads)."""

    def __init__(self) -> None:
        self.value = 0


# ----------------------------------------------------------------------------------------------- the tracker


class _Tracker:
    """This process's position in the running task (None between tasks); ``listener`` hears every change."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered: dict[Group, int] = {}
        self.inside: tuple[Group, int, str] | None = None
        self.since = 0.0
        self.last = BEFORE_FIRST
        self.cpu_at = 0.0  # the task thread's CPU time at the last change
        self.active = False
        self.depth = 0  # a collective built on others (all_gather_object) counts once
        self.listener: Callable[[Position], None] | None = None
        self.work: Any = WorkCounter()
        self.hook: Any = None
        self.clock: int | None = None  # the task thread's CPU clock
        self.cpu0 = 0.0

    def snapshot(self) -> Position:
        return Position(dict(self.entered), self.inside, self.last, self.cpu_at)

    def task_cpu(self) -> float:
        now = thread_cpu_s(self.clock)
        return 0.0 if now is None else now - self.cpu0

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
        cpu = tracker.task_cpu()
        with tracker.lock:
            number = tracker.entered.get(group, 0) + 1
            tracker.entered[group] = number
            if blocking:
                tracker.inside, tracker.since = (group, number, name), time.monotonic()
            tracker.depth += 1
            tracker.cpu_at = cpu
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


def begin(listener: Callable[[Position], None] | None = None, work: Any = None) -> None:
    """A task starts in this process: count from zero, tell ``listener`` of every change, count every module the
    task runs in ``work`` (a fresh WorkCounter by default). The task's thread says so itself (``task_thread``)."""
    install()
    counter = work if work is not None else WorkCounter()
    counter.value = 0

    def ran_a_module(module: Any, args: Any) -> None:
        counter.value += 1

    with _TRACKER.lock:
        _TRACKER.entered, _TRACKER.inside, _TRACKER.last, _TRACKER.depth = {}, None, BEFORE_FIRST, 0
        _TRACKER.listener, _TRACKER.active, _TRACKER.work, _TRACKER.cpu_at = listener, True, counter, 0.0
        if _TRACKER.hook is None:
            _TRACKER.hook = torch.nn.modules.module.register_module_forward_pre_hook(ran_a_module)


def task_thread() -> None:
    """Called on the thread that runs the task: its CPU time is the task's (any thread may read it: task_cpu_s)."""
    clock = time.pthread_getcpuclockid(threading.get_ident()) if hasattr(time, "pthread_getcpuclockid") else None
    with _TRACKER.lock:
        _TRACKER.clock = clock
        _TRACKER.cpu0 = thread_cpu_s(clock) or 0.0


def task_cpu_s() -> float:
    """The CPU time the running task's thread has used since the task began."""
    return _TRACKER.task_cpu()


def work_done() -> int:
    """How many modules the running task has run."""
    return int(_TRACKER.work.value)


def end() -> None:
    """The task is over: stop counting and stop telling."""
    with _TRACKER.lock:
        _TRACKER.active, _TRACKER.listener = False, None
        if _TRACKER.hook is not None:
            _TRACKER.hook.remove()
            _TRACKER.hook = None


def note(where: str) -> None:
    """Say where this rank is between collectives (the words a straggler is reported with)."""
    if not _TRACKER.active:
        return
    cpu = _TRACKER.task_cpu()
    with _TRACKER.lock:
        _TRACKER.last, _TRACKER.cpu_at = where, cpu
    _TRACKER.changed()


def position() -> tuple[Position, float]:
    """This process's position and since when (monotonic) it has waited in its current collective."""
    with _TRACKER.lock:
        return _TRACKER.snapshot(), _TRACKER.since

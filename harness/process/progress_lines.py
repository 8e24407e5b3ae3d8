"""Progress lines on stderr, with the expected total, for the long stretches pytest's own progress does not show:
the mutation score's passes, the ranks of a torchrun launch arriving and waiting on each other, the gpu tier
loading a checkpoint's weights (one item, minutes on a big model, no dot printed meanwhile).

Only stderr, never a report file: the reports stay byte-for-byte the same whatever was printed. Inside a pytest
run, output capture would hold a line until the item ends, which is exactly when it stops being news, so the
pytest plugin installs a writer that steps past capture (``set_writer``). Standard library only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["Meter", "Ticking", "loading", "plan_loads", "restore", "saved", "say", "set_writer", "weight_bytes"]

_WRITER: list[Callable[[str], None]] = []
_LOCK = threading.Lock()
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_PLAN: dict[tuple[str, str], int] = {}  # (checkpoint path, dtype) -> its weight bytes, for the run's planned loads
_STARTED: list[tuple[str, str]] = []  # the planned loads begun so far, in order


def set_writer(writer: Callable[[str], None] | None) -> None:
    """Where lines go (None: plain stderr again)."""
    _WRITER.clear()
    if writer is not None:
        _WRITER.append(writer)


State = tuple[list[Callable[[str], None]], dict[tuple[str, str], int], list[tuple[str, str]]]


def saved() -> State:
    """The writer and the load plan, for a nested pytest run (pytester, in process) to put back when it ends."""
    return list(_WRITER), dict(_PLAN), list(_STARTED)


def restore(state: State) -> None:
    _WRITER[:] = state[0]
    _PLAN.clear()
    _PLAN.update(state[1])
    _STARTED[:] = state[2]


def say(line: str) -> None:
    """One progress line, now: through the installed writer, else to stderr."""
    with _LOCK:
        if _WRITER:
            _WRITER[0](line)
            return
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class Meter:
    """``done`` of ``total`` units of one stretch of work, said at most every ``every_s`` seconds (and at the
    first and last update), so a thousand mutants make a few dozen lines, not a thousand."""

    def __init__(self, what: str, total: int, unit: str, *, every_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.unit, self.every_s, self.clock = what, total, unit, every_s, clock
        self.began = clock()
        self._last: float | None = None
        self._said = -1  # the count last said

    def line(self, done: int, detail: str = "") -> str:
        elapsed = self.clock() - self.began
        text = f"{self.what}: {done}/{self.total} {self.unit}"
        return text + (f" ({detail})" if detail else "") + f", {elapsed:.0f} s"

    def update(self, done: int, detail: str = "", *, force: bool = False) -> bool:
        """Say where the work is when it is time to; True when a line was said."""
        now = self.clock()
        finished = done >= self.total and self._said < self.total
        due = self._last is None or now - self._last >= self.every_s or finished
        if not (force or due):
            return False
        self._last, self._said = now, done
        say(self.line(done, detail))
        return True


class Ticking:
    """A context that says ``what`` as its block starts (one call that gives no progress of its own, like loading
    a checkpoint), ``then`` (default ``what``) every ``every_s`` seconds while it runs, and how long it took."""

    def __init__(self, what: str, *, then: str = "", every_s: float = 15.0) -> None:
        self.what, self.then, self.every_s = what, then or what, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.began = 0.0

    def __enter__(self) -> Ticking:
        self.began = time.monotonic()
        say(f"{self.what} ...")
        self._thread = threading.Thread(target=self._tick, name="parity-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            say(f"{self.then}: still running, {time.monotonic() - self.began:.0f} s")

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # a line being written finishes before the caller goes on
        outcome = "done" if kind is None else f"failed ({getattr(kind, '__name__', kind)})"
        say(f"{self.then}: {outcome} in {time.monotonic() - self.began:.1f} s")


def weight_bytes(path: str | Path) -> int:
    """The bytes of the weight files in a checkpoint directory (the top level and one below: sharded layouts)."""
    root = Path(path)
    files = [*root.glob("*"), *root.glob("*/*")] if root.is_dir() else []
    return sum(f.stat().st_size for f in files if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def plan_loads(loads: Sequence[tuple[str, str]]) -> None:
    """The model loads a run expects, as (checkpoint path, dtype): ``loading`` then counts them as they begin and
    says how much of the run's weights came before. An empty plan keeps loads silent (unit tests)."""
    _PLAN.clear()
    _STARTED.clear()
    _PLAN.update({load: weight_bytes(load[0]) for load in dict.fromkeys(loads)})


def _amount(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**27 else f"{count / 2**20:.1f} MiB"


def loading(path: str, dtype: str, what: str) -> contextlib.AbstractContextManager[object]:
    """Around one model load: which of the planned loads it is and a tick while it runs; nothing when the run
    planned no loads or not this one (a load again of one already begun keeps its number)."""
    key = (path, dtype)
    if key not in _PLAN:
        return contextlib.nullcontext()
    if key not in _STARTED:
        _STARTED.append(key)
    number = _STARTED.index(key) + 1
    before = sum(_PLAN[k] for k in _STARTED[: number - 1])
    then = f"gpu tier: model {number}/{len(_PLAN)}, {what}"
    return Ticking(f"gpu tier: loading model {number}/{len(_PLAN)}: {what} ({_amount(_PLAN[key])}; "
                   f"{_amount(before)} of the run's {_amount(sum(_PLAN.values()))} of weights loaded before it)",
                   then=then)

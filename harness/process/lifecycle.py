"""A run stops when asked and leaves no process behind.

Ctrl-C (SIGINT to the terminal's foreground process group), SIGTERM (a CI cancel, ``timeout``) and SIGHUP (a closed
terminal) all end a run the same way: the run's own process kills every rank process it started at once, then raises
``StopRequested`` (a KeyboardInterrupt), so pytest stops with its interrupted summary and the report is written
marked interrupted. An interrupt is never a check's verdict: it is not an ``Exception``, so no check records it.

The kernel may hand a process's signal to any of its threads (torch's pools, a transport's), and Python then runs
the handler only when the main thread next runs Python code, which a wait with a long timeout can put off. So a
small thread sits on the signal wakeup fd: it kills the ranks the moment any thread took the signal (which ends the
main thread's wait on them) and, if the handler still has not run, interrupts the main thread itself.

Rank processes never outlive the process that started them: each asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``), so even a parent killed by SIGKILL leaves nothing behind; they ignore SIGINT, which the
terminal sends to them too, because deciding to stop is the parent's (a rank's KeyboardInterrupt would otherwise
come back as a task failure and the next item would start). Under torchrun each rank is a pytest run of its own:
it stops on the signal like any run, and dies with the launcher if the launcher is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["STOP_SIGNALS", "StopRequested", "adopt", "as_rank", "die_with_parent", "disown", "install",
           "kill_children", "raise_if_requested", "requested"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_CHILDREN: set[int] = set()  # pids of the rank processes this process started and has not reaped
_REQUESTED: list[str] = []  # the signals that asked this run to stop, first one first
_RELAYED: list[int] = []  # signals the watch thread sent the main thread again (not a second request)
HANDLER_WITHIN_S = 0.2  # how long the main thread gets to run the handler before the watch thread interrupts it
_STOP_WATCH = 0  # the byte that ends the watch thread (no signal is numbered 0)
_WATCHING: list[bool] = []  # non-empty while install()'s handlers and wakeup fd are in place


def _forked_child() -> None:
    """In any process forked from this one: its signals are its own, not this run's (a fork shares the wakeup fd's
    pipe, so a signal to the child would otherwise read as one to the run), and it started no rank."""
    _CHILDREN.clear()
    if _WATCHING:
        with contextlib.suppress(ValueError):  # forked from a thread other than the main one: nothing was shared
            signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forked_child)


class StopRequested(KeyboardInterrupt):
    """The run was asked to stop by a signal: pytest ends the session as interrupted."""


def adopt(pid: int) -> None:
    """A rank process this process started: killed at once if the run is asked to stop."""
    _CHILDREN.add(pid)


def disown(pid: int) -> None:
    """A rank process that was reaped."""
    _CHILDREN.discard(pid)


def kill_children() -> None:
    """SIGKILL every rank process this process started (reaping is left to whoever holds them)."""
    for pid in list(_CHILDREN):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def requested() -> str:
    """The name of the signal that asked this run to stop ("" when none did)."""
    return _REQUESTED[0] if _REQUESTED else ""


def raise_if_requested() -> None:
    """Raise the stop where a wait can take it. The handler's own raise is lost when the signal lands inside code
    whose exceptions Python only reports (an at-fork callback, a finalizer): a world starting its ranks is in one
    at every fork. Waits that outlast a signal call this, so the run still stops."""
    if _REQUESTED:
        name = _REQUESTED[0]
        raise StopRequested(f"{'Ctrl-C' if name == 'SIGINT' else name}: the run was asked to stop; every rank process "
                            "it started was killed")


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _RELAYED and _REQUESTED:  # the watch thread's nudge of a request already being handled
        _RELAYED.pop()
        return
    _REQUESTED.append(name)
    kill_children()
    if len(_REQUESTED) > 1:  # asked again while stopping: stop now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
    raise_if_requested()


def install() -> Callable[[], None]:
    """Handle the stop signals in this (main) process; returns what puts the previous handlers back.

    Outside the main thread of the main interpreter (an in-process run inside a thread) nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)
    outer = list(_REQUESTED)  # an enclosing run's request (an in-process run inside a run), put back at restore
    _REQUESTED.clear()
    _RELAYED.clear()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    active = threading.Event()
    active.set()
    watch = threading.Thread(target=_watch_signals, args=(read_end, threading.main_thread().ident, active),
                             name="parity-stop-signals", daemon=True)
    watch.start()
    _WATCHING.append(True)

    def restore() -> None:
        active.clear()  # first: a watch thread between a signal and its nudge must not nudge the enclosing run
        with contextlib.suppress(OSError):
            os.write(write_end, bytes([_STOP_WATCH]))
        watch.join(timeout=2 * HANDLER_WITHIN_S + 1.0)
        _WATCHING.clear()
        _REQUESTED[:] = outer
        _RELAYED.clear()
        signal.set_wakeup_fd(previous_fd)
        for fd in (read_end, write_end):
            with contextlib.suppress(OSError):
                os.close(fd)
        for signum, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    return restore


def _watch_signals(read_end: int, main_thread: int | None, active: threading.Event) -> None:
    """The wakeup fd's reader: on a stop signal, kill the ranks now and make sure the main thread hears of it."""
    stops = {int(s) for s in STOP_SIGNALS}
    while True:
        try:
            got = os.read(read_end, 64)
        except OSError:
            return
        if not got or _STOP_WATCH in got or not active.is_set():
            return
        for signum in (b for b in got if b in stops):
            kill_children()
            if _REQUESTED or _RELAYED:  # already being handled (or this is the nudge coming back)
                continue
            threading.Event().wait(HANDLER_WITHIN_S)
            if not _REQUESTED and main_thread is not None and active.is_set():  # the main thread sits in a wait
                _RELAYED.append(signum)
                with contextlib.suppress(OSError, ValueError):
                    signal.pthread_kill(main_thread, signum)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def as_rank(parent_pid: int) -> None:
    """Set a freshly started rank process up: it dies with ``parent_pid``, leaves Ctrl-C to it, and ends at once on
    SIGTERM or SIGHUP (the handlers a fork inherited would raise into the rank's task instead)."""
    die_with_parent()
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # a fork inherits the parent's: this process's signals are not the parent's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    if os.getppid() != parent_pid:  # the parent died before the kernel was asked to tell this process
        os._exit(1)

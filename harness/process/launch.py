"""Runs launched by torchrun: this process is one rank of the launcher's group, not the parent of a world.

torchrun (one process per GPU, any number of nodes) sets RANK, WORLD_SIZE and LOCAL_RANK. Every rank
runs the same pytest session, so every rank reaches the same distributed task in the same order: the
task runs here, in this process, and the ranks then agree on the outcome. A failure on any rank thus
fails the task on every rank.

Agreement never rides on a collective that a stuck or dead peer could hold up. Every rank posts its
outcome of each step to a board (keys on the launcher's TCP store, a server no worker hosts under
torchrun) and reads the others' from it, and a heartbeat thread per rank bumps a counter there. So
while a rank waits (for its own task, or for the others' outcomes) it watches the board and gives up:

- ``grace_s`` after another rank posted a failure, when its own task is still stuck in a collective
  (it reports itself "blocked");
- as soon as a peer is gone: on this rank's own host (same kernel and pid namespace) its process is read
  from /proc, so a stopped (SIGSTOP) or exited (SIGKILL) peer is seen within half a second, and a live
  peer that is merely slow (an import holding the GIL for tens of seconds on a loaded machine) is never
  mistaken for a dead one; on another host, when its heartbeat has not moved for ``silence_s``. Such a
  peer is reported "died" with the phase it was in, and left out of every later agreement;
- ``stuck_s()`` after its own task entered a collective that a live peer has not reached (each rank posts how many
  collectives it entered, harness.process.progress), once that peer's own progress has stopped for as long (each rank's
  watch posts its pace: how long its position and the modules it runs stood still, whether its task thread's CPU
  time did, and, on a GPU, whether its stream still has work): that peer is named, and it names itself "stuck".
  A rank that computes is never named, however slowly;
- at the task's own time limit ("hung").

``silence_s + grace_s`` plus polling stays within ``fault_bound()`` (30 s by default, PARITY_FAULT_BOUND_S
or --fault-bound): every rank raises that soon after any rank raised, stopped or died, naming it. Task
results (tensors) still travel on a small gloo side group, once every rank has reported success, under
the same watch. A step whose collective never finished leaves the task group unusable: it is marked
lost, and the process leaves without waiting on it (harness.plugin exits once the session is reported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.process import progress, progress_lines

__all__ = ["ENV", "FAULT_BOUND_ENV", "Launch", "PeerLost", "agree", "fault_bound", "gather", "grace_s", "join",
           "joined", "launched", "leave", "lost", "mark_lost", "process_state", "run_task", "set_fault_bound",
           "silence_s", "stuck_s"]

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
FAULT_BOUND_ENV = "PARITY_FAULT_BOUND_S"
DEFAULT_FAULT_BOUND_S = 30.0
MIN_FAULT_BOUND_S = 3.0  # below this a busy rank's heartbeat jitter would read as a dead rank
HEARTBEAT_S = 0.5
POLL_S = 0.05
PHASE_TIMEOUT_S = 3600.0  # item phases: the slowest rank's pytest item may load a big model (liveness still watched)
BOARD_PREFIX = "fastpath-parity"
LOG = logging.getLogger("harness.process.launch")

_BOUND: list[float] = []  # set_fault_bound's value; else the environment's, else the default


def _bound_from(text: str, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < MIN_FAULT_BOUND_S:
        raise ValueError(f"{source}={text!r}: expected a number of seconds >= {MIN_FAULT_BOUND_S:g} (how soon every "
                         f"rank must raise after one raised, stopped or died; default {DEFAULT_FAULT_BOUND_S:g})")
    return value


def set_fault_bound(seconds: float | str | None, source: str = "--fault-bound") -> None:
    """The run's bound (None: back to the environment's or the default); a bad value is a ValueError naming it."""
    _BOUND.clear()
    if seconds is not None:
        _BOUND.append(_bound_from(str(seconds), source))


def fault_bound() -> float:
    """Seconds within which every rank raises after any rank raised, stopped or died."""
    if _BOUND:
        return _BOUND[0]
    text = os.environ.get(FAULT_BOUND_ENV, "").strip()
    return _bound_from(text, FAULT_BOUND_ENV) if text else DEFAULT_FAULT_BOUND_S


def silence_s() -> float:
    """A peer whose heartbeat has not moved for this long is gone (stopped or dead)."""
    return fault_bound() / 3


def grace_s() -> float:
    """After a peer failed, how long a rank's own step may still finish before it reports itself blocked."""
    return min(5.0, fault_bound() / 6)


def stuck_s() -> float:
    """How long peers wait inside a collective for a live rank that never reaches it before they name it.

    Two graces below the bound: the waiting ranks give up, then the straggler itself within one grace.
    """
    return fault_bound() - 2 * grace_s()


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int


class PeerLost(RuntimeError):
    """A peer stopped or died while this rank waited on it; ``gone`` maps each such rank to why and when."""

    def __init__(self, message: str, gone: dict[int, str]):
        super().__init__(message)
        self.gone = gone


def _host_key() -> str:
    """Which kernel and pid namespace this process lives in: ranks that share it can read each other in /proc."""
    parts = []
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.endswith("/pid") else Path(source).read_text().strip())
        except OSError:
            return ""  # no /proc: every peer is watched through its heartbeat
    return "|".join(parts)


def process_state(pid: int) -> str:
    """A local process's state letter from /proc (R, S, D, T, t, Z, ...), or "gone" when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]


LOCAL_GONE = {"T": "the process was stopped (SIGSTOP)", "t": "the process was stopped (traced)",
              "Z": "the process exited or was killed", "X": "the process exited or was killed",
              "gone": "the process exited or was killed"}
LOCAL_CONFIRM_S = 0.5  # a local peer must look stopped or gone for this long (a job-control stop and resume is not)


class _Board:
    """Every rank's outcome per step and a heartbeat per rank, on the launcher's store (never on a collective)."""

    def __init__(self, store: Any, beat_store: Any, launch: Launch):
        self.store = store
        self.launch = launch
        self.step = 0
        self.gone: dict[int, tuple[str, str]] = {}  # rank -> (the phase it was found gone in, why)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last heartbeat count, when it last moved)
        self._local: dict[int, int] = {}  # peer rank -> pid, for peers on this host
        self._odd_since: dict[int, float] = {}  # local peer -> since when it looks stopped or gone
        self._stop = threading.Event()
        self._beat_store = beat_store
        self._host = _host_key()
        self.store.set(f"who/{launch.rank}", json.dumps({"host": self._host, "pid": os.getpid()}))
        self._beat("start")
        self._thread = threading.Thread(target=self._beat_loop, name=f"parity-heartbeat-rank{launch.rank}",
                                        daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- liveness
    def _beat(self, _: str = "") -> None:
        self._beat_store.add(f"hb/{self.launch.rank}", 1)

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception as err:  # noqa: BLE001 - the store went away: the launcher is shutting down
                LOG.warning("rank %d: heartbeat stopped: %s", self.launch.rank, err)
                return

    def _learn_local_peers(self) -> None:
        """Which peers share this host (and pid namespace), read once each has posted who it is."""
        for rank in range(self.launch.world_size):
            if rank == self.launch.rank or rank in self._local or not self._host:
                continue
            key = f"who/{rank}"
            if self.store.check([key]):
                who = json.loads(self.store.get(key))
                self._local[rank] = who["pid"] if who["host"] == self._host else -1

    def lost_peers(self) -> dict[int, str]:
        """Peers (not yet gone) that stopped or died: rank -> why (a fixed sentence per cause).

        A peer on this host is read from /proc; a peer elsewhere is gone when its heartbeat has not moved for
        silence_s() (a rank that stays busy keeps beating, from its own thread).
        """
        ranks = [r for r in range(self.launch.world_size) if r != self.launch.rank and r not in self.gone]
        if not ranks:
            return {}
        self._learn_local_peers()
        now = time.monotonic()
        lost: dict[int, str] = {}
        remote = []
        for rank in ranks:
            pid = self._local.get(rank, -1)
            if pid < 0:
                remote.append(rank)
                continue
            state = process_state(pid)
            if state not in LOCAL_GONE:
                self._odd_since.pop(rank, None)
            elif now - self._odd_since.setdefault(rank, now) >= LOCAL_CONFIRM_S:
                lost[rank] = LOCAL_GONE[state]
        if remote:
            counts = self.store.multi_get([f"hb/{r}" for r in remote])
            for rank, raw in zip(remote, counts, strict=True):
                count = int(raw)
                last = self._seen.get(rank)
                if last is None or last[0] != count:
                    self._seen[rank] = (count, now)
                elif now - last[1] >= silence_s():
                    lost[rank] = f"no heartbeat for {silence_s():g} s: the process stopped or died"
        return lost

    def start_watch(self) -> None:
        """A fresh look at every peer, so time spent outside a wait never counts as silence."""
        self._seen.clear()
        self._odd_since.clear()
        with contextlib.suppress(Exception):
            self.lost_peers()

    # ----------------------------------------------------------------------------- outcomes
    def next_step(self) -> int:
        self.step += 1
        return self.step

    def post(self, step: int, outcome: tuple[str, str, str]) -> None:
        self.store.set(f"s{step}/r{self.launch.rank}", json.dumps(list(outcome)))
        if outcome[0] != "ok":
            self.store.add(f"s{step}/failed", 1)
        if step > 2:  # every rank read step - 2 before any rank could post step - 1
            with contextlib.suppress(Exception):
                self.store.delete_key(f"s{step - 2}/r{self.launch.rank}")
                self.store.delete_key(f"p{step - 2}/r{self.launch.rank}")
                self.store.delete_key(f"q{step - 2}/r{self.launch.rank}")

    def post_position(self, step: int, where: progress.Position) -> None:
        self.store.set(f"p{step}/r{self.launch.rank}", json.dumps(where.to_json()))

    def post_pace(self, step: int, pace: progress.Pace) -> None:
        self.store.set(f"q{step}/r{self.launch.rank}", json.dumps(pace.to_json()))

    def pace(self, step: int, rank: int) -> progress.Pace | None:
        """What ``rank`` last posted of its progress in ``step`` (None before it posted any)."""
        key = f"q{step}/r{rank}"
        if not self.store.check([key]):
            return None
        return progress.Pace.from_json(json.loads(self.store.get(key)))

    def positions(self, step: int) -> dict[int, progress.Position]:
        """Where every rank that posted one is inside ``step`` (its collectives; harness.process.progress)."""
        keys = {r: f"p{step}/r{r}" for r in range(self.launch.world_size) if r not in self.gone}
        present = {r: k for r, k in keys.items() if self.store.check([k])}
        if not present:
            return {}
        raw = self.store.multi_get(list(present.values()))
        return {r: progress.Position.from_json(json.loads(v)) for r, v in zip(present, raw, strict=True)}

    def stragglers(self, step: int) -> list[progress.Straggler]:
        """Live ranks behind a collective some rank waits in during ``step`` (those that posted an outcome are not)."""
        finished = set(self.read(step))
        return progress.stragglers(self.positions(step), finished, self.launch.world_size,
                                   unseen="an earlier step: it has not started this task")

    def failures(self, step: int) -> int:
        return int(self.store.add(f"s{step}/failed", 0))

    def read(self, step: int) -> dict[int, tuple[str, str, str]]:
        """The outcomes posted so far for ``step`` (gone ranks are not waited for)."""
        keys = {r: f"s{step}/r{r}" for r in range(self.launch.world_size) if r not in self.gone}
        present = {r: k for r, k in keys.items() if self.store.check([k])}
        if not present:
            return {}
        raw = self.store.multi_get(list(present.values()))
        return {r: tuple(json.loads(v)) for r, v in zip(present, raw, strict=True)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)


@dataclass
class _Joined:
    launch: Launch
    backend: str
    side: Any  # the gloo group task results travel on
    board: _Board
    lost: str = ""  # why the task group can no longer be trusted (a step's collective never finished)
    stuck: list[threading.Thread] = field(default_factory=list)


_JOINED: _Joined | None = None


def launched() -> Launch | None:
    """This rank's place in a torchrun launch, or None when the process was not launched by torchrun."""
    present = [name for name in ENV if name in os.environ]
    if not present:
        return None
    missing = [name for name in ENV if name not in os.environ]
    if missing:
        raise ValueError(f"a torchrun launch sets {', '.join(ENV)}; this environment has {present} "
                         f"but not {missing}")
    try:
        values = {name: int(os.environ[name]) for name in ENV}
    except ValueError:
        raise ValueError(f"{', '.join(ENV)} must be integers, got "
                         f"{ {name: os.environ[name] for name in ENV} }") from None
    launch = Launch(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if not 0 <= launch.rank < launch.world_size or launch.local_rank < 0:
        raise ValueError(f"torchrun environment out of range: RANK={launch.rank}, WORLD_SIZE={launch.world_size}, "
                         f"LOCAL_RANK={launch.local_rank}")
    return launch


def _board_stores(launch: Launch, timeout: datetime.timedelta) -> tuple[Any, Any]:
    """Two clients of the launcher's store (MASTER_ADDR:MASTER_PORT): one to poll, one for the heartbeat."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        raise ValueError(f"a torchrun launch sets MASTER_ADDR and MASTER_PORT (the store the ranks agree on); got "
                         f"MASTER_ADDR={host!r}, MASTER_PORT={port!r}")
    attempt = (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run = f"{BOARD_PREFIX}/{attempt[0]}/{attempt[1]}"
    clients = []
    for _ in range(2):
        client = dist.TCPStore(host, int(port), launch.world_size, is_master=False, timeout=timeout)
        clients.append(dist.PrefixStore(run, client))
    LOG.info("rank %d: board on the launcher's store %s:%s (%s)", launch.rank, host, port, run)
    return clients[0], clients[1]


def join(device_type: str, pg_timeout_s: float = 300.0) -> Launch:
    """Join the launcher's group once (env://): NCCL on cuda:LOCAL_RANK, gloo on the CPU; idempotent."""
    global _JOINED
    launch = launched()
    if launch is None:
        raise ValueError(f"not launched by torchrun: {', '.join(ENV)} are not in the environment")
    if _JOINED is not None:
        wanted = "nccl" if device_type == "cuda" else "gloo"
        if _JOINED.backend != wanted:
            raise ValueError(f"this rank already joined the launcher's group on {_JOINED.backend}; "
                             f"a {device_type} world needs {wanted}")
        return _JOINED.launch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if launch.local_rank >= visible:
            raise ValueError(f"LOCAL_RANK={launch.local_rank} needs GPU {launch.local_rank}; {visible} visible "
                             "(launch at most one process per GPU: --nproc-per-node <= the GPU count)")
        torch.cuda.set_device(launch.local_rank)
    else:
        torch.set_num_threads(1)  # the node's ranks share its cores
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    stores = _board_stores(launch, datetime.timedelta(seconds=max(silence_s(), 1.0)))
    if not dist.is_initialized():
        with _arrivals(stores[0], launch, backend):
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
    elif dist.get_backend() != backend:
        raise ValueError(f"the default group is {dist.get_backend()}, a {device_type} world needs {backend}")
    board = _Board(*stores, launch)
    # results only: it is used once every rank reported success, and under the same watch as the board
    side = dist.new_group(backend="gloo", timeout=timeout)
    _JOINED = _Joined(launch, backend, side, board)
    return launch


ARRIVALS_EVERY_S = 5.0  # how often rank 0 says how many ranks reached the rendezvous while it waits
WAITING_AFTER_S = 10.0  # a wait on peers' outcomes longer than this is said on stderr (rank 0), then every as long


@contextlib.contextmanager
def _arrivals(store: Any, launch: Launch, backend: str) -> Iterator[None]:
    """Around the rendezvous: every rank counts itself in on the launcher's store, and rank 0 says how many of the
    world have arrived while it waits (a node that comes late, or never, is seen as a count that stops short)."""
    store.add("arrived", 1)
    if launch.rank != 0:
        yield
        return
    meter = progress_lines.Meter(f"torchrun launch: joining the {backend} group", launch.world_size,
                                 "ranks arrived", every_s=ARRIVALS_EVERY_S)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(ARRIVALS_EVERY_S):
            with contextlib.suppress(Exception):  # the store going away ends the rendezvous, which reports it
                meter.update(int(store.add("arrived", 0)), force=True)

    watcher = threading.Thread(target=watch, name="parity-arrivals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=2 * ARRIVALS_EVERY_S)
    meter.update(launch.world_size, "every rank joined", force=True)


def _joined() -> _Joined:
    if _JOINED is None:
        raise RuntimeError("join() the launcher's group first")
    return _JOINED


def joined() -> Launch | None:
    """This rank's launch once it joined the launcher's group, else None."""
    return _JOINED.launch if _JOINED is not None else None


def lost() -> str:
    """Why the launcher's group was given up ("" while it is usable)."""
    return _JOINED.lost if _JOINED is not None else ""


def mark_lost(reason: str) -> None:
    """Give up the launcher's task group (a collective on it never finished on some rank)."""
    joined = _joined()
    if not joined.lost:
        joined.lost = reason


def _gone_outcome(board: _Board, rank: int) -> tuple[str, str, str]:
    phase, why = board.gone[rank]
    return ("died", f"{why} (during {phase})", "")


def _note_gone(board: _Board, lost: dict[int, str], phase: str) -> None:
    for rank, why in lost.items():
        if rank not in board.gone:
            board.gone[rank] = (phase, why)
            LOG.warning("rank %d: rank %d lost during %s: %s", board.launch.rank, rank, phase, why)


def _wait_for_peers(board: _Board, step: int, phase: str, deadline: float) -> list[tuple[str, str, str]]:
    """Every rank's outcome of ``step`` in rank order; a silent peer is "died", a late one "hung" at ``deadline``."""
    world = board.launch.world_size
    began = time.monotonic()
    meter = progress_lines.Meter(f"torchrun launch: {phase}", world, "ranks reported", every_s=WAITING_AFTER_S)
    while True:
        posted = board.read(step)
        waiting = [r for r in range(world) if r not in posted and r not in board.gone]
        if not waiting:
            break
        if board.launch.rank == 0 and time.monotonic() - began >= WAITING_AFTER_S:
            meter.update(world - len(waiting), f"waiting on rank(s) {waiting}")
        _note_gone(board, {r: why for r, why in board.lost_peers().items() if r in waiting}, phase)
        if time.monotonic() >= deadline:
            for rank in waiting:
                if rank not in board.gone:
                    posted[rank] = ("hung", f"no outcome of {phase} before this rank's deadline", "")
            break
        time.sleep(POLL_S)
    return [posted[r] if r in posted else _gone_outcome(board, r) for r in range(world)]


def agree(status: str, error: str = "", trace: str = "", *, phase: str = "an item phase",
          timeout_s: float = PHASE_TIMEOUT_S) -> list[tuple[str, str, str]]:
    """Every rank's (status, error, traceback) for the same step, in rank order, read from the board.

    Waits for the slowest live rank up to ``timeout_s``; a rank that stops or dies is reported "died"
    (within half a second on this host, silence_s() elsewhere), and is not waited for again.
    """
    board = _joined().board
    step = board.next_step()
    board.start_watch()
    board.post(step, (status, error, trace))
    return _wait_for_peers(board, step, phase, time.monotonic() + timeout_s)


def _stalled(board: _Board, step: int, straggler: progress.Straggler, own: progress.Pace | None,
             ) -> progress.Straggler | None:
    """``straggler`` with why it counts as stuck, or None while its posted pace shows progress (a rank that posted
    no pace for this step, still in an earlier one, is judged by its position alone)."""
    pace = own if straggler.rank == board.launch.rank else board.pace(step, straggler.rank)
    if pace is None:
        return straggler
    why = progress.stalled(pace, progress.peers_cpu_s(board.positions(step), straggler), stuck_s())
    return dataclasses.replace(straggler, why=why) if why else None


def _straggler_status(board: _Board, step: int, phase: str, rank: int, own: progress.Pace | None = None,
                      judge: bool = False) -> tuple[str, str, str] | None:
    """This rank's outcome when some rank never reached the collective it waits in (or when it is that rank), or
    when every other rank of its group returned without entering it. ``judge``: only a straggler whose own progress
    stopped counts (this rank decides to give up on it); otherwise being behind is enough (its peers already did)."""
    found = board.stragglers(step)
    if not found:
        positions = board.positions(step)
        alone = [a for a in progress.abandoned(positions, set(board.read(step)), board.launch.world_size)
                 if a.rank == rank]
        return ("blocked", alone[0].cause(stuck_s()), "") if alone else None
    mine = next((s for s in found if s.rank == rank), None)
    if mine is not None:
        return ("stuck", (_stalled(board, step, mine, own) or mine).cause(stuck_s()), "")
    if judge:
        found = [s for s in (_stalled(board, step, s, own) for s in found) if s is not None]
        if not found:
            return None
    first = found[0]
    return ("blocked", f"{first.text(stuck_s())}, while this rank waited inside it during {phase}", "")


def _watched(work: Callable[[], Any], phase: str, deadline: float, step: int | None,
             ) -> tuple[tuple[str, str, str], Any]:
    """Run ``work`` on a daemon thread while watching the board: (status, error, traceback) and its result.

    Gives up on the thread ``grace_s()`` after a peer failed this step or went silent, at ``deadline``, or (in a
    task step) once it has waited stuck_s() inside a collective that a live peer never reached, naming that peer;
    the abandoned thread sits in a collective that can never finish, so the task group is marked lost. Where the
    worker is (harness.process.progress) goes to the board as it moves, so a waiting peer can tell who is behind.
    """
    joined = _joined()
    board = joined.board
    rank = joined.launch.rank
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            if joined.backend == "nccl":
                torch.cuda.set_device(joined.launch.local_rank)  # the current device is per thread
            if step is not None:
                progress.task_thread()
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 - every failure is reported to every rank
            box["error"] = (f"{type(err).__name__}: {err}", traceback.format_exc())

    worker = threading.Thread(target=target, name=f"parity-{phase}-rank{rank}", daemon=True)
    board.start_watch()
    posted: progress.Position | None = None
    if step is not None:
        posted = progress.position()[0]
        board.post_position(step, posted)
    meter = progress.PaceMeter(stuck_s())
    pace: progress.Pace | None = None
    paced = -math.inf
    worker.start()
    given_up: float | None = None
    why = ""
    while worker.is_alive():
        worker.join(POLL_S)
        if not worker.is_alive():
            break
        now = time.monotonic()
        if step is not None:
            where, since = progress.position()
            if where != posted:
                board.post_position(step, where)
                posted = where
            if now - paced >= HEARTBEAT_S:
                paced = now
                pace = meter.sample(now, (where, progress.work_done()), progress.task_cpu_s(), _device_busy(joined))
                board.post_pace(step, pace)
            if given_up is None and where.inside is not None and now - since >= stuck_s():
                named = _straggler_status(board, step, phase, rank, pace, judge=True)
                if named is not None:
                    joined.stuck.append(worker)
                    mark_lost(f"{phase} did not finish on rank {rank}: {named[1]}")
                    return named, None
        if given_up is None:
            failed = step is not None and board.failures(step) > 0
            lost = board.lost_peers()
            if failed or lost:
                _note_gone(board, lost, phase)
                given_up = now + grace_s()
                why = (f"another rank failed {phase}" if failed else
                       f"rank(s) {sorted(lost)} stopped or died during {phase}")
        if given_up is not None and now >= given_up:
            joined.stuck.append(worker)
            named = _straggler_status(board, step, phase, rank, pace) if step is not None else None
            if named is not None and named[0] == "stuck":
                mark_lost(f"{phase} did not finish on rank {rank}: it {named[1]}")
                return named, None
            mark_lost(f"{phase} did not finish on rank {rank} after {why}")
            return ("blocked", f"still inside {phase} {grace_s():g} s after {why}", ""), None
        if now >= deadline:
            joined.stuck.append(worker)
            mark_lost(f"{phase} hung on rank {rank}")
            return ("hung", f"no result within the time limit of {phase}", ""), None
    if "error" in box:
        return ("raised", *box["error"]), None
    return ("ok", "", ""), box.get("result")


def _device_busy(joined: _Joined) -> bool:
    """Whether this rank's GPU stream still has work queued (a rank waiting on its device is computing)."""
    if joined.backend != "nccl":
        return False
    try:
        return not torch.cuda.current_stream(joined.launch.local_rank).query()
    except Exception:  # noqa: BLE001 - a device that cannot be asked shows no progress; its CPU time still may
        return False


def run_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float,
             ) -> tuple[list[tuple[str, str, str]], Any]:
    """Run ``fn`` on this rank under the watch, then agree: (every rank's outcome in rank order, this result)."""
    joined = _joined()
    board = joined.board
    name = getattr(fn, "__qualname__", repr(fn))
    phase = f"task {name}"
    step = board.next_step()
    began = time.monotonic()
    progress.begin()
    try:
        mine, result = _watched(lambda: fn(*args, **kwargs), phase, began + timeout_s, step)
    finally:
        progress.end()
    board.post(step, mine)
    # a peer still running its task is waited for until its own time limit (same timeout), plus the grace
    outcomes = _wait_for_peers(board, step, phase, began + timeout_s + grace_s() + 1.0)
    return outcomes, result


def gather(result: Any) -> list[Any]:
    """Every rank's result in rank order (on the side group, so CPU objects only travel), under the watch."""
    import torch.distributed as dist

    joined = _joined()
    slots: list[Any] = [None] * joined.launch.world_size
    status, value = _watched(lambda: dist.all_gather_object(slots, result, group=joined.side), "the result gather",
                             time.monotonic() + PHASE_TIMEOUT_S, None)
    if status[0] == "raised":
        raise RuntimeError(f"the result gather failed on rank {joined.launch.rank}: {status[1]}")
    if status[0] != "ok":
        gone = {r: f"{why} (during {phase})" for r, (phase, why) in joined.board.gone.items()}
        raise PeerLost(f"the result gather did not finish: {status[1]}", gone)
    del value
    return slots


def leave() -> None:
    """Destroy the launcher's group at the end of the session (NCCL warns about a group left behind)."""
    global _JOINED
    if _JOINED is None:
        return
    import torch.distributed as dist

    _JOINED.board.close()
    if dist.is_initialized() and not _JOINED.lost:
        dist.destroy_process_group()
    _JOINED = None

"""Runs launched by torchrun: this process is one rank of the launcher's group, not the parent of a world.

torchrun (one process per GPU, any number of nodes) sets RANK, WORLD_SIZE and LOCAL_RANK. Every rank
runs the same pytest session, so every rank reaches the same distributed task in the same order: the
task runs here, in this process, and the ranks then agree on the outcome over a small gloo side group
(a few bytes of status per rank; results only once every rank succeeded). A failure on any rank thus
fails the task on every rank, and the side group stays usable when the task's own group is stuck.
"""

from __future__ import annotations

import datetime
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ENV", "Launch", "agree", "gather", "join", "joined", "launched", "leave", "lost", "mark_lost", "run_here"]

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SIDE_TIMEOUT_S = 3600.0  # the side group waits for the slowest rank's pytest item, which may load a big model


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int


@dataclass
class _Joined:
    launch: Launch
    backend: str
    side: Any  # the gloo group outcomes travel on
    lost: str = ""  # why the task group can no longer be trusted (a task hung inside a collective)


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
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=pg_timeout_s))
    elif dist.get_backend() != backend:
        raise ValueError(f"the default group is {dist.get_backend()}, a {device_type} world needs {backend}")
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SIDE_TIMEOUT_S))
    _JOINED = _Joined(launch, backend, side)
    return launch


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


def agree(status: str, error: str = "", trace: str = "") -> list[tuple[str, str, str]]:
    """Every rank's (status, error, traceback) for the same step, in rank order (on the side group)."""
    import torch.distributed as dist

    joined = _joined()
    slots: list[Any] = [None] * joined.launch.world_size
    dist.all_gather_object(slots, (status, error, trace), group=joined.side)
    return slots


def gather(result: Any) -> list[Any]:
    """Every rank's result in rank order (on the side group, so CPU objects only travel)."""
    import torch.distributed as dist

    joined = _joined()
    slots: list[Any] = [None] * joined.launch.world_size
    dist.all_gather_object(slots, result, group=joined.side)
    return slots


def run_here(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             timeout_s: float) -> tuple[tuple[str, str, str], Any]:
    """Run ``fn`` on this rank with a time limit: ((status, error, traceback), result).

    The task runs on a daemon thread so a rank stuck in a collective still reports "hung" and reaches
    the side group; its group is then marked lost, since the stuck collective can never complete.
    """
    joined = _joined()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            if joined.backend == "nccl":
                torch.cuda.set_device(joined.launch.local_rank)  # the current device is per thread
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - every task failure is reported to every rank
            box["error"] = (f"{type(err).__name__}: {err}", traceback.format_exc())

    worker = threading.Thread(target=target, name=f"parity-task-rank{joined.launch.rank}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        joined.lost = f"a task hung on rank {joined.launch.rank} (no result within {timeout_s:g} s)"
        return ("hung", f"no result within {timeout_s:g} s", ""), None
    if "error" in box:
        return ("raised", *box["error"]), None
    return ("ok", "", ""), box["result"]


def mark_lost(reason: str) -> None:
    """Give up the launcher's group (another rank hung in a collective this rank may still be part of)."""
    _joined().lost = reason


def leave() -> None:
    """Destroy the launcher's group at the end of the session (NCCL warns about a group left behind)."""
    global _JOINED
    if _JOINED is None:
        return
    import torch.distributed as dist

    if dist.is_initialized() and not _JOINED.lost:
        dist.destroy_process_group()
    _JOINED = None

"""Module-level tasks for the world tests (tasks travel to ranks by reference)."""

import time

import torch
import torch.distributed as dist


def all_gather_ranks(scale: float) -> torch.Tensor:
    mine = torch.tensor([float(dist.get_rank()) * scale])
    slots = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(slots, mine)
    return torch.cat(slots)


def raise_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"injected failure on rank {rank}")
    return dist.get_rank()


def raise_before_gather(rank: int) -> torch.Tensor:
    """``rank`` raises before the all-gather every other rank enters."""
    if dist.get_rank() == rank:
        raise ValueError(f"injected failure on rank {rank} before the gather")
    return all_gather_ranks(1.0)


def return_before_gather(rank: int) -> torch.Tensor | None:
    """``rank`` returns, without raising, before the all-gather every other rank enters."""
    if dist.get_rank() == rank:
        return None
    return all_gather_ranks(1.0)


def hang_on(rank: int) -> int:
    if dist.get_rank() == rank:
        time.sleep(3600)
    return dist.get_rank()


def pid() -> int:
    import os

    return os.getpid()


def double(x: int, key: object = None, value: object = None, layout: object = None, *, scale: object = None) -> int:
    """An implementation under test for the conformance counting test (importable in a spawned rank), shaped like
    the attention contract it stands in for."""
    return 2 * x


def call_implementation(path: str, raise_after: bool) -> int:
    """Call the implementation under test of ``path`` once on this rank (then raise, if asked)."""
    from harness.plugins import conformance

    answer = conformance.resolve(path, lambda x: x)(1)
    if raise_after:
        raise RuntimeError(f"rank {dist.get_rank()} raised after calling the implementation under test")
    return answer


def signal_on(rank: int, signum: int) -> int:
    """``rank`` stops or kills itself (SIGSTOP, SIGKILL); the others answer at once."""
    import os

    if dist.get_rank() == rank:
        os.kill(os.getpid(), signum)
    return dist.get_rank()


def stuck_before_gather(rank: int) -> torch.Tensor:
    """``rank`` never reaches the all-gather its peers wait in (alive, busy in Python); the others go in."""
    from harness.process import progress

    if dist.get_rank() == rank:
        progress.note("a long sleep before the all-gather")
        time.sleep(3600)
    return all_gather_ranks(1.0)


def stuck_after_first_gather(rank: int) -> torch.Tensor:
    """Every rank meets at one all-gather; then ``rank`` never reaches the second."""
    first = all_gather_ranks(1.0)
    if dist.get_rank() == rank:
        time.sleep(3600)
    return first + all_gather_ranks(2.0)


def spinning_before_gather(rank: int) -> torch.Tensor:
    """``rank`` loops in Python forever (alive, its CPU busy, computing nothing) while the others go in."""
    from harness.process import progress

    if dist.get_rank() == rank:
        progress.note("a loop in Python before the all-gather")
        turns = 0
        while turns >= 0:
            turns += 1
    return all_gather_ranks(1.0)


def deadlocked_before_gather(rank: int) -> torch.Tensor:
    """``rank`` takes a lock it already holds (a deadlock) while the others go in."""
    import threading

    from harness.process import progress

    if dist.get_rank() == rank:
        progress.note("taking a lock before the all-gather")
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    return all_gather_ranks(1.0)


def product_rounds(rounds: int, size: int = 192) -> float:
    """Real work without a module: ``rounds`` matrix products on this thread (seeded inputs)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator) / size**0.5
    b = a.clone()
    for _ in range(rounds):
        b = torch.tanh(a @ b)
    return float(b.sum())


def module_rounds(rounds: int, width: int = 192) -> float:
    """Real work through modules: ``rounds`` passes of a small MLP."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    x = torch.randn(8, width)
    with torch.no_grad():
        for _ in range(rounds):
            x = net(x)
    return float(x.sum())


def slower_before_gather(rank: int, rounds: int, factor: int, modules: bool) -> float:
    """Every rank does ``rounds`` of real work (or none, with ``modules``), ``rank`` does ``factor`` times as much,
    then they all-gather: returns when this rank entered the gather (time.monotonic, one host's clock)."""
    work = module_rounds if modules else product_rounds
    mine = rounds * factor if dist.get_rank() == rank else (0 if modules else rounds)
    if mine:
        work(mine)
    entered = time.monotonic()
    all_gather_ranks(1.0)
    return entered


def slowed(decoder, seconds: float, calls: int | None = None):
    """``decoder`` with each call (or only its first ``calls``) repeated until ``seconds`` have passed: real work
    for that long, however fast or loaded the machine (a count measured on a first, cold call would not be)."""
    made = [0]

    def decode(tile: torch.Tensor) -> torch.Tensor:
        made[0] += 1
        until = time.perf_counter() + (seconds if calls is None or made[0] <= calls else 0.0)
        out = decoder(tile)
        while time.perf_counter() < until:
            out = decoder(tile)
        return out

    return decode


def alone_in_gather(rank: int) -> int:
    """``rank`` enters an all-gather that every other rank returns without entering."""
    if dist.get_rank() == rank:
        all_gather_ranks(1.0)
    return dist.get_rank()


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that are still running (not gone, not zombies): what a world left behind."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split()[2] != "Z":
                    running.append(pid)
        except FileNotFoundError:
            pass
    return running

"""Worlds on real gloo groups: round trips, a raise on one rank, a hang on one rank, no leftovers."""

import os
import signal
import time

import pytest
import torch

from harness import dist as dist_mod
from harness import launch
from harness.dist import World, WorldError, WorldPool, WorldTaskError, WorldTimeout
from tests import dist_tasks

pytestmark = pytest.mark.cpu


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split()[2] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


@pytest.fixture(scope="module")
def world8():
    with World(8) as world:
        yield world


def test_eight_rank_all_gather_round_trip(world8):
    results = world8.run(dist_tasks.all_gather_ranks, 2.0)
    expected = torch.arange(8, dtype=torch.float32) * 2.0
    assert len(results) == 8
    for rank, gathered in enumerate(results):
        assert torch.equal(gathered, expected), f"rank {rank} gathered {gathered}"


def test_raise_on_one_rank_lists_every_rank(world8):
    with pytest.raises(WorldTaskError) as info:
        world8.run(dist_tasks.raise_on, 3)
    err = info.value
    assert err.raised_ranks == [3]
    assert [o.status for o in err.outcomes] == ["ok"] * 3 + ["raised"] + ["ok"] * 4
    text = str(err)
    assert "rank 3: raised: ValueError: injected failure on rank 3" in text
    assert "--- rank 3 traceback ---" in text
    # the world survives a task that every rank answered
    assert world8.run(dist_tasks.all_gather_ranks, 1.0)[0].tolist() == list(range(8))


def test_hang_on_one_rank_times_out_and_leaves_no_process():
    world = World(4).start()
    pids = world.run(dist_tasks.pid)
    began = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        world.run(dist_tasks.hang_on, 2, timeout_s=2.0)
    assert time.monotonic() - began < 10.0
    assert info.value.hung == [2]
    assert "timed out after 2 s on ranks [2] of 4" in str(info.value)
    assert not world.alive
    assert _alive(pids) == [], f"rank processes left behind: {_alive(pids)}"
    with pytest.raises(WorldError, match="not running"):
        world.run(dist_tasks.pid)


@pytest.fixture
def short_bound():
    """A 3 s fault bound: stragglers are named after 2 s (two half-second graces below it)."""
    launch.set_fault_bound(3.0)
    yield launch.fault_bound()
    launch.set_fault_bound(None)


@pytest.mark.parametrize(("task", "collective", "last"), [
    (dist_tasks.stuck_before_gather, "all_gather #1", "a long sleep before the all-gather"),
    (dist_tasks.stuck_after_first_gather, "all_gather #2", "all_gather #1, which it left"),
])
def test_a_live_rank_that_never_reaches_its_peers_collective_is_named_within_the_bound(short_bound, task,
                                                                                        collective, last):
    """Rank 2 is alive and busy in Python while the others wait in a collective it never enters: it is named, with
    the collective and where it was last seen, within the bound (not at the transport's own 300 s timeout), the
    others are reported as waiting for it, and nothing is left behind."""
    world = World(4).start()
    pids = world.run(dist_tasks.pid)
    began = time.monotonic()
    with pytest.raises(WorldTaskError) as info:
        world.run(task, 2, timeout_s=120.0)
    took = time.monotonic() - began
    assert took < short_bound, f"named after {took:.1f} s"
    text = str(info.value)
    assert text.startswith(f"task {task.__qualname__}: rank 2 did not reach {collective} within 2 s "
                           f"(last seen in {last}); ranks [0, 1, 3] waited for it there"), text
    assert [o.status for o in info.value.outcomes] == ["blocked", "blocked", "stuck", "blocked"]
    assert f"rank 0: blocked: waited in {collective} for rank(s) [2]" in text
    assert not world.alive and _alive(pids) == [], f"rank processes left behind: {_alive(pids)}"


def test_a_rank_left_alone_in_a_collective_its_peers_returned_without_is_named_within_the_bound(short_bound):
    world = World(4).start()
    pids = world.run(dist_tasks.pid)
    began = time.monotonic()
    with pytest.raises(WorldTaskError) as info:
        world.run(dist_tasks.alone_in_gather, 2, timeout_s=120.0)
    assert time.monotonic() - began < short_bound
    assert str(info.value).startswith("task alone_in_gather: rank 2 waited 2 s alone in all_gather #1: ranks "
                                      "[0, 1, 3] returned without entering it"), str(info.value)
    assert [o.status for o in info.value.outcomes] == ["ok", "ok", "blocked", "ok"]
    assert not world.alive and _alive(pids) == []


def test_pool_reuses_and_restarts_worlds():
    pool = WorldPool()
    try:
        first = pool.get(2)
        assert pool.get(2) is first
        with pytest.raises(WorldTimeout):
            first.run(dist_tasks.hang_on, 0, timeout_s=1.0)
        second = pool.get(2)
        assert second is not first and second.alive
        assert second.run(dist_tasks.all_gather_ranks, 1.0)[1].tolist() == [0.0, 1.0]
    finally:
        pool.close()


def test_world_sizes_the_group_cannot_have():
    with pytest.raises(ValueError, match="at least 1 rank"):
        World(0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            World(2, device="cuda")


def test_closing_a_world_reaps_every_rank(world8):
    world = World(3).start()
    pids = world.run(dist_tasks.pid)
    assert len(set(pids)) == 3 and os.getpid() not in pids
    world.close()
    assert _alive(pids) == []


@pytest.mark.parametrize(("signum", "said"), [(signal.SIGSTOP, "died: the process was stopped (SIGSTOP)"),
                                              (signal.SIGKILL, "died: rank process killed by signal 9")])
def test_a_stopped_or_killed_rank_fails_every_rank_within_the_grace_and_leaves_nothing(signum, said):
    """A stopped rank never answers and never closes its pipe: it is read from /proc, not waited out."""
    world = World(3).start()
    pids = world.run(dist_tasks.pid)
    began = time.monotonic()
    with pytest.raises(WorldTaskError) as info:
        world.run(dist_tasks.signal_on, 1, signum, timeout_s=120.0)
    took = time.monotonic() - began
    assert took < dist_mod.ERROR_GRACE_S, f"{took:.1f} s: the stopped rank was waited out, not read from /proc"
    assert f"rank 1: {said}" in str(info.value)
    assert [o.status for o in info.value.outcomes][1] == "died"
    assert not world.alive and _alive(pids) == [], f"rank processes left behind: {_alive(pids)}"


def test_error_text_keeps_no_per_run_detail():
    text = "ValueError: [/torch/csrc/x.cpp:12] bad store at [::1]:2204, 10.0.0.3:29500; pid 4242 at 0x7f3a2b1c0d00"
    assert dist_mod.stable_error(text) == ("ValueError: bad store at [::1]:<port>, 10.0.0.3:<port>; pid <pid> at "
                                           "0x<address>")
    reset = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:46803: "
             "Connection reset by peer. This is typically caused by a remote worker hanging")
    closed = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Connection closed by peer "
              "[127.0.0.1]:10393. This is typically caused by a remote worker crashing")
    assert dist_mod.stable_error(reset) == dist_mod.stable_error(closed) == f"RuntimeError: {dist_mod.LOST_PEER_TEXT}"

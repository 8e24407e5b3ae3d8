"""Worlds on real gloo groups: round trips, a raise on one rank, a stopped or killed rank, no leftovers (the
failures that wait out a bound are in tests/test_dist_bounds.py)."""

import os
import signal
import time

import pytest
import torch

from harness.process import dist as dist_mod
from harness.process.dist import ERROR_GRACE_S, World, WorldPool, WorldTaskError, WorldTimeout
from tests import dist_tasks
from tests.dist_tasks import alive as _alive

pytestmark = pytest.mark.cpu


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


@pytest.mark.parametrize(("task", "statuses", "headline", "blocked"), [
    (dist_tasks.raise_before_gather, ["blocked", "blocked", "raised", "blocked"], "failed on ranks [0, 1, 2, 3] of 4",
     "rank 0: blocked: waits in all_gather #1, which rank(s) [2] left the task without entering"),
    # no rank failed (a fast path that does not fail closed): without this the task would wait out its time limit
    (dist_tasks.return_before_gather, ["blocked", "blocked", "ok", "blocked"],
     "ranks [0, 1, 3] of 4 wait in a collective that ranks which returned never entered",
     "rank 0: blocked: waits in all_gather #1, which rank(s) [2] left the task without entering"),
    (dist_tasks.alone_in_gather, ["ok", "ok", "blocked", "ok"],
     "ranks [2] of 4 wait in a collective that ranks which returned never entered",
     "rank 2: blocked: waits in all_gather #1, which rank(s) [0, 1, 3] left the task without entering"),
], ids=["raised", "returned", "left_alone"])
def test_ranks_left_in_a_collective_by_ranks_that_left_the_task_fail_at_once(task, statuses, headline, blocked):
    """A rank raises, or returns, before the gather its peers wait in (or all its peers return without the one rank 2
    entered): nothing can bring the waiting ranks out, so the task fails as soon as the parent knows it, with no grace
    period or time limit waited out, each waiting rank named with the collective it waits in, and no process left."""
    world = World(4).start()
    try:
        pids = world.run(dist_tasks.pid)
        began = time.monotonic()
        with pytest.raises(WorldTaskError) as info:
            world.run(task, 2, timeout_s=120.0)
        took = time.monotonic() - began
    finally:
        world.close()
    assert [o.status for o in info.value.outcomes] == statuses, str(info.value)
    assert headline in str(info.value) and blocked in str(info.value), str(info.value)
    assert took < ERROR_GRACE_S, f"failed after {took:.1f} s: the grace period ({ERROR_GRACE_S:g} s) was waited out"
    assert dist_tasks.alive(pids) == []


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

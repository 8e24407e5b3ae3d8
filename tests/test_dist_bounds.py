"""Worlds that must fail within a bound: a hang on one rank, a live rank that never reaches its peers' collective,
a rank left alone in one. Each waits out its bound (2 s), so they run with the launchers (``launch``: scripts/test-all)
rather than in the cpu gate's time budget; tests/test_dist.py keeps the worlds' instant failures."""

import time

import pytest

from harness import launch
from harness.dist import World, WorldError, WorldTaskError, WorldTimeout
from tests import dist_tasks
from tests.dist_tasks import alive as _alive

pytestmark = pytest.mark.launch


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

"""Worlds that must fail within a bound: a hang on one rank, a live rank that never reaches its peers' collective.
Each waits out its bound (2 s), so they run with the launchers (``launch``: scripts/test-all)
rather than in the cpu gate's time budget; tests/test_dist.py keeps the worlds' instant failures (a rank
left in a collective by ranks that raised or returned among them)."""

import time

import pytest
import torch

from harness.process import launch
from harness.process.dist import World, WorldError, WorldTaskError, WorldTimeout
from tests import dist_tasks
from tests.dist_tasks import alive as _alive

pytestmark = [pytest.mark.launch, pytest.mark.wallclock]


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


IDLE = "no progress: its position, the modules it runs and its CPU time all stood still"
LOOPING = "busy without progress: it entered no collective and ran no module"


@pytest.mark.parametrize(("task", "collective", "last", "why"), [
    (dist_tasks.stuck_before_gather, "all_gather #1", "a long sleep before the all-gather", IDLE),
    (dist_tasks.stuck_after_first_gather, "all_gather #2", "all_gather #1, which it left", IDLE),
    (dist_tasks.deadlocked_before_gather, "all_gather #1", "taking a lock before the all-gather", IDLE),
    (dist_tasks.spinning_before_gather, "all_gather #1", "a loop in Python before the all-gather", LOOPING),
], ids=["asleep", "asleep-after-a-gather", "deadlocked", "spinning"])
def test_a_live_rank_that_never_reaches_its_peers_collective_is_named_within_the_bound(short_bound, task,
                                                                                        collective, last, why):
    """Rank 2 is alive (asleep, deadlocked, or looping in Python) while the others wait in a collective it never
    enters: it is named, with the collective, where it was last seen and why it counts as stuck, within the bound
    (not at the transport's own 300 s timeout), the others are reported as waiting for it, nothing is left behind."""
    world = World(4).start()
    pids = world.run(dist_tasks.pid)
    began = time.monotonic()
    with pytest.raises(WorldTaskError) as info:
        world.run(task, 2, timeout_s=120.0)
    took = time.monotonic() - began
    assert took < short_bound, f"named after {took:.1f} s"
    text = str(info.value)
    head = (f"task {task.__qualname__}: rank 2 did not reach {collective} within 2 s (last seen in {last}): {why}")
    assert text.startswith(head), text
    assert "; ranks [0, 1, 3] waited for it there; the world was torn down" in text.splitlines()[0], text
    assert [o.status for o in info.value.outcomes] == ["blocked", "blocked", "stuck", "blocked"]
    assert f"rank 0: blocked: waited in {collective} for rank(s) [2]" in text
    assert not world.alive and _alive(pids) == [], f"rank processes left behind: {_alive(pids)}"


def _rounds_for(seconds: float, modules: bool) -> int:
    """How many rounds of the task's work take about ``seconds`` of one thread on this host (measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = dist_tasks.module_rounds if modules else dist_tasks.product_rounds
        work(5)  # warm
        rounds, spent = 8, 0.0
        while spent < 0.25:
            rounds *= 2
            began = time.thread_time()
            work(rounds)
            spent = time.thread_time() - began
        per_round = spent / rounds
    finally:
        torch.set_num_threads(threads)
    return max(1, round(seconds / per_round))


@pytest.mark.parametrize("modules", [False, True], ids=["peers-did-the-same-work", "peers-had-none"])
def test_a_rank_three_times_slower_by_real_work_is_never_called_stuck(short_bound, modules):
    """Rank 2 does three times its peers' work (matrix products with no module, beside peers doing the same work
    once), or is the only rank with work (module forwards, beside peers with none): its peers wait in the gather
    longer than the bound's stuck time, and the task still succeeds on every rank, nobody named."""
    stuck_s = launch.stuck_s()
    # the peers' share of work takes the stuck time itself, so rank 2's two more shares leave it twice the stuck
    # time behind even where another run shares the cores (1.5 s shares left it 1.95 s behind there)
    rounds = _rounds_for(stuck_s, modules)
    world = World(4).start()
    try:
        entered = world.run(dist_tasks.slower_before_gather, 2, rounds, 3, modules, timeout_s=120.0)
    finally:
        world.close()
    waited = entered[2] - max(t for r, t in enumerate(entered) if r != 2)
    assert waited > stuck_s, (f"rank 2 reached the gather only {waited:.1f} s after its peers: the test did not make "
                              f"it slow enough to be called stuck under a wall-clock bound of {stuck_s:g} s")

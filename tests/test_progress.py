"""Who is behind a collective and who is stuck: the pure rules the world's parent and every torchrun rank apply to
positions and paces."""

import dataclasses

import pytest
import torch

from harness.process.progress import (
    BEFORE_FIRST,
    IDLE_CPU_SHARE,
    SPIN_FACTOR,
    Pace,
    PaceMeter,
    Position,
    WorkCounter,
    abandoned,
    begin,
    deserted,
    end,
    peers_cpu_s,
    stalled,
    stragglers,
    task_cpu_s,
    task_thread,
    work_done,
)

pytestmark = pytest.mark.cpu

WORLD = (0, 1, 2, 3)


def _waiting(group: tuple[int, ...], number: int, name: str = "all_gather") -> Position:
    return Position({group: number}, (group, number, name), f"{name} #{number - 1}, which it left")


def test_a_rank_that_entered_fewer_collectives_than_its_waiting_peers_is_behind():
    positions = {0: _waiting(WORLD, 2), 1: _waiting(WORLD, 2), 2: Position({WORLD: 1}, None, "decoding its pieces"),
                 3: _waiting(WORLD, 2)}
    (found,) = stragglers(positions, set(), 4)
    assert (found.rank, found.collective, found.last, found.waiting) == (2, "all_gather #2", "decoding its pieces",
                                                                         (0, 1, 3))
    assert found.text(20.0) == "rank 2 did not reach all_gather #2 within 20 s (last seen in decoding its pieces)"


def test_nobody_is_behind_while_every_rank_is_inside_or_past_the_collective():
    inside = {r: _waiting(WORLD, 1) for r in WORLD}
    assert stragglers(inside, set(), 4) == []
    past = {0: _waiting(WORLD, 2), 1: Position({WORLD: 2}, None, "all_gather #2, which it left"),
            2: _waiting(WORLD, 2), 3: _waiting(WORLD, 2)}
    assert stragglers(past, set(), 4) == []


def test_a_rank_still_inside_a_collective_its_peers_have_left_is_leaving_it_not_behind():
    """Seen under load: the all-gather every rank waited in completes, a peer enters the next one, and a rank whose
    return from the first lags (its own thread not yet scheduled) must not be named, by its peers or by itself."""
    positions = {0: _waiting(WORLD, 1), 1: _waiting(WORLD, 4), 2: _waiting(WORLD, 3), 3: _waiting(WORLD, 2)}
    assert stragglers(positions, set(), 4) == []
    # out of #1 and not yet in #2: behind again (ranks 2 and 3, inside collectives rank 1 has left, are still not)
    left = {**positions, 0: Position({WORLD: 1}, None, "all_gather #1, which it left")}
    assert [found.rank for found in stragglers(left, set(), 4)] == [0]


def test_a_rank_with_no_position_yet_is_behind_and_said_to_be_where_the_caller_says():
    positions = {0: _waiting(WORLD, 1), 1: _waiting(WORLD, 1), 3: _waiting(WORLD, 1)}
    assert stragglers(positions, set(), 4)[0].last == BEFORE_FIRST
    assert stragglers(positions, set(), 4, unseen="an earlier step")[0].last == "an earlier step"


def test_a_finished_rank_is_left_to_the_time_limit_and_a_subgroup_counts_only_its_members():
    positions = {0: _waiting(WORLD, 1), 1: _waiting(WORLD, 1), 3: _waiting(WORLD, 1)}
    assert stragglers(positions, {2}, 4) == []  # returned without the collective: a protocol break, not a straggler
    pair = (0, 1)
    sub = {0: _waiting(pair, 3, "broadcast"), 1: Position({pair: 2}, None, "x"), 2: Position(), 3: Position()}
    (found,) = stragglers(sub, set(), 4)
    assert (found.rank, found.collective) == (1, "broadcast #3 of the group [0, 1]")


def test_a_rank_behind_while_waiting_in_another_collective_is_said_to_wait_there():
    """Mismatched collective orders: rank 1 waits in a broadcast of a pair while the world waits in an all-gather."""
    pair = (0, 1)
    positions = {0: _waiting(WORLD, 1), 1: Position({pair: 1}, (pair, 1, "broadcast"), "x"),
                 2: _waiting(WORLD, 1), 3: _waiting(WORLD, 1)}
    first, second = stragglers(positions, set(), 4)  # a deadlock: each of the pair waits where the other is not
    assert (first.rank, first.collective, first.last) == (0, "broadcast #1 of the group [0, 1]",
                                                          "all_gather #1, where it waits")
    assert (second.rank, second.collective, second.last) == (1, "all_gather #1",
                                                             "broadcast #1 of the group [0, 1], where it waits")


def test_positions_travel_as_json_and_back():
    where = Position({WORLD: 3, (1, 2): 1}, ((1, 2), 1, "gather"), "somewhere")
    assert Position.from_json(where.to_json()) == where


def test_a_rank_whose_group_returned_without_its_collective_waits_there_alone():
    positions = {0: Position({WORLD: 1}, None, "x"), 2: _waiting(WORLD, 2)}
    (found,) = abandoned(positions, {0, 1, 3}, 4)
    assert (found.rank, found.collective, found.returned) == (2, "all_gather #2", (0, 1, 3))
    assert found.cause(20.0) == "waited 20 s alone in all_gather #2: ranks [0, 1, 3] returned without entering it"
    assert abandoned(positions, {0, 1}, 4) == []  # rank 3 may still come
    reached = {0: Position({WORLD: 2}, None, "x"), 2: _waiting(WORLD, 2)}
    assert abandoned(reached, {0, 1, 3}, 4) == []  # rank 0 entered it: a transport matter, not a protocol break



def test_a_rank_waiting_in_a_collective_that_a_finished_peer_never_entered_can_never_return():
    """One member gone without entering is enough (abandoned needs all of them, and a bound of time)."""
    positions = {0: _waiting(WORLD, 1), 1: _waiting(WORLD, 1), 3: Position({}, None, "x")}
    assert deserted(positions, {3}, 4) == {
        0: "waits in all_gather #1, which rank(s) [3] left the task without entering",
        1: "waits in all_gather #1, which rank(s) [3] left the task without entering"}
    assert deserted(positions, set(), 4) == {}  # rank 3 may still come
    entered = {**positions, 3: Position({WORLD: 1}, None, "x")}
    assert deserted(entered, {3}, 4) == {}  # it entered before it left: the others may still get their data
    other_group = {0: _waiting((0, 1), 1), 3: Position({}, None, "x")}
    assert deserted(other_group, {3}, 4) == {}  # rank 3 is no member of the group rank 0 waits in

# ----------------------------------------------------------------------------------------------- pace

WINDOW = 2.0


def _meter_over(samples: list[tuple[float, object, float]]) -> list:
    meter = PaceMeter(WINDOW)
    return [meter.sample(now, done, cpu) for now, done, cpu in samples]


def test_a_rank_whose_position_modules_and_cpu_stand_still_is_idle_once_the_window_is_full():
    paces = _meter_over([(0.0, "a", 1.0), (1.0, "a", 1.0), (2.0, "a", 1.0), (2.5, "a", 1.0)])
    assert [p.still_s for p in paces] == [0.0, 1.0, 2.0, 2.5]
    assert [p.idle for p in paces] == [False, False, True, True]  # not before a whole window was seen


def test_cpu_time_that_advances_is_not_idle_and_what_it_did_moving_restarts_the_stillness():
    busy = _meter_over([(0.0, "a", 0.0), (1.0, "a", 1.0), (2.0, "a", 2.0), (3.0, "a", 3.0)])
    assert not any(p.idle for p in busy) and busy[-1].still_s == 3.0 and busy[-1].cpu_s == 3.0
    moving = _meter_over([(0.0, "a", 0.0), (1.0, "b", 0.0), (2.5, "b", 0.0)])
    assert [p.still_s for p in moving] == [0.0, 0.0, 1.5]
    meter = PaceMeter(WINDOW)
    meter.sample(0.0, "a", 0.0)
    assert meter.sample(3.0, "a", 0.0, busy=True).still_s == 0.0  # a device still working for it is progress


def test_a_trickle_of_cpu_below_the_idle_share_is_idle():
    trickle = IDLE_CPU_SHARE * WINDOW / 2
    paces = _meter_over([(0.0, "a", 0.0), (1.0, "a", trickle / 2), (2.0, "a", trickle)])
    assert paces[-1].idle
    assert not _meter_over([(0.0, "a", 0.0), (2.0, "a", 2 * IDLE_CPU_SHARE * WINDOW)])[-1].idle


def test_only_a_straggler_whose_progress_stopped_is_stuck():
    assert stalled(Pace(still_s=1.9, idle=True, cpu_s=0.0), 0.0, WINDOW) == ""  # moved within the bound
    assert stalled(Pace(still_s=2.0, idle=True, cpu_s=0.0), 0.0, WINDOW).startswith("no progress: its position")
    looping = stalled(Pace(still_s=5.0, idle=False, cpu_s=SPIN_FACTOR * 1.0), 1.0, WINDOW)
    assert looping.startswith("busy without progress: it entered no collective and ran no module"), looping
    assert f"{SPIN_FACTOR:g}x the CPU time its peers needed" in looping
    # three times its peers' work, with nothing to show for the whole bound: computing, never stuck
    assert stalled(Pace(still_s=50.0, idle=False, cpu_s=3.0), 1.0, WINDOW) == ""


def test_peers_cpu_is_the_most_any_waiting_peer_spent_to_reach_the_collective():
    positions = {0: Position({WORLD: 1}, (WORLD, 1, "all_gather"), cpu_s=0.5),
                 1: Position({WORLD: 1}, (WORLD, 1, "all_gather"), cpu_s=1.5),
                 2: Position({}, None, "x", cpu_s=9.0), 3: Position({WORLD: 1}, (WORLD, 1, "all_gather"))}
    (found,) = stragglers(positions, set(), 4)
    assert found.rank == 2 and peers_cpu_s(positions, found) == 1.5
    assert found.cause(2.0).endswith("(last seen in x)")
    assert dataclasses.replace(found, why="asleep").cause(2.0).endswith("(last seen in x): asleep")


def test_a_position_travels_with_its_cpu_time_and_reads_one_posted_without_it():
    where = Position({WORLD: 2}, (WORLD, 2, "broadcast"), "here", cpu_s=1.25)
    assert Position.from_json(where.to_json()) == where and Position.from_json(where.to_json()).cpu_s == 1.25
    older = {key: value for key, value in where.to_json().items() if key != "cpu_s"}
    assert Position.from_json(older).cpu_s == 0.0
    pace = Pace(3.0, True, 1.5)
    assert Pace.from_json(pace.to_json()) == pace


def test_a_task_counts_the_modules_it_runs_and_its_thread_cpu_time_until_it_ends():
    counter = WorkCounter()
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    begin(work=counter)
    try:
        task_thread()
        net(torch.ones(1, 4))
        assert counter.value == 3 == work_done()  # the Sequential and its two children
        spent = task_cpu_s()
        turns = 0
        while task_cpu_s() - spent < 0.02:
            turns += 1
        assert task_cpu_s() > spent
    finally:
        end()
    net(torch.ones(1, 4))
    assert counter.value == 3, "modules run after the task ended are not the task's"

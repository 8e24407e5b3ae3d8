"""Who is behind a collective: the pure rule the world's parent and every torchrun rank apply to positions."""

import pytest

from harness.progress import BEFORE_FIRST, Position, abandoned, stragglers

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

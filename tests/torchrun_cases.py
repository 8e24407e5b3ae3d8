"""Items run inside ``torchrun -m pytest`` by tests/test_torchrun.py (not collected on their own).

Each rank runs this same session; the world is the launcher's group. The first item is a world task
that raises on the last rank, the second fails on rank 1 only (a plain assert), the last hangs one
rank inside a world task.
"""

import os

import pytest

from harness.process.dist import World, WorldTaskError, WorldTimeout
from tests import dist_tasks

SIZE = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


@pytest.fixture(scope="module")
def world():
    with World(SIZE) as launched:
        yield launched


def test_world_is_the_launchers_group(world):
    gathered = world.run(dist_tasks.all_gather_ranks, 1.0)
    assert [g.tolist() for g in gathered] == [[float(r) for r in range(SIZE)]] * SIZE
    assert world.run(dist_tasks.pid)[RANK] == os.getpid(), "the task ran in another process"


def test_a_raise_on_the_last_rank_reaches_every_rank(world):
    with pytest.raises(WorldTaskError) as info:
        world.run(dist_tasks.raise_on, SIZE - 1)
    assert info.value.raised_ranks == [SIZE - 1]
    assert f"injected failure on rank {SIZE - 1}" in str(info.value)


def test_fails_on_rank_1_only():
    assert RANK != 1, "injected item failure on rank 1"


def test_a_hang_on_rank_1_times_out_on_every_rank(world):
    with pytest.raises(WorldTimeout) as info:
        world.run(dist_tasks.hang_on, 1, timeout_s=2.0)
    assert info.value.hung == [1]
    assert not world.alive

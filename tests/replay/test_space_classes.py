"""Each input class of the replay space is what shows its bug: under the class's ablation, a drawn point outside the
class still passes (without the class, the bug would hide), while the kill matrix holds every point inside it."""

from __future__ import annotations

import pytest

from fixtures import replay_space
from harness.judging import ablation, catalogue, checks
from harness.judging.checks import CheckContext

pytestmark = pytest.mark.cpu

OUTSIDE = {  # ablation -> the values a point outside its class has
    "replay.missing_config_batches": {"config": "off"},
    "replay.velocity_transform_dropped": {"config": "on", "velocity": "identity"},
    "replay.next_latents_rounded_to_bf16": {"config": "on", "trajectory": "bf16"},
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_a_point_outside_the_class_passes_under_the_class_bug(name):
    catalogue.load()
    point = next(p for p in replay_space.POINTS if all(p[a] == v for a, v in OUTSIDE[name].items()))
    claimed = ablation.get(name).kills
    assert claimed and replay_space.check_id(point) not in claimed
    with ablation.get(name).apply():
        verdict = checks.run_check(replay_space.check_id(point), CheckContext())
    assert verdict.passed, verdict.describe()


def test_every_value_of_every_axis_is_drawn_and_the_ids_name_their_points():
    for axis, values in replay_space.AXES.items():
        assert {p[axis] for p in replay_space.POINTS} == set(values), axis
    ids = [replay_space.check_id(p) for p in replay_space.POINTS]
    assert len(set(ids)) == len(ids)
    assert all(i == "replay.space." + "-".join(p.values()) for i, p in zip(ids, replay_space.POINTS, strict=True))

"""The conformance state a rank carries: calls made inside ranks add up, and a task's specs leave with the task."""

from __future__ import annotations

import pytest

from harness.plugins import conformance

pytestmark = pytest.mark.cpu

AR = "harness.ar.loop:fast_rollout"
REPLAY = "harness.replay.replay:replay_batched"


@pytest.fixture
def clean():
    saved = (conformance.specs(), conformance.call_counts())
    conformance.clear()
    yield
    conformance.clear()
    for path, spec in saved[0].items():
        conformance.use(path, spec)
    conformance.add_calls(saved[1])


def test_calls_counted_in_ranks_add_to_the_calls_made_here(clean):
    conformance.add_calls({"ar": 2})
    conformance.add_calls({"ar": 3, "decode": 1})
    assert conformance.call_counts() == {"ar": 5, "decode": 1}
    assert conformance.calls("ar") == 5 and conformance.calls("replay") == 0


def test_a_tasks_specs_are_installed_for_the_task_and_the_ranks_own_restored_after(clean):
    conformance.use("ar", AR)
    with conformance.applied({"replay": REPLAY}):
        assert conformance.specs() == {"ar": AR, "replay": REPLAY}
    assert conformance.specs() == {"ar": AR}  # the task's spec is gone and the rank's own is back
    with pytest.raises(ValueError, match="unknown path"), conformance.applied({"nowhere": AR}):
        pass
    assert conformance.specs() == {"ar": AR}  # a refused task leaves the rank as it was

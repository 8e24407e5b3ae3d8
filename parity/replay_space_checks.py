"""Replay checks over the input space (``fixtures.replay_space``): one check per drawn point, its id naming it.

At a point whose config leaves the batched path off (none given, or the flag off) the fast path must decline (None,
no forward); everywhere else batched log-probs and transition means must equal serial bitwise (the fake kernel is
batch-shape invariant), with the spy proving one forward of S*cfg*B rows. Under ``--impl replay=...`` each check
judges the user's ``replay_batched`` (through ``harness.replay.judge``), and a declaration that leaves a point's input
class out (a guidance schedule, a CFG layout) puts that check under the guard contract.
"""

from __future__ import annotations

import functools

from fixtures import replay_space
from harness.judging import space
from harness.judging.checks import register
from harness.judging.compare import Verdict, exact, holds
from harness.replay.judge import compare_replay, run_batched

POLICY = ("exact (bitwise) where the config turns the batched path on; elsewhere fact: the batched path declines "
          "(None, no forward)")


def space_point(point: dict[str, str]) -> Verdict:
    problem = replay_space.problem(point)
    if point["config"] in replay_space.DECLINES:
        result, forwards = run_batched(problem)
        given = "no config" if problem.config is None else f"{problem.config}"
        return holds(result is None and not forwards, f"with {given} the batched path declines: None, no forward",
                     returned=type(result).__name__, forwards=str(list(forwards)))
    verdict = compare_replay(problem, exact(), "log_probs")
    return verdict.merge(compare_replay(problem, exact(), "prev_sample_means"))


for _point in replay_space.POINTS:
    _id = replay_space.check_id(_point)
    register(_id, policy=POLICY, doc=f"the fake kernel at {space.describe(_point)}")(
        functools.partial(space_point, _point))
    space.at(_id, family="fake", cfg="2", payload="tensor", **_point)

"""The conformance state a check and a rank carry: which implementation the running check judges (and whether under
the guard contract), the tally of its calls' outcomes, the part of it a rank measured for one task, and that tally
added into the main process."""

from __future__ import annotations

import pytest

from harness.judging import space
from harness.plugins import conformance
from harness.plugins.declarations import ReplayDeclaration
from harness.process import carried
from harness.registry import Registry

pytestmark = pytest.mark.cpu

AR = "harness.ar.loop:fast_rollout"
REPLAY = "harness.replay.replay:replay_batched"
MINE = f"{__name__}:replay_by_conditions"
LEFT = f"{__name__}:left_rollout"
CARRIED = carried.CARRIED.get("implementations")


def replay_by_conditions(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    """A replay that does what ``conditions`` asks: answer, decline (None), or raise ``segment``."""
    if conditions == "answer":
        return adapter
    if conditions == "decline":
        return None
    raise segment


replay_by_conditions.declares = ReplayDeclaration(guidance="scale")


def left_rollout(backend, batch, max_new_tokens, eos=()):
    raise NotImplementedError


left_rollout.padding_side = "left"


@pytest.fixture
def clean():
    saved = (conformance.specs(), conformance.call_counts())
    conformance.clear()
    yield
    conformance.clear()
    space.forget("replay.cstate.")
    space.forget("ar.cstate.")
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


def _call(fn, conditions: str, error: BaseException | None = None):
    return fn("result", conditions, error)


def _refuse(fn, error: BaseException) -> None:
    with pytest.raises(type(error)):
        _call(fn, "raise", error)


@pytest.fixture
def families(clean, monkeypatch):
    """Replay checks of family alpha (one scale: judged; a schedule: guarded), of family gamma and of no single
    family; ar checks of model tiny judging each layout; the replay implementation given for alpha."""
    space.at("replay.cstate.alpha.*", family="alpha", guidance="scale")
    space.at("replay.cstate.alpha.schedule", guidance="schedule")
    space.at("replay.cstate.gamma.*", family="gamma")
    space.at("ar.cstate.*", model="tiny")
    monkeypatch.setattr(conformance, "LAYOUT_CHECKS", Registry("layout declaration", list_known=False))
    conformance.judges_layout("ar.cstate.left.*", "ar", "left")
    conformance.judges_layout("ar.cstate.right.*", "ar", "right")
    conformance.use("replay", MINE, "alpha")


def test_a_checks_calls_are_tallied_answered_declined_and_refused_keeping_the_first_refusal_cut_short(clean):
    assert conformance.outcomes("replay") == conformance.Outcomes() and conformance.Outcomes().calls == 0
    conformance.use("replay", MINE)
    fn = conformance.resolve("replay", None)
    _call(fn, "answer")
    _call(fn, "answer")
    _call(fn, "decline")
    _refuse(fn, ValueError("x" * 400 + "\nthe second line"))
    _refuse(fn, RuntimeError("a later refusal"))
    assert conformance.outcomes("replay") == conformance.Outcomes(2, 1, 2, ("ValueError: " + "x" * 400)[:300])
    assert len(conformance.outcomes("replay").refusal) == 300
    assert conformance.calls("replay") == 5


def test_select_makes_only_the_checks_own_implementation_active_and_guarding_only_under_the_guard_contract(
        families):
    conformance.use("ar", LEFT, "tiny")
    guarded = conformance.select("replay.cstate.alpha.schedule")
    assert guarded.mode == conformance.GUARDED and conformance.active("replay") == MINE
    fn = conformance.resolve("replay", None)
    _refuse(fn, NotImplementedError("schedules"))  # a refusal is the guard contract's to judge
    assert conformance.select("replay.cstate.alpha.scale").mode == conformance.JUDGED
    assert conformance.active("replay") == MINE
    assert conformance.declaration("replay") == ReplayDeclaration(families=("alpha",), guidance="scale")
    with pytest.raises(conformance.DeclarationBreach, match="inside its declaration"):
        _call(fn, "raise", NotImplementedError("scales"))
    assert conformance.select("replay.cstate.gamma.scale").mode == conformance.OUTSIDE
    assert conformance.active("replay") is None and conformance.declaration("replay") is None
    assert conformance.select("ar.cstate.left.tokens").mode == conformance.JUDGED
    assert conformance.active("ar") == LEFT
    assert conformance.select("ar.cstate.right.tokens").mode == conformance.NOT_JUDGED_MODE
    assert conformance.active("ar") is None, "another layout's check judges nothing under test"


def test_a_check_of_no_single_family_lies_outside_implementations_given_per_family(families):
    conformance.use("ar", LEFT, "tiny")
    found = conformance.judgement("replay.cstate.whole")
    assert (found.mode, found.key) == (conformance.OUTSIDE, None)
    assert found.reason == ("outside what the implementations declare: the check drives no single family, and the "
                            "replay implementations under test are given per family (alpha)")


def test_a_task_runs_under_the_checks_selection_and_guard_and_the_rank_gets_its_own_back(families):
    conformance.select("replay.cstate.alpha.schedule")
    state = CARRIED.capture()
    conformance.clear()
    conformance.use("ar", AR)  # the rank's own
    with CARRIED.enter(state):
        assert conformance.active("replay") == MINE
        assert conformance.declaration("replay") == ReplayDeclaration(families=("alpha",), guidance="scale")
        _refuse(conformance.resolve("replay", None), NotImplementedError("schedules"))
    assert conformance.specs() == {"ar": AR} and conformance.active("replay") is None


def test_a_ranks_tally_holds_the_tasks_own_calls_and_refusal_only(clean):
    conformance.use("replay", MINE)
    fn = conformance.resolve("replay", None)
    _call(fn, "answer")
    _call(fn, "answer")
    _refuse(fn, ValueError("an earlier task's"))
    mark = CARRIED.mark()
    _call(fn, "decline")
    _refuse(fn, ValueError("the task's own"))
    own = {"none": 1, "refused": 1, "refusal": "ValueError: the task's own"}
    assert CARRIED.tally(mark) == {"calls": {"replay": 2}, "outcomes": {"replay": own}}
    assert CARRIED.tally(CARRIED.mark()) == {"calls": {}, "outcomes": {}}


def test_a_ranks_tally_adds_into_the_main_process_keeping_the_first_refusal(clean):
    conformance.use("replay", MINE)
    fn = conformance.resolve("replay", None)
    _call(fn, "answer")
    _refuse(fn, ValueError("the main process's"))
    CARRIED.absorb({"calls": {"replay": 2, "ar": 2},
                    "outcomes": {"replay": {"answered": 2, "refusal": "ValueError: a rank's"},
                                 "ar": {"none": 1, "refused": 1, "refusal": "ValueError: a rank's"}}})
    assert conformance.outcomes("replay") == conformance.Outcomes(3, 0, 1, "ValueError: the main process's")
    assert conformance.outcomes("ar") == conformance.Outcomes(0, 1, 1, "ValueError: a rank's")
    assert conformance.call_counts() == {"replay": 4, "ar": 2}


def test_a_rank_reset_drops_everything_it_inherited(families):
    given_only = CARRIED.capture()
    conformance.select("replay.cstate.alpha.schedule")
    _refuse(conformance.resolve("replay", None), NotImplementedError("schedules"))
    CARRIED.reset()
    assert conformance.given() == {} and conformance.call_counts() == {}
    assert conformance.outcomes("replay") == conformance.Outcomes()
    conformance.use("replay", MINE, "alpha")
    assert CARRIED.capture() == given_only, "no check's selection or guard is left"

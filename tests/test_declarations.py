"""Implementations in a framework's own shape: per-subject ``--impl``, typed declarations of what each drives and
supports, checks outside a declaration reported as not judged, the guard contract for what a declaration leaves
out, and a NotImplementedError inside a declaration failing the check by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.judging import ablation, checks, space
from harness.plugins import conformance
from harness.plugins.declarations import (
    ARDeclaration,
    AttentionDeclaration,
    DecodeDeclaration,
    ReplayDeclaration,
    declared_by,
    for_subject,
)

pytestmark = pytest.mark.cpu

# ------------------------------------------------------------------------------------------ the input space


def test_a_point_merges_every_matching_pattern_the_most_specific_winning():
    space.at("replay.ddemo.*", family="fake", guidance="schedule")
    space.at("replay.ddemo.sd3x.*", family="sd3x", guidance="scale")
    try:
        assert _mine(space.point("replay.ddemo.sd3x.log_probs")) == {"family": "sd3x", "guidance": "scale"}
        assert _mine(space.point("replay.ddemo.other")) == {"family": "fake", "guidance": "schedule"}
        assert space.describe({"guidance": "scale", "family": "sd3x"}) == "guidance=scale,family=sd3x"
        assert list(space.point("replay.ddemo.sd3x.x"))[:1] == ["family"]  # in the path's axis order
    finally:
        space.forget("replay.ddemo")
    assert "family" not in space.point("replay.ddemo.sd3x.log_probs")


def _mine(found: dict[str, str]) -> dict[str, str]:
    """The axes these tests set (a loaded catalogue's ``replay.*`` pattern sets others on every replay id)."""
    return {name: value for name, value in found.items() if name in ("family", "guidance")}


def test_an_unknown_axis_or_a_value_a_closed_axis_does_not_admit_is_refused():
    with pytest.raises(KeyError, match="replay has no input axis 'colour'; its axes: family, cfg_layout"):
        space.at("replay.ddemo.*", colour="red")
    with pytest.raises(ValueError, match=r"axis 'guidance' takes one of \['scale', 'schedule'\], got 'sometimes'"):
        space.at("replay.ddemo.*", guidance="sometimes")
    assert "colour" not in space.point("replay.ddemo.x")


# ------------------------------------------------------------------------------------------- declarations


def test_the_subject_field_is_the_one_on_the_space_s_subject_axis():
    """A declaration does not restate which axis is its path's subject: the input space says so, once."""
    from harness.plugins.declarations import _axis_field

    assert _axis_field("dtype").metadata == {"axis": "dtype"}
    for declared in (ReplayDeclaration(), ARDeclaration(), DecodeDeclaration()):
        (subject,) = [f for f in dataclasses.fields(declared) if f.name == declared.subject_field]
        assert subject.metadata["axis"] == space.subject_axis(declared.path).name


def test_a_declaration_class_may_list_plain_fields_and_other_axes_before_its_subject():
    from typing import ClassVar

    from harness.plugins.declarations import Declaration, _axis_field

    @dataclasses.dataclass(frozen=True)
    class SubjectLast(Declaration):
        path: ClassVar[str] = "ar"
        padding_side: str = "right"
        dtypes: tuple[str, ...] | None = _axis_field("dtype")
        models: tuple[str, ...] | None = _axis_field("model")

    declared = SubjectLast(dtypes="float32")
    assert declared.subject_field == "models" and declared.supported() == {"dtype": ("float32",)}


def test_a_declaration_names_the_values_of_its_axes_and_refuses_unknown_ones_listing_the_known():
    declared = ReplayDeclaration(families="sd3", cfg_layouts=("uncond_first",), guidance="scale",
                                 means_dtype="trajectory")
    assert declared.families == ("sd3",)
    assert declared.supported() == {"cfg_layout": ("uncond_first",), "guidance": ("scale",)}
    assert declared.output_dtype("prev_sample_means") == "trajectory"
    assert declared.output_dtype("log_probs") == "float32"
    assert declared.describe() == ("ReplayDeclaration(families=('sd3',), cfg_layouts=('uncond_first',), "
                                   "guidance='scale', means_dtype='trajectory')")
    with pytest.raises(ValueError, match="unknown cfg_layout 'interleaved'; known: uncond_first, fused_cond_first"):
        ReplayDeclaration(cfg_layouts=("interleaved",))
    with pytest.raises(ValueError, match="unknown guidance 'per_row'; known: 'schedule'"):
        ReplayDeclaration(guidance="per_row")
    with pytest.raises(ValueError, match="unknown output dtype 'bf16'; known: float32, trajectory"):
        ReplayDeclaration(means_dtype="bf16")
    with pytest.raises(ValueError, match="empty; leave it out"):
        ReplayDeclaration(families=())
    with pytest.raises(TypeError, match="expected a tuple of names"):
        DecodeDeclaration(vaes=(3,))
    with pytest.raises(TypeError, match="gather_to_one: expected True or False"):
        DecodeDeclaration(gather_to_one="no")
    with pytest.raises(ValueError, match="unknown padding side 'up'"):
        ARDeclaration(padding_side="up")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        AttentionDeclaration(dtypes=("float8",))


def test_a_point_is_inside_outside_or_an_unsupported_input_class_of_a_declaration():
    declared = ReplayDeclaration(families=("sd3", "hunyuan_image3"), guidance="scale")
    assert declared.outside({"family": "sd3", "guidance": "scale"}) is None
    assert declared.outside({"family": "flux"}) == ("it drives family 'flux'; the implementation declares families "
                                                    "sd3, hunyuan_image3")
    assert declared.unsupported({"family": "sd3", "guidance": "schedule"}) == [
        "guidance 'schedule' (declares scale)"]
    decode = DecodeDeclaration(gather_to_one=False, slicing=False)
    assert decode.unsupported({"transport": "gather", "slicing": "on"}) == [
        "transport 'gather' (declares all_gather)", "slicing 'on' (declares off)"]
    assert ReplayDeclaration().outside({"family": "anything"}) is None  # no families named: every one
    assert declared.outside({"guidance": "scale"}) == ("the check drives no single family, and the implementation "
                                                       "declares families sd3, hunyuan_image3")


def test_a_declaration_left_at_its_defaults_restricts_nothing():
    """Every capability a declaration leaves out is taken: a decode gathers to one rank and honours slicing unless
    it says otherwise; attention has no subject field."""
    for declared in (ReplayDeclaration(), ARDeclaration(), DecodeDeclaration(), AttentionDeclaration()):
        assert declared.supported() == {} and declared.subjects is None, declared
    assert (DecodeDeclaration().gather_to_one, DecodeDeclaration().slicing) == (True, True)
    assert AttentionDeclaration().subject_field == ""
    assert [d.subject_field for d in (ReplayDeclaration(), ARDeclaration(), DecodeDeclaration())] == [
        "families", "models", "vaes"]


def test_a_callable_declares_by_its_declares_attribute_and_a_subject_key_narrows_it():
    def replay(adapter, conditions, segment, strategy, target, guidance=None, config=None): ...

    assert declared_by("replay", replay) == ReplayDeclaration()
    replay.declares = ReplayDeclaration(families=("sd3", "hunyuan_image3"))
    assert for_subject("replay", replay, "sd3").families == ("sd3",)
    with pytest.raises(ValueError, match="given for 'flux', but it declares families sd3, hunyuan_image3"):
        for_subject("replay", replay, "flux")
    replay.declares = DecodeDeclaration()
    with pytest.raises(TypeError, match="a replay implementation declares a harness.plugins.declarations."
                                        "ReplayDeclaration"):
        declared_by("replay", replay)


# ----------------------------------------------------------------------------- a conformance run, end to end

DEMO = '''
import torch
from harness.judging import space
from harness.judging.checks import register
from harness.judging.compare import exact
from harness.plugins import conformance


def own(x, guidance):
    return [v * guidance for v in x]


def _run(guidance):
    fast = conformance.resolve("replay", own)
    got = fast([1.0, 2.0], guidance)
    if got is None:
        return exact().judge(torch.tensor([0.0]), torch.tensor([1.0]))  # a decline: the check cannot judge it
    return exact().judge(torch.tensor(got), torch.tensor(own([1.0, 2.0], guidance)))


for _family in ("alpha", "beta"):
    register(f"replay.ddemo.{_family}.scale")(lambda _f=_family: _run(2.0))
    register(f"replay.ddemo.{_family}.schedule")(lambda _f=_family: _run(3.0))
    space.at(f"replay.ddemo.{_family}.*", family=_family, guidance="scale")
    space.at(f"replay.ddemo.{_family}.schedule", guidance="schedule")
'''

USER = '''
from harness.plugins.declarations import ReplayDeclaration


def right(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    return [v * conditions for v in adapter]


def refuses_schedules(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    if conditions == 3.0:  # the demo's schedule stands for a per-step guidance schedule
        raise ValueError("one guidance scale per rollout")
    return right(adapter, conditions)


refuses_schedules.declares = ReplayDeclaration(guidance="scale")


def declines_schedules(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    return None if conditions == 3.0 else right(adapter, conditions)


declines_schedules.declares = ReplayDeclaration(guidance="scale")


def wrong_on_schedules(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    return right(adapter, 2.0)  # one scale read for every step: a different answer


wrong_on_schedules.declares = ReplayDeclaration(guidance="scale")


def not_implemented(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    raise NotImplementedError("not written yet")


not_implemented.declares = ReplayDeclaration(families=("alpha",), guidance="scale")


def declares_a_stranger(adapter, conditions, segment=None, strategy=None, target=None, guidance=None, config=None):
    return right(adapter, conditions)


declares_a_stranger.declares = ReplayDeclaration(families=("alpha", "gamma"))
'''

GENERATED = '''
import pytest
from harness.judging import catalogue, checks
from harness.judging.items import check_params

catalogue.load(["ddemo_checks"], [])
IDS = [c.id for c in checks.all_checks("cpu") if ".ddemo." in c.id]


@pytest.mark.cpu
@pytest.mark.parametrize("parity", check_params(IDS))
def test_parity_check(parity, parity_session, parity_ctx):
    verdict = parity_session.check(parity.check, parity_ctx)
    assert verdict.passed, verdict.describe()
'''


@pytest.fixture(autouse=True)
def _clean():
    yield
    checks.CHECKS.forget("replay.ddemo.")
    ablation.ABLATIONS.forget("replay.ddemo")
    space.forget("replay.ddemo")
    conformance.clear()


@pytest.fixture
def demo(pytester):
    pytester.makepyfile(ddemo_checks=DEMO, ddemo_user=USER, test_ddemo=GENERATED)
    pytester.syspathinsert()
    return pytester


def _run(demo, *impls: str, report: str = "out/r.json"):
    args = ["-p", "harness.plugin", "-m", "cpu", f"--parity-report={report}", "--parity-report=out/r.md"]
    for impl in impls:
        args += ["--impl", impl]
    result = demo.runpytest(*args)
    data = json.loads((demo.path / report).read_text()) if (demo.path / report).exists() else None
    return result, data


def test_a_per_family_implementation_judges_its_family_and_reports_the_rest_outside_its_declaration(demo):
    result, data = _run(demo, "replay.alpha=ddemo_user:right")
    result.assert_outcomes(passed=2, deselected=2)
    assert data["implementations"] == {"replay.alpha": "ddemo_user:right"}
    assert [c["id"] for c in data["checks"]] == ["replay.ddemo.alpha.scale", "replay.ddemo.alpha.schedule"]
    reason = "outside what the implementations declare: it drives family 'beta'; given for alpha"
    assert data["not_judged"] == {"replay.ddemo.beta.scale": reason, "replay.ddemo.beta.schedule": reason}
    result.stdout.fnmatch_lines(["conformance mode: replay checks of alpha judge ddemo_user:right*",
                                 "not judged: 2 checks (deselected, neither passed nor failed; 2 outside what the "
                                 "implementations declare)"])
    markdown = (demo.path / "out/r.md").read_text()
    assert "## Not judged (excluded: neither passed nor failed), by reason" in markdown
    assert f"- {reason}: `replay.ddemo.beta.scale`, `replay.ddemo.beta.schedule`" in markdown


def test_a_path_wide_and_a_per_family_implementation_share_the_catalogue(demo):
    result, data = _run(demo, "replay=ddemo_user:right", "replay.beta=ddemo_user:refuses_schedules")
    result.assert_outcomes(passed=4)
    assert data["guarded"] == {"replay.ddemo.beta.schedule": "declared unsupported: guidance 'schedule' (declares "
                                                             "scale)"}
    rows = {c["id"]: c for c in data["checks"]}
    assert rows["replay.ddemo.beta.schedule"]["metrics"]["guard"] == ("refused: ValueError: one guidance scale per "
                                                                       "rollout")
    assert rows["replay.ddemo.alpha.schedule"]["metrics"].get("guard") is None  # the path-wide one: judged


@pytest.mark.parametrize(("impl", "passed", "failed", "guard"), [
    ("refuses_schedules", 2, 0, "refused: ValueError: one guidance scale per rollout"),
    ("declines_schedules", 2, 0, "returned None: the caller takes the serial loop"),
    ("wrong_on_schedules", 1, 1, "a different answer"),
])
def test_an_input_class_declared_unsupported_is_still_fed_and_must_be_refused_or_declined(demo, impl, passed, failed,
                                                                                          guard):
    result, data = _run(demo, f"replay.alpha=ddemo_user:{impl}")
    result.assert_outcomes(passed=passed, failed=failed, deselected=2)
    row = next(c for c in data["checks"] if c["id"] == "replay.ddemo.alpha.schedule")
    assert row["metrics"]["guard"] == guard
    assert row["policy"].startswith("guard contract (declared unsupported: guidance 'schedule' (declares scale)): "
                                    "refuse or take the stock path, never a different answer")
    result.stdout.fnmatch_lines(["guard contract: 1 checks feed an input class the implementation declares "
                                 "unsupported; it must refuse it or take the stock path, never answer otherwise:"])
    if failed:
        result.stdout.fnmatch_lines(["*returned a different answer on an input class it declares unsupported*"])


def test_not_implemented_inside_the_declaration_fails_the_check_naming_the_declaration(demo):
    result, data = _run(demo, "replay=ddemo_user:not_implemented")
    result.assert_outcomes(failed=1, passed=1, deselected=2)  # the schedule check is guarded: a refusal passes it
    row = next(c for c in data["checks"] if c["id"] == "replay.ddemo.alpha.scale")
    assert row["error"]["type"] == "DeclarationBreach"
    assert row["error"]["message"] == (
        "ddemo_user:not_implemented raised NotImplementedError on an input inside its declaration "
        "ReplayDeclaration(families=('alpha',), guidance='scale'): not written yet")


@pytest.mark.parametrize(("impl", "message"), [
    ("replay.gamma=ddemo_user:right", "--impl replay.gamma=ddemo_user:right: unknown family 'gamma'; the replay "
                                      "catalogue drives alpha, beta"),
    ("replay=ddemo_user:declares_a_stranger", "--impl replay=ddemo_user:declares_a_stranger: unknown family 'gamma'; "
                                              "the replay catalogue drives alpha, beta"),
    ("replay.beta=ddemo_user:not_implemented", "given for 'beta', but it declares families alpha"),
    ("attention.x=ddemo_user:right", "attention implementations are given path-wide"),
    ("replay.a.b=ddemo_user:right", "expected PATH=MODULE:CALLABLE or PATH.SUBJECT=MODULE:CALLABLE"),
])
def test_a_declaration_or_key_naming_what_the_catalogue_does_not_drive_is_a_usage_error(demo, impl, message):
    result = demo.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", impl)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_a_declaration_naming_an_unknown_capability_is_a_usage_error_listing_the_known_ones(demo):
    demo.makepyfile(ddemo_bad="""
from harness.plugins.declarations import ReplayDeclaration


def replay(adapter, conditions, segment, strategy, target, guidance=None, config=None):
    return None


replay.declares = ReplayDeclaration(cfg_layouts=("interleaved",))
""")
    result = demo.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "replay=ddemo_bad:replay")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("unknown cfg_layout 'interleaved'; known: uncond_first, fused_cond_first" in result.stderr.str())


def test_one_family_under_test_twice_is_a_usage_error(demo):
    result = demo.runpytest("-p", "harness.plugin", "--impl", "replay.alpha=ddemo_user:right",
                            "--impl", "replay.alpha=ddemo_user:refuses_schedules")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "replay 'alpha' is already under test (ddemo_user:right)" in result.stderr.str()


def test_the_help_shows_the_per_family_form(demo):
    result = demo.runpytest("-p", "harness.plugin", "--help")
    text = " ".join(result.stdout.str().split())
    assert "--impl=PATH[.SUBJECT]=MODULE:CALLABLE" in text
    assert "PATH.SUBJECT gives one for a single replay family, ar model or decode VAE" in text


# ------------------------------------------------------------------------------------------ the guard contract

REASON = "declared unsupported: guidance 'schedule' (declares scale)"


def _verdict(passed: bool, margin: float | None, fast_path_violated: bool = False):
    from harness.judging.compare import Verdict

    made = Verdict("replay.x.y", passed, {"max_abs": 0.0 if passed else 1.0}, "exact (bitwise)", margin,
                   headline="max_abs")
    return made.require_ran(not fast_path_violated, "one forward of S*B rows")


@pytest.mark.parametrize(("found", "every_rank", "passed", "guard"), [
    (conformance.Outcomes(refused=2, refusal="ValueError: one scale"), True, True, "refused: ValueError: one scale"),
    (conformance.Outcomes(none=1), True, True, "returned None: the caller takes the serial loop"),
    (conformance.Outcomes(none=1, refused=1, refusal="ValueError: x"), True, True,
     "refused or declined (1 raised, 1 returned None)"),
    (conformance.Outcomes(refused=3, refusal="ValueError: x"), False, False,
     "raised (not on every rank: the others were left waiting): RuntimeError: boom"),
    (conformance.Outcomes(answered=1, refused=1, refusal="ValueError: x"), True, False, "raised: RuntimeError: boom"),
])
def test_the_guard_contract_accepts_refusals_and_declines_on_every_rank_only(found, every_rank, passed, guard):
    error = RuntimeError("boom")
    verdict = conformance.guard_verdict("replay", REASON, found, None, error, every_rank)
    assert verdict.passed is passed and verdict.metrics["guard"] == guard
    assert verdict.policy.startswith(f"guard contract ({REASON})")


def test_the_guard_contract_accepts_the_stock_answer_not_another_one():
    answered = conformance.Outcomes(answered=1)
    same = conformance.guard_verdict("replay", REASON, answered, _verdict(True, 0.0), None)
    assert same.passed and same.metrics["guard"] == "the stock answer"
    stock_way = conformance.guard_verdict("replay", REASON, answered, _verdict(True, 0.0, fast_path_violated=True),
                                          None)
    assert stock_way.passed, "the stock answer by the stock path: the fast path's own facts do not apply"
    other = conformance.guard_verdict("replay", REASON, answered, _verdict(False, 3.0), None)
    assert not other.passed and other.metrics["guard"] == "a different answer"
    assert other.message.startswith(f"returned a different answer on an input class it declares unsupported ({REASON})")


def test_a_refusal_passes_on_every_path_and_a_raise_counts_as_on_every_rank_unless_said_otherwise():
    refused = conformance.Outcomes(refused=1, refusal="ValueError: one scale")
    for path in ("replay", "decode"):
        verdict = conformance.guard_verdict(path, REASON, refused, None, RuntimeError("boom"))
        assert verdict.passed and verdict.metrics["guard"] == "refused: ValueError: one scale"


def test_a_raise_after_an_answer_fails_its_text_cut_short():
    error = RuntimeError("e" * 1000)
    verdict = conformance.guard_verdict("replay", REASON, conformance.Outcomes(answered=1), None, error)
    assert not verdict.passed
    assert verdict.metrics["guard"] == f"raised: RuntimeError: {'e' * 1000}"[:300]
    said = "the implementation under test raised after answering 1 call(s): RuntimeError: "
    assert verdict.message == f"{said}{'e' * 1000}"[:400]
    assert (len(verdict.metrics["guard"]), len(verdict.message)) == (300, 400)


@pytest.mark.parametrize(("margin", "passed"), [(1.0, True), (1.5, False)])
def test_the_stock_answer_by_the_stock_path_passes_up_to_a_margin_of_one(margin, passed):
    """Numbers at the tolerance pass, whatever the fast path's own facts; past it the answer is another one."""
    stock_way = _verdict(True, margin, fast_path_violated=True)
    found = conformance.guard_verdict("replay", REASON, conformance.Outcomes(answered=1), stock_way, None)
    assert found.passed is passed
    assert found.metrics["guard"] == ("the stock answer" if passed else "a different answer")


def test_none_is_a_decline_only_where_the_contract_says_so():
    """decode returns None on every rank but the destination of a gather: there it is an answer, not a decline."""
    none = conformance.Outcomes(none=2)
    assert not conformance.guard_verdict("decode", REASON, none, _verdict(False, 5.0), None).passed
    assert conformance.guard_verdict("replay", REASON, none, _verdict(False, 5.0), None).passed


def test_outcomes_count_every_call_of_a_check():
    found = conformance.Outcomes(answered=2, none=1, refused=4)
    assert found.calls == 7

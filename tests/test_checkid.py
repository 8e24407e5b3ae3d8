"""CheckId keeps today's id strings, selects by part, and the runner stamps ids onto id-less verdicts."""

from __future__ import annotations

import pytest

from harness.judging import checks
from harness.judging.checkid import CheckId
from harness.judging.compare import Verdict, exact, holds

pytestmark = pytest.mark.cpu


def test_string_form_is_the_report_id_and_parse_round_trips():
    assert str(CheckId("ar", "qwen3", "b1", "logp")) == "ar.qwen3.b1.logp"
    assert str(CheckId("demo", case="guard", what="off")) == "demo.guard.off"
    assert str(CheckId("ar", "fake", "", "finished_rows")) == "ar.fake.finished_rows"
    for text in ("decode.t37.w4.gather_dst2.bitexact", "replay.cfg1.returns_result", "ar.qwen3.b1.logp"):
        assert str(CheckId.parse(text)) == text
    with pytest.raises(ValueError, match="path and a what"):
        CheckId("ar", "fake")
    with pytest.raises(ValueError, match="path.case.what"):
        CheckId.parse("ar..logp")


def test_selectors_match_by_part():
    grid = CheckId.grid("ar", ("fake", "qwen3"), ("b1", "concat"), ("tokens", "logp"))
    assert len(grid) == 8 and str(grid[0]) == "ar.fake.b1.tokens"
    picked = [c for c in grid if c.matches(subject="fake", what={"logp"})]
    assert [str(c) for c in picked] == ["ar.fake.b1.logp", "ar.fake.concat.logp"]


@pytest.fixture
def scratch_registry():
    saved = checks.CHECKS.snapshot()
    yield
    checks.CHECKS.restore(saved)


def test_runner_stamps_the_registered_id_and_the_policy_is_listed(scratch_registry):
    check_id = CheckId("demo", "stamp", "", "fact")
    checks.register(check_id, policy=exact())(lambda ctx: holds(True, "holds"))
    assert checks.get(str(check_id)).policy == exact().describe()
    verdict = checks.run_check(check_id, checks.CheckContext())
    assert verdict.check_id == "demo.stamp.fact" and verdict.passed


def test_a_verdict_filed_under_another_id_is_refused(scratch_registry):
    checks.register("demo.stamp.other")(lambda ctx: Verdict("demo.else", True, {}, "fact", None))
    with pytest.raises(ValueError, match="returned a verdict for 'demo.else'"):
        checks.run_check("demo.stamp.other", checks.CheckContext())


def test_the_context_reaches_only_a_check_that_takes_it(scratch_registry):
    seen = []
    checks.register("demo.ctx.takes", policy="fact: demo")(lambda ctx: seen.append(ctx) or holds(True, "took it"))
    checks.register("demo.ctx.none", policy="fact: demo")(lambda: holds(True, "needs none"))
    ctx = checks.CheckContext()
    assert checks.run_check("demo.ctx.takes", ctx).passed and seen == [ctx]
    assert checks.run_check("demo.ctx.none", ctx).passed
    assert (checks.get("demo.ctx.takes").takes_ctx, checks.get("demo.ctx.none").takes_ctx) == (True, False)

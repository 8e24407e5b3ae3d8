"""The report never reads greener than the run: a check that raises, times out or skips is in it as such, every
collected check and (ablation, check) pair is counted, and its pass count is pytest's."""

import json

import pytest

from harness import session
from harness.judging import ablation, checks
from harness.process.dist import RankOutcome, WorldTaskError, WorldTimeout
from harness.reports.report import Unfinished
from tests.test_plugin import GENERATED_TESTS, _clean_registry  # noqa: F401 - the demo registry, cleaned per test

pytestmark = pytest.mark.cpu

IMPL = '''
def scale(x):
    return [2 * v for v in x]
'''

CHECKS = '''
import pytest
import torch
import demo_impl
from harness.judging.checks import register
from harness.judging.compare import exact


def _judge(check_id):
    x = [1.0, 2.0]
    return exact().judge(torch.tensor(demo_impl.scale(x)), torch.tensor([2 * v for v in x]))


@register("demo.outcome.passes")
def passes(ctx):
    return _judge("demo.outcome.passes")


@register("demo.outcome.raises")
def raises(ctx):
    raise RuntimeError("the fast path crashed at port 40123")


@register("demo.outcome.skips")
def skips(ctx):
    pytest.skip("this stack cannot build the path")


@register("demo.outcome.fails")
def fails(ctx):
    return _judge("demo.outcome.fails").require(False, "one batched forward")
'''

ABLATIONS = '''
from harness.judging.ablation import ablation

ablation("demo.outcome.bug", "demo_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=["demo.outcome.passes", "demo.outcome.raises", "demo.outcome.skips", "demo.outcome.fails"],
         why="adds one", kill_mode="tolerance")
'''

# the plugin tests' generated items (a check item per demo check, a kill item per claimed pair, a gpu-only item)
# over this file's catalogue, and one kill item skipped by a mark before any check ran
TESTS = GENERATED_TESTS + '''

@pytest.mark.cpu
@pytest.mark.skip(reason="skipped before it ran")
@pytest.mark.parametrize("parity", kill_params([("demo.outcome.unrun", "demo.outcome.passes")]))
def test_marked(parity):
    pass
'''


@pytest.fixture
def outcomes(pytester):
    pytester.makepyfile(demo_impl=IMPL, demo_checks=CHECKS, demo_ablations=ABLATIONS, test_outcomes=TESTS)
    pytester.syspathinsert()
    return pytester


def test_the_report_counts_every_item_and_its_pass_count_is_pytests(outcomes):
    parity = outcomes.runpytest("-p", "harness.plugin", "-k", "test_check", "--parity-report=out/checks.json")
    counted = parity.parseoutcomes()
    data = json.loads((outcomes.path / "out/checks.json").read_text())
    summary = data["summary"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == \
        (counted.get("passed", 0), counted.get("failed", 0), counted.get("skipped", 0)) == (1, 2, 1)
    assert summary["checks"] == len(data["checks"]) == 4
    rows = {c["id"]: c for c in data["checks"]}
    assert rows["demo.outcome.raises"]["status"] == "failed" and not rows["demo.outcome.raises"]["passed"]
    assert rows["demo.outcome.raises"]["error"] == {"type": "RuntimeError", "ranks": [],
                                                    "message": "the fast path crashed at port <port>"}
    assert rows["demo.outcome.skips"] == {**rows["demo.outcome.skips"], "status": "skipped",
                                          "reason": "this stack cannot build the path"}
    assert rows["demo.outcome.fails"]["status"] == "failed" and "error" not in rows["demo.outcome.fails"]
    parity.stdout.fnmatch_lines(["FAIL*demo.outcome.raises*RuntimeError: the fast path crashed*",
                                 "SKIP*demo.outcome.skips*skipped: this stack cannot build the path*",
                                 "checks: 1/4 passed, 2 failed, 1 skipped; ablations: 0/0 killed all their checks"])


def test_every_pair_is_counted_failed_survived_or_skipped(outcomes):
    result = outcomes.runpytest("-p", "harness.plugin", "--parity-report=out/all.json", "--parity-report=out/all.md")
    result.assert_outcomes(passed=2, failed=4, skipped=4)  # skipped: a check, two pairs, the gpu-only item
    data = json.loads((outcomes.path / "out/all.json").read_text())
    kills = {(a["name"], k["check"]): k for a in data["ablations"] for k in a["kills"]}
    assert {pair: k["status"] for pair, k in kills.items()} == {
        ("demo.outcome.bug", "demo.outcome.passes"): "killed",
        ("demo.outcome.bug", "demo.outcome.raises"): "failed",  # its baseline raised: never run under the bug
        ("demo.outcome.bug", "demo.outcome.skips"): "skipped",
        ("demo.outcome.bug", "demo.outcome.fails"): "failed",  # its baseline failed
        ("demo.outcome.unrun", "demo.outcome.passes"): "skipped",  # skipped by a mark, before any check ran
    }
    raised = kills[("demo.outcome.bug", "demo.outcome.raises")]
    assert raised["error"]["type"] == "CheckFailedEarlier" and "RuntimeError" in raised["error"]["message"]
    assert kills[("demo.outcome.unrun", "demo.outcome.passes")]["reason"] == "skipped before it ran"
    summary = data["summary"]
    assert summary == {**summary, "checks": 4, "passed": 1, "failed": 2, "skipped": 1, "ablations": 2, "killed": 0,
                       "pairs": 5, "pairs_killed": 1, "pairs_survived": 0, "pairs_failed": 2, "pairs_skipped": 2}
    statuses = {a["name"]: a["status"] for a in data["ablations"]}
    assert statuses == {"demo.outcome.bug": "failed", "demo.outcome.unrun": "skipped"}
    markdown = (outcomes.path / "out/all.md").read_text()
    assert "**checks** 1/4 passed, 2 failed, 1 skipped" in markdown and "| FAILED | demo.outcome.bug |" in markdown
    assert "## Skipped" in markdown and "- `demo.outcome.skips`: this stack cannot build the path" in markdown


def test_the_same_command_gives_the_same_report_bytes(outcomes):
    texts = []
    for run in range(2):
        outcomes.runpytest("-p", "harness.plugin", "-k", "test_check", f"--parity-report=out/{run}.json")
        texts.append((outcomes.path / f"out/{run}.json").read_bytes())
        checks.CHECKS.forget("demo.outcome.")
        ablation.ABLATIONS.forget("demo.outcome.")
    assert texts[0] == texts[1]


def test_a_world_failure_names_its_ranks_and_a_timeout_its_hung_ones():
    outcomes = [RankOutcome(0, "blocked", "no result within the grace period after another rank failed"),
                RankOutcome(1, "raised", "ValueError: bad latent at 0x7f00deadbeef on port 5555"),
                RankOutcome(2, "ok")]
    got = session.unfinished("decode.x", WorldTaskError("task decode_task raised on ranks [0, 1] of 3", outcomes))
    assert got == Unfinished("decode.x", "failed", "task decode_task raised on ranks [0, 1] of 3: rank 1: raised: "
                             "ValueError: bad latent at 0x<address> on port <port>", "WorldTaskError", (1,))
    hung = [RankOutcome(0, "ok"), RankOutcome(1, "hung", "no result within 2 s")]
    got = session.unfinished("decode.y", WorldTimeout("task t timed out after 2 s on ranks [1] of 2", hung))
    assert (got.error_type, got.ranks, got.status) == ("WorldTimeout", (1,), "failed")
    assert session.unfinished("decode.z", pytest.skip.Exception("no CUDA")).fields() == {"reason": "no CUDA"}


def test_a_stuck_rank_is_the_one_a_failed_row_names_not_the_ranks_that_waited_for_it():
    outcomes = [RankOutcome(0, "blocked", "waited in all_gather #1 for rank(s) [2]"),
                RankOutcome(1, "blocked", "waited in all_gather #1 for rank(s) [2]"),
                RankOutcome(2, "stuck", "did not reach all_gather #1 within 20 s (last seen in decoding)")]
    got = session.unfinished("decode.gpu", WorldTaskError("task t: rank 2 did not reach all_gather #1", outcomes))
    assert got.ranks == (2,)
    assert got.reason.endswith("rank 2: stuck: did not reach all_gather #1 within 20 s (last seen in decoding)")


def test_an_item_that_passed_here_and_failed_elsewhere_shows_the_failing_rank_s_own_error():
    failed = [(0, "WorldTaskError: task t: rank 2 did not reach all_gather #1 within 20 s"),
              (2, "WorldTaskError: task t: rank 2 did not reach all_gather #1 within 20 s")]
    got = session.failed_elsewhere("decode.gpu.bitexact", failed, here=0)
    assert got == Unfinished("decode.gpu.bitexact", "failed", "rank 2: WorldTaskError: task t: rank 2 did not reach "
                             "all_gather #1 within 20 s", "failed on another rank", (2,))


def test_a_report_path_that_breaks_during_the_run_does_not_stop_the_others(outcomes):
    """Checked at configure, a path can still go away before the end: the others are written, the table printed."""
    outcomes.makepyfile(test_breaks='''
import pathlib


def test_zz_breaks_the_report_directory():
    doomed = pathlib.Path("doomed")
    doomed.rmdir()
    doomed.write_text("a file where the report directory was")
''')
    (outcomes.path / "doomed").mkdir()
    result = outcomes.runpytest("-p", "harness.plugin", "-k", "test_check or breaks", "--parity-report=doomed/a.json",
                                "--parity-report=kept/b.json")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    result.stdout.fnmatch_lines(["checks: 1/4 passed, 2 failed, 1 skipped*",
                                 "parity report written to kept/b.json",
                                 "ERROR --parity-report doomed/a.json: not written (*"])
    assert json.loads((outcomes.path / "kept/b.json").read_text())["summary"]["checks"] == 4


def test_a_run_that_fails_outside_its_checks_never_reads_green(outcomes):
    """Every check passes and every claimed pair is killed, but another test of the run fails: pytest exits 1, and
    the report says so first (and beside its counts), naming the test, instead of reading all green."""
    outcomes.makepyfile(test_wording='''
def test_an_adapter_refusal_judged_by_its_wording():
    assert "cfg must be 1" in "cfg has to be 1 or 2, got 3"
''')
    result = outcomes.runpytest("-p", "harness.plugin", "-k", "(passes and not unrun) or wording",
                                "--parity-report=out/run.json",
                                "--parity-report=out/run.md")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    data = json.loads((outcomes.path / "out/run.json").read_text())
    summary = data["summary"]
    assert (summary["checks"], summary["passed"], summary["pairs"], summary["pairs_killed"]) == (1, 1, 1, 1)
    line = ("NOT GREEN: pytest exits 1 (tests failed); 1 test(s) outside the parity checks failed: "
            "test_wording.py::test_an_adapter_refusal_judged_by_its_wording (call: AssertionError)")
    assert data["not_green"] == line
    result.stdout.fnmatch_lines([line, "*", "checks: 1/1 passed; ablations: 1/1 killed all their checks", line])
    assert (outcomes.path / "out/run.md").read_text().startswith(f"# Parity report\n\n**{line}**\n")


def test_a_green_run_says_nothing_of_the_kind(outcomes):
    result = outcomes.runpytest("-p", "harness.plugin", "-k", "passes and not unrun", "--parity-report=out/green.json")
    assert result.ret == pytest.ExitCode.OK
    assert "not_green" not in json.loads((outcomes.path / "out/green.json").read_text())
    assert "NOT GREEN" not in result.stdout.str()


def test_the_not_green_line_says_why_or_that_the_cause_lies_outside_any_test():
    from harness.summary import not_green_line

    green = {"summary": {"failed": 0, "pairs_survived": 0, "pairs_failed": 0}}
    assert not_green_line(0, green, [], []) is None
    assert not_green_line(1, {"summary": {**green["summary"], "failed": 2}}, [], []) is None  # its table says so
    assert not_green_line(1, green, [], ["replay.x: the implementation under test never ran"]) == (
        "NOT GREEN: pytest exits 1 (tests failed); replay.x: the implementation under test never ran")
    assert not_green_line(3, green, [], []) == ("NOT GREEN: pytest exits 3 (internal error); an error outside any "
                                                "test (collection, usage or an internal error: see pytest's own "
                                                "summary)")
    assert not_green_line(77, green, ["t.py::x (setup: OSError)"], []) == (
        "NOT GREEN: pytest exits 77; 1 test(s) outside the parity checks failed: t.py::x (setup: OSError)")

"""Conformance mode (--impl): a user's callable judged by a path's checks, the other paths deselected,
the suite's own ablations skipped for it, the report naming it, a silent fallback failing."""

import json

import pytest

from harness import ablation, checks, conformance

pytestmark = pytest.mark.cpu

SUITE_IMPL = '''
def scale(x):
    """The suite's own fast function (the seam its ablations patch)."""
    return [2 * v for v in x]


def stock(x):
    return [v + v for v in x]
'''

USER_IMPL = '''
def right(x):
    return [v * 2 for v in x]


def off_by_one(x):
    return [v * 2 + 1 for v in x]


not_callable = 3
'''

CHECKS = '''
import torch
import suite_impl
from harness import conformance
from harness.checks import register
from harness.compare import exact


@register("attention.cdemo.exact")
def cdemo_exact(ctx):
    fast = conformance.resolve("attention", suite_impl.scale)
    x = [1.0, 2.0, 3.0]
    return exact().judge("attention.cdemo.exact", torch.tensor(fast(x)), torch.tensor(suite_impl.stock(x)))


@register("attention.cdemo.fallback")
def cdemo_fallback(ctx):
    """Fetches the implementation under test, then silently falls back to the suite's own: must fail."""
    fast = conformance.resolve("attention", suite_impl.scale)
    x = [1.0, 2.0]
    got = suite_impl.scale(x) if fast is not suite_impl.scale else fast(x)
    return exact().judge("attention.cdemo.fallback", torch.tensor(got), torch.tensor(suite_impl.stock(x)))


@register("attention.cdemo.unwired")
def cdemo_unwired(ctx):
    """Never fetches the implementation under test (a check not routed through conformance.resolve)."""
    x = [1.0, 2.0]
    return exact().judge("attention.cdemo.unwired", torch.tensor(suite_impl.scale(x)),
                         torch.tensor(suite_impl.stock(x)))


@register("decode.cdemo.exact")
def decode_exact(ctx):
    x = [1.0]
    return exact().judge("decode.cdemo.exact", torch.tensor(suite_impl.scale(x)), torch.tensor(suite_impl.stock(x)))
'''

ABLATIONS = '''
from harness.ablation import ablation

ablation("attention.cdemo_plus_one", "suite_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=["attention.cdemo.exact", "attention.cdemo.fallback", "attention.cdemo.unwired"], why="adds one",
         kill_mode="tolerance")
ablation("decode.cdemo_plus_one", "suite_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=["decode.cdemo.exact"], why="adds one", kill_mode="tolerance")
'''

GENERATED = '''
import pytest
from harness import ablation, catalogue, checks

catalogue.load(["cdemo_checks"], ["cdemo_ablations"])
IDS = [c.id for c in checks.all_checks("cpu") if ".cdemo." in c.id]
PAIRS = [(a.name, c) for a in ablation.all_ablations() if "cdemo" in a.name for c in a.kills]


@pytest.mark.cpu
@pytest.mark.parametrize("check_id", IDS)
def test_parity_check(check_id, parity_session, parity_ctx):
    verdict = parity_session.check(check_id, parity_ctx)
    assert verdict.passed, verdict.describe()


@pytest.mark.cpu
@pytest.mark.parametrize(("ablation_name", "check_id"), PAIRS)
def test_ablation_kills_check(ablation_name, check_id, parity_session, parity_ctx):
    assert parity_session.kill(ablation_name, check_id, parity_ctx).killed


@pytest.mark.cpu
def test_every_check_is_claimed():
    pass
'''

PATH_TESTS = {
    "test_attention_properties": "import pytest\n\n\n@pytest.mark.cpu\ndef test_attention_property():\n    pass\n",
    "test_decode_properties": "import pytest\n\n\n@pytest.mark.cpu\ndef test_decode_property():\n    pass\n",
}


@pytest.fixture(autouse=True)
def _clean():
    checks._forget("attention.cdemo.")
    checks._forget("decode.cdemo.")
    ablation._forget("attention.cdemo")
    ablation._forget("decode.cdemo")
    conformance.clear()
    yield
    checks._forget("attention.cdemo.")
    checks._forget("decode.cdemo.")
    ablation._forget("attention.cdemo")
    ablation._forget("decode.cdemo")
    conformance.clear()


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(suite_impl=SUITE_IMPL, user_impl=USER_IMPL, cdemo_checks=CHECKS,
                        cdemo_ablations=ABLATIONS, test_generated=GENERATED, **PATH_TESTS)
    pytester.syspathinsert()
    return pytester


def test_without_impl_every_path_and_the_kill_matrix_run(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu")
    result.assert_outcomes(passed=11)


def test_a_right_implementation_passes_and_the_report_names_it(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "not fallback and not unwired", "-rs", "--parity-report=out/r.json",
                             "--parity-report=out/r.md")
    # kept: the attention check and the attention path's own test; skipped: the suite's attention ablation
    result.assert_outcomes(passed=2, skipped=1, deselected=8)
    result.stdout.fnmatch_lines(["conformance mode: attention checks judge user_impl:right*"])  # the header
    result.stdout.fnmatch_lines(["implementation under test for attention: user_impl:right"])  # the report
    result.stdout.fnmatch_lines(["*the suite's ablations patch the suite's seams, not user_impl:right; measure "
                                 "teeth with scripts/mutation-score --module user_impl*"])
    data = json.loads((suite.path / "out/r.json").read_text())
    assert data["implementations"] == {"attention": "user_impl:right"}
    assert [c["id"] for c in data["checks"]] == ["attention.cdemo.exact"]
    assert "**implementation under test for attention**: `user_impl:right`" in (suite.path / "out/r.md").read_text()
    assert conformance.specs() == {}  # the run's specs do not outlive it


def test_a_buggy_implementation_fails_naming_the_check(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:off_by_one",
                             "-k", "not fallback and not unwired")
    result.assert_outcomes(failed=1, passed=1, skipped=1, deselected=8)
    result.stdout.fnmatch_lines(["FAILED*test_parity_check[[]attention.cdemo.exact[]]*"])


def test_a_check_that_fetches_the_implementation_and_falls_back_fails(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "test_parity_check and fallback")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the implementation under test never ran (user_impl:right was fetched through "
                                 "harness.conformance.resolve but not called)*"])


def test_a_run_whose_checks_never_call_the_implementation_fails(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "test_parity_check and unwired")
    result.assert_outcomes(passed=1)  # the check judges the suite's code, as it is written to...
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # ...but the run judged nothing of the user's
    result.stdout.fnmatch_lines(["FAILED --impl attention=user_impl:right: the implementation under test never ran "
                                 "in any attention check*"])


@pytest.mark.parametrize(("given", "message"), [
    ("attention", "--impl 'attention': expected PATH=MODULE:CALLABLE"),
    ("video=user_impl:right", "unknown path 'video'"),
    ("attention=user_impl", "must read 'package.module:callable'"),
    ("attention=user_impl:nope", "--impl attention=user_impl:nope: implementation 'user_impl:nope': user_impl has "
                                 "no attribute 'nope'"),
    ("attention=no_such_module:f", "module 'no_such_module' cannot be imported"),
    ("attention=user_impl:not_callable", "'not_callable' is not callable"),
])
def test_a_bad_spec_is_a_usage_error_naming_it(suite, given, message):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", given)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_one_path_under_test_twice_is_a_usage_error(suite):
    result = suite.runpytest("-p", "harness.plugin", "--impl", "attention=user_impl:right",
                             "--impl", "attention=user_impl:off_by_one")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "path 'attention' is already under test (user_impl:right)" in result.stderr.str()

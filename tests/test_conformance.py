"""Conformance mode (--impl): a user's callable judged by a path's checks, the other paths deselected,
the suite's own ablations skipped for it, the report naming it, a check that never calls it failing, one
declared unable to call it deselected and listed as not judged, calls counted inside every rank."""

import json

import pytest

from harness.judging import ablation, checks
from harness.plugins import conformance
from harness.process.dist import World, WorldTaskError
from tests import dist_tasks

# every test here is of the cpu tier but the spawned variant, a launcher test (tens of seconds on 2 cores)

SUITE_IMPL = '''
def scale(x):
    """The suite's own fast function (the seam its ablations patch)."""
    return [2 * v for v in x]


def stock(x):
    return [v + v for v in x]
'''

USER_IMPL = '''
def right(x, key=None, value=None, layout=None, *, scale=None):  # shaped like the attention contract
    return [v * 2 for v in x]


def off_by_one(x, key=None, value=None, layout=None, *, scale=None):
    return [v * 2 + 1 for v in x]


not_callable = 3
'''

CHECKS = '''
import torch
import suite_impl
from harness.plugins import conformance
from harness.judging.checks import register
from harness.judging.compare import exact


@register("attention.cdemo.exact")
def cdemo_exact(ctx):
    fast = conformance.resolve("attention", suite_impl.scale)
    x = [1.0, 2.0, 3.0]
    return exact().judge(torch.tensor(fast(x)), torch.tensor(suite_impl.stock(x)))


@register("attention.cdemo.fallback")
def cdemo_fallback(ctx):
    """Fetches the implementation under test, then silently falls back to the suite's own: must fail."""
    fast = conformance.resolve("attention", suite_impl.scale)
    x = [1.0, 2.0]
    got = suite_impl.scale(x) if fast is not suite_impl.scale else fast(x)
    return exact().judge(torch.tensor(got), torch.tensor(suite_impl.stock(x)))


@register("attention.cdemo.unwired")
def cdemo_unwired(ctx):
    """Never fetches the implementation under test (a check not routed through conformance.resolve)."""
    x = [1.0, 2.0]
    return exact().judge(torch.tensor(suite_impl.scale(x)),
                         torch.tensor(suite_impl.stock(x)))


@register("attention.cdemo.stock_only")
def cdemo_stock_only(ctx):
    """Compares the stock path with itself: no implementation under test can run here, and it says so."""
    x = [1.0, 2.0]
    return exact().judge(torch.tensor(suite_impl.stock(x)),
                         torch.tensor(suite_impl.stock(x)))


conformance.not_judged("attention.cdemo.stock_*", "compares the stock path with itself")


@register("replay.cdemo.exact")
def replay_exact(ctx):
    x = [1.0]
    return exact().judge(torch.tensor(suite_impl.scale(x)), torch.tensor(suite_impl.stock(x)))
'''

ABLATIONS = '''
from harness.judging.ablation import ablation

ablation("attention.cdemo_plus_one", "suite_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=["attention.cdemo.exact", "attention.cdemo.fallback", "attention.cdemo.unwired"], why="adds one",
         kill_mode="tolerance")
ablation("replay.cdemo_plus_one", "suite_impl:scale", lambda x: [2 * v + 1 for v in x],
         kills=["replay.cdemo.exact"], why="adds one", kill_mode="tolerance")
'''

GENERATED = '''
import pytest
from harness.judging import ablation
from harness.judging import catalogue
from harness.judging import checks
from harness.judging.items import check_params, kill_params

catalogue.load(["cdemo_checks"], ["cdemo_ablations"])
IDS = [c.id for c in checks.all_checks("cpu") if ".cdemo." in c.id]
PAIRS = [(a.name, c) for a in ablation.all_ablations() if "cdemo" in a.name for c in a.kills]


@pytest.mark.cpu
@pytest.mark.parametrize("parity", check_params(IDS))
def test_parity_check(parity, parity_session, parity_ctx):
    verdict = parity_session.check(parity.check, parity_ctx)
    assert verdict.passed, verdict.describe()


@pytest.mark.cpu
@pytest.mark.parametrize("parity", kill_params(PAIRS))
def test_ablation_kills_check(parity, parity_session, parity_ctx):
    assert parity_session.kill(parity.ablation, parity.check, parity_ctx).killed


@pytest.mark.cpu
def test_every_check_is_claimed():
    pass
'''

PATH_TESTS = {
    "test_attention_properties": "import pytest\n\n\n@pytest.mark.cpu\ndef test_attention_property():\n    pass\n",
    "test_replay_properties": "import pytest\n\n\n@pytest.mark.cpu\ndef test_replay_property():\n    pass\n",
}


@pytest.fixture(autouse=True)
def _clean():
    conformance.NOT_JUDGED.unregister("attention.cdemo.stock_*")
    checks.CHECKS.forget("attention.cdemo.")
    checks.CHECKS.forget("replay.cdemo.")
    ablation.ABLATIONS.forget("attention.cdemo")
    ablation.ABLATIONS.forget("replay.cdemo")
    conformance.clear()
    yield
    conformance.NOT_JUDGED.unregister("attention.cdemo.stock_*")
    checks.CHECKS.forget("attention.cdemo.")
    checks.CHECKS.forget("replay.cdemo.")
    ablation.ABLATIONS.forget("attention.cdemo")
    ablation.ABLATIONS.forget("replay.cdemo")
    conformance.clear()


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(suite_impl=SUITE_IMPL, user_impl=USER_IMPL, cdemo_checks=CHECKS,
                        cdemo_ablations=ABLATIONS, test_generated=GENERATED, **PATH_TESTS)
    pytester.syspathinsert()
    return pytester


@pytest.mark.cpu
def test_without_impl_every_path_and_the_kill_matrix_run(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu")
    result.assert_outcomes(passed=12)


@pytest.mark.cpu
def test_a_right_implementation_passes_and_the_report_names_it(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "not fallback and not unwired", "-rs", "--parity-report=out/r.json",
                             "--parity-report=out/r.md")
    # kept: the attention check; skipped: the suite's attention ablation; deselected: the replay items, the
    # stock-only check a conformance run cannot judge, and the attention path's own test (the suite's code)
    result.assert_outcomes(passed=1, skipped=1, deselected=10)
    result.stdout.fnmatch_lines(["conformance mode: attention checks judge user_impl:right*"])  # the header
    result.stdout.fnmatch_lines(["implementation under test for attention: user_impl:right"])  # the report
    result.stdout.fnmatch_lines(["*the suite's ablations patch the suite's seams, not user_impl:right; measure "
                                 "teeth with scripts/mutation-score --module user_impl*"])
    data = json.loads((suite.path / "out/r.json").read_text())
    assert data["implementations"] == {"attention": "user_impl:right"}
    assert [c["id"] for c in data["checks"]] == ["attention.cdemo.exact"]
    assert data["not_judged"] == {"attention.cdemo.stock_only": "compares the stock path with itself"}
    result.stdout.fnmatch_lines(["not judged: 1 attention tests of the suite's own implementation (property, fault "
                                 "and unit tests beside the catalogue, deselected: only the checks judge yours)",
                                 "not judged: 1 checks cannot call the implementation under test (deselected, neither "
                                 "passed nor failed):",
                                 "  attention.cdemo.stock_only: compares the stock path with itself"])
    assert "**implementation under test for attention**: `user_impl:right`" in (suite.path / "out/r.md").read_text()
    assert conformance.specs() == {}  # the run's specs do not outlive it


@pytest.mark.cpu
def test_a_buggy_implementation_fails_naming_the_check(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:off_by_one",
                             "-k", "not fallback and not unwired")
    result.assert_outcomes(failed=1, skipped=1, deselected=10)
    result.stdout.fnmatch_lines(["FAILED*test_parity_check[[]attention.cdemo.exact[]]*"])


@pytest.mark.cpu
def test_a_check_that_fetches_the_implementation_and_falls_back_fails(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "test_parity_check and fallback")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*VIOLATED: the implementation under test (user_impl:right) ran in this check*"])


@pytest.mark.cpu
def test_a_check_that_never_calls_the_implementation_fails_whatever_its_numbers(suite):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", "attention=user_impl:right",
                             "-k", "test_parity_check and unwired")
    result.assert_outcomes(failed=1)  # the numbers of the suite's own code pass; they judge nothing of the user's
    result.stdout.fnmatch_lines(["*VIOLATED: the implementation under test (user_impl:right) ran in this check*",
                                 "FAILED --impl attention=user_impl:right: no attention check called the "
                                 "implementation under test"])


@pytest.mark.cpu
def test_declarations_match_ids_and_patterns_and_keep_one_reason():
    conformance.not_judged("attention.cdemo.stock_*", "compares the stock path with itself")
    assert conformance.judged_by("attention.cdemo.stock_only") == "compares the stock path with itself"
    assert conformance.judged_by("attention.cdemo.exact") is None
    conformance.not_judged("attention.cdemo.stock_*", "compares the stock path with itself")  # idempotent
    with pytest.raises(ValueError, match="declared twice with different reasons"):
        conformance.not_judged("attention.cdemo.stock_*", "another reason")
    with pytest.raises(ValueError, match="say why"):
        conformance.not_judged("attention.cdemo.other", " ")
    conformance.not_judged("attention.cdemo.stock_only.*", "a narrower reason")  # the most specific pattern wins
    try:
        assert conformance.judged_by("attention.cdemo.stock_only.x") == "a narrower reason"
        assert conformance.judged_by("attention.cdemo.stock_x") == "compares the stock path with itself"
    finally:
        conformance.NOT_JUDGED.unregister("attention.cdemo.stock_only.*")


def _count_inside_ranks(start_method: str) -> None:
    """The implementation under test travels to each rank as a spec; each rank's calls come back with its
    answer, a raise included (a fault check judges the user's code by the raise)."""
    with World(2, start_method=start_method) as world:
        conformance.use("attention", "tests.dist_tasks:double")
        try:
            assert world.run(dist_tasks.call_implementation, "attention", False) == [2, 2]
            assert conformance.calls("attention") == 2
            with pytest.raises(WorldTaskError, match="raised after calling"):
                world.run(dist_tasks.call_implementation, "attention", True)
            assert conformance.calls("attention") == 4
        finally:
            conformance.clear()


@pytest.mark.cpu
def test_calls_made_inside_forked_ranks_are_counted_even_when_the_call_raises():
    _count_inside_ranks("fork")


@pytest.mark.launch
def test_calls_made_inside_spawned_ranks_are_counted_even_when_the_call_raises():
    _count_inside_ranks("spawn")


@pytest.mark.cpu
@pytest.mark.parametrize(("given", "message"), [
    ("attention", "--impl 'attention': expected PATH=MODULE:CALLABLE"),
    ("video=user_impl:right", "unknown path 'video'"),
    ("attention=user_impl", "must read 'package.module:callable'"),
    ("attention=user_impl:nope", "--impl attention=user_impl:nope: implementation 'user_impl:nope': user_impl has "
                                 "no attribute 'nope'"),
    ("attention=no_such_module:f", "module 'no_such_module' cannot be imported"),
    ("attention=user_impl:not_callable", "'not_callable' is not callable"),
    ("replay=os:system", "implementation 'os:system'(command) cannot take the replay contract's call "
                         "replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None): "
                         "too many positional arguments"),
    ("attention=builtins:__import__", "cannot take the attention contract's call kernel(query, key, value, layout, *, "
                                      "scale=None): got an unexpected keyword argument 'scale'"),
    ("attention=builtins:max", "implementation 'builtins:max': its signature cannot be read (a builtin or extension "
                               "function?), so it cannot be checked against the attention contract kernel(query, key, "
                               "value, layout, *, scale=None); wrap it in a Python function with that signature"),
])
def test_a_bad_spec_is_a_usage_error_naming_it(suite, given, message):
    result = suite.runpytest("-p", "harness.plugin", "-m", "cpu", "--impl", given)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


@pytest.mark.cpu
def test_the_contract_call_of_every_path_binds_only_a_callable_that_can_take_it():
    from harness.plugins import conformance

    assert conformance.contract_call("decode") == (("vae", "z", "group"), ())  # transport, dst: only when not default
    assert conformance.contract_call("attention") == (("query", "key", "value", "layout"), ("scale",))

    def kernel(q, k, v, layout, *, scale=None): ...
    def flexible(*args, **kwargs): ...
    def renamed_scale(q, k, v, layout, *, softmax_scale=None): ...
    def decode_without_transport(vae, z, group): ...  # judged by the all-gather checks, failing the gather ones

    conformance.check_signature("attention", "m:kernel", kernel)
    conformance.check_signature("attention", "m:flexible", flexible)
    conformance.check_signature("decode", "m:decode_without_transport", decode_without_transport)
    with pytest.raises(ValueError, match="unexpected keyword argument 'scale'"):
        conformance.check_signature("attention", "m:renamed_scale", renamed_scale)
    with pytest.raises(ValueError, match="missing a required argument: 'extra'"):
        conformance.check_signature("ar", "m:more", lambda backend, batch, steps, eos, extra: None)


@pytest.mark.cpu
def test_one_path_under_test_twice_is_a_usage_error(suite):
    result = suite.runpytest("-p", "harness.plugin", "--impl", "attention=user_impl:right",
                             "--impl", "attention=user_impl:off_by_one")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "path 'attention' is already under test (user_impl:right)" in result.stderr.str()


@pytest.mark.cpu
def test_a_layout_declared_again_alike_is_kept_and_differently_is_refused(monkeypatch):
    from harness.registry import Registry

    monkeypatch.setattr(conformance, "LAYOUT_CHECKS", Registry("layout declaration", list_known=False))
    conformance.judges_layout("ar.*.left.*", "ar", "left")
    conformance.judges_layout("ar.*.left.*", "ar", "left")  # a module imported twice: the same declaration
    assert conformance.LAYOUT_CHECKS.get("ar.*.left.*") == ("ar", "left")
    with pytest.raises(ValueError, match=r"declared twice: \('ar', 'left'\) and \('ar', 'right'\)"):
        conformance.judges_layout("ar.*.left.*", "ar", "right")
    with pytest.raises(ValueError, match="has no layout 'middle'"):
        conformance.judges_layout("ar.*", "ar", "middle")


@pytest.mark.cpu
def test_an_implementation_declaring_an_unknown_layout_is_refused_when_put_under_test(tmp_path, monkeypatch):
    (tmp_path / "sideways_impl.py").write_text(
        "def fast_rollout(backend, batch, max_new_tokens, eos=()):\n    raise NotImplementedError\n\n"
        "fast_rollout.padding_side = 'middle'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="padding_side = 'middle'"):
        conformance.use("ar", "sideways_impl:fast_rollout")
    assert "ar" not in conformance.specs()


@pytest.mark.cpu
def test_a_layout_declared_both_ways_on_one_callable_must_agree():
    from harness.plugins.declarations import ARDeclaration

    def callable_with(attribute: str, declared: str):
        return type("F", (), {"padding_side": attribute, "declares": ARDeclaration(padding_side=declared)})()

    assert conformance.declared_layout("ar", callable_with("left", "left")) == "left"
    with pytest.raises(ValueError, match="declares padding_side = 'left' but its padding_side attribute says "
                                         "'right': keep one"):
        conformance.declared_layout("ar", callable_with("right", "left"))

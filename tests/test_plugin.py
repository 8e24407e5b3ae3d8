"""The plugin, registry, kill matrix and report, driven through pytest's own pytester."""

import json

import pytest
import torch

from harness.inputs import host
from harness.judging import ablation, checks

pytestmark = pytest.mark.cpu

DEMO_IMPL = '''
def scale(x):
    """The seam: the fast path's one job."""
    return [2 * v for v in x]


def fast(x):
    return demo_impl.scale(x)


def stock(x):
    return [v + v for v in x]
'''

DEMO_CHECKS = '''
import torch
import demo_impl
from harness.judging.checks import register
from harness.judging.compare import exact, close


@register("demo.double.exact")
def double_exact(ctx):
    x = [1.0, 2.0, 3.0]
    return exact().judge(torch.tensor(demo_impl.scale(x)), torch.tensor(demo_impl.stock(x)))


@register("demo.double.close")
def double_close(ctx):
    x = [1.0, 2.0]
    return close(atol=0.1, rtol=0.0, reason="demo").judge(torch.tensor(demo_impl.scale(x)),
                                                         torch.tensor(demo_impl.stock(x)))
'''

GENERATED_TESTS = '''
import pytest
import torch
from harness.judging import ablation
from harness.judging import catalogue
from harness.judging import checks
from harness.judging.items import check_params, kill_params

catalogue.load(["demo_checks"], ["demo_ablations"])


@pytest.mark.cpu
@pytest.mark.parametrize("parity", check_params(c.id for c in checks.all_checks("cpu")
                                                if c.id.startswith(("demo.", "twin."))))
def test_check(parity, parity_session, parity_ctx):
    verdict = parity_session.check(parity.check, parity_ctx)
    assert verdict.passed, verdict.describe()


PAIRS = [(a.name, c) for a in ablation.all_ablations("demo") for c in a.kills]


@pytest.mark.cpu
@pytest.mark.parametrize("parity", kill_params(PAIRS))
def test_kill(parity, parity_session, parity_ctx):
    assert parity_session.check(parity.check, parity_ctx).passed
    assert parity_session.kill(parity.ablation, parity.check, parity_ctx).killed


@pytest.mark.gpu
def test_gpu_only():
    pass
'''


def demo_ablations(replacement: str, kills: str = '["demo.double.exact", "demo.double.close"]',
                   mode: str = "tolerance") -> str:
    return f'''
from harness.judging.ablation import ablation

ablation("demo.off_by_one", "demo_impl:scale", lambda x: {replacement},
         kills={kills}, why="adds one to every element", kill_mode="{mode}")
'''


@pytest.fixture(autouse=True)
def _clean_registry():
    checks.CHECKS.forget("demo.")
    ablation.ABLATIONS.forget("demo.")
    yield
    checks.CHECKS.forget("demo.")
    ablation.ABLATIONS.forget("demo.")


@pytest.fixture
def demo(pytester):
    pytester.makepyfile(demo_impl=DEMO_IMPL, demo_checks=DEMO_CHECKS, test_demo=GENERATED_TESTS)
    pytester.makepyfile(demo_ablations=demo_ablations("[2 * v + 1 for v in x]"))
    pytester.syspathinsert()
    return pytester


def test_table_and_both_report_formats(demo):
    result = demo.runpytest("-p", "harness.plugin", "-m", "cpu", "--parity-report=out/parity.md",
                            "--parity-report=out/parity.json")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([
        "*fastpath-parity report*",
        "PASS*demo.double.exact*max_abs=0*",
        "PASS*demo.double.close*max_abs=0*1.000e-01*",
        "KILLED*demo.off_by_one*tolerance*2/2*",
        "checks: 2/2 passed; ablations: 1/1 killed all their checks",
    ])
    data = json.loads((demo.path / "out/parity.json").read_text())
    assert set(data) == {"host", "checks", "ablations", "summary"}
    assert data["host"] == json.loads(json.dumps(host.fingerprint()))  # where it ran, for scripts/compare-reports
    assert next(iter(data)) == "host" and data["host"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"id", "path", "where", "passed", "metrics", "policy", "margin"} <= set(data["checks"][0])
    assert data["checks"][0]["where"] == "demo_checks:double_exact"
    assert data["checks"][0]["path"] == "demo"
    kill = data["ablations"][0]
    assert kill["name"] == "demo.off_by_one" and kill["path"] == "demo" and kill["kill_mode"] == "tolerance"
    assert {k["mode"] for k in kill["kills"]} == {"tolerance"}
    assert {k["check"] for k in kill["kills"]} == {"demo.double.exact", "demo.double.close"}
    assert all(k["killed"] for k in kill["kills"])
    close_kill = next(k for k in kill["kills"] if k["check"] == "demo.double.close")
    assert close_kill["margin"] == pytest.approx(10.0)  # |d| = 1 against atol 0.1
    assert data["summary"] == {"checks": 2, "passed": 2, "failed": 0, "skipped": 0, "ablations": 1, "killed": 1,
                               "pairs": 2, "pairs_killed": 2, "pairs_survived": 0, "pairs_failed": 0,
                               "pairs_skipped": 0}
    assert {c["status"] for c in data["checks"]} == {"passed"} and kill["status"] == "killed"
    markdown = (demo.path / "out/parity.md").read_text()
    assert "| PASS | demo.double.exact |" in markdown and "| KILLED | demo.off_by_one | tolerance | 2/2 |" in markdown
    assert f"**host** {host.summary(data['host'])}" in markdown


def test_surviving_ablation_fails_the_kill_matrix(pytester):
    pytester.makepyfile(demo_impl=DEMO_IMPL, demo_checks=DEMO_CHECKS, test_demo=GENERATED_TESTS)
    pytester.makepyfile(demo_ablations=demo_ablations("[v * 2 for v in x]"))  # not a bug: survives
    pytester.syspathinsert()
    result = pytester.runpytest("-p", "harness.plugin", "-m", "cpu")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["SURVIVED*demo.off_by_one*0/2*"])


@pytest.fixture
def demo_modules(demo):
    """The demo modules imported in this process (removed again so pytester runs re-import them)."""
    import importlib
    import sys

    yield importlib.import_module("demo_checks").demo_impl
    for name in ("demo_impl", "demo_checks", "demo_ablations"):
        sys.modules.pop(name, None)


def test_seam_is_restored_even_when_the_check_raises(demo_modules):
    demo_impl = demo_modules

    original = demo_impl.scale
    item = ablation.ablation("demo.raises", "demo_impl:scale", lambda x: 1 / 0,
                             kills=["demo.double.exact"], why="crashes", kill_mode="raises",
                             raises=(ZeroDivisionError,))
    result = ablation.run_under(item, "demo.double.exact", checks.CheckContext())
    assert result.killed and result.mode == "raises" and result.how == "raised ZeroDivisionError"
    assert demo_impl.scale is original
    undeclared = ablation.ablation("demo.raises_undeclared", "demo_impl:scale", lambda x: 1 / 0,
                                   kills=["demo.double.exact"], why="crashes", kill_mode="tolerance")
    result = ablation.run_under(undeclared, "demo.double.exact", checks.CheckContext())
    assert not result.killed and result.mode == "wrong exception ZeroDivisionError"
    assert demo_impl.scale is original


def test_a_kill_in_another_mode_than_declared_is_not_a_kill(demo_modules):
    """A numeric bug declared 'fact' must not pass because the numbers caught it, and vice versa."""
    item = ablation.ablation("demo.numeric_declared_fact", "demo_impl:scale", lambda x: [2 * v + 1 for v in x],
                             kills=["demo.double.close"], why="-", kill_mode="fact", fact="one forward")
    result = ablation.run_under(item, "demo.double.close", checks.CheckContext())
    assert not result.killed and result.mode == "tolerance" and result.declared == "fact"
    with pytest.raises(ValueError, match="must name the spy fact"):
        ablation.ablation("demo.fact_unnamed", "demo_impl:scale", lambda x: x, kills=["demo.double.close"],
                          why="-", kill_mode="fact")
    with pytest.raises(ValueError, match="kill mode 'numbers'"):
        ablation.ablation("demo.bad_mode", "demo_impl:scale", lambda x: x, kills=["demo.double.close"],
                          why="-", kill_mode="numbers")


def test_a_failed_catalogue_load_leaves_no_half_registry(demo):
    """Claims are validated when the whole catalogue loads; a failure rolls every registration back."""
    import sys

    from harness.judging import catalogue

    demo.makepyfile(demo_ablations=demo_ablations("x", kills='["demo.no_such_check"]'))
    before_checks, before_ablations = len(checks.all_checks()), len(ablation.all_ablations())
    for _ in range(2):  # a retry meets the same clean state, not "registered twice"
        with pytest.raises(ValueError, match="claims unknown check ids"):
            catalogue.load(["demo_checks"], ["demo_ablations"])
        assert len(checks.all_checks()) == before_checks and len(ablation.all_ablations()) == before_ablations
        assert "demo_checks" not in sys.modules and "demo_ablations" not in sys.modules
    demo.makepyfile(demo_ablations=demo_ablations("[2 * v + 1 for v in x]"))
    catalogue.load(["demo_checks"], ["demo_ablations"])
    catalogue.load(["demo_checks"], ["demo_ablations"])  # idempotent
    assert checks.exists("demo.double.exact") and ablation.get("demo.off_by_one").kill_mode == "tolerance"
    for name in ("demo_impl", "demo_checks", "demo_ablations"):
        sys.modules.pop(name, None)


def test_unknown_check_id_fails_when_the_catalogue_loads_naming_it(demo):
    demo.makepyfile(demo_ablations=demo_ablations("x", kills='["demo.no_such_check"]'))
    result = demo.runpytest("-p", "harness.plugin")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*claims unknown check ids:*demo.no_such_check*"])


def test_unknown_seam_fails_when_the_catalogue_loads_naming_it(demo):
    demo.makepyfile(demo_ablations='''
from harness.judging.ablation import ablation
ablation("demo.ghost", "demo_impl:no_such_function", lambda x: x, kills=["demo.double.exact"], why="-",
         kill_mode="tolerance")
''')
    result = demo.runpytest("-p", "harness.plugin")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*seam 'demo_impl:no_such_function'*no callable 'no_such_function'*"])


def test_duplicate_and_malformed_check_ids_are_rejected():
    with pytest.raises(ValueError, match="path.case.what"):
        checks.register("Demo")
    checks.register("demo.once.only")(lambda ctx: None)
    with pytest.raises(ValueError, match="registered twice"):
        checks.register("demo.once.only")(lambda ctx: None)


def test_gpu_tests_skip_without_cuda_with_a_reason(demo):
    result = demo.runpytest("-p", "harness.plugin", "-m", "gpu", "-rs")
    result.assert_outcomes(skipped=1, deselected=4)
    result.stdout.fnmatch_lines(["*gpu tier needs CUDA*torch.cuda.is_available() is False*"])


def test_gpu_tests_skip_without_checkpoint_naming_the_option(demo):
    result = demo.runpytest("-p", "harness.plugin", "-m", "gpu", "--device", "cpu", "-rs")
    result.assert_outcomes(skipped=1, deselected=4)
    result.stdout.fnmatch_lines(["*pass --checkpoint=PATH*"])


def test_missing_checkpoint_is_a_usage_error_naming_the_path(demo):
    result = demo.runpytest("-p", "harness.plugin", "-m", "gpu", "--checkpoint=/does/not/exist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--checkpoint: checkpoint /does/not/exist: no such file or directory*"])


def test_bad_dtype_and_report_suffix_are_usage_errors(demo):
    result = demo.runpytest("-p", "harness.plugin", "--dtype", "fp8")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dtype 'fp8'*"])
    result = demo.runpytest("-p", "harness.plugin", "--parity-report=out/report.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*must end in .md, .json or .html*"])


def _interrupted_three_calls_deep() -> pytest.ExceptionInfo[BaseException]:
    def inner() -> None:
        raise KeyboardInterrupt

    def middle() -> None:
        __tracebackhide__ = True
        inner()

    def outer() -> None:
        middle()

    with pytest.raises(KeyboardInterrupt) as excinfo:
        outer()
    return excinfo


@pytest.mark.parametrize("full_trace", [False, True])
def test_an_interrupt_is_formatted_from_the_frame_pytest_prints(full_trace, pytestconfig, monkeypatch):
    """Only the frames pytest prints of an interrupt are formatted (their source parsed); ``--full-trace`` keeps all."""
    from harness import summary

    monkeypatch.setattr(pytestconfig.option, "fulltrace", full_trace)
    excinfo = _interrupted_three_calls_deep()
    printed = lambda: vars(excinfo._getreprcrash())  # noqa: E731 - the one line pytest prints of an interrupt
    before, crash = len(excinfo.traceback), printed()
    summary.InterruptTraceback(pytestconfig).pytest_keyboard_interrupt(excinfo)
    assert printed() == crash and crash["lineno"] == excinfo.traceback[-1].lineno + 1
    if full_trace:
        assert len(excinfo.traceback) == before
    else:
        assert [entry.name for entry in excinfo.traceback] == ["inner"] and before > 1


def test_what_collection_built_is_out_of_the_garbage_collectors_reach():
    """This very run froze what its collection built: a full collection walks only what the checks made since."""
    import gc

    assert gc.get_freeze_count() > 10_000

"""No silent green: a run given --checkpoint, --capture-dir or --impl on which no check ran exits 1, naming the
option, its value and why (the skip and deselection reasons, counted once each); a run that judged them exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.attention_captures import small_capture
from harness import given_inputs
from harness.attention import capture as capture_io
from harness.attention.layout import AttentionLayout
from harness.inputs import checkpoints
from harness.inputs.ledger import InputLedger
from harness.judging import checks
from harness.judging.compare import holds
from harness.plugins import conformance
from harness.process import launch

pytestmark = pytest.mark.cpu

checkpoints.registered_kinds()  # the kinds' plugin modules imported here, not inside a pytester run's sandbox

WHY = "this demo stack cannot load the checkpoint's generation (it needs transformers 4.x)"

DEMO = f'''
import pytest
from harness.judging.items import ParityItem, check_params
from harness.session import SESSION_KEY

WHY = {WHY!r}


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        given = metafunc.config.stash[SESSION_KEY].checkpoints
        cases = [ParityItem("ar.idemo.gpu", label=f"ar.idemo.gpu[{{c.name}}-{{dtype}}]", checkpoint=str(c.path))
                 for c in given for dtype in ("fp32", "bf16")]
        metafunc.parametrize("case", [pytest.param(c, id=c.label) for c in cases])


def test_checkpoint_skips(case):
    pytest.skip(WHY)


def test_checkpoint_runs(case):
    pass


@pytest.mark.parametrize("parity", check_params(["attention.idemo.reads_capture", "attention.idemo.synthetic"]))
def test_capture_skips(parity):
    pytest.skip("no capture of this layout")


@pytest.mark.parametrize("parity", check_params(["attention.idemo.reads_capture", "attention.idemo.synthetic"]))
def test_capture_runs(parity):
    pass


@pytest.mark.parametrize("parity", check_params(["attention.idemo.exact", "attention.idemo.stock_only"]))
def test_impl_skips(parity):
    pytest.skip("the implementation needs CUDA")


def test_machinery():
    pass


def test_broken():
    assert False
'''

USER_IMPL = "def attend(*args, **kwargs):\n    return None\n"


def _demo_check() -> object:
    return holds(True, "a demo fact")


@pytest.fixture(autouse=True)
def _clean():
    """The demo's checks (one reads the capture directory) and its not-judged declaration, for this test only."""
    checks.register("attention.idemo.reads_capture", reads=("capture_dir",))(_demo_check)
    checks.register("attention.idemo.synthetic")(_demo_check)
    conformance.not_judged("attention.idemo.stock_*", "compares the stock path with itself")
    yield
    checks.CHECKS.forget("attention.idemo.")
    conformance.NOT_JUDGED.unregister("attention.idemo.stock_*")
    conformance.clear()


@pytest.fixture
def demo(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_idemo=DEMO, user_impl=USER_IMPL)
    pytester.syspathinsert()
    checkpoint = pytester.path / "hunyuan"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    return pytester


def _captures(root: Path) -> Path:
    directory = root / "captures"
    directory.mkdir()
    for layout, call in ((AttentionLayout(4, 6, 2, "prefill"), 0), (AttentionLayout(3, 6, 2, "denoise"), 32)):
        capture_io.save_capture(small_capture(layout, heads=1, head_dim=4), directory / f"call{call}_rank0.npz")
    return directory


def test_a_checkpoint_every_item_of_which_skipped_fails_the_run_naming_why(demo):
    checkpoint = demo.path / "hunyuan"
    result = demo.runpytest("-p", "harness.plugin", f"--checkpoint={checkpoint}", "-k", "checkpoint_skips",
                            "--parity-report=out/r.json", "--parity-report=out/r.md")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert result.parseoutcomes()["skipped"] == 2
    line = (f"--checkpoint={checkpoint}: no check ran on it: 2 items skipped ({WHY}); 2 items deselected "
            "(by this run's -m/-k/--deselect)")
    result.stdout.fnmatch_lines([f"FAILED {line}"])
    assert json.loads((demo.path / "out/r.json").read_text())["nothing_ran"] == [line]
    assert f"- {line}" in (demo.path / "out/r.md").read_text()


def test_a_checkpoint_a_check_ran_on_exits_0(demo):
    result = demo.runpytest("-p", "harness.plugin", f"--checkpoint={demo.path / 'hunyuan'}", "-k", "checkpoint")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=2)
    assert "no check ran on it" not in result.stdout.str()


def test_a_checkpoint_no_item_was_selected_for_fails_the_run_even_with_nothing_collected(demo):
    checkpoint = demo.path / "hunyuan"
    result = demo.runpytest("-p", "harness.plugin", f"--checkpoint={checkpoint}", "-k", "machinery")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"FAILED --checkpoint={checkpoint}: no check ran on it: 4 items deselected*"])
    nothing = demo.runpytest("-p", "harness.plugin", f"--checkpoint={checkpoint}", "-k", "no_such_test")
    assert nothing.ret == pytest.ExitCode.TESTS_FAILED  # not 5: CI wrappers often let "no tests collected" pass


def test_listing_items_runs_none_by_design(demo):
    result = demo.runpytest("-p", "harness.plugin", f"--checkpoint={demo.path / 'hunyuan'}", "--co", "-q")
    assert result.ret == pytest.ExitCode.OK


def test_a_capture_directory_only_its_readers_count_for(demo):
    captures = _captures(demo.path)
    result = demo.runpytest("-p", "harness.plugin", f"--capture-dir={captures}", "-k", "capture_skips")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"FAILED --capture-dir={captures}: no check ran on it: 1 item skipped (no capture "
                                 "of this layout); 1 item deselected (by this run's -m/-k/--deselect)"])
    judged = demo.runpytest("-p", "harness.plugin", f"--capture-dir={captures}", "-k", "capture")
    assert judged.ret == pytest.ExitCode.OK


def test_an_implementation_every_check_of_which_skipped_or_was_deselected_fails_the_run(demo):
    result = demo.runpytest("-p", "harness.plugin", "--impl", "attention=user_impl:attend", "-k", "impl_skips")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(skipped=1)
    # the demo's capture checks are attention checks too: -k deselected them
    result.stdout.fnmatch_lines(["FAILED --impl attention=user_impl:attend: no check ran on it: 4 items deselected (by "
                                 "this run's -m/-k/--deselect); 1 item skipped (the implementation needs CUDA); 1 item "
                                 "deselected (cannot call the implementation under test: compares the stock path with "
                                 "itself)"])


def test_a_failing_run_still_says_why(demo):
    checkpoint = demo.path / "hunyuan"
    result = demo.runpytest("-p", "harness.plugin", f"--checkpoint={checkpoint}", "-k", "checkpoint_skips or broken")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1, skipped=2)
    result.stdout.fnmatch_lines([f"FAILED --checkpoint={checkpoint}: no check ran on it: 2 items skipped*"])


def test_the_ledger_counts_a_check_that_ran_and_names_what_kept_the_others_from_running():
    ledger = InputLedger(("--checkpoint=/m", "--impl ar=m:f"))
    ledger.expect("t[a]", ["--checkpoint=/m"])
    ledger.expect("t[b]", ["--checkpoint=/m", "--impl ar=m:f"])
    ledger.report("t[a]", "setup", "failed", "OSError: no weights")
    ledger.report("t[b]", "setup", "passed", "")
    ledger.report("t[b]", "call", "failed", "AssertionError")
    ledger.report("t[b]", "teardown", "passed", "")
    assert ledger.idle() == {}  # a check that ran and failed judged the input
    stopped = InputLedger(("--checkpoint=/m",))
    stopped.expect("t[a]", ["--checkpoint=/m"])
    stopped.expect("t[b]", ["--checkpoint=/m"])
    stopped.report("t[a]", "setup", "failed", "OSError: no weights")
    assert stopped.idle() == {"--checkpoint=/m": "--checkpoint=/m: no check ran on it: 1 item failed before its "
                                                 "check (OSError: no weights); 1 item not run (the session stopped "
                                                 "before them)"}


def test_under_torchrun_an_input_idle_on_any_rank_fails_every_rank(monkeypatch):
    """Ranks exchange their lines on the launcher's board (its own store, no collective), so each exits alike."""
    posted = []
    theirs = {"--checkpoint=/m": "--checkpoint=/m: no check ran on it: 2 items skipped (rank 1's reason)"}
    mine = {"--checkpoint=/m": "--checkpoint=/m: no check ran on it: 2 items skipped (rank 0's reason)"}

    def agree(status, error="", trace="", **_):
        posted.append(status)
        return [("ok", error, ""), ("ok", json.dumps(theirs), ""), ("died", "rank 2 died", "")]

    def lost(*_, **__):
        raise RuntimeError("the board is gone")

    with monkeypatch.context() as patched:  # undone before this test's own report goes through the plugin
        patched.setattr(launch, "joined", lambda: object())
        patched.setattr(launch, "agree", agree)
        from_peers, own = given_inputs._agreed({}), given_inputs._agreed(mine)
        patched.setattr(launch, "agree", lost)
        unreadable = given_inputs._agreed(mine)
    assert from_peers == theirs and posted == ["ok", "ok"]  # "ok": the board counts no failure for it
    assert own == mine  # the lowest rank's line
    assert unreadable == mine  # this rank's own verdict stands

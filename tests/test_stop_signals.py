"""How a run answers a stop signal, in this process: the handlers go in and come out whole, a stop kills the rank
processes it started and raises the interrupt pytest reports, and a report of a stopped run says so first.
tests/test_lifecycle.py stops whole runs (forked and under torchrun) and counts what they leave."""

import contextlib
import signal
import subprocess

import pytest

from harness.process import lifecycle
from harness.process.dist import World
from harness.reports import report
from harness.session import OUTCOME_ERRORS
from tests.dist_tasks import alive

pytestmark = pytest.mark.cpu


@pytest.fixture
def installed(monkeypatch):
    """The stop handlers of a run of its own, whose adopted children are only this test's (the session's worlds'
    ranks are not in them)."""
    monkeypatch.setattr(lifecycle, "_CHILDREN", set())
    restore = lifecycle.install()
    yield
    restore()


def test_a_request_made_inside_an_inner_run_ends_with_it(monkeypatch):
    """An in-process run inside a run (pytester) that was asked to stop leaves the outer run's request as it was."""
    monkeypatch.setattr(lifecycle, "_CHILDREN", set())
    restore = lifecycle.install()
    with contextlib.suppress(lifecycle.StopRequested):
        lifecycle._on_stop_signal(signal.SIGHUP, None)
    assert lifecycle.requested() == "SIGHUP"
    restore()
    assert lifecycle.requested() == ""
    lifecycle.raise_if_requested()  # nothing to raise


def test_the_stop_handlers_go_in_and_come_out_whole():
    before = {signum: signal.getsignal(signum) for signum in lifecycle.STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    restore = lifecycle.install()
    try:
        assert all(signal.getsignal(signum) is lifecycle._on_stop_signal for signum in lifecycle.STOP_SIGNALS)
        assert signal.set_wakeup_fd(signal.set_wakeup_fd(-1)) != wakeup, "the watch thread reads the wakeup fd"
    finally:
        restore()
    assert {signum: signal.getsignal(signum) for signum in lifecycle.STOP_SIGNALS} == before
    assert signal.set_wakeup_fd(wakeup) == wakeup


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_kills_the_ranks_at_once_and_raises_the_interrupt(installed, signum):
    child = subprocess.Popen(["sleep", "60"])
    lifecycle.adopt(child.pid)
    try:
        with pytest.raises(lifecycle.StopRequested) as info:
            signal.raise_signal(signum)  # the handler runs, and raises, before this call returns
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        lifecycle.disown(child.pid)
        if child.poll() is None:
            child.kill()
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert str(info.value) == f"{name}: the run was asked to stop; every rank process it started was killed"
    assert lifecycle.requested() == signal.Signals(signum).name
    assert alive([child.pid]) == []


def test_the_interrupt_is_never_an_outcome_a_check_records():
    assert issubclass(lifecycle.StopRequested, KeyboardInterrupt)
    assert not issubclass(lifecycle.StopRequested, OUTCOME_ERRORS)


def test_a_report_of_a_stopped_run_says_so_before_anything_else():
    data = report.build([], [])
    data["interrupted"] = "INTERRUPTED by SIGTERM: the run stopped before every item ran"
    assert report.render_terminal(data).startswith(data["interrupted"])
    assert report.render_markdown(data).startswith(f"# Parity report\n\n**{data['interrupted']}**")
    assert data["interrupted"] in report.render_html(data)
    del data["interrupted"]
    assert "INTERRUPTED" not in report.render_terminal(data) + report.render_markdown(data)


def test_a_stop_whose_raise_was_lost_is_raised_by_the_next_wait(installed):
    """A signal that lands inside code whose exceptions Python only reports (an at-fork callback: a world forking its
    ranks is inside one at every fork) loses the handler's raise; the request stands, and the next world start
    raises it before forking anything."""
    with contextlib.suppress(lifecycle.StopRequested):  # what the at-fork callback's reporting does with it
        lifecycle._on_stop_signal(signal.SIGTERM, None)
    assert lifecycle.requested() == "SIGTERM"
    world = World(2)
    with pytest.raises(lifecycle.StopRequested, match="SIGTERM: the run was asked to stop"):
        world.start()
    assert not world.alive and set() == lifecycle._CHILDREN

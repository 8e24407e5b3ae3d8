"""A run stops when asked and leaves nothing behind: each test starts a run in a session of its own, stops it
mid-decode the way a terminal, a CI cancel or a closed terminal would, and counts the processes left in that session.

The runs are subprocesses (a fresh pytest, forked ranks, torchrun), so they go with the launchers (``launch``).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.inputs import compat

pytestmark = [pytest.mark.launch, pytest.mark.wallclock,
              pytest.mark.skipif(compat.path_unavailable("decode") is not None,
                                 reason=str(compat.path_unavailable("decode")))]

REPO = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 10.0  # every process a run started ends this soon after the signal
CTRL_C_WITHIN_S = 5.0  # and a run stopped by Ctrl-C has exited this soon (1 to 4 s on 2 idle cores)


def session_processes(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``: what a run started in its own session left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] not in "ZX":
            found.append(int(entry.name))
    return found


def _environment(notes: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARITY_THREADS": "1", "PARITY_TEST_NOTES": str(notes)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PARITY_START_METHOD", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    return env


def _start(args: list[str], notes: Path, out: Path) -> subprocess.Popen:
    notes.mkdir(parents=True, exist_ok=True)
    with out.open("w") as handle:
        return subprocess.Popen(args, cwd=REPO, env=_environment(notes), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for(condition, run: subprocess.Popen, out: Path, what: str, within_s: float = 180.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"the run never got to {what} (exit {run.poll()}):\n{out.read_text()[-3000:]}")
        time.sleep(0.1)


def _signal(run: subprocess.Popen, how: str) -> None:
    """``how``: a signal name sent to the run's root process, or "Ctrl-C": SIGINT to its whole process group."""
    if how == "Ctrl-C":
        os.killpg(run.pid, signal.SIGINT)
    else:
        run.send_signal(getattr(signal, how))


def _after_stop(run: subprocess.Popen) -> tuple[float, float, list[int]]:
    """(seconds until the root exited, seconds until its session was empty, what was still there at the bound)."""
    stopped = time.monotonic()
    exited = empty = None
    left: list[int] = []
    while time.monotonic() - stopped < GONE_WITHIN_S + 2:
        if exited is None and run.poll() is not None:
            exited = time.monotonic() - stopped
        left = session_processes(run.pid)
        if exited is not None and not left:
            empty = time.monotonic() - stopped
            break
        time.sleep(0.05)
    for pid in left:  # nothing may outlive the test, whatever it found
        os.kill(pid, signal.SIGKILL)
    if run.poll() is None:
        run.kill()
    run.wait()
    return (exited if exited is not None else float("inf"), empty if empty is not None else float("inf"), left)


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_run_stopped_mid_decode_leaves_no_process(how, tmp_path):
    """Four forked ranks in the middle of a long sharded decode; the run is stopped: every process of its session is
    gone within the bound (a SIGKILLed parent's ranks too: they die with it), and a run that could answer says it
    was asked to stop, with pytest's interrupted exit status."""
    notes, out = tmp_path / "notes", tmp_path / "out.txt"
    run = _start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/lifecycle_cases.py"],
                 notes, out)
    _wait_for(lambda: len(list(notes.glob("rank*.pid"))) == 4, run, out, "the middle of the decode")
    time.sleep(0.5)
    _signal(run, how)
    exited, empty, left = _after_stop(run)
    text = out.read_text()
    assert not left and empty <= GONE_WITHIN_S, f"{how}: {left} still running {GONE_WITHIN_S:g} s later:\n{text}"
    if how != "SIGKILL":
        assert run.returncode == pytest.ExitCode.INTERRUPTED, f"{how}: exit {run.returncode}\n{text}"
        said = "Ctrl-C" if how == "Ctrl-C" else how
        assert f"StopRequested: {said}: the run was asked to stop" in text, text
    if how == "Ctrl-C":
        assert exited <= CTRL_C_WITHIN_S, f"Ctrl-C: the run took {exited:.1f} s to stop:\n{text}"
    print(f"\n{how} mid-decode: the run exited after {exited:.1f} s, its session was empty after {empty:.1f} s")


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_a_torchrun_launch_stopped_mid_decode_leaves_no_process(how, tmp_path):
    """The same decode on four torchrun ranks; the launcher is stopped as a terminal or a CI cancel would: the
    launcher and every rank are gone within the bound."""
    notes, out = tmp_path / "notes", tmp_path / "out.txt"
    run = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                  "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/lifecycle_cases.py"], notes, out)
    _wait_for(lambda: len(list(notes.glob("rank*.pid"))) == 4, run, out, "the middle of the decode")
    time.sleep(0.5)
    _signal(run, how)
    exited, empty, left = _after_stop(run)
    assert not left and empty <= GONE_WITHIN_S, f"{how}: {left} still running:\n{out.read_text()[-4000:]}"
    assert run.returncode != 0
    print(f"\ntorchrun, {how} mid-decode: the launcher exited after {exited:.1f} s, its session was empty after "
          f"{empty:.1f} s")


def test_ctrl_c_stops_the_parity_gate_within_seconds_and_the_report_says_it_was_interrupted(tmp_path):
    """The cpu tier's decode checks, stopped by Ctrl-C once some have passed and ranks run: pytest's interrupted
    summary within the bound, a report marked interrupted (never green), and no check recorded the interrupt."""
    report = tmp_path / "parity.json"
    out = tmp_path / "out.txt"
    run = _start([sys.executable, "-m", "pytest", "-m", "cpu", "-k", "decode", "-v", "-p", "no:cacheprovider",
                  f"--parity-report={report}", "parity/"], tmp_path / "notes", out)

    def mid_decode() -> bool:
        return out.read_text().count("PASSED") >= 3 and len(session_processes(run.pid)) > 1

    _wait_for(mid_decode, run, out, "three passed decode items with ranks running")
    _signal(run, "Ctrl-C")
    exited, empty, left = _after_stop(run)
    text = out.read_text()
    assert exited <= CTRL_C_WITHIN_S, f"the run took {exited:.1f} s to stop:\n{text[-3000:]}"
    print(f"\nCtrl-C on the parity gate: the run exited after {exited:.1f} s, its session was empty after "
          f"{empty:.1f} s")
    assert not left and empty <= GONE_WITHIN_S, f"{left} still running:\n{text[-3000:]}"
    assert run.returncode == pytest.ExitCode.INTERRUPTED, text[-3000:]
    assert "StopRequested: Ctrl-C: the run was asked to stop" in text, text[-3000:]
    data = json.loads(report.read_text())
    assert data["interrupted"].startswith("INTERRUPTED by Ctrl-C: the run stopped before every item ran"), data
    assert "INTERRUPTED by Ctrl-C" in text.split("fastpath-parity report", 1)[1], text[-3000:]
    assert data["checks"], "some decode checks finished before the interrupt"
    errors = [c for c in data["checks"] if c["status"] == "failed"]
    assert not errors, f"an interrupt became a check's verdict: {errors}"


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_a_split_run_stopped_mid_decode_leaves_no_process_and_a_report_that_says_so(how, tmp_path):
    """The decode checks and kill pairs split over two xdist workers, stopped once items passed and ranks run: every
    process of the session (controller, workers, their ranks) is gone within the bound, and the report is written
    and marked interrupted (a report of an earlier run never stands for this one)."""
    pytest.importorskip("xdist")
    report = tmp_path / "parity.json"
    report.write_text('{"checks": [], "left": "by an earlier run"}')
    out = tmp_path / "out.txt"
    run = _start([sys.executable, "-m", "pytest", "-m", "cpu", "-k", "decode", "-n", "2", "-v", "-p",
                  "no:cacheprovider", f"--parity-report={report}", "parity/", "mutation/"], tmp_path / "notes", out)

    def mid_decode() -> bool:
        return out.read_text().count("PASSED") >= 3 and len(session_processes(run.pid)) > 3

    _wait_for(mid_decode, run, out, "three passed decode items with ranks running")
    _signal(run, how)
    exited, empty, left = _after_stop(run)
    text = out.read_text()
    assert not left and empty <= GONE_WITHIN_S, f"{how}: {left} still running {GONE_WITHIN_S:g} s later:\n{text}"
    assert run.returncode == pytest.ExitCode.INTERRUPTED, f"{how}: exit {run.returncode}\n{text[-3000:]}"
    data = json.loads(report.read_text())
    said = "Ctrl-C" if how == "Ctrl-C" else how
    assert data["interrupted"].startswith(f"INTERRUPTED by {said}: the run stopped before every item ran"), data
    assert "left" not in data
    print(f"\n{how} on a split run: the run exited after {exited:.1f} s, its session was empty after {empty:.1f} s")

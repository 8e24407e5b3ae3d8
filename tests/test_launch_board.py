"""The torchrun board on its own: two ranks' boards on one in-process TCP store agree on outcomes, and find a
peer that stopped or died (from /proc on this host, from its silent heartbeat elsewhere) without any collective.
The launches themselves are in tests/test_torchrun.py (marked launch)."""

import datetime
import json
import signal
import subprocess
import time

import pytest
import torch.distributed as dist

from harness.process import launch

pytestmark = pytest.mark.cpu


@pytest.fixture
def boards():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    made = []
    for rank in range(2):
        clients = [dist.PrefixStore("board", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                           timeout=datetime.timedelta(seconds=5))) for _ in range(2)]
        made.append(launch._Board(*clients, launch.Launch(rank, 2, rank)))
    yield made
    for board in made:
        board.close()
    launch.set_fault_bound(None)


def _pretend(board: "launch._Board", rank: int, host: str, pid: int) -> None:
    """Make ``board`` believe peer ``rank`` is process ``pid`` on ``host`` ("" host: another machine)."""
    board.store.set(f"who/{rank}", json.dumps({"host": host, "pid": pid}))
    board._local.pop(rank, None)


def _until(found, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = found()
        if got:
            return got
        time.sleep(0.05)
    return found()


def test_ranks_agree_from_the_board_and_a_failure_is_counted(boards):
    first, second = boards
    step = first.next_step()
    assert second.next_step() == step
    first.post(step, ("ok", "", ""))
    assert first.failures(step) == 0 and launch._wait_for_peers(first, step, "t", time.monotonic() + 0.2) == \
        [("ok", "", ""), ("hung", "no outcome of t before this rank's deadline", "")]
    second.post(step, ("raised", "ValueError: x", "trace"))
    assert first.failures(step) == 1
    assert launch._wait_for_peers(first, step, "t", time.monotonic() + 5) == \
        [("ok", "", ""), ("raised", "ValueError: x", "trace")]


@pytest.mark.parametrize(("signum", "why"), [(signal.SIGSTOP, "the process was stopped (SIGSTOP)"),
                                             (signal.SIGKILL, "the process exited or was killed")])
def test_a_local_peer_that_stopped_or_died_is_read_from_proc(boards, signum, why):
    first, _ = boards
    peer = subprocess.Popen(["sleep", "60"])
    try:
        _pretend(first, 1, first._host, peer.pid)
        first.start_watch()
        assert first.lost_peers() == {}, "a live peer, silent or not, is not lost"
        peer.send_signal(signum)
        assert _until(first.lost_peers) == {1: why}
    finally:
        peer.kill()
        peer.wait()


def test_a_remote_peer_is_lost_when_its_heartbeat_stops(boards, monkeypatch):
    first, second = boards
    monkeypatch.setattr(launch, "HEARTBEAT_S", 0.05)  # shrunk together, so the test takes a second, not ten
    monkeypatch.setattr(launch, "silence_s", lambda: 0.8)
    _pretend(first, 1, "", -1)
    time.sleep(0.1)  # the beat loop picks up the short period
    first.start_watch()
    time.sleep(1.0)  # longer than the silence: only its beating keeps it
    assert first.lost_peers() == {}, "its heartbeat thread still beats"
    second.close()
    assert _until(first.lost_peers, 4.0) == {1: "no heartbeat for 0.8 s: the process stopped or died"}


def test_the_fault_bound_is_checked_and_split(monkeypatch):
    monkeypatch.delenv(launch.FAULT_BOUND_ENV, raising=False)
    assert (launch.fault_bound(), launch.silence_s(), launch.grace_s()) == (30.0, 10.0, 5.0)
    monkeypatch.setenv(launch.FAULT_BOUND_ENV, "12")
    assert (launch.fault_bound(), launch.silence_s(), launch.grace_s()) == (12.0, 4.0, 2.0)
    for bad in ("2", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match="expected a number of seconds >= 3"):
            launch.set_fault_bound(bad)
    launch.set_fault_bound(None)

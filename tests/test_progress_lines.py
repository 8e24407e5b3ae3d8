"""Progress on stderr where pytest shows none, each line with its expected total: the meter's pace, a model load
among the run's planned loads, the ranks of a torchrun launch arriving and reporting, the mutation score's passes;
and a line from inside a test reaches the terminal past pytest's capture."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from harness.process import launch, progress_lines
from tools.mutation_score.cli import progress_detail

pytestmark = pytest.mark.cpu


@pytest.fixture
def lines():
    said: list[str] = []
    state = progress_lines.saved()
    progress_lines.set_writer(said.append)
    yield said
    progress_lines.restore(state)


def test_a_meter_says_its_total_first_last_and_at_most_every_interval(lines):
    now = [0.0]
    meter = progress_lines.Meter("mutation score: stage 2/2, mutants", 180, "mutants judged", every_s=15.0,
                                 clock=lambda: now[0])
    assert meter.update(0)
    now[0] = 5.0
    assert not meter.update(12, "first pass settled 12")
    now[0] = 16.0
    assert meter.update(41, "first pass settled 39, second pass 2")
    now[0] = 17.0
    assert meter.update(180)  # the last one is said at once, and once
    now[0] = 18.0
    assert not meter.update(180)
    assert lines == ["mutation score: stage 2/2, mutants: 0/180 mutants judged, 0 s",
                     "mutation score: stage 2/2, mutants: 41/180 mutants judged (first pass settled 39, second pass "
                     "2), 16 s",
                     "mutation score: stage 2/2, mutants: 180/180 mutants judged, 17 s"]


def test_a_planned_model_load_names_its_place_and_the_weights_before_it(lines, tmp_path):
    first, second = tmp_path / "vae", tmp_path / "dit"
    for folder, size in ((first, 3 * 2**20), (second, 2**20)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * size)
        (folder / "config.json").write_text("{}")
    progress_lines.plan_loads([(str(first), "torch.float32"), (str(second), "torch.float32"),
                               (str(second), "torch.bfloat16")])
    with progress_lines.loading(str(second), "torch.bfloat16", "dit (Model, bfloat16) on cpu"):
        pass
    with progress_lines.loading(str(first), "torch.float32", "vae (Vae, float32) on cpu"):
        pass
    with progress_lines.loading(str(second), "torch.float16", "not planned"):
        pass
    assert lines[0] == ("gpu tier: loading model 1/3: dit (Model, bfloat16) on cpu (1.0 MiB; 0.0 MiB of the run's "
                        "5.0 MiB of weights loaded before it) ...")
    assert lines[1].startswith("gpu tier: model 1/3, dit (Model, bfloat16) on cpu: done in ")
    assert lines[2] == ("gpu tier: loading model 2/3: vae (Vae, float32) on cpu (3.0 MiB; 1.0 MiB of the run's "
                        "5.0 MiB of weights loaded before it) ...")
    assert len(lines) == 4  # a load the run did not plan says nothing


def test_a_load_that_ticks_says_it_is_still_running_and_how_it_ended(lines):
    def slow_failure() -> None:
        with progress_lines.Ticking("loading", every_s=0.05):
            time.sleep(0.2)
            raise ValueError("no weights")

    with pytest.raises(ValueError, match="no weights"):
        slow_failure()
    assert lines[0] == "loading ..." and any(line.startswith("loading: still running") for line in lines)
    assert lines[-1].startswith("loading: failed (ValueError) in ")


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    return lambda: dist.PrefixStore("run", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                        timeout=datetime.timedelta(seconds=5)))


def test_rank_zero_counts_the_ranks_arriving_at_the_rendezvous(lines, store, monkeypatch):
    monkeypatch.setattr(launch, "ARRIVALS_EVERY_S", 0.05)
    peer = store()
    with launch._arrivals(store(), launch.Launch(0, 3, 0), "gloo"):
        time.sleep(0.2)
        peer.add("arrived", 1)
        time.sleep(0.2)
    assert any(line.startswith("torchrun launch: joining the gloo group: 1/3 ranks arrived") for line in lines)
    assert any(line.startswith("torchrun launch: joining the gloo group: 2/3 ranks arrived") for line in lines)
    assert lines[-1].startswith("torchrun launch: joining the gloo group: 3/3 ranks arrived (every rank joined)")
    before = len(lines)
    with launch._arrivals(store(), launch.Launch(1, 3, 1), "gloo"):
        time.sleep(0.1)
    assert len(lines) == before  # only rank 0 speaks


def test_rank_zero_names_the_ranks_it_still_waits_on(lines, store, monkeypatch):
    monkeypatch.setattr(launch, "WAITING_AFTER_S", 0.05)
    board, peer = (launch._Board(store(), store(), launch.Launch(rank, 2, rank)) for rank in range(2))
    try:
        step = board.next_step()
        assert peer.next_step() == step
        board.post(step, ("ok", "", ""))  # the peer never reports
        launch._wait_for_peers(board, step, "task decode", time.monotonic() + 0.3)
    finally:
        board.close()
        peer.close()
    assert any(line.startswith("torchrun launch: task decode: 1/2 ranks reported (waiting on rank(s) [1])")
               for line in lines)


def test_the_mutation_progress_counts_each_pass_and_outcome():
    records = [{"status": "killed", "pass": 1}, {"status": "killed", "pass": 2}, {"status": "survived", "pass": 2},
               {"status": "timeout", "pass": 1}]
    assert progress_detail(records) == "first pass settled 2, second pass 2; 2 killed, 1 survived, 1 timeout"


def test_a_line_said_inside_a_test_passes_pytest_capture(pytester):
    pytester.makepyfile(test_says='''
        from harness.process import progress_lines

        def test_loading():
            progress_lines.say("gpu tier: loading model 1/1: demo")
            print("captured, as usual")
    ''')
    result = pytester.runpytest_inprocess("-p", "harness.plugin", "-q")
    assert result.ret == 0
    result.stderr.fnmatch_lines(["gpu tier: loading model 1/1: demo"])
    assert "captured, as usual" not in result.stdout.str()

"""torchrun launches: the World joins the launcher's gloo group, every rank computes, rank 0 reports.

Each test starts ``torchrun --standalone`` in a subprocess with per-rank logs, so every rank's own
pytest result is read back: a failure on any rank must fail that item on every rank.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import checkpoints as tiny_checkpoints
from harness.inputs import compat

# the launchers (spawned ranks, torchrun, the gpu tier's dry run) are marked `launch`: scripts/test-all runs
# them; the rest of this file is CPU-tier machinery

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _torchrun(nproc: int, pytest_args: list[str], log_dir: Path) -> tuple[int, list[str], str]:
    """Run pytest under torchrun; (exit code, each rank's stdout in rank order, torchrun's own output)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PARITY_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PARITY_START_METHOD"):
        env.pop(name, None)
    args = [*TORCHRUN, f"--nproc-per-node={nproc}", f"--log-dir={log_dir}", "--redirects=3",
            "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ranks = []
    for rank in range(nproc):
        logs = sorted(log_dir.glob(f"**/attempt_0/{rank}/stdout.log"))
        assert len(logs) == 1, f"rank {rank}: expected one stdout.log under {log_dir}, found {logs}\n{done.stderr}"
        ranks.append(logs[0].read_text())
    return done.returncode, ranks, done.stdout + done.stderr


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    return tiny_checkpoints.write_all(tmp_path_factory.mktemp("torchrun"), ("minimax_h3_vae",))["minimax_h3_vae"]


@pytest.mark.launch
@pytest.mark.skipif(compat.path_unavailable("decode") is not None, reason=str(compat.path_unavailable("decode")))
def test_gpu_tier_decode_under_torchrun(tiny_vae, tmp_path):
    """Two ranks (a 4-rank launch of the same command is as green; it costs ~2x here, so the lane runs 2)."""
    nproc = 2
    report = tmp_path / "report.json"
    code, ranks, launcher = _torchrun(nproc, ["-m", "gpu", "--device", "cpu", "--dtype", "fp32",
                                              f"--checkpoint={tiny_vae}", f"--parity-report={report}",
                                              "-k", "decode.gpu.bitexact", "gpu/test_gpu.py"], tmp_path / "logs")
    assert code == 0, "\n".join(f"--- rank {r} ---\n{text[-3000:]}" for r, text in enumerate(ranks)) + launcher
    data = json.loads(report.read_text())
    items = 1 + len(data["ablations"])  # the check, then one kill item per ablation claiming it
    for rank, text in enumerate(ranks):
        assert re.search(rf"\b{items} passed\b", text), f"rank {rank} did not pass every item:\n{text[-3000:]}"
    tables = [rank for rank, text in enumerate(ranks) if "fastpath-parity report" in text]
    assert tables == [0], f"the table must be printed by rank 0 only, printed by {tables}"
    assert f"ranks: torchrun group of {nproc} (this is rank 0)" in ranks[0]
    (check,) = data["checks"]
    assert check["id"] == "decode.gpu.bitexact[video_vae-fp32]" and check["passed"]
    assert f"over {nproc} ranks" in json.dumps(check), "the decode did not run over every launched rank"
    assert data["summary"]["killed"] == data["summary"]["ablations"] >= 2


@pytest.mark.launch
@pytest.mark.wallclock
def test_a_failure_on_one_rank_fails_every_rank(tmp_path):
    """Four ranks (no model: this launch is light): world tasks agree, and an item failing on one rank fails on all."""
    nproc = 4
    code, ranks, launcher = _torchrun(nproc, ["tests/torchrun_cases.py", "-rf"], tmp_path / "logs")
    assert code != 0, launcher
    for rank, text in enumerate(ranks):
        assert re.search(r"\b1 failed, 3 passed\b", text), f"rank {rank}:\n{text[-3000:]}"
        assert "FAILED tests/torchrun_cases.py::test_fails_on_rank_1_only" in text, f"rank {rank}:\n{text[-3000:]}"
        if rank != 1:
            assert f"failed on ranks [1] of {nproc} (passed here, on rank {rank})" in text, text[-3000:]
    assert "injected item failure on rank 1" in ranks[1]


@pytest.mark.cpu
def test_a_partial_or_garbled_torchrun_environment_is_a_clear_error(monkeypatch):
    from harness.process import launch
    from harness.process.dist import World

    for name in launch.ENV:
        monkeypatch.delenv(name, raising=False)
    assert launch.launched() is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"this environment has \['RANK'\] but not \['WORLD_SIZE', 'LOCAL_RANK'\]"):
        launch.launched()
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="must be integers"):
        launch.launched()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="out of range: RANK=4, WORLD_SIZE=4"):
        launch.launched()
    monkeypatch.setenv("RANK", "1")
    assert launch.launched() == launch.Launch(1, 4, 0)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4: a world here is the launcher's 4 ranks, but 2 were asked"):
        World(2)


def _listening(port: int) -> bool:
    """Whether any socket on this machine listens on ``port`` (/proc/net/tcp{,6}: state 0A)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    return True
    return False


def run_fault(fault: str, log_dir: Path, *, nproc: int = 4, fault_rank: int = 1, bound: float | None = None,
              monitor_interval: float | None = None, extra_env: dict[str, str] | None = None) -> dict:
    """One torchrun launch of tests/torchrun_faults.py with ``fault`` on ``fault_rank``: what every rank saw,
    when the launch ended, and what it left behind (processes, shared-memory files, the launcher's port)."""
    notes = log_dir / "notes"
    notes.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARITY_THREADS": "1", "PARITY_TEST_FAULT": fault,
           "PARITY_TEST_FAULT_RANK": str(fault_rank), "PARITY_TEST_FAULT_LOG": str(notes), **(extra_env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PARITY_START_METHOD", "PARITY_FAULT_BOUND_S"):
        env.pop(name, None)
    if bound is not None:
        env["PARITY_FAULT_BOUND_S"] = str(bound)
    launcher = [*TORCHRUN, f"--nproc-per-node={nproc}", f"--log-dir={log_dir / 'logs'}", "--redirects=3"]
    if monitor_interval is not None:  # how often torchrun itself looks at its workers (default 0.1 s)
        launcher.append(f"--monitor-interval={monitor_interval}")
    shm_before = set(os.listdir("/dev/shm"))
    with (log_dir / "launcher.log").open("w") as out:
        launch = subprocess.Popen([*launcher, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "tests/torchrun_faults.py"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        exited: dict[int, float] = {}  # rank -> when its process was gone (polled: a rank may never note it)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for path in notes.glob("rank*.json"):
                with contextlib.suppress(ValueError, OSError):
                    rank, pid = int(path.stem.removeprefix("rank")), json.loads(path.read_text())["pid"]
                    if rank not in exited and not _running(pid):
                        exited[rank] = time.time()
            if launch.poll() is not None:
                break
            time.sleep(0.1)
        else:
            launch.kill()
        returncode = launch.wait()
    ended = time.time()
    ranks = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in notes.glob("rank*.json")}
    pids = [seen["pid"] for seen in ranks.values()]
    fault_at = ranks[fault_rank]["fault_at"]
    survivors = {r: seen for r, seen in ranks.items() if r != fault_rank or fault.startswith("raise")}
    return {
        "ranks": ranks, "returncode": returncode, "output": (log_dir / "launcher.log").read_text(),
        "raised_within": max(seen.get("raised_at", float("inf")) - fault_at for seen in survivors.values()),
        "all_raised": all("raised_at" in seen for seen in survivors.values()),
        "survivors_exited_within": max(exited.get(r, ended) - fault_at for r in survivors),
        "exited_within": ended - fault_at,
        "alive": [pid for pid in pids if _running(pid)],
        "shm_left": sorted(name for name in set(os.listdir("/dev/shm")) - shm_before
                           if any(str(pid) in name for pid in pids)),
        "port_listening": _listening(ranks[0]["port"]),
        "message": next((f"{seen['error']} | {seen['outcomes'][r]}" for r, seen in sorted(survivors.items())
                         if "error" in seen and r != fault_rank), "no rank raised"),
        "rank_logs": _rank_logs(log_dir / "logs"),
    }


def _rank_logs(logs: Path, tail: int = 3000) -> str:
    """The end of each rank's own stdout and stderr (torchrun's ``--redirects=3`` files): what a failed launch's
    message needs beside torchrun's summary, which says only that a rank exited."""
    parts = []
    for path in sorted(logs.glob("*/attempt_*/*/std*.log")):
        text = path.read_text(errors="replace").strip()
        if text:
            parts.append(f"--- rank {path.parent.name} {path.name}:\n{text[-tail:]}")
    return "\n".join(parts)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


FAULT_BOUND_UNDER_TEST = 15.0  # silence 5 s, grace 2.5 s: the default 30 s bound's mechanism, in half the time
SIGKILL_MONITOR_S = 60.0  # torchrun's --monitor-interval in the SIGKILL launch (see its parameter)


@pytest.mark.launch
@pytest.mark.wallclock
@pytest.mark.skipif(compat.path_unavailable("decode") is not None, reason=str(compat.path_unavailable("decode")))
@pytest.mark.parametrize(("fault", "monitor_interval"), [
    ("raise_after_gather", None),
    ("raise_outside_protocol", None),
    ("sigstop", None),
    # torchrun would SIGTERM the others within 0.1 s itself; here the suite must close them. The agent first looks
    # at its workers one interval after starting them, so the interval must outlast the ranks' start-up (17 s was
    # measured beside CI's other streams, where 20 s let torchrun close them first) plus the bound
    ("sigkill", SIGKILL_MONITOR_S),
    ("stuck", None),  # alive and beating, never reaching the probe exchange: only its position gives it away
    ("spin", None),  # alive, beating and busy, computing nothing: its CPU time against its peers' gives it away
])
def test_a_faulting_rank_makes_every_rank_raise_within_the_bound(fault, monitor_interval, tmp_path):
    """Four ranks decode the tiny VAE; rank 1 faults mid-decode. Every other rank raises naming it within the bound,
    and nothing is left: no process, no shared-memory file, no listening launcher port."""
    seen = run_fault(fault, tmp_path, bound=FAULT_BOUND_UNDER_TEST, monitor_interval=monitor_interval)
    detail = f"{fault}: {json.dumps(seen['ranks'], indent=1)}\n{seen['output'][-4000:]}\n{seen['rank_logs']}"
    if not seen["all_raised"] and "closing signal SIGTERM" in seen["output"]:
        detail = ("torchrun's agent closed the surviving ranks before they raised: the launch started too slowly for "
                  f"its monitor interval ({monitor_interval} s) to outlast the bound\n{detail}")
    assert seen["all_raised"], detail
    assert seen["raised_within"] <= FAULT_BOUND_UNDER_TEST, detail
    assert "rank 1" in seen["message"], detail
    if fault == "raise_after_gather":  # inside the protocol: everyone raises at the next status exchange
        assert seen["raised_within"] < 2.0 and "ShardedDecodeError" in json.dumps(seen["ranks"]), detail
    elif fault == "sigstop":
        assert "rank 1: died: the process was stopped (SIGSTOP)" in json.dumps(seen["ranks"]), detail
    elif fault == "sigkill":
        assert "rank 1: died: the process exited or was killed" in json.dumps(seen["ranks"]), detail
    elif fault in ("stuck", "spin"):  # named by every rank, itself included, with the collective it never reached
        within = f"within {FAULT_BOUND_UNDER_TEST - 2 * 2.5:g} s"
        why = {"stuck": "no progress: its position, the modules it runs and its CPU time all stood still",
               "spin": "busy without progress: it entered no collective and ran no module"}[fault]
        for rank, saw in seen["ranks"].items():
            assert saw["error"].startswith(f"task faulty_decode_task: rank 1 did not reach all_gather #1 {within} "
                                           "(last seen in computing its pieces [1] of 4, before the probe exchange): "
                                           f"{why}"), f"rank {rank}: {saw['error']}"
            assert "rank 1: stuck: did not reach all_gather #1" in saw["outcomes"][1], f"rank {rank}: {saw}"
        assert seen["ranks"][1]["raised_at"] - seen["ranks"][1]["fault_at"] <= FAULT_BOUND_UNDER_TEST, detail
    if fault in ("sigstop", "sigkill"):
        assert seen["returncode"] != 0, "torchrun reports the rank it lost"
    else:  # the faulting rank's own items expected the fault: every rank's session passes, and exits
        assert seen["returncode"] == 0, detail
    print(f"\n{fault}: every other rank raised within {seen['raised_within']:.1f} s and exited within "
          f"{seen['survivors_exited_within']:.1f} s; the launch ended {seen['exited_within']:.1f} s after the fault: "
          f"{seen['message']}")
    assert not seen["alive"] and not seen["shm_left"] and not seen["port_listening"], detail


SLOW_BOUND = 6.0  # stuck after 4 s (two 1 s graces below it)


@pytest.mark.launch
@pytest.mark.wallclock
@pytest.mark.skipif(compat.path_unavailable("decode") is not None, reason=str(compat.path_unavailable("decode")))
def test_a_rank_three_times_slower_is_waited_for_under_torchrun(tmp_path):
    """Four ranks decode the tiny VAE, the first decoder call repeated for 2.5 s of real work, rank 1's for three
    times as long: its peers wait in the probe exchange longer than the stuck time, and the decode still succeeds
    on every rank (a wall-clock bound would have named rank 1), and the launch leaves nothing behind."""
    seen = run_fault("slow", tmp_path, bound=SLOW_BOUND, extra_env={"PARITY_TEST_SLOW_S": "2.5"})
    detail = f"{json.dumps(seen['ranks'], indent=1)}\n{seen['output'][-4000:]}\n{seen['rank_logs']}"
    assert seen["returncode"] == 0, detail
    assert all("finished_at" in saw for saw in seen["ranks"].values()), detail
    reached = seen["ranks"][0]["reached"]
    waited = reached[1] - max(at for rank, at in enumerate(reached) if rank != 1)
    stuck_s = seen["ranks"][0]["stuck_s"]
    assert waited > stuck_s, f"rank 1 was only {waited:.1f} s behind (stuck after {stuck_s:g} s): not slow enough"
    assert not seen["alive"] and not seen["shm_left"] and not seen["port_listening"], detail

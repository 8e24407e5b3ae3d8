"""torchrun launches: the World joins the launcher's gloo group, every rank computes, rank 0 reports.

Each test starts ``torchrun --standalone`` in a subprocess with per-rank logs, so every rank's own
pytest result is read back: a failure on any rank must fail that item on every rank.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import checkpoints as tiny_checkpoints
from harness import compat

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
    for rank, text in enumerate(ranks):
        assert re.search(r"\b3 passed\b", text), f"rank {rank} did not pass every item:\n{text[-3000:]}"
    tables = [rank for rank, text in enumerate(ranks) if "fastpath-parity report" in text]
    assert tables == [0], f"the table must be printed by rank 0 only, printed by {tables}"
    assert f"ranks: torchrun group of {nproc} (this is rank 0)" in ranks[0]
    data = json.loads(report.read_text())
    (check,) = data["checks"]
    assert check["id"] == "decode.gpu.bitexact[minimax_h3_vae-fp32]" and check["passed"]
    assert f"over {nproc} ranks" in json.dumps(check), "the decode did not run over every launched rank"
    assert data["summary"]["killed"] == data["summary"]["ablations"] == 2


@pytest.mark.launch
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
    from harness import launch
    from harness.dist import World

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

"""The gpu tier's code on the CPU: tiny checkpoints of every kind, --device cpu, fp32 and bf16, checks and kills.

This is how CI exercises kind detection, offline loading and the gpu checks without a GPU. It runs
pytest in a subprocess so the inner run has its own registry, session and report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import checkpoints as tiny_checkpoints
from harness import catalogue, checks
from harness.checkpoints import KINDS, CheckpointError, detect, load_model

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoints.write_all(tmp_path_factory.mktemp("checkpoints"))


def test_every_kind_is_written_and_detected(tiny_dir):
    kinds = {detect(path).kind for path in tiny_dir.values()}
    assert kinds == set(KINDS), f"tiny checkpoints cover {sorted(kinds)}, the gpu tier reads {sorted(KINDS)}"


def test_gpu_tier_dry_run_over_every_checkpoint_kind(tiny_dir, tmp_path):
    report = tmp_path / "gpu.json"
    args = [sys.executable, "-m", "pytest", "-m", "gpu", "--device", "cpu", "--dtype", "fp32,bf16", "-q",
            "-p", "no:cacheprovider", f"--parity-report={report}", "gpu/test_gpu.py"]
    args += [f"--checkpoint={path}" for path in tiny_dir.values()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"gpu dry run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    data = json.loads(report.read_text())
    catalogue.load()  # the ablation catalogue, which loads the checks first
    expected = set()
    for check in checks.all_checks("gpu"):
        for kind, path in tiny_dir.items():
            if detect(path).feeds == check.path:
                expected |= {f"{check.id}[{kind}-{dtype}]" for dtype in ("fp32", "bf16")}
    ran = {c["id"] for c in data["checks"]}
    assert ran == expected, f"missing: {sorted(expected - ran)}; unexpected: {sorted(ran - expected)}"
    assert all(c["passed"] for c in data["checks"])
    assert data["summary"]["checks"] == data["summary"]["passed"] == len(expected)
    killed = {k["check"] for a in data["ablations"] for k in a["kills"] if k["killed"]}
    assert killed == expected, f"gpu checks no ablation killed in the dry run: {sorted(expected - killed)}"
    assert data["summary"]["killed"] == data["summary"]["ablations"] > 0


def test_a_checkpoint_that_does_not_load_names_the_path(tmp_path):
    target = tmp_path / "broken_sd3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(CheckpointError, match=r"broken_sd3: could not load SD3Transformer2DModel"):
        load_model(detect(target), torch.float32, "cpu")


def test_wrong_kind_is_a_usage_error_naming_the_path(tmp_path):
    target = tmp_path / "unet"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", f"--checkpoint={target}", "-p",
                           "no:cacheprovider", "gpu/test_gpu.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"checkpoint {target}: unsupported model kind (UNet2DConditionModel)" in done.stderr

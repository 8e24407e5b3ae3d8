"""Checkpoint rules the gpu tier leans on: kinds are registered on demand and validated, a model directory is read
from its config, loads stay offline and run a directory's code only when the checkpoint opted in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.inputs import checkpoints
from harness.inputs.checkpoints import Checkpoint, CheckpointError, detect
from harness.plugins import entry_points as plugins
from harness.plugins.entry_points import CheckpointKind, Registry

pytestmark = pytest.mark.cpu


@pytest.fixture
def empty_registry(monkeypatch):
    """A registry no entry point has filled: a source checkout whose installed metadata predates the suite's."""
    registry = Registry("checkpoint kind", "")
    monkeypatch.setattr(plugins, "CHECKPOINT_KINDS", registry)
    return registry


def _model(tmp_path, **config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_suites_own_kinds_are_registered_on_demand(empty_registry):
    names = {kind.name for kind in checkpoints.registered_kinds()}
    assert {"causal_lm", "attention_capture", "video_vae", "sd3_transformer"} <= names  # suite and path plugins
    assert checkpoints.KINDS["causal_lm"] == "ar" and len(checkpoints.KINDS) == len(names)
    assert "'video_vae': 'decode'" in repr(checkpoints.KINDS)


@pytest.mark.parametrize("names", [(), ("",), ("Good", ""), ["AList"]])
def test_a_kind_without_proper_class_names_is_refused_naming_it(empty_registry, names):
    empty_registry.register("odd", CheckpointKind("odd", "ar", names, "transformers"), origin="a test")
    with pytest.raises(CheckpointError, match=r"'odd' \(registered by a test\): class_names must be a non-empty "
                                              r"tuple of strings"):
        checkpoints.registered_kinds()


def test_a_model_directory_is_read_from_its_config_not_from_files_beside_it(tmp_path):
    folder = _model(tmp_path, architectures=["NobodysModelForVision"])
    (folder / "call0_rank0.npz").write_bytes(b"")  # an attention capture lying beside the weights
    with pytest.raises(CheckpointError, match=r"unsupported model kind \(NobodysModelForVision\)"):
        detect(folder)


def test_a_checkpoint_made_without_its_kind_object_reads_the_registry():
    checkpoint = Checkpoint(Path("/ckpt/qwen3-tiny"), "causal_lm", "Qwen3ForCausalLM")
    assert (checkpoint.feeds, checkpoint.family, checkpoint.source, checkpoint.name) == ("ar", "", "", "qwen3-tiny")


class _Loaded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))


@pytest.fixture
def loads(monkeypatch):
    """Every from_pretrained call's keyword arguments; nothing is read from disk or the network."""
    import diffusers
    import transformers

    seen: list[dict] = []

    def from_pretrained(*args, **kwargs):
        seen.append(kwargs)
        return _Loaded()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(diffusers.AutoencoderKL, "from_pretrained", from_pretrained)
    return seen


def test_loads_are_offline_and_run_no_directory_code_without_the_opt_in(tmp_path, loads):
    lm = CheckpointKind("causal_lm_rule", "ar", ("*ForCausalLM",), "transformers")
    plain = Checkpoint(tmp_path, "causal_lm_rule", "Qwen3ForCausalLM", {}, spec=lm)
    checkpoints.load_model(plain, torch.float32, "cpu")
    assert (loads[-1]["local_files_only"], loads[-1]["trust_remote_code"]) == (True, False)
    opted = Checkpoint(tmp_path, "causal_lm_rule", "Qwen3ForCausalLM", {}, remote_code=True, spec=lm)
    with pytest.raises(checkpoints.CheckpointError, match="--trust-remote-code"):
        checkpoints.load_model(opted, torch.float32, "cpu")  # the run did not opt in
    checkpoints.load_model(opted, torch.float32, "cpu", trust_remote_code=True)
    assert loads[-1]["trust_remote_code"] is True
    vae = CheckpointKind("vae_rule", "decode", ("AutoencoderKL",), "diffusers")
    checkpoints.load_model(Checkpoint(tmp_path, "vae_rule", "AutoencoderKL", {}, spec=vae), torch.float32, "cpu")
    assert loads[-1]["local_files_only"] is True

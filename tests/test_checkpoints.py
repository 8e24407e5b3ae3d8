"""Checkpoint kinds are read from files; anything else is an error naming the path and what was expected."""

import json

import pytest

from harness.checkpoints import CheckpointError, detect

pytestmark = pytest.mark.cpu


def _config(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("config", "kind", "feeds"), [
    ({"_class_name": "AutoencoderKLMiniMaxH3"}, "video_vae", "decode"),
    ({"_class_name": "SD3Transformer2DModel"}, "dit", "replay"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "causal_lm", "ar"),
    ({"architectures": ["HunyuanImage3ForCausalMM"], "auto_map": {"AutoModelForCausalLM": "m.C"}}, "causal_lm", "ar"),
])
def test_kinds_are_read_from_config(tmp_path, config, kind, feeds):
    checkpoint = detect(_config(tmp_path, "model", **config))
    assert checkpoint.kind == kind and checkpoint.feeds == feeds
    assert checkpoint.remote_code == ("auto_map" in config)


def test_capture_directory(tmp_path):
    (tmp_path / "call0_rank0.npz").write_bytes(b"")
    assert detect(tmp_path).kind == "attention_capture"


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        detect(tmp_path / "nope")


def test_a_file_is_not_a_checkpoint(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected a directory, got a file"):
        detect(file)


def test_empty_directory_is_not_a_model(tmp_path):
    with pytest.raises(CheckpointError, match=r"not a model \(no config.json"):
        detect(tmp_path)


def test_unknown_class_names_what_was_found(tmp_path):
    with pytest.raises(CheckpointError, match="unsupported model kind \\(UNet2DConditionModel\\)"):
        detect(_config(tmp_path, "unet", _class_name="UNet2DConditionModel"))


def test_pipeline_directory_asks_for_the_component(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="pipeline directory; pass the component"):
        detect(tmp_path)


def test_remote_code_without_auto_map(tmp_path):
    with pytest.raises(CheckpointError, match="no auto_map"):
        detect(_config(tmp_path, "hi3", architectures=["HunyuanImage3ForCausalMM"]))


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        detect(tmp_path)

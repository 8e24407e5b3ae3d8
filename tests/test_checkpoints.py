"""Checkpoint kinds come from the registry; anything unregistered is an error listing what is supported."""

import dataclasses
import json
import os
import re
import types
from pathlib import Path

import pytest
import torch

from harness.inputs import checkpoints
from harness.inputs.checkpoints import CheckpointError, detect, load_model, null_fields
from harness.plugins import entry_points as plugins
from harness.plugins.entry_points import CheckpointKind

pytestmark = pytest.mark.cpu


def _config(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def extra_kind():
    """Register a kind for one test, as an installed package would, and take it out after."""
    added = []

    def add(kind):
        plugins.CHECKPOINT_KINDS.register(kind.name, kind, origin="tests.test_checkpoints")
        added.append(kind.name)
        return kind

    yield add
    for name in added:
        plugins.CHECKPOINT_KINDS.unregister(name)


@pytest.mark.parametrize(("config", "kind", "feeds"), [
    ({"_class_name": "AutoencoderKLMiniMaxH3"}, "video_vae", "decode"),
    ({"_class_name": "SD3Transformer2DModel"}, "sd3_transformer", "replay"),
    ({"_class_name": "QwenImageTransformer2DModel"}, "qwen_image_transformer", "replay"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "causal_lm", "ar"),
    ({"architectures": ["HunyuanImage3ForCausalMM"], "auto_map": {"AutoModelForCausalLM": "m.C"}}, "hunyuan_image3",
     "ar"),
])
def test_kinds_are_read_from_config(tmp_path, config, kind, feeds):
    checkpoint = detect(_config(tmp_path, "model", **config))
    assert checkpoint.kind == kind and checkpoint.feeds == feeds
    assert checkpoint.remote_code == ("auto_map" in config)


def test_a_detected_checkpoint_hashes_though_it_carries_its_config(tmp_path):
    """A checkpoint is frozen and carries the config dict it was read from: the dict stays out of its identity, so
    it can key a cache, and two reads of one directory are the same key."""
    folder = _config(tmp_path, "model", _class_name="SD3Transformer2DModel", num_layers=2)
    first, second = detect(folder), detect(folder)
    assert first.config == {"_class_name": "SD3Transformer2DModel", "num_layers": 2}
    assert first == second and {first: "loaded"}[second] == "loaded"


def test_the_shipped_kinds_are_registrations_through_the_entry_point_function():
    registry = plugins.Registry("checkpoint kind", "")
    module = type("Plugins", (), {"CHECKPOINT_KINDS": registry})
    checkpoints.register(module)
    checkpoints.register(module)  # idempotent: the same objects
    assert registry.names() == sorted(k.name for k in checkpoints.SHIPPED_KINDS)
    assert set(checkpoints.KINDS) >= set(registry.names())
    assert checkpoints.KINDS["video_vae"] == "decode"
    assert checkpoints.KINDS["sd3_transformer"] == "replay"  # the replay families register their own kinds


def test_hunyuan_image3_is_its_own_remote_code_kind(tmp_path):
    """Its own kind (it claims more gpu kill items than a plain causal LM), driven by the remote-code backend, and
    only with the auto_map its code ships under."""
    from harness.ar import plugins as ar_plugins

    found = detect(_config(tmp_path, "hi3", architectures=["HunyuanImage3ForCausalMM"], auto_map={"A": "m.C"}))
    assert (found.kind, found.source, found.remote_code, found.family) == (
        "hunyuan_image3", "remote_code", True, ar_plugins.REMOTE_CODE)
    with pytest.raises(CheckpointError, match="HunyuanImage3ForCausalMM needs its remote code, but config.json has "
                                              "no auto_map"):
        detect(_config(tmp_path, "bare", architectures=["HunyuanImage3ForCausalMM"]))


def test_remote_code_is_refused_naming_each_module_it_would_import(tmp_path):
    found = detect(_config(tmp_path, "hi3", architectures=["HunyuanImage3ForCausalMM"],
                           auto_map={"AutoConfig": "configs.hunyuan.HunyuanConfig",
                                     "AutoModelForCausalLM": "org/repo--modeling_hunyuan.HunyuanImage3ForCausalMM"}))
    with pytest.raises(CheckpointError, match=r"imports Python shipped in that directory \(configs\.hunyuan\.py, "
                                              r"modeling_hunyuan\.py\); that code is not run without"):
        checkpoints.require_trust(found, trusted_here=False)
    checkpoints.require_trust(found, trusted_here=True)


def test_a_class_diffusers_lacks_has_no_null_fields_to_read_and_json_types_are_named(monkeypatch):
    unknown = checkpoints.Checkpoint(Path("x"), "sd3_transformer", "NoSuchTransformer2DModel", {"patch_size": None},
                                     spec=checkpoints.kind_for_family("replay", "sd3"))
    assert unknown.source == "diffusers" and null_fields(unknown) == []
    unreadable = dataclasses.replace(unknown, class_name="SD3Transformer2DModel")

    def no_signature(_):
        raise ValueError("no signature found")

    monkeypatch.setattr(checkpoints, "inspect", types.SimpleNamespace(signature=no_signature))
    assert null_fields(unreadable) == []  # a constructor whose signature cannot be read: none named
    assert [checkpoints._json_type(v) for v in (None, True, 3, 2.5, "a", [], {})] == [
        "null", "boolean", "number", "number", "string", "array", "object"]


def test_capture_directory(tmp_path):
    (tmp_path / "call0_rank0.npz").write_bytes(b"")
    checkpoint = detect(tmp_path)
    assert (checkpoint.kind, checkpoint.feeds) == ("attention_capture", "attention")


def test_a_registered_kind_is_detected_and_names_its_family(tmp_path, extra_kind):
    extra_kind(CheckpointKind("pixart_test", "replay", ("PixArtTransformer2DModel",), "diffusers",
                              family="pixart_test"))
    checkpoint = detect(_config(tmp_path, "pixart", _class_name="PixArtTransformer2DModel"))
    assert (checkpoint.kind, checkpoint.feeds, checkpoint.family, checkpoint.source) == (
        "pixart_test", "replay", "pixart_test", "diffusers")
    assert checkpoints.kind_for_family("replay", "pixart_test").name == "pixart_test"


def test_a_family_without_a_kind_is_an_error_listing_the_kinds():
    with pytest.raises(CheckpointError, match=r"replay family 'nope': no checkpoint kind .*registered checkpoint "
                                              r"kinds: .*sd3_transformer \(feeds replay, family sd3"):
        checkpoints.kind_for_family("replay", "nope")


def test_two_kinds_claiming_one_class_is_an_error_naming_both(tmp_path, extra_kind):
    extra_kind(CheckpointKind("sd3_again", "replay", ("SD3Transformer2DModel",), "diffusers", family="sd3"))
    with pytest.raises(CheckpointError, match=r"claimed by several checkpoint kinds: sd3_again "
                                              r"\(tests.test_checkpoints\), sd3_transformer "
                                              r"\(harness.replay.families\)"):
        detect(_config(tmp_path, "sd3", _class_name="SD3Transformer2DModel"))


def test_a_malformed_registered_kind_names_its_origin(tmp_path, extra_kind):
    extra_kind(CheckpointKind("bad_feeds", "video", ("X",), "diffusers"))
    with pytest.raises(CheckpointError, match=r"'bad_feeds' \(registered by tests.test_checkpoints\): feeds must"):
        detect(_config(tmp_path, "x", _class_name="X"))


def test_remote_code_kind_requires_its_auto_map(tmp_path, extra_kind):
    extra_kind(CheckpointKind("remote_lm_test", "ar", ("RemoteOnlyForCausalMM",), "remote_code"))
    with pytest.raises(CheckpointError, match="needs its remote code, but config.json has no auto_map"):
        detect(_config(tmp_path, "r1", architectures=["RemoteOnlyForCausalMM"]))
    found = detect(_config(tmp_path, "r2", architectures=["RemoteOnlyForCausalMM"], auto_map={"A": "m.C"}))
    assert (found.kind, found.remote_code) == ("remote_lm_test", True)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        detect(tmp_path / "nope")


def test_a_file_is_not_a_checkpoint(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected a directory, got a file"):
        detect(file)


@pytest.mark.parametrize("denied", ["R_OK", "X_OK"])
def test_a_directory_that_cannot_be_listed_is_refused(tmp_path, monkeypatch, denied):
    """Listing a directory takes read and search permission; the OS answers through os.access (root bypasses
    both, so the answer is stood in for here)."""
    refused = getattr(os, denied)
    monkeypatch.setattr(checkpoints.os, "access", lambda path, mode: not mode & refused)
    with pytest.raises(CheckpointError, match="the directory cannot be listed"):
        detect(tmp_path)


def test_empty_directory_is_not_a_model(tmp_path):
    with pytest.raises(CheckpointError, match=r"not a model \(no config.json"):
        detect(tmp_path)


def test_unknown_class_names_what_was_found_and_the_registered_kinds(tmp_path):
    with pytest.raises(CheckpointError, match=r"unsupported model kind \(UNet2DConditionModel\); registered "
                                              r"checkpoint kinds: .*video_vae \(feeds decode, family minimax_h3: "
                                              r"diffusers AutoencoderKLMiniMaxH3\)"):
        detect(_config(tmp_path, "unet", _class_name="UNet2DConditionModel"))


def test_pipeline_directory_asks_for_the_component(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="pipeline directory; pass the component"):
        detect(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        detect(tmp_path)


def test_a_config_past_the_size_limit_is_refused_unread_and_one_at_it_is_read(tmp_path):
    """16 MiB: configs are kilobytes, so a larger file is refused by its size before a byte of it is read."""
    limit = 16 * 2**20
    for size, refused in ((limit + 1, True), (limit, False)):
        target = tmp_path / f"at{size}"
        target.mkdir()
        with open(target / "config.json", "wb") as config:
            config.truncate(size)  # sparse NUL bytes: not a config, so a read file fails on its content instead
        with pytest.raises(CheckpointError) as caught:
            detect(target)
        assert (f"is {size} bytes; a model config is a small JSON object (at most {limit} bytes read)"
                in str(caught.value)) is refused, caught.value


@pytest.mark.parametrize(("text", "field_name", "value"), [
    ('{"_class_name": "SD3Transformer2DModel", "sample_size": NaN}', "'sample_size'", "nan"),
    ('{"_class_name": "SD3Transformer2DModel", "scale": {"shift": [1.0, Infinity]}}', "'scale.shift[1]'", "inf"),
])
def test_a_config_number_that_is_not_finite_is_refused_naming_the_field(tmp_path, text, field_name, value):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"config.json: field {re.escape(field_name)} is {value}; a model "
                                              "config holds finite numbers"):
        detect(tmp_path)


def _tiny_with(tmp_path, kind, **fields):
    from fixtures import checkpoints as tiny_checkpoints

    tiny_checkpoints.KINDS[kind](tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return tmp_path


def test_a_null_field_the_class_takes_a_value_for_is_refused_when_read_naming_it(tmp_path):
    """A null where the model's constructor takes a value fails inside the model code, naming nothing; it is
    refused when the checkpoint is read (so --checkpoint stops the run at configure time), naming the field."""
    directory = _tiny_with(tmp_path, "sd3_transformer", patch_size=None, qk_norm=None)
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(directory))}: config.json field "
                                              r"'patch_size' is null where SD3Transformer2DModel takes a value "
                                              r"\(its parameter does not default to or admit None\)"):
        detect(directory)  # qk_norm defaults to None: a null there is the default, so only patch_size is named
    by_hand = checkpoints.Checkpoint(directory, "sd3_transformer", "SD3Transformer2DModel",
                                     json.loads((directory / "config.json").read_text()),
                                     spec=checkpoints.kind_for_family("replay", "sd3"))
    assert null_fields(by_hand) == ["patch_size"]
    unjudged = checkpoints.Checkpoint(directory, "sd3_transformer", "SD3Transformer2DModel", by_hand.config)
    assert unjudged.source != "diffusers" and null_fields(unjudged) == []  # only a diffusers config's nulls
    with pytest.raises(CheckpointError, match=r"field 'patch_size' is null"):
        load_model(by_hand, torch.float32, "cpu")  # a Checkpoint not built by detect meets the rule at load


def test_a_null_the_model_admits_is_read_and_loaded(tmp_path):
    """Sana's ``out_channels: int | None = 32``: the default is a value, but the annotation admits None, which the
    model reads as "same as in_channels". A legitimate null is never refused."""
    found = detect(_tiny_with(tmp_path, "sana_transformer", out_channels=None))
    assert null_fields(found) == []
    model = load_model(found, torch.float32, "cpu")
    assert model.config.out_channels is None


def test_a_checkpoint_path_that_is_a_symlink_loop_or_dangles_says_so(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointError, match=r"checkpoint .*loop is a symlink loop; expected a model directory"):
        detect(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=r"dangling is a symlink to .*gone, which does not exist"):
        detect(dangling)


def test_which_constructor_parameters_take_a_value():
    """A parameter with a value default and no annotation takes a value; None as default, or an annotation that
    admits None, or neither default nor annotation, does not say so."""
    import inspect

    def make(default=inspect.Parameter.empty, annotation=inspect.Parameter.empty) -> inspect.Parameter:
        return inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)

    assert checkpoints._takes_a_value(make(default=3))
    assert checkpoints._takes_a_value(make(annotation="int"))
    assert checkpoints._takes_a_value(make(default=None)) is False
    assert not checkpoints._takes_a_value(make())
    assert not checkpoints._takes_a_value(make(default=3, annotation="int | None"))
    assert not checkpoints._takes_a_value(make(default=3, annotation="Optional[int]"))


def test_a_config_without_a_null_has_no_null_fields_and_imports_nothing(tmp_path):
    """The rule reads only nulls: a config that holds none answers an empty list before diffusers is consulted."""
    import dataclasses

    found = detect(_tiny_with(tmp_path, "sana_transformer", out_channels=None))
    without = dataclasses.replace(found, config={k: v for k, v in found.config.items() if v is not None})
    assert null_fields(without) == [] and isinstance(null_fields(without), list)

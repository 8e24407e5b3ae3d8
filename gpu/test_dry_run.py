"""The gpu tier's code on the CPU: tiny checkpoints of every kind, --device cpu, fp32 and bf16, checks and kills.
``pytest -m launch gpu/test_dry_run.py --dry-run-kind sd3_transformer`` dry-runs one kind (repeatable) instead.

This is how CI exercises kind detection, offline loading and the gpu checks without a GPU. It runs
pytest in a subprocess so the inner run has its own registry, session and report. The inner run is
what a GPU node does, as far as a CPU can: its ranks are spawned (PARITY_START_METHOD=spawn, so every
rank rebuilds the catalogues before re-applying a decode ablation) and its models are placed through
accelerate (--device-map with a max-memory split on the CPU).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import checkpoints as tiny_checkpoints
from gpu import checks as gpu_checks
from gpu import decode as gpu_decode
from gpu import replay as gpu_replay
from harness.inputs import compat
from harness.inputs import device_map as device_maps
from harness.inputs.checkpoints import KINDS, CheckpointError, detect, load_model
from harness.judging import catalogue, checks

# the launchers (spawned ranks, torchrun, the gpu tier's dry run) are marked `launch`: scripts/test-all runs
# them; the rest of this file is CPU-tier machinery

REPO = Path(__file__).resolve().parents[1]
CPU_SPLIT = '{"cpu": "8GiB"}'  # a max-memory split the CPU can honour: the device-map code path without a GPU
GIB = 2**30


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoints.write_all(tmp_path_factory.mktemp("checkpoints"))


def unwritten_kinds(written: set[str]) -> tuple[set[str], set[str]]:
    """Kinds the gpu tier reads on this stack but no tiny checkpoint covers: (the suite's own, installed packages'
    that registered no writer). The first is a gap in the suite; the second is named, not failed."""
    readable = {kind for kind, feeds in KINDS.items() if compat.path_unavailable(feeds) is None}
    without_writer = set(tiny_checkpoints.plugin_writers()[1])
    missing = readable - written
    return missing - without_writer, missing & without_writer


@pytest.mark.cpu
def test_every_kind_is_written_and_detected(tiny_dir):
    """Every kind the gpu tier reads has a tiny checkpoint here, the suite's from fixtures/checkpoints.py and an
    installed package's from its CheckpointKind.tiny (or its replay family's tiny_model); a package kind with
    neither is named, since a plugin registering a kind must not turn the gate red."""
    kinds = {detect(path).kind for path in tiny_dir.values()}
    gaps, named = unwritten_kinds(kinds)
    assert not gaps, f"tiny checkpoints cover {sorted(kinds)}; the gpu tier also reads {sorted(gaps)}"
    if named:
        import warnings

        warnings.warn(f"checkpoint kinds {sorted(named)} registered no tiny writer (CheckpointKind.tiny): the gpu "
                      "tier's CPU dry run does not cover them", stacklevel=1)


@pytest.mark.cpu
def test_an_installed_kind_is_written_from_its_own_writer_or_named(tmp_path, monkeypatch):
    """A package's kind with a writer is written and detected like the suite's; one without is named, not failed."""
    from harness.plugins import entry_points as plugins

    def write(target):
        tiny_checkpoints.KINDS["sd3_transformer"](target)  # any diffusers DiT the registry can detect

    from fixtures.replay_models import tiny_model
    from harness.inputs import checkpoints as checkpoints_mod
    from harness.replay import families

    with_writer = plugins.CheckpointKind("sd3_from_plugin", "replay", ("SD3Transformer2DModel",), "diffusers",
                                         family="sd3", tiny=write)
    from_family = plugins.CheckpointKind("family_tiny_model", "replay", ("SD3Transformer2DModel",), "diffusers",
                                         family="with_tiny_model")
    without = plugins.CheckpointKind("nothing_to_write", "replay", ("NoSuchModel",), "diffusers", family="sd3")
    monkeypatch.setattr(checkpoints_mod, "registered_kinds", lambda: [with_writer, from_family, without])
    real_get = families.get_family
    monkeypatch.setattr(families, "get_family", lambda name: type("F", (), {"tiny_model": lambda: tiny_model("sd3")})
                        if name == "with_tiny_model" else real_get(name))
    found, missing = tiny_checkpoints.plugin_writers()
    assert list(found) == ["sd3_from_plugin", "family_tiny_model"] and missing == ["nothing_to_write"]
    written = tiny_checkpoints.write_all(tmp_path, ("sd3_from_plugin", "family_tiny_model"))
    monkeypatch.undo()  # the stand-in kinds were never registered: detect with the real registry
    assert {detect(path).kind for path in written.values()} == {"sd3_transformer"}


def fp32_only_on(check_id: str, path) -> bool:
    """Whether a gpu check judges this checkpoint in fp32 only (its bf16 item skips, saying why): the decode check
    whose fp16 autocast runs over fp32 weights, and the pipeline oracle of a diffusers pipeline."""
    if check_id in gpu_decode.FP32_ONLY_CHECKS:
        return True
    return check_id == gpu_replay.ORACLE_ID and gpu_replay.oracle_skip_reason(str(path), torch.bfloat16) is not None


@pytest.mark.cpu
def test_the_pipeline_oracle_judges_fp32_on_diffusers_pipelines_and_any_dtype_on_hunyuan_image3(tiny_dir):
    """The gpu tier's pipeline oracle runs where its family's oracle judges the dtype: a diffusers pipeline in fp32
    (its bf16 item skips, naming the reason), HunyuanImage-3's own loop in any dtype."""
    sd3 = str(tiny_dir["sd3_transformer"])
    assert gpu_replay.oracle_skip_reason(sd3, torch.float32) is None
    reason = gpu_replay.oracle_skip_reason(sd3, torch.bfloat16)
    assert reason and "replay family 'sd3'" in reason and "judges float32" in reason
    hunyuan = [path for kind, path in tiny_dir.items() if kind.startswith("hunyuan_image3")]
    assert hunyuan and all(gpu_replay.oracle_skip_reason(str(path), dtype) is None for path in hunyuan
                           for dtype in (torch.float32, torch.bfloat16))


@pytest.fixture
def dry_run_dir(request, tmp_path_factory):
    """The tiny checkpoints the dry run covers: every kind, or only those ``--dry-run-kind`` names (written alone, so
    a one-kind run does not write the others)."""
    from gpu.conftest import dry_run_kinds

    kinds = dry_run_kinds(request.config)
    if kinds is None:
        return request.getfixturevalue("tiny_dir")
    return tiny_checkpoints.write_all(tmp_path_factory.mktemp("dry_run"), kinds)


@pytest.mark.launch
def test_gpu_tier_dry_run_over_every_checkpoint_kind(dry_run_dir, tmp_path):
    """The gpu tier's items over every tiny checkpoint kind, or over the kinds ``--dry-run-kind`` names: each
    passes, every claimed kill is killed, and the labels name each checkpoint's kind."""
    tiny_dir = dry_run_dir
    report = tmp_path / "gpu.json"
    args = [sys.executable, "-m", "pytest", "-m", "gpu", "--device", "cpu", "--dtype", "fp32,bf16", "-q",
            "-p", "no:cacheprovider", f"--parity-report={report}", f"--device-map={CPU_SPLIT}", "gpu/test_gpu.py",
            "--trust-remote-code"]  # the tiny HunyuanImage-3 checkpoints carry the suite's own fake remote code
    args += [f"--checkpoint={path}" for path in tiny_dir.values()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PARITY_START_METHOD": "spawn"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"gpu dry run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    mapped = {kind for kind, path in tiny_dir.items() if f"device map {CPU_SPLIT}: {path} on cpu" in done.stdout}
    in_process = {kind for kind, path in tiny_dir.items() if detect(path).feeds in ("replay", "ar", "decode")}
    assert mapped == in_process, f"loaded through the device map: {sorted(mapped)}, expected {sorted(in_process)}"
    data = json.loads(report.read_text())
    catalogue.load()  # the ablation catalogue, which loads the checks first
    labels = gpu_checks.checkpoint_labels([detect(path) for path in tiny_dir.values()])
    assert all(labels[str(path)].startswith(detect(path).kind) for path in tiny_dir.values()), labels
    expected, fp32_only = set(), set()
    for check in checks.all_checks("gpu"):
        for path in tiny_dir.values():
            if check.path in (detect(path).feeds, *gpu_checks.also_feeds(detect(path))):
                label = labels[str(path)]
                expected.add(f"{check.id}[{label}-fp32]")
                (fp32_only if fp32_only_on(check.id, path) else expected).add(f"{check.id}[{label}-bf16]")
    ran = {c["id"] for c in data["checks"] if c["status"] != "skipped"}
    assert ran == expected, f"missing: {sorted(expected - ran)}; unexpected: {sorted(ran - expected)}"
    assert all(c["passed"] for c in data["checks"] if c["status"] != "skipped")
    # an fp32-only check's bf16 item is reported as skipped with its reason, never as a pass
    skipped = {c["id"] for c in data["checks"] if c["status"] == "skipped"}
    assert skipped == fp32_only, f"skipped: {sorted(skipped)}; expected {sorted(fp32_only)}"
    assert data["summary"]["passed"] == len(expected)
    assert data["summary"]["skipped"] == len(fp32_only)
    killed = {k["check"] for a in data["ablations"] for k in a["kills"] if k["killed"]}
    assert killed == expected, f"gpu checks no ablation killed in the dry run: {sorted(expected - killed)}"
    pairs = [k for a in data["ablations"] for k in a["kills"]]
    assert pairs and {k["status"] for k in pairs} <= {"killed", "skipped"}, [k for k in pairs if not k["killed"]]
    assert {k["check"] for k in pairs if k["status"] == "skipped"} <= fp32_only
    assert all(any(k["killed"] for k in a["kills"]) for a in data["ablations"])
    remote = {str(path) for kind, path in tiny_dir.items() if detect(path).remote_code}
    assert set(data["remote_code"]["ran"]) == remote and data["remote_code"]["trusted"], data["remote_code"]


@pytest.mark.cpu
def test_a_checkpoint_that_does_not_load_names_the_path(tmp_path):
    target = tmp_path / "broken_sd3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(CheckpointError, match=r"broken_sd3: could not load SD3Transformer2DModel"):
        load_model(detect(target), torch.float32, "cpu")


@pytest.mark.launch
def test_wrong_kind_is_a_usage_error_naming_the_path(tmp_path):
    """A whole pytest process (about 8 s), so it runs with the launchers; tests/test_checkpoints.py holds the
    in-process refusal of the same kind."""
    target = tmp_path / "unet"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", f"--checkpoint={target}", "-p",
                           "no:cacheprovider", "gpu/test_gpu.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"checkpoint {target}: unsupported model kind (UNet2DConditionModel)" in done.stderr


@pytest.mark.cpu
@pytest.mark.parametrize("text", ["balanced", "auto", "sequential", CPU_SPLIT, '{"0": "70GiB", "1": "70GiB"}',
                                  '{"0": 1000000, "cpu": "1.5 GB"}'])
def test_device_map_accepts_strategies_and_memory_splits(text):
    spec = device_maps.parse(text)
    kwargs = spec.loader_kwargs()
    assert kwargs["device_map"] in device_maps.STRATEGIES
    if text.startswith("{"):
        assert set(kwargs["max_memory"]) == {int(k) if k.isdigit() else k for k in json.loads(text)}


@pytest.mark.parametrize(("text", "message"), [
    ("cuda:0", "expected one of balanced, auto, sequential"),
    ('{"0": "70GiB"', "not valid JSON"),
    ("{}", "non-empty JSON object"),
    ('{"gpu0": "70GiB"}', "device 'gpu0' is neither a GPU index nor \"cpu\""),
    ('{"0": "lots"}', "memory 'lots' for device '0' must be a positive byte count"),
    ('{"0": -5}', "memory -5 for device '0'"),
    ('{"0": true}', "memory True for device '0'"),
])
@pytest.mark.cpu
def test_device_map_rejects_bad_text_naming_what_is_accepted(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        device_maps.parse(text)


@pytest.mark.cpu
def test_default_placement_keeps_one_gpu_where_the_weights_fit():
    gpu0 = torch.device("cuda", 0)
    free = {0: 80 * GIB, 1: 80 * GIB}
    assert device_maps.choose(None, gpu0, 60 * GIB, free) is None  # fits 80% of one GPU
    split = device_maps.choose(None, gpu0, 160 * GIB, free)  # HunyuanImage-3 in bf16
    assert split is not None and split.strategy == "balanced" and "160.0 GiB" in split.text
    assert device_maps.choose(None, gpu0, 160 * GIB, {0: 80 * GIB}) is None  # nowhere to spill: one device
    assert device_maps.choose(None, torch.device("cpu"), 160 * GIB, free) is None
    asked = device_maps.parse("sequential")
    assert device_maps.choose(asked, gpu0, 1, free) is asked


@pytest.mark.cpu
def test_weight_bytes_read_from_safetensors_headers(tiny_dir):
    for kind in ("sd3_transformer", "qwen3_lm"):
        model = load_model(detect(tiny_dir[kind]), torch.float32, "cpu")
        stored = sum(t.numel() for t in model.state_dict().values())
        assert device_maps.weight_bytes(tiny_dir[kind], torch.bfloat16) == 2 * stored, kind
        assert device_maps.weight_bytes(tiny_dir[kind], torch.float32) == 4 * stored, kind


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["flux_transformer", "qwen3_lm", "hunyuan_image3"])
def test_device_mapped_load_places_the_model_and_changes_no_weight(tiny_dir, kind, monkeypatch):
    monkeypatch.setattr(device_maps, "_PLACEMENTS", [])  # keep this run's own placement summary clean
    checkpoint = detect(tiny_dir[kind])
    trusted = checkpoint.remote_code  # the tiny HunyuanImage-3 carries the suite's own fake remote code
    plain = load_model(checkpoint, torch.float32, "cpu", trust_remote_code=trusted)
    mapped = load_model(checkpoint, torch.float32, "cpu", device_map=CPU_SPLIT, trust_remote_code=trusted)
    where = device_maps.placements()[-1]
    assert where == (str(checkpoint.path), CPU_SPLIT, {"": "cpu"})
    plain_state, mapped_state = plain.state_dict(), mapped.state_dict()
    assert plain_state.keys() == mapped_state.keys()
    assert all(torch.equal(plain_state[k], mapped_state[k]) for k in plain_state), kind
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match=re.escape(f"GPUs [{visible}] are not visible ({visible} are)")):
        load_model(checkpoint, torch.float32, "cpu", device_map=f'{{"{visible}": "1GiB"}}', trust_remote_code=trusted)


@pytest.mark.cpu
def test_gpu_labels_name_each_checkpoint_by_its_kind_and_number_a_kind_given_twice():
    from harness.inputs.checkpoints import Checkpoint

    given = [Checkpoint(Path("/models/final-run-7"), "sd3_transformer", "SD3Transformer2DModel"),
             Checkpoint(Path("/models/qwen3"), "causal_lm", "Qwen3ForCausalLM"),
             Checkpoint(Path("/models/moe"), "causal_lm", "HunYuanMoEV1ForCausalLM")]
    assert gpu_checks.checkpoint_labels(given) == {"/models/final-run-7": "sd3_transformer",
                                                   "/models/qwen3": "causal_lm_1", "/models/moe": "causal_lm_2"}


@pytest.mark.cpu
def test_a_dry_run_kind_that_no_writer_writes_is_a_usage_error_naming_those_it_does():
    from gpu.conftest import dry_run_kinds

    def config(kinds):
        return type("Config", (), {"getoption": lambda self, name, default=None: kinds})()

    assert dry_run_kinds(config(None)) is None
    assert dry_run_kinds(config(["sd3_transformer", "qwen3_lm", "sd3_transformer"])) == ("sd3_transformer", "qwen3_lm")
    with pytest.raises(pytest.UsageError, match=r"--dry-run-kind sd3: no tiny checkpoint kind of that name; the dry "
                                                r"run writes .*sd3_transformer"):
        dry_run_kinds(config(["sd3"]))

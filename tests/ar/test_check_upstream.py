"""scripts/check-upstream's pieces: what a code directory holds, the tiny configs, the pytest run, the summary, the
CPU patches, and (``launch``) the whole run on a code directory written from the fakes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import ar_models, check_upstream, upstream_checkpoint
from fixtures.ar_checkpoint import COMMON_FILE, IMAGE_FILES, PORTABLE_FILE, auto_map, source_path
from fixtures.upstream_checkpoint import KINDS, UpstreamPackageError, package_generations, tiny_config
from harness.inputs import compat

REPO = Path(__file__).resolve().parents[2]


def _touch(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("")
    return directory


@pytest.mark.cpu
def test_the_generations_are_read_from_the_files(tmp_path: Path) -> None:
    assert package_generations(_touch(tmp_path / "g1", "hunyuan.py", "configuration_hunyuan.py")) == [1]
    two = _touch(tmp_path / "g2", "modeling_hunyuan_image_3.py", "configuration_hunyuan_image_3.py")
    assert package_generations(two) == [2]
    assert package_generations(_touch(two, "hunyuan.py", "configuration_hunyuan.py")) == [1, 2]  # as 5848fb47
    with pytest.raises(UpstreamPackageError, match=r"holds neither generation's modeling code; expected hunyuan.py "
                                                   r"\+ configuration_hunyuan.py \(generation 1\) or"):
        package_generations(_touch(tmp_path / "half", "hunyuan.py"))
    with pytest.raises(UpstreamPackageError, match="not a directory"):
        package_generations(tmp_path / "missing")


@pytest.mark.cpu
def test_tiny_configs_route_as_released() -> None:
    moe, dense, drop = (tiny_config(kind) for kind in KINDS)
    assert moe["num_experts"] >= 2 and moe["moe_topk"] == [2] * moe["num_hidden_layers"]  # per-layer top-k
    assert moe["use_mixed_mlp_moe"] and not moe["moe_drop_tokens"] and drop["moe_drop_tokens"]
    assert dense["num_experts"] == 1
    with pytest.raises(ValueError, match="kind must be one of"):
        tiny_config("sparse")


@pytest.mark.cpu
@pytest.mark.parametrize("offered", [True, False])
def test_the_pytest_run_patches_the_cpu_and_trusts_remote_code_only_when_offered(
        offered: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(check_upstream, "pytest_offers", lambda option: offered and option == "--trust-remote-code")
    cpu = check_upstream.pytest_command([tmp_path / "gen2_moe"], "cpu", "fp32", tmp_path / "r.json",
                                        tmp_path / "r.xml", ["-x"])
    assert cpu[1:4] == ["-m", "pytest", "-m"] and "fixtures.upstream_cpu" not in cpu  # the gpu tier patches itself
    assert f"--checkpoint={tmp_path / 'gen2_moe'}" in cpu and cpu[-1] == "-x"
    assert ("--trust-remote-code" in cpu) == offered
    cuda = check_upstream.pytest_command([tmp_path / "gen2_moe"], "cuda", "bf16", tmp_path / "r.json",
                                         tmp_path / "r.xml", [])
    assert "fixtures.upstream_cpu" not in cuda and "--device=cuda" in cuda


@pytest.mark.cpu
def test_a_gpu_tier_dry_run_on_a_hunyuan_checkpoint_patches_the_cpu_by_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's HunyuanImage-3 checkpoint dry-run with --device cpu (or auto without CUDA) gets fixtures.upstream_cpu
    without naming it; other checkpoints, unreadable configs and CUDA runs do not."""
    from gpu import conftest as gpu_conftest

    hunyuan, other, broken = tmp_path / "h", tmp_path / "o", tmp_path / "b"
    for path, text in ((hunyuan, json.dumps({"auto_map": auto_map(2)})), (other, json.dumps({"model_type": "x"})),
                       (broken, "[garbage")):
        path.mkdir()
        (path / "config.json").write_text(text)
    assert gpu_conftest.hunyuan_checkpoints([str(other), str(broken), str(hunyuan), str(tmp_path / "none")]) == [
        str(hunyuan)]
    installs: list[int] = []
    monkeypatch.setattr(gpu_conftest.upstream_cpu, "install", lambda: installs.append(1))
    options = {"device": "cpu", "checkpoint": [str(hunyuan)]}
    config = type("Config", (), {"getoption": lambda self, name: options[name]})()
    gpu_conftest.pytest_configure(config)
    assert installs == [1]
    options["checkpoint"] = [str(other)]
    gpu_conftest.pytest_configure(config)
    options.update(device="cuda", checkpoint=[str(hunyuan)])
    gpu_conftest.pytest_configure(config)
    assert installs == [1]
    assert gpu_conftest.dry_run_on_cpu("auto") is not __import__("torch").cuda.is_available()


@pytest.mark.cpu
def test_the_summary_reads_verdicts_kills_and_the_named_routing_cause() -> None:
    routing = "MoE routing depends on what shares the forward, not on padding: a token alone ..."
    data = {"checks": [
        {"id": "ar.gpu.batched_vs_b1[gen2_moe-fp32]", "passed": False, "margin": "inf", "headline": "max_abs",
         "metrics": {"logp_max_abs": 0.75, "moe_routing": routing}},
        {"id": "ar.gpu.batched_vs_b1[gen1_dense-bf16]", "passed": True, "margin": 0.1, "headline": "max_abs",
         "metrics": {"kl_per_row": [1e-4, 6e-4], "moe_routing": "no MoE layer"}},
        {"id": "ar.gpu.batched_vs_b1[gen2_moe-bf16]", "passed": False, "margin": 0.125, "headline": "max_abs",
         "violated": ["MoE routing ignores what shares a forward"],
         "metrics": {"kl_per_row": [0.25], "moe_routing": routing}}],
        "ablations": [{"name": "ar.decode_mask_removed", "kills": [
            {"check": "ar.gpu.batched_vs_b1[gen1_dense-bf16]", "killed": True, "margin": 463.0, "mode": "tolerance"}]}]}
    data["checks"].append({"id": "ar.gpu.left.batched_vs_b1[gen2_moe-fp32]", "passed": True, "margin": 0.2,
                           "headline": "max_abs", "metrics": {"logp_max_abs": 1e-6, "moe_routing": "no MoE layer"}})
    left = check_upstream.summarize(data, "ar.left")  # the left-padded layout's row stands apart
    assert left[("gen2_moe", "fp32")]["passed"] and set(left) == {("gen2_moe", "fp32")}
    rows = check_upstream.summarize(data)  # the ar rows: the right-padded check's, not overwritten by the left
    failed, passed = rows[("gen2_moe", "fp32")], rows[("gen1_dense", "bf16")]
    assert (failed["passed"], failed["margin"], failed["why"]) == (False, float("inf"), routing)
    assert failed["headline"] == "logp|d| 7.50e-01" and failed["kills"] == []
    assert (passed["passed"], passed["headline"], passed["why"]) == (True, "KL 6.00e-04", "")
    assert passed["kills"] == [("ar.decode_mask_removed", True, 463.0, "tolerance")]
    by_fact = rows[("gen2_moe", "bf16")]  # its numbers alone pass (margin 0.125): the row says a fact failed
    assert (by_fact["passed"], by_fact["margin"], by_fact["why"]) == (False, "fact", routing)


@pytest.mark.cpu
def test_a_failed_checks_note_carries_its_reason_never_a_bare_name() -> None:
    """A check that raised: the exception's first line; one failed by its numbers: the metric with its value and
    bound; one failed by a fact: the fact (each note once read "None" or a metric's bare name)."""
    raised = {"id": "attention.gpu.denoise.decomposed[gen2_moe_captures-fp32]", "passed": False,
              "margin": None, "headline": None, "metrics": {},
              "error": {"type": "RuntimeError", "message": "shape mismatch at layer 1\nTraceback ...", "ranks": []}}
    numbers = {"id": "replay.gpu.cfg2.log_probs[gen2_moe-fp32]", "passed": False, "margin": 3.5,
               "headline": "max_relative_to_local", "tolerance": 0.002, "metrics": {"max_relative_to_local": 0.007}}
    fact = {"id": "replay.gpu.cfg2.latents[gen2_moe-fp32]", "passed": False, "margin": 0.5, "headline": "max_abs",
            "violated": ["every row's image span is its own"], "metrics": {"max_abs": 0.0}}
    assert check_upstream.failure_reason(raised) == "raised RuntimeError: shape mismatch at layer 1"
    assert check_upstream.failure_reason(numbers) == "max_relative_to_local = 0.007 > bound 0.002 (margin 3.5)"
    assert check_upstream.failure_reason(fact) == "fact failed: every row's image span is its own"
    rows = check_upstream.summarize({"checks": [raised], "ablations": []}, "attention")
    assert rows[("gen2_moe_captures", "fp32")]["why"] == "denoise.decomposed: raised RuntimeError: shape " \
                                                          "mismatch at layer 1"
    rows = check_upstream.summarize({"checks": [numbers], "ablations": []}, "replay")
    assert rows[("gen2_moe", "fp32")]["why"] == ("cfg2.log_probs: max_relative_to_local = 0.007 > bound 0.002 "
                                                 "(margin 3.5)")


@pytest.mark.cpu
def test_the_oracle_has_a_row_of_its_own_whose_failure_names_the_step_and_the_numbers() -> None:
    """The pipeline oracle's gpu check reads as its own row beside replay's, with its kills; a failure by numbers
    reads as the verdict's message does (what failed, at which step, measured against its bound)."""
    message = ("step 0 combine (relative): max_abs 9.1e+00 exceeds 4 x control 4.768e-07 + floor 0.0 = 1.907e-06; "
               "worst element at row 0, element (2, 1, 0)\nstep 1 combine (relative): ...")
    data = {"checks": [
        {"id": "replay.gpu.oracle.pipeline[gen1_dense-bf16]", "passed": False, "margin": 9.1e5,
         "headline": "max_abs", "tolerance": 1.9e-6, "metrics": {"max_abs": 9.1}, "violated": [], "message": message},
        {"id": "replay.gpu.cfg2.log_probs[gen1_dense-bf16]", "passed": True, "margin": 0.1, "headline": "max_abs",
         "metrics": {"max_abs": 1e-6}}],
        "ablations": [{"name": "replay.timestep_units_wrong", "kills": [
            {"check": "replay.gpu.oracle.pipeline[gen1_dense-fp32]", "killed": True, "margin": 5.2e5,
             "mode": "tolerance"}]}]}
    assert check_upstream.table_path("replay.gpu.oracle.pipeline[gen1_dense-bf16]") == "oracle"
    oracle = check_upstream.summarize(data, "oracle")
    assert set(oracle) == {("gen1_dense", "bf16"), ("gen1_dense", "fp32")}
    row = oracle[("gen1_dense", "bf16")]
    assert not row["passed"] and row["why"] == ("oracle.pipeline: step 0 combine (relative): max_abs 9.1e+00 exceeds 4 "
                                                "x control 4.768e-07 + floor 0.0 = 1.907e-06; worst element at row 0, "
                                                "element (2, 1, 0) (margin 9.1e+05)")
    assert oracle[("gen1_dense", "fp32")]["kills"] == [("replay.timestep_units_wrong", True, 5.2e5, "tolerance")]
    assert set(check_upstream.summarize(data, "replay")) == {("gen1_dense", "bf16")}  # replay's row stays replay's
    shown = check_upstream.parser().format_help()  # what --help prints
    assert "pipeline oracle" in shown and "gen<G>_<kind>:oracle" in shown, shown


@pytest.mark.cpu
def test_a_row_whose_contract_rows_fail_reads_fail_whatever_its_checks_did() -> None:
    """A bug only the contract rows see (the prediction read at row 0's image positions: batched and serial replay
    and the oracle agree with each other on such code) turns the row's check column FAIL, naming the contract row;
    the row's own failure follows it."""
    passing = {"passed": True, "headline": "log_probs", "margin": 0.1,
               "kills": [("replay.nesting_swapped", True, 40.0, "tolerance")]}
    line, note, green = check_upstream.table_line("gen2_dense:replay", "fp32", passing, (11, 11))
    assert green and " PASS " in line and " 11/11 " in line and note == ""
    line, note, green = check_upstream.table_line("gen2_dense:replay", "fp32", passing, (10, 11),
                                                  ["contract row 7 (rows independent) failed"])
    assert not green and " FAIL " in line and " 10/11 " in line and " PASS " not in line
    assert note == "contract row 7 (rows independent) failed" and note in line
    failing = {**passing, "passed": False, "why": "cfg2.log_probs: max_abs = 1 > bound 0.1 (margin 10)"}
    _, note, _ = check_upstream.table_line("gen2_dense:replay", "fp32", failing, (10, 11),
                                           ["contract row 7 (rows independent) failed"])
    assert note == "contract row 7 (rows independent) failed; cfg2.log_probs: max_abs = 1 > bound 0.1 (margin 10)"
    line, _, green = check_upstream.table_line("gen2_dense:oracle", "bf16", {"kills": []}, None)
    assert not green and line.split()[2:4] == ["-", "-"]  # nothing judged: no contract cell, no verdict


@pytest.mark.launch
def test_the_cpu_patches_apply_from_outside() -> None:
    """In a fresh interpreter (seconds: ``launch``): the stand-in imports in place of a torchvision that does not,
    the VAE's CUDA empty lands on the CPU, and the MoE's set_device and NVTX range do nothing (each only where the
    host lacks them)."""
    probe = ("import torch; from fixtures import upstream_cpu; done = upstream_cpu.install(); "
             "import torchvision.transforms as T, transformers; "
             "from transformers import Siglip2ImageProcessorFast; "
             "print(done, torch.empty(0, device='cuda').device.type, torch.cuda.set_device(None), "
             "type(torch.cuda.nvtx.range('x')).__name__, T.Compose([T.ToTensor()]).__class__.__name__, "
             "Siglip2ImageProcessorFast.__module__, upstream_cpu.install() == done)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip()
    assert "'torchvision stand-in'" in printed and "'torch.cuda.set_device no-op'" in printed
    # transformers 4.x keeps the fast processor in image_processing_siglip2_fast, 5.x in image_processing_siglip2
    assert re.search(r"cpu None nullcontext Compose transformers\.models\.siglip2\.image_processing_siglip2(_fast)? "
                     r"True$", printed), printed


def _fake_package(directory: Path, generation: int) -> Path:
    """A user's code directory written from a fake: the generation's two files plus the fakes they import."""
    modeling, configuration = upstream_checkpoint.GENERATION_FILES[generation]
    directory.mkdir(parents=True)
    (directory / modeling).write_text(source_path(generation).read_text())
    # transformers 4.x copies only the modules the configuration file imports itself: the common module's helpers too
    (directory / configuration).write_text(
        "from .ar_hunyuan_common import HunyuanImage3Config  # noqa: F401\n"
        "from .hunyuan_image_gen import timestep_embedding  # noqa: F401\n"
        "from .hunyuan_image_pipeline import FlowMatchDiscreteScheduler  # noqa: F401\n")
    for helper in (COMMON_FILE, PORTABLE_FILE, *IMAGE_FILES):
        (directory / helper).write_text(source_path(ar_models.PORTABLE).with_name(helper).read_text())
    return directory


@pytest.mark.launch
@pytest.mark.parametrize("generation", [1, 2])
def test_check_upstream_runs_on_a_code_directory(tmp_path: Path, generation: int) -> None:
    """The whole script on a directory holding a fake generation: 4.x runs it (generation 2's MoE fails, named;
    dense passes with its kills); 5.x refuses it, naming the generation."""
    package = _fake_package(tmp_path / "hunyuan_image_3", generation)
    done = subprocess.run([str(REPO / "scripts" / "check-upstream"), str(package), "--dir", str(tmp_path / "run"),
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHON": sys.executable})
    table = done.stdout[done.stdout.index("check-upstream summary"):]
    name = f"gen{generation}"
    if not compat.has_module("transformers.modeling_attn_mask_utils"):
        assert done.returncode == 1 and table.count("refused:") == 2
        assert f"HunyuanImage-3 generation {generation} ({upstream_checkpoint.GENERATION_FILES[generation][0]})" \
            in table
        return
    rows = {line.split()[0] + " " + line.split()[1]: line for line in table.splitlines() if line.startswith(name)}
    for dtype in ("fp32", "bf16"):
        assert " 13/13 " in rows[f"{name}_dense {dtype}"] and " PASS " in rows[f"{name}_dense {dtype}"]
        assert " 4/4 " in rows[f"{name}_dense {dtype}"]
        left = rows[f"{name}_dense:left {dtype}"]  # the left-padded layout: its own row, its own kills
        assert " 13/13 " in left and " PASS " in left and re.search(r" (\d+)/\1 ", left), left
        moe = rows[f"{name}_moe {dtype}"]
        assert (" FAIL " in moe and "MoE routing depends" in moe) == (generation == 2), moe
        for image_row in (f"{name}_moe:replay {dtype}", f"{name}_dense:replay {dtype}", f"{name}_moe_captures {dtype}",
                          f"{name}_moe:oracle {dtype}", f"{name}_dense:oracle {dtype}"):
            assert " PASS " in rows[image_row], rows[image_row]  # the image forward: replay, its loop, its captures
        assert " 11/11 " in rows[f"{name}_dense:replay {dtype}"] and " 4/4 " in rows[f"{name}_moe_captures {dtype}"]
        assert " 11/11 " in rows[f"{name}_dense:oracle {dtype}"] and " 3/3 " in rows[f"{name}_dense:oracle {dtype}"]
    assert (done.returncode == 0) == (generation == 1), done.stdout[-3000:]
    report = json.loads((tmp_path / "run" / "check-upstream.json").read_text())
    assert sum(check["id"].startswith("ar.gpu.batched_vs_b1") for check in report["checks"]) == 4
@pytest.mark.cpu
def test_one_generation_at_a_time_asked_named_by_config_or_the_current_one(tmp_path: Path) -> None:
    """A directory holding both generations (an Instruct checkout) judges one: the one asked for, else the one its
    config.json's auto_map names, else generation 2; the other is reported as not run, saying how to run it."""
    both = [1, 2]
    assert check_upstream.choose_generations(tmp_path, both, 1) == (
        [1], {2: "not run: --generation 1 was asked for; pass --generation 2 to judge generation 2"})
    assert check_upstream.choose_generations(tmp_path, both, None) == (
        [2], {1: "not run: it holds both and generation 2 is the current one; pass --generation 1 to judge "
                 "generation 1"})
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": auto_map(1)}))
    assert check_upstream.choose_generations(tmp_path, both, None) == (
        [1], {2: "not run: its config.json's auto_map names generation 1; pass --generation 2 to judge generation 2"})
    (tmp_path / "config.json").write_text("[not json")  # read as data: unreadable means "names nothing"
    assert check_upstream.choose_generations(tmp_path, both, None)[0] == [2]
    assert check_upstream.choose_generations(tmp_path, [1], None) == ([1], {})
    with pytest.raises(ValueError, match=r"--generation 2, but the directory holds generation\(s\) \[1\] only"):
        check_upstream.choose_generations(tmp_path, [1], 2)


@pytest.mark.launch
@pytest.mark.skipif(compat.has_module("transformers.modeling_attn_mask_utils"),
                    reason="transformers 4.x runs HunyuanImage-3: this is the 5.x lane's refusal")
def test_a_gpu_run_on_transformers_5_given_a_hunyuan_image3_checkpoint_judges_nothing_and_exits_non_zero(tmp_path):
    """Every item of a HunyuanImage-3 checkpoint skips on 5.x with the generation's reason; a lane that judged
    nothing must not read green."""
    from fixtures import checkpoints as tiny_checkpoints

    path = tiny_checkpoints.write_all(tmp_path, ("hunyuan_image3_gen2",))["hunyuan_image3_gen2"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--device",
                           "cpu", f"--checkpoint={path}", "--trust-remote-code", "gpu/test_gpu.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:]
    assert f"--checkpoint={path}: no check ran on it" in done.stdout
    assert "HunyuanImage-3 generation 2 (modeling_hunyuan_image_3.py) imports transformers.modeling_attn_mask_utils" \
        in done.stdout

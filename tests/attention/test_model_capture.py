"""``scripts/capture-attention`` on the fake HunyuanImage-3's tiny checkpoint: captures of its own image forward, in
the format ``--capture-dir`` reads, judged by the attention checks; its masks held to the contract's formula; and
the usage errors (the trust flag, a model without an image forward, a directory that is not HunyuanImage-3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fixtures.ar_checkpoint import write_gen_image_remote_code, write_hunyuan_remote_code
from fixtures.capture_attention import main
from harness import catalogue, checks
from harness.attention import capture as capture_io
from harness.attention import contract
from harness.attention.model_capture import capture_model, check_formula
from harness.checkpoints import TRUST_FLAG, remote_code_ran
from harness.checks import CheckContext

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_gen_image_remote_code(tmp_path_factory.mktemp("hunyuan_image3_gen_image"))


@pytest.fixture(scope="module")
def captured(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("captures") / "out"
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(out)]) == 0
    return out


def test_the_captures_hold_both_phases_in_the_capture_format(captured):
    capture_io.validate_directory(captured)
    prefill = capture_io.load_capture(capture_io.phase_capture_path(captured, "prefill"))
    denoise = capture_io.load_capture(capture_io.phase_capture_path(captured, "denoise"))
    assert [p.name for p in capture_io.find_captures(captured)] == ["call0_rank0.npz", "call1_rank0.npz"]
    first = contract.detect_layout(prefill.mask)
    later = contract.detect_layout(denoise.mask)
    assert first.phase == "prefill" and len(first.images) == 1  # the conditional image's span, then the generated
    assert later.phase == "denoise" and later.special_len == 1 and later.span == first.span
    assert prefill.heads == 4 and prefill.kv_heads == 2  # the GQA repeat undone: key/value at their own heads


def test_the_attention_checks_judge_the_kernels_on_them(captured):
    catalogue.load()
    ctx = CheckContext(capture_dir=str(captured))
    for phase in ("prefill", "denoise"):
        for check in (f"attention.capture.{phase}.contract", f"attention.{phase}.decomposed.vs_sdpa",
                      f"attention.{phase}.block_padded.vs_sdpa"):
            verdict = checks.run_check(check, ctx)
            assert verdict.passed, verdict


def test_a_mask_off_the_formula_is_named_by_position(checkpoint):
    from harness.checkpoints import detect, load_model

    model = load_model(detect(checkpoint), torch.float32, "cpu", trust_remote_code=True)
    recorded = capture_model(model)
    assert [check_formula(item) for item in recorded] == [None, None]
    denoise = recorded[1]
    mask = denoise.capture.mask.clone()
    mask[0, 0, 0, denoise.span[0]] = True  # the timestep row (just before the span) shown the span's first key
    bad = dataclasses.replace(denoise, capture=dataclasses.replace(denoise.capture, mask=mask))
    position = denoise.positions[0]
    assert check_formula(bad) == (f"1 of {mask.shape[2] * mask.shape[3]} pairs differ; first at query row 0 (position "
                                  f"{position}), key {denoise.span[0]}: the model's mask says True, the formula False")


def test_nothing_from_the_directory_runs_without_the_flag(checkpoint, tmp_path, capsys):
    ran = list(remote_code_ran())
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert TRUST_FLAG in capsys.readouterr().err
    assert remote_code_ran() == ran and not (tmp_path / "out").exists()


def test_a_checkpoint_without_an_image_forward_is_a_usage_error(tmp_path, capsys):
    text_only = write_hunyuan_remote_code(tmp_path / "text_only", kind="dense", generation="portable")
    assert main(["--checkpoint", str(text_only), TRUST_FLAG, "--out", str(tmp_path / "out")]) == 2
    assert "no vae['latent_channels']" in capsys.readouterr().err


def test_other_bad_inputs_are_usage_errors(checkpoint, captured, tmp_path, capsys):
    assert main(["--checkpoint", str(captured), TRUST_FLAG, "--out", str(tmp_path / "a")]) == 2
    assert "HunyuanImage3ForCausalMM" in capsys.readouterr().err
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(tmp_path / "b"), "--layers", "3"]) == 2
    assert "--layers [3]: the model has layers 0..0" in capsys.readouterr().err
    assert main(["--checkpoint", str(checkpoint), TRUST_FLAG, "--out", str(captured)]) == 2
    assert "already holds captures" in capsys.readouterr().err

"""The HunyuanImage-3 replay family on its image forward: the fakes held to the gen_image contract, and, with a
checkout of upstream's code named by ``PARITY_HUNYUAN_SRC``, the real code held to the same rows with the family's
replay and pipeline oracle run on it.

``PARITY_HUNYUAN_SRC`` is one or more code directories (``hunyuan_image_3/`` of a checkout; ``os.pathsep``
between several, e.g. one per generation), each judged for the generation ``scripts/check-upstream`` would judge
there. The real code imports modules transformers 5 removed, so those tests run on the lowest lane only.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest
import torch

from fixtures import gen_image_contract
from fixtures.replay_families import family_traits
from fixtures.replay_models import tiny_hunyuan_image3
from harness.attention import capture as capture_io
from harness.attention.model_capture import capture_model, check_formula
from harness.inputs import compat
from harness.judging import ablation, catalogue, checks
from harness.judging.checks import CheckContext
from harness.replay import pipeline_oracle
from harness.replay.controls import measure_batch_shape_control
from harness.replay.families import get_family
from harness.replay.families.hunyuan_image3 import ImageForwardError, require_image_forward
from harness.replay.judge import compare_replay
from harness.replay.policies import local_scale_policy
from harness.replay.problem import make_problem
from tests.replay.test_hunyuan_oracle import LOOP_BUGS, plant_loop_bug

pytestmark = pytest.mark.cpu

SRC_ENV = "PARITY_HUNYUAN_SRC"
FOUR_X = compat.has_module("transformers.modeling_attn_mask_utils")
ORACLE_ABLATIONS = ("replay.timestep_units_wrong", "replay.cfg_order_declared_wrong", "replay.velocity_sign_flipped")


def _rows_failed(model) -> list[str]:
    return [f"{row.number} {row.point}: {row.measured}" for row in gen_image_contract.run_gen_image_contract(model)
            if not row.passed]


@pytest.mark.parametrize("generation", ["portable", 1, 2])
def test_the_fakes_meet_the_gen_image_contract(generation):
    if generation != "portable" and not FOUR_X:
        pytest.skip(f"the fake of HunyuanImage-3 generation {generation} imports transformers.modeling_attn_mask_utils,"
                    f" as upstream's does: transformers 4.x only")
    assert _rows_failed(tiny_hunyuan_image3(0, generation)) == []


def test_an_input_check_asserted_inline_instead_of_through_the_class_fails_row_12(monkeypatch):
    """Row 12 holds the fakes to upstream's patchable ``_check_inputs``: a model that asserts a missing input inline
    (as the fakes once did) ignores a framework's patch of the class method, and the row says so."""
    model = tiny_hunyuan_image3(0, "portable")
    cls = type(model)
    original = cls.forward

    @functools.wraps(original)  # the family reads the forward's signature to tell the generation
    def inline(self, *args, **kwargs):
        if kwargs.get("mode") == "gen_image":
            assert kwargs.get("images") is not None, "images missing (an inline assert)"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", inline)
    (row,) = gen_image_contract.run_gen_image_contract(model, (12,))
    assert not row.passed and "AssertionError" in row.measured and "expected the patched check" in row.measured
    monkeypatch.undo()
    (row,) = gen_image_contract.run_gen_image_contract(model, (12,))
    assert row.passed, row.measured


def test_the_family_knows_its_layout():
    traits = family_traits("hunyuan_image3")
    assert traits.fused and traits.branch_independent == ("cond_vae_images",)
    assert traits.rope_fields == ("rope_image_info",) and set(traits.list_fields) == {"cond_vae_images",
                                                                                      "rope_image_info"}


def test_a_model_without_an_image_forward_is_refused_naming_what_is_missing():
    from fixtures.ar_models import fake_upstream

    with pytest.raises(ImageForwardError, match=r"no vae\['latent_channels'\]"):
        require_image_forward(fake_upstream("dense"))  # the text path only: no vae in its config

    class TextOnly(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, rope_image_info=None, mode="gen_text"):
            return input_ids

    with pytest.raises(ImageForwardError, match=r"generation 2\) takes no position_ids, first_step, images, "
                                                 r"image_mask"):
        require_image_forward(TextOnly())

    class Plain(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    with pytest.raises(ImageForwardError, match="takes neither custom_pos_emb .* nor rope_image_info"):
        require_image_forward(Plain())


def test_a_cfg_distilled_model_is_refused():
    model = tiny_hunyuan_image3()
    model.config.cfg_distilled = True
    try:
        with pytest.raises(ImageForwardError, match="sets cfg_distilled"):
            require_image_forward(model)
    finally:
        del model.config.cfg_distilled


def test_latents_off_the_image_span_are_refused_before_the_model_runs():
    family = get_family("hunyuan_image3")
    adapter = family.adapter(tiny_hunyuan_image3())
    conditions = adapter.conditions_from_prompts(adapter.example_prompts(2, 1, torch.Generator().manual_seed(0)), 1)
    with pytest.raises(ValueError, match=r"make 12 image tokens per row .* image spans hold \[16\] tokens"):
        adapter.forward(torch.zeros(2, 4, 3, 4), torch.full((2,), 500.0), conditions)


def test_a_prediction_read_at_row_0s_image_positions_fails_the_contract_and_its_rows(monkeypatch):
    """A bug batched and serial replay share (and the pipeline oracle, which runs the same forward): the prediction
    read at row 0's image positions for every row. Only the contract rows see it, so check-upstream's replay and
    oracle rows read FAIL on it, naming the contract row, whatever their checks said."""
    from fixtures.check_upstream import table_line

    model = tiny_hunyuan_image3()
    read = model.ragged_final_layer

    def at_row_0(hidden, image_mask, *args, **kwargs):
        rows_alike = image_mask[:1].expand_as(image_mask) if image_mask is not None else None
        return read(hidden, rows_alike, *args, **kwargs)

    monkeypatch.setattr(model, "ragged_final_layer", at_row_0)
    failed = [row for row in gen_image_contract.run_gen_image_contract(model, (7,)) if not row.passed]
    assert [row.number for row in failed] == [7], failed  # rows independent: a row alone reads its own positions
    passing = {"passed": True, "headline": "oracle.pipeline", "margin": 0.0, "kills": [("k", True, 1e5, "tolerance")]}
    for label in ("gen2_dense:replay", "gen2_dense:oracle"):
        line, note, green = table_line(label, "fp32", passing, (10, 11),
                                       [f"contract row {row.number} ({row.point}) failed" for row in failed])
        assert not green and " FAIL " in line and "contract row 7 (rows independent) failed" in note


# ------------------------------------------------------------------------------ the real code (lowest lane)


def _sources() -> list[Path]:
    value = os.environ.get(SRC_ENV, "")
    return [Path(part) for part in value.split(os.pathsep) if part]


def _real_cases() -> list:
    """(code directory, generation) per directory ``PARITY_HUNYUAN_SRC`` names; one that holds no generation's code
    is a case that fails naming the variable and what the directory lacks."""
    from fixtures.check_upstream import choose_generations
    from fixtures.upstream_checkpoint import UpstreamPackageError, package_generations

    cases = []
    for source in _sources():
        package = source / "hunyuan_image_3" if (source / "hunyuan_image_3").is_dir() else source
        try:
            generations, _ = choose_generations(package, package_generations(package), None)
        except UpstreamPackageError as err:
            cases.append(pytest.param(package, f"{SRC_ENV}: {err}", id=f"unusable-{package.name}"))
            continue
        cases += [pytest.param(package, g, id=f"gen{g}-{package.parent.name or package.name}") for g in generations]
    return cases or [pytest.param(None, None, id="unset")]


@pytest.fixture(scope="module")
def real_models(tmp_path_factory):
    """Tiny dense checkpoints built from the real code with upstream's own classes, loaded (its code runs)."""
    from fixtures import upstream_cpu
    from fixtures.upstream_checkpoint import write_checkpoint
    from harness.inputs.checkpoints import detect, load_model

    upstream_cpu.install()
    loaded = {}

    def load(package: Path, generation: int):
        key = (str(package), generation)
        if key not in loaded:
            target = tmp_path_factory.mktemp(f"gen{generation}")
            write_checkpoint(package, target, generation, "dense")
            loaded[key] = load_model(detect(target), torch.float32, "cpu", trust_remote_code=True)
        return loaded[key]

    return load


@pytest.mark.parametrize(("package", "generation"), _real_cases())
def test_the_real_code_meets_the_contract_and_replays(package, generation, real_models, tmp_path):
    """The rows the fakes meet hold on upstream's own code; the family's replay and pipeline oracle pass on it, the
    oracle ablations failing it; its own mask builder's masks, captured at its SDPA calls, are the contract's formula
    and the attention checks judge the kernels on them."""
    if isinstance(generation, str):
        pytest.fail(generation)
    if package is None:
        pytest.skip(f"{SRC_ENV} names no HunyuanImage-3 code directory (set it to a checkout's hunyuan_image_3/, "
                    f"several separated by {os.pathsep!r}, to hold the fakes to the real code)")
    if not FOUR_X:
        pytest.skip(f"HunyuanImage-3 generation {generation} imports transformers.modeling_attn_mask_utils, which "
                    f"transformers {compat.TRANSFORMERS_MAJOR}.x removed: run it on the lowest lane")
    model = real_models(package, generation)
    assert _rows_failed(model) == []
    family = get_family("hunyuan_image3")
    adapter = family.adapter(model)
    assert adapter.generation == generation
    conditions = family.example_conditions(adapter, 3, 2, torch.Generator().manual_seed(22))
    problem = make_problem("real.cfg2", adapter, conditions, seed=2, latent_shape=adapter.latent_shape)
    control = measure_batch_shape_control(problem)
    for what in ("log_probs", "prev_sample_means"):
        verdict = compare_replay(problem, local_scale_policy(control, what, torch.float32), what)
        assert verdict.passed, verdict.describe()
    prompts = adapter.example_prompts(3, 2, torch.Generator().manual_seed(17))
    latents = torch.randn((3, *adapter.latent_shape), generator=torch.Generator().manual_seed(18))

    def oracle():
        record = pipeline_oracle.run_pipeline(family, adapter, prompts, latents, 4.5)
        return pipeline_oracle.judge_family(family, adapter, record)

    verdict = oracle()
    assert verdict.passed, verdict.describe()  # what failed, at which step, the numbers against their bound
    catalogue.load()
    for name in ORACLE_ABLATIONS:
        with ablation.get(name).apply():
            killed = oracle()
        assert not killed.passed, f"{name} survived the pipeline oracle on the real code:\n{killed.describe()}"
    for bug in LOOP_BUGS:  # bugs in upstream's own loop: replay shares none of them, the oracle fails each
        with pytest.MonkeyPatch.context() as patch:
            plant_loop_bug(bug, model, patch)
            caught = oracle()
        assert not caught.passed and caught.margin > 1e3, f"{bug} in the real loop passed the oracle"
    low = family.adapter(copy.deepcopy(model).to(torch.bfloat16))  # bf16: under the autocast its loop needs
    record = pipeline_oracle.run_pipeline(family, low, prompts, latents, 4.5)
    verdict = pipeline_oracle.judge_family(family, low, record)
    assert verdict.passed and verdict.metrics["step 1_arithmetic"] == "bfloat16", verdict.describe()
    recorded = capture_model(model)
    assert [check_formula(item) for item in recorded] == [None] * len(recorded)
    assert {item.phase for item in recorded} == {"prefill", "denoise"}
    out = tmp_path / "captures"
    out.mkdir()
    for item in recorded:
        capture_io.save_capture(item.capture, out / item.capture.name)
    ctx = CheckContext(capture_dir=str(out))
    for phase in ("prefill", "denoise"):
        for check in (f"attention.capture.{phase}.contract", f"attention.{phase}.decomposed.vs_sdpa"):
            verdict = checks.run_check(check, ctx)
            assert verdict.passed, verdict.describe()

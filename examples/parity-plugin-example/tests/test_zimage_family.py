"""The Z-Image family as the suite sees it: list-valued I/O, ragged captions, a cond-anchored combine, a negation.

ZImageTransformer2DModel takes one latent per sample and one caption per sample (lists; captions of different
lengths, no mask) and returns a list. The family declares what its pipeline does (``zimage.py``) and passes the
pipeline oracle as written, with no patch of the suite. Each planted bug below is a mistake a family author makes
on this shape, and each fails naming what was measured: the timestep's units, the CFG order, the sign, the
declared combine, the rows of a field that differ from the pipeline's; a per-row length kept in
``Conditions.shared`` fails parity on the stock floor's ceiling. An adapter that writes its combine as code of
its own still meets the suite's ablations of what a combine receives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity_plugin_example import zimage

from harness.inputs import checkpoints
from harness.judging import ablation, catalogue, checks
from harness.judging.compare import Verdict
from harness.plugins import entry_points as plugins
from harness.replay import denoiser, pipeline_oracle
from harness.replay.controls import measure_batch_shape_control
from harness.replay.judge import compare_replay
from harness.replay.policies import local_scale_policy
from harness.replay.problem import make_problem
from harness.replay.toolkit import STANDARD, CheckpointKind, ReplayFamily, fused_cond_first_conditions

BATCH, GUIDANCE = 2, 4.5
DECLARED = "cond_anchored: cond + g * (cond - uncond)"


@pytest.fixture(scope="module")
def model():
    return zimage.tiny_zimage()


def _variant(adapter_class: type, name: str) -> ReplayFamily:
    kind = CheckpointKind(name, "replay", zimage.FAMILY.class_names, "diffusers", family=name)
    return ReplayFamily(name, adapter_class, kind, zimage.PIPELINE, tiny_model=zimage.tiny_zimage)


def _judged(family: ReplayFamily, model) -> tuple[pipeline_oracle.PipelineRecord, Verdict]:
    """The family's pipeline run on ``model`` for two steps from its own prompts, and the oracle's verdict."""
    adapter = family.adapter(model)
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(17))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(18))
    record = pipeline_oracle.run_pipeline(family, adapter, prompts, latents, GUIDANCE)
    return record, pipeline_oracle.judge_family(family, adapter, record)


def test_the_entry_point_registers_the_family_and_its_checkpoint_kind():
    assert plugins.REPLAY_FAMILIES.get("zimage_example") is zimage.FAMILY
    assert checkpoints.kind_for_family("replay", "zimage_example") is zimage.CHECKPOINT_KIND


def test_the_adapter_gives_its_pipeline_s_model_inputs_and_velocity(model):
    record, verdict = _judged(zimage.FAMILY, model)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["declared_combine"] == DECLARED
    # what the oracle lined up: the pipeline's lists, one forward of both branches per step
    step = record.steps[0]
    (forward,) = step.forwards
    latents, captions, out = forward.arguments["x"], forward.arguments["cap_feats"], forward.output
    assert all(isinstance(value, list) and len(value) == 2 * BATCH for value in (latents, captions, out))
    assert len({tuple(caption.shape) for caption in captions}) == 2 * BATCH  # ragged: every length differs
    order = pipeline_oracle.adapter_order(denoiser.declared_layout(zimage.FAMILY.adapter(model)), BATCH)
    aligned = pipeline_oracle.align(step, record.prompts, "cap_feats", order)
    assert isinstance(aligned.rows["cap_feats"], list) and isinstance(aligned.output, list)
    assert isinstance(aligned.rows["t"], torch.Tensor) and aligned.rows["t"].shape == (2 * BATCH,)


class TimestepInSD3Units(zimage.ZImageAdapter):
    """The timestep hook left at the default, sigma * 1000 (SD3's units), where the pipeline passes 1 - sigma."""

    timestep = zimage.ModelAdapter.timestep


class HalvesSwapped(zimage.ZImageAdapter):
    """Declares cond-first and builds its rows uncond-first: the negative captions where the prompt's belong."""

    def conditions_from_prompts(self, prompts, cfg):
        if cfg == 1:
            return super().conditions_from_prompts(prompts, cfg)
        swapped = {"prompt_embeds": prompts["negative_prompt_embeds"],
                   "negative_prompt_embeds": prompts["prompt_embeds"]}
        return super().conditions_from_prompts(swapped, cfg)


class SignDropped(zimage.ZImageAdapter):
    """The pipeline's negation of the prediction left out."""

    velocity_transform = "identity"

    def velocity(self, prediction, x, sigma):
        return prediction


class SD3Combine(zimage.ZImageAdapter):
    """The standard combine, uncond + g (cond - uncond), declared for a pipeline anchored on the cond branch."""

    cfg_combine = STANDARD


class CaptionsTruncated(zimage.ZImageAdapter):
    """Every caption cut to 3 tokens (a max_sequence_length too short): the longer captions lose their tail."""

    def conditions_from_prompts(self, prompts, cfg):
        cut = {key: [caption[:3] for caption in value] for key, value in prompts.items()}
        return super().conditions_from_prompts(cut, cfg)


@pytest.mark.parametrize(("bug", "named"), [
    (TimestepInSD3Units, "step 0 timestep: mismatched elements"),
    (HalvesSwapped, "step 0: CFG order: the rows the adapter declares cond carry the pipeline's prompt, the uncond "
                    "rows its negative prompt; cond[0] carries uncond[0], cond[1] carries uncond[1]"),
    (SignDropped, "expected: step 0 combine: not a sign flip of the pipeline's; observed: sign_flip=step 0 combine is "
                  "the exact negation"),
    (SD3Combine, "step 0 combine: the family's declared CFG combine (standard: uncond + g * (cond - uncond)) gives "
                 "the prediction the pipeline handed its scheduler"),
    (CaptionsTruncated, "step 0: every other transformer input equals the pipeline's, row by row; cap_feats: rows "),
], ids=lambda value: value.__name__ if isinstance(value, type) else "")
def test_each_planted_bug_fails_the_oracle_naming_what_it_measured(bug, named, model):
    _, verdict = _judged(_variant(bug, f"zimage_{bug.__name__.lower()}"), model)
    assert not verdict.passed
    assert named in verdict.message, verdict.message[:2000]
    # no bug is blamed on another cause: only a branch swap is a CFG order, none is a batch composition
    assert ("CFG order" in verdict.message) is (bug is HalvesSwapped), verdict.message[:2000]
    assert "batch composition" not in verdict.message, verdict.message[:2000]


def test_a_truncated_caption_is_named_by_its_rows_and_shapes(model):
    _, verdict = _judged(_variant(CaptionsTruncated, "zimage_captions_truncated"), model)
    cut = verdict.metrics["input_cap_feats"]
    prompts = zimage.FAMILY.adapter(model).example_prompts(BATCH, 2, torch.Generator().manual_seed(17))
    long = [f"{branch}[{b}] (shape (3, 16) vs the pipeline's ({len(caption)}, 16))"
            for branch, key in (("cond", "prompt_embeds"), ("uncond", "negative_prompt_embeds"))
            for b, caption in enumerate(prompts[key]) if len(caption) > 3]
    assert long and cut == "rows " + ", ".join(long), cut
    assert verdict.metrics["cfg_order_crossed"] == ""


def test_a_wrong_combine_is_named_with_the_declared_formula_and_its_samples(model):
    _, verdict = _judged(_variant(SD3Combine, "zimage_sd3_combine"), model)
    assert verdict.metrics["declared_combine"] == "standard: uncond + g * (cond - uncond)"
    assert verdict.metrics["samples_differing"] == ", ".join(f"sample {b}" for b in range(BATCH))


class LengthsShared(zimage.ZImageAdapter):
    """Keeps the captions padded to one tensor (a row field) and their lengths under ``Conditions.shared``, as one
    serial forward's ``[cond_B; uncond_B]`` list, repeated to the forward's rows: right at cfg x B rows, wrong once
    S steps are stacked."""

    def conditions_from_prompts(self, prompts, cfg):
        padded = {key: torch.stack([torch.nn.functional.pad(c, (0, 0, 0, zimage.TEXT_TOKENS - len(c))) for c in value])
                  for key, value in prompts.items()}
        lengths = [len(c) for key in ("prompt_embeds", "negative_prompt_embeds")[:cfg] for c in prompts[key]]
        return fused_cond_first_conditions(padded, cfg, {"cap_padded": "prompt_embeds"},
                                           shared={"cap_lengths": tuple(lengths)})

    def forward(self, hidden, timestep, conditions):
        lengths = list(conditions.shared["cap_lengths"]) * (hidden.shape[0] // len(conditions.shared["cap_lengths"]))
        captions = [row[:n] for row, n in zip(conditions.rows["cap_padded"], lengths, strict=True)]
        rows = {"cap_feats": captions}
        return super().forward(hidden, timestep, dataclasses.replace(conditions, rows=rows))


def test_a_per_row_length_kept_in_shared_fails_parity_on_the_stock_floor_s_ceiling(model):
    adapter = LengthsShared(model)
    conditions = adapter.example_conditions(3, 2, torch.Generator().manual_seed(22))
    with torch.no_grad():
        problem = make_problem("zimage.lengths_shared", adapter, conditions, seed=2, latent_shape=adapter.latent_shape)
        policy = local_scale_policy(measure_batch_shape_control(problem), "log_probs", torch.float32)
        verdict = compare_replay(problem, policy, "log_probs")
    assert not verdict.passed
    assert verdict.violated_facts[0].startswith("the stock path itself depends on the batch composition"), \
        verdict.describe()


class InlineCombine(zimage.ZImageAdapter):
    """The pipeline's combine written as the adapter's own code instead of declared."""

    cfg_combine = STANDARD  # what the base class would declare: the code below is what runs

    def combine(self, cond, uncond, guidance_scale):
        return cond + guidance_scale * (cond - uncond)


def test_an_adapter_that_writes_its_combine_as_code_still_meets_the_ablations_of_what_a_combine_receives(model):
    """The dropped scale and the swapped halves act on what the family's combine receives, so an adapter with its
    own combine code is caught by them like a declared one; reports name the code as the adapter's own."""
    catalogue.load()
    from parity.replay_checks import pipeline_combine

    family = _variant(InlineCombine, "zimage_inline_combine")
    plugins.REPLAY_FAMILIES.register(family.name, family, origin="tests: an adapter with its own combine code")
    try:
        passed = pipeline_combine(family.name)
        assert passed.passed, passed.describe()
        assert "InlineCombine.combine (the adapter's own code" in passed.policy
        for name in ("replay.guidance_scale_dropped", "replay.cfg_halves_swapped"):
            with ablation.get(name).apply():
                killed = pipeline_combine(family.name)
            assert not killed.passed and killed.margin > 1, (name, killed.describe())
    finally:
        plugins.REPLAY_FAMILIES.unregister(family.name)


def test_the_suite_generates_its_replay_catalogue_for_the_family():
    catalogue.load()
    ids = {c.id for c in checks.all_checks("cpu") if "zimage_example" in c.id}
    assert {"replay.zimage_example.cfg2.log_probs", "replay.zimage_example.cfg2.pipeline_combine",
            "replay.zimage_example.cfg2.growth.prev_sample_means", "replay.oracle.pipeline.zimage_example"} <= ids, ids

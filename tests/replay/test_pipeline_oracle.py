"""The pipeline oracle's own tests: two adapter bugs that pass batched-vs-serial parity and the combine check
alike (a CogView4 timestep in sigma units, a Sana adapter that declares cond-first while building its rows
uncond-first, as SanaPipeline concatenates them) are caught by the oracle; and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fixtures.replay_models import tiny_model
from harness.compare import exact
from harness.plugins import CheckpointKind
from harness.replay import denoiser, pipeline_oracle
from harness.replay.conditions import Conditions, broadcast_rows
from harness.replay.controls import measure_batch_shape_control
from harness.replay.denoiser import FUSED_COND_FIRST, concat_branches, predict_velocity
from harness.replay.families import COGVIEW4, SANA, ReplayFamily
from harness.replay.families.cogview4 import CogView4Adapter
from harness.replay.families.sana import SanaAdapter
from harness.replay.judge import compare_replay
from harness.replay.policies import local_scale_policy
from harness.replay.problem import make_problem

pytestmark = pytest.mark.cpu

BATCH, GUIDANCE = 2, 4.5


class SigmaUnitsCogView4(CogView4Adapter):
    """Passes sigma where CogView4Pipeline passes its timestep in [0, 1000]."""

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma


class PipelineOrderSana(SanaAdapter):
    """Declares fused cond-first but fuses its rows ``[negative; prompt]``, the way SanaPipeline batches them."""

    cfg_layout = FUSED_COND_FIRST

    def conditions_from_prompts(self, prompts, cfg):
        if cfg == 1:
            return super().conditions_from_prompts(prompts, cfg)
        rows = {"encoder_hidden_states": torch.cat([prompts["negative_prompt_embeds"], prompts["prompt_embeds"]]),
                "encoder_attention_mask": torch.cat([prompts["negative_prompt_attention_mask"],
                                                     prompts["prompt_attention_mask"]])}
        return Conditions(batch=prompts["prompt_embeds"].shape[0], rows=rows, cfg_factor=2)


def _variant(base: ReplayFamily, name: str, adapter_class) -> ReplayFamily:
    kind = CheckpointKind(name, "replay", base.class_names, "diffusers", family=name)
    return ReplayFamily(name, adapter_class, kind, base.pipeline)


def _oracle(family: ReplayFamily, base: str):
    adapter = family.adapter(tiny_model(base))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    record = pipeline_oracle.run_pipeline(family, adapter, prompts, latents, GUIDANCE)
    return adapter, pipeline_oracle.judge_family(family, adapter, record)


def _parity_and_combine_pass(family: ReplayFamily, adapter) -> None:
    """What the catalogue already ran on the bug: batched vs serial at cfg 2, and the combine check (which
    splits the branches by the adapter's own declaration). Both pass."""
    conditions = family.example_conditions(adapter, BATCH, 2, torch.Generator().manual_seed(6))
    problem = make_problem(f"{family.name}.cfg2", adapter, conditions, seed=2, latent_shape=adapter.latent_shape)
    policy = local_scale_policy(measure_batch_shape_control(problem), "log_probs", torch.float32)
    verdict = compare_replay(problem, policy)
    assert verdict.passed, verdict.describe()
    x = problem.segment.latent_at(0).float()
    fused = concat_branches(conditions.negative, conditions) if conditions.negative is not None else conditions
    out = adapter.forward(torch.cat([x, x]), adapter.timestep(torch.full((2 * BATCH,), 0.6)), broadcast_rows(fused))
    cond, uncond = denoiser.split_branches(denoiser.declared_layout(adapter), out, BATCH)
    combined = exact().judge(predict_velocity(adapter, x, 0.6, conditions, GUIDANCE),
                             uncond + GUIDANCE * (cond - uncond))
    assert combined.passed, combined.describe()


def test_a_cogview4_timestep_in_sigma_units_passes_parity_and_fails_the_oracle():
    family = _variant(COGVIEW4, "cogview4_sigma_units", SigmaUnitsCogView4)
    adapter, verdict = _oracle(family, "cogview4")
    assert not verdict.passed
    assert verdict.margin > 1e3 and "step 0 timestep" in verdict.message, verdict.describe()
    _parity_and_combine_pass(family, adapter)


def test_a_sana_adapter_declaring_the_wrong_cfg_order_passes_parity_and_fails_the_oracle():
    family = _variant(SANA, "sana_pipeline_order", PipelineOrderSana)
    adapter, verdict = _oracle(family, "sana")
    assert not verdict.passed
    assert any("CFG order: the rows the adapter declares cond carry the pipeline's prompt" in fact
               for fact in verdict.violated_facts), verdict.describe()
    assert verdict.metrics["cfg_order_backwards"] is True and verdict.margin > 10, verdict.describe()
    _parity_and_combine_pass(family, adapter)


def test_the_shipped_adapters_pass_their_oracle():
    for family, base in ((COGVIEW4, "cogview4"), (SANA, "sana")):
        _, verdict = _oracle(family, base)
        assert verdict.passed, verdict.describe()


def test_a_family_without_a_pipeline_is_an_oracle_error():
    family = dataclasses.replace(SANA, pipeline=None)
    with pytest.raises(pipeline_oracle.OracleError, match="registers no pipeline"):
        pipeline_oracle.build_pipeline(family, SANA.adapter(tiny_model("sana")))


def test_prompts_that_do_not_differ_from_the_negative_ones_are_refused():
    adapter = SANA.adapter(tiny_model("sana"))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    prompts["negative_prompt_embeds"] = prompts["prompt_embeds"].clone()
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    record = pipeline_oracle.run_pipeline(SANA, adapter, prompts, latents, GUIDANCE)
    with pytest.raises(pipeline_oracle.OracleError, match="matches 2 rows of prompt_embeds / negative_prompt_embeds"):
        pipeline_oracle.judge_family(SANA, adapter, record)

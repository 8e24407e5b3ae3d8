"""Pipeline-oracle checks: every registered replay family's adapter held to its own diffusers pipeline.

``replay.oracle.pipeline.<family>`` runs the family's registered pipeline (``ReplayFamily.pipeline``) on
its tiny model for two steps from the adapter's example prompts (no text encoder, ``output_type="latent"``)
and asserts that the adapter's denoiser, at the same latents and sigma, hands the transformer the same
inputs (timestep in the pipeline's units, CFG branch order, masks, guidance, latents) and returns the
same output (harness.replay.pipeline_oracle). Parity cannot see these bugs: they hit stock and fast alike.
The pipeline's run touches no seam an ablation patches, so it is recorded once per family.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fixtures.replay_cases import BATCH, GUIDANCE
from fixtures.replay_families import family_names
from fixtures.replay_models import tiny_model
from harness.judging import floors
from harness.judging.checks import register
from harness.judging.compare import Verdict
from harness.plugins import conformance
from harness.replay import discriminating, pipeline_oracle
from harness.replay.families import get_family
from harness.replay.families.base import ModelAdapter

__all__ = ["FAMILIES", "oracle_record"]

FAMILIES = family_names()


@functools.cache
def oracle_record(family: str) -> tuple[ModelAdapter, pipeline_oracle.PipelineRecord]:
    """The family's adapter and its pipeline's record at cfg 2, from seeded discriminating prompts."""
    registered = get_family(family)
    adapter = registered.adapter(tiny_model(family))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(17))
    discriminating.require_discriminating(adapter.conditions_from_prompts(prompts, 2), f"replay family {family!r}")
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(18))
    return adapter, pipeline_oracle.run_pipeline(registered, adapter, prompts, latents, float(GUIDANCE))


POLICY = (f"model inputs: close(atol={pipeline_oracle.TIMESTEP_ULPS:g} fp32 ulps of their scale); output: relative "
          f"error <= {pipeline_oracle.K_OUTPUT:g} x the stock floor, at least 4 fp32 ulps of the local magnitude")


def pipeline_oracle_check(family: str) -> Verdict:
    """The family's adapter against its pipeline; the verdict states the short policy and keeps each part's own
    (every step's inputs, branch outputs, combine and velocity: thousands of characters) among its notes."""
    adapter, record = oracle_record(family)
    verdict = pipeline_oracle.judge_family(get_family(family), adapter, record)
    return dataclasses.replace(verdict, policy=POLICY, notes=(*verdict.notes, f"each part's policy: {verdict.policy}"))


for _family in FAMILIES:
    register(f"replay.oracle.pipeline.{_family}", policy=POLICY,
             doc=f"the {_family} adapter's denoiser gives its diffusers pipeline's model inputs and output")(
        functools.partial(pipeline_oracle_check, _family))
conformance.not_judged("replay.oracle.pipeline.*", "holds the family's adapter to its diffusers pipeline (model inputs "
                                                   "and output); no batched replay runs")
floors.declare("replay.oracle.pipeline.*", "4 fp32 ulps of the local magnitude",
               "8 sqrt(K) fp32 ulps, K = the transformer's Linear/Conv fan-ins plus the tokens it attends over (the "
               "control regroups the pipeline's own rows, nothing else)")

"""The Lumina2 family as the suite sees it: a pipeline that negates its model output, held to that pipeline.

Lumina2Pipeline steps its scheduler on ``-noise_pred`` and passes the timestep as ``1 - t / 1000``. The family
declares both (``Lumina2Adapter.velocity`` / ``timestep``); these tests show the pipeline oracle holds it to the
real pipeline, and that the same adapter without its negation fails naming a sign flip, not a vague mismatch.
"""

import pytest
import torch
from parity_plugin_example import lumina2

from harness.inputs import checkpoints
from harness.judging import catalogue, checks
from harness.plugins import entry_points as plugins
from harness.replay import pipeline_oracle

BATCH, GUIDANCE = 2, 4.5


def _record(adapter):
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(17))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(18))
    return pipeline_oracle.run_pipeline(lumina2.FAMILY, adapter, prompts, latents, GUIDANCE)


@pytest.fixture(scope="module")
def model():
    return lumina2.tiny_lumina2()


def test_the_entry_point_registers_the_family_and_its_checkpoint_kind():
    assert plugins.REPLAY_FAMILIES.get("lumina2_example") is lumina2.FAMILY
    assert checkpoints.kind_for_family("replay", "lumina2_example") is lumina2.CHECKPOINT_KIND


def test_the_adapter_gives_its_pipeline_s_model_inputs_and_velocity(model):
    adapter = lumina2.FAMILY.adapter(model)
    verdict = pipeline_oracle.judge_family(lumina2.FAMILY, adapter, _record(adapter))
    assert verdict.passed, verdict.describe()


class _SignDropped(lumina2.Lumina2Adapter):
    """The family as first written: the pipeline's negation of the prediction left out."""

    velocity_transform = "identity"

    def velocity(self, prediction, x, sigma):
        return prediction


def test_the_negation_left_out_fails_naming_a_sign_flip(model):
    adapter = _SignDropped(model)
    verdict = pipeline_oracle.judge_family(lumina2.FAMILY, adapter, _record(adapter))
    assert not verdict.passed
    # the failure leads with the named cause, before any number
    assert verdict.message.startswith("expected: step 0 combine: not a sign flip of the pipeline's; observed: "
                                      "sign_flip=step 0 combine is the exact negation"), verdict.message[:300]
    assert "relative error 2" in verdict.message and verdict.metrics["max_abs"] == 2.0


def test_the_suite_generates_its_replay_catalogue_for_the_family():
    catalogue.load()
    ids = {c.id for c in checks.all_checks("cpu") if "lumina2_example" in c.id}
    assert {"replay.lumina2_example.cfg2.log_probs", "replay.lumina2_example.cfg2.pipeline_combine",
            "replay.oracle.pipeline.lumina2_example"} <= ids, ids

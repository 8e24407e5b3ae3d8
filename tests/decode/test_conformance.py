"""The decode path's public doors: the plugin registration and a user's sharded_decode under --impl."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fixtures import decode_models, decode_tasks
from harness.decode import families, judge, sharded
from harness.plugins import conformance
from harness.plugins import entry_points as plugins

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def stock_everywhere(vae: Any, z: torch.Tensor, group: Any) -> torch.Tensor:
    """A user's 'sharded' decode that silently decodes everything on every rank (what the spies must catch)."""
    return sharded.stock_decode(vae, z)


def test_register_adds_the_vae_and_its_checkpoint_kind():
    # fresh registries: the process-wide ones are filled by the entry points and harness.inputs.checkpoints
    fresh = SimpleNamespace(VAES=plugins.Registry("VAE", ""), CHECKPOINT_KINDS=plugins.Registry("kind", ""),
                            CheckpointKind=plugins.CheckpointKind)
    families.register(fresh)
    assert fresh.VAES._entries == {"minimax_h3": families.MINIMAX_H3}
    kind = fresh.CHECKPOINT_KINDS._entries["video_vae"]
    assert (kind.feeds, kind.class_names, kind.family) == ("decode", ("AutoencoderKLMiniMaxH3",), "minimax_h3")
    assert families.MINIMAX_H3.drives(decode_models.tiny_vae())
    families.register(fresh)  # idempotent: the same entries again are not "registered twice"


@pytest.mark.parametrize(("spec", "passes"), [("harness.decode.sharded:sharded_decode", True),
                                               (f"{__name__}:stock_everywhere", False)], ids=["right", "fallback"])
def test_the_implementation_under_test_runs_inside_every_rank(spec, passes, parity_ctx):
    running = conformance.active("decode")
    if running is not None:  # this test puts its own implementations under test; never touch the run's
        pytest.skip(f"--impl decode={running}: this test drives the conformance slot itself")
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))
    world = parity_ctx.world(2)  # started before the spec is set: a rank forked under it would keep it
    with conformance.applied({"decode": spec}):  # put back as it was afterwards: the run's specs are not ours
        results = world.run(decode_tasks.decode_task, job)
    assert [r.impl_calls for r in results] == [1, 1]
    verdict = judge.judge_decode(results, sharded=True)
    assert verdict.passed is passes, verdict.describe()
    if not passes:
        assert set(verdict.violated_facts) == {"each piece decoded exactly once across the world",
                                               "every rank communicated (a collective ran on every rank)"}

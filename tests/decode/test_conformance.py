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


def test_the_transfer_spy_names_a_returned_cpu_copy_and_nothing_the_call_only_passed_through_the_cpu():
    """What ``decode_task`` records as the call's move of its output to the CPU: the output is (a view of) what a
    ``.cpu()`` or a ``.to("cpu")`` returned meanwhile, a copy as from an accelerator; pieces that travelled through
    the CPU and were assembled into a new video, a video a copy was only made of, a dtype cast and a move to a
    device given as an object are not such a move."""
    video = torch.arange(12.0).reshape(3, 4)
    with decode_tasks._moves_to_cpu() as moved:
        copied = video.cpu()
        viewed = video.to("cpu")[:, :2]
        cast = video.to(torch.float64)
        home = video.to(video.device)
        assembled = torch.cat([piece.cpu() for piece in video.split(2)])
    assert "cpu" not in torch.Tensor.__dict__ and "to" not in torch.Tensor.__dict__  # inherited again
    assert [decode_tasks._moved_by(t, moved) for t in (copied, viewed, cast, home, assembled, video)] == [
        "Tensor.cpu()", "Tensor.to('cpu')", "", "", "", ""]  # the video itself was only sent through a copy
    assert decode_tasks._moved_by(None, moved) == decode_tasks._moved_by(torch.empty(0), moved) == ""

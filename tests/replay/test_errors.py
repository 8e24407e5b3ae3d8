"""Bad input to replay gets a clear, specific error naming what was wrong and what was expected."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fakes.replay_conditions import HI3_FIELDS, fused_conditions
from fakes.replay_kernel import FakeDenoiser
from fixtures.replay_cases import BATCH, fake_problem
from harness.replay import tiling
from harness.replay.conditions import Conditions, concat_payloads, payload_rows
from harness.replay.denoiser import UNCOND_FIRST, guidance_at, predict_velocity
from harness.replay.guards import ReplayConfig
from harness.replay.replay import replay_batched, replay_serial
from harness.replay.rollout import flow_sigmas
from harness.replay.sde import FlowGRPOSDE, MultistepSDE, as_rows
from harness.replay.segment import TrajectorySegment
from harness.replay.spy import spy_forwards

pytestmark = pytest.mark.cpu

REPLAYS = pytest.mark.parametrize("replay_fn", [replay_serial, replay_batched], ids=["serial", "batched"])


def _call(replay_fn, problem, **changes):
    p = problem.with_(**changes)
    return replay_fn(p.adapter, p.conditions, p.segment, p.strategy, p.target, p.guidance, p.config)


@REPLAYS
@pytest.mark.parametrize("config", [ReplayConfig(True), ReplayConfig()], ids=["flag_on", "flag_off"])
@pytest.mark.parametrize(("target", "exc", "match"), [
    ((2, 5), ValueError, r"target steps \[2, 5\] are not SDE steps of this segment \(sde_indices=\[0, 1, 3, 4, 6\]\)"),
    ((9,), ValueError, r"target steps \[9\] are not SDE steps"),
    ((3, 1, 3), ValueError, r"target steps \[3\] appear more than once"),
    ((), ValueError, "target is empty"),
    ((1.0, 3), TypeError, r"target steps must be ints, got \[1.0\]"),
    ("13", TypeError, "target must be a sequence of step indices, got str"),
])
def test_bad_targets_name_the_bad_steps(replay_fn, config, target, exc, match):
    with pytest.raises(exc, match=match):
        _call(replay_fn, fake_problem("cfg2"), target=target, config=config)


@REPLAYS
@pytest.mark.parametrize("config", [ReplayConfig(True), ReplayConfig()], ids=["flag_on", "flag_off"])
def test_guidance_schedule_without_a_target_step(replay_fn, config):
    """Refused before any forward runs, whether or not the batched path would have declined."""
    problem = fake_problem("cfg2")
    with spy_forwards(problem.adapter.module) as spy, \
            pytest.raises(ValueError, match="guidance schedule has 4 entries; no scale for step 4"):
        _call(replay_fn, problem, guidance=(1.0, 2.0, 3.0, 4.0), config=config)
    assert spy.calls == 0


def test_guidance_kind():
    with pytest.raises(TypeError, match="guidance must be a float or a per-step sequence"):
        guidance_at("4.5", 0)


@REPLAYS
def test_conditions_for_another_batch(replay_fn):
    other = fused_conditions(BATCH + 1, HI3_FIELDS, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"conditions are for batch 4 but the segment holds 3 samples"):
        _call(replay_fn, fake_problem("cfg2"), conditions=other)


@REPLAYS
def test_a_field_with_the_wrong_row_count(replay_fn):
    problem = fake_problem("cfg2")
    rows = dict(problem.conditions.rows, text_embeds=torch.zeros(5, 3, 8))
    bad = dataclasses.replace(problem.conditions, rows=rows)
    with pytest.raises(ValueError, match=r"field 'text_embeds' has 5 rows; expected 3 or 6 \(batch=3, cfg_factor=2\)"):
        _call(replay_fn, problem, conditions=bad)


def test_layout_mismatch_is_named():
    problem = fake_problem("cfg2")
    sd3_style = FakeDenoiser(UNCOND_FIRST, (4, 4, 4))
    x = torch.zeros(BATCH, 4, 4, 4)
    with pytest.raises(ValueError, match="uncond-first .* pass the uncond branch as Conditions.negative"):
        predict_velocity(sd3_style, x, 0.5, problem.conditions, 4.5)
    fused_style = FakeDenoiser()
    with pytest.raises(ValueError, match="fused cond-first .* not Conditions.negative"):
        predict_velocity(fused_style, x, 0.5, fake_problem("uncond_first").conditions, 4.5)


@pytest.mark.parametrize("repeats", [0, -1, -7])
def test_repeats_must_be_positive(repeats):
    with pytest.raises(ValueError, match=f"repeats must be >= 1 .*got {repeats}"):
        tiling.tile_conditions(fake_problem("cfg2").conditions, repeats)


@pytest.mark.parametrize("repeats", [1.0, True, "2"])
def test_repeats_must_be_an_int(repeats):
    with pytest.raises(TypeError, match="repeats must be an int"):
        tiling.tile_conditions(fake_problem("cfg2").conditions, repeats)


def test_tile_field_names_a_misaligned_field():
    with pytest.raises(ValueError, match=r"field 'cond_images' has 5 rows; expected 3 .* or 6"):
        tiling.tile_field("cond_images", [torch.zeros(1)] * 5, 2, 3, 2)


def test_conditions_construction_errors():
    with pytest.raises(ValueError, match="Conditions.batch must be a positive int, got 0"):
        Conditions(batch=0, rows={})
    with pytest.raises(ValueError, match="cfg_factor must be 1 .* or 2"):
        Conditions(batch=2, rows={}, cfg_factor=3)
    with pytest.raises(ValueError, match=r"fields \['x'\] are both row-aligned and shared"):
        Conditions(batch=2, rows={"x": torch.zeros(2)}, shared={"x": 1})
    neg = Conditions(batch=2, rows={"y": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"negative row fields \['y'\] differ from the cond branch's \['x'\]"):
        Conditions(batch=2, rows={"x": torch.zeros(2)}, negative=neg)
    with pytest.raises(ValueError, match="cannot be combined with cfg_factor=2"):
        Conditions(batch=2, rows={"y": torch.zeros(4)}, cfg_factor=2, negative=neg)


def test_payload_kinds():
    with pytest.raises(ValueError, match="a 0-d tensor has no rows"):
        payload_rows(torch.tensor(1.0), "field 'scale'")
    with pytest.raises(TypeError, match="a row payload must be a tensor or a list/tuple.*got dict"):
        payload_rows({}, "field 'bad'")
    with pytest.raises(TypeError, match="cannot concatenate payload kinds"):
        concat_payloads([[torch.zeros(1)], (torch.zeros(1),)])


def test_stale_fused_uncond_is_refused_by_the_fake_model():
    problem = fake_problem("cfg2")
    tiled = tiling.tile_conditions(problem.conditions, 2)
    stale = dataclasses.replace(tiled, fused_uncond=problem.conditions.fused_uncond)
    x = torch.zeros(2 * BATCH, 4, 4, 4)
    with pytest.raises(ValueError, match="stale fused_uncond: field .* caches 3 uncond rows but .* has 6"):
        predict_velocity(problem.adapter, x, 0.5, stale, 4.5)


def _segment(**changes):
    base = fake_problem("cfg1").segment
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return TrajectorySegment(**{**fields, **changes})


def test_segment_validation_names_the_problem():
    base = fake_problem("cfg1").segment
    with pytest.raises(ValueError, match=r"latents for steps \[8\] are not stored; each SDE step i needs x_i"):
        _segment(sde_indices=(0, 1, 3, 4, 7), log_probs=torch.zeros(BATCH, 5))
    with pytest.raises(ValueError, match=r"sde_indices \[8\] lie outside \[0, 7\]"):
        _segment(sde_indices=(0, 8), log_probs=torch.zeros(BATCH, 2))
    with pytest.raises(ValueError, match=r"log_probs must be \[B, S_all\] = \[3, 5\], got \[3, 4\]"):
        _segment(log_probs=base.log_probs[:, :4])
    with pytest.raises(ValueError, match="sigmas must decrease strictly"):
        _segment(sigmas=flow_sigmas(7).flip(0))
    with pytest.raises(TypeError, match="sigmas must be float32"):
        _segment(sigmas=base.sigmas.double())
    with pytest.raises(ValueError, match=r"no latent stored for step 8; stored: \[0, 1, 2"):
        base.latent_at(8)


def test_sde_input_errors():
    with pytest.raises(ValueError, match=r"sigma must be a scalar or a per-row vector of 3 entries, got shape \(2,\)"):
        as_rows(torch.zeros(2), 3)
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="sigma_next < sigma on every row"):
        FlowGRPOSDE().transition(x, x, 0.3, 0.5, 0.9)
    with pytest.raises(ValueError, match="MultistepSDE needs step_index"):
        MultistepSDE().transition(x, x, 0.5, 0.3, 0.9)

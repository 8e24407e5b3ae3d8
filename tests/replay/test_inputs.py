"""Replay inputs checked where they enter, on hand-made values (no replay runs here): conditions, payload
kinds, CFG layouts, segments and targets, guidance schedules, replay's own entry checks. One test per entry point,
so each asserts every edge of its own checks (exact messages, the smallest valid input)."""

from __future__ import annotations

import re

import pytest
import torch

from harness.replay.conditions import Conditions, concat_payloads
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST, DenoiserAdapter, guidance_at, predict_velocity
from harness.replay.replay import replay, replay_batched, replay_serial
from harness.replay.rollout import flow_sigmas
from harness.replay.sde import FlowGRPOSDE
from harness.replay.segment import TrajectorySegment, validate_targets

pytestmark = pytest.mark.cpu


def _refused(exc, message, make):
    with pytest.raises(exc, match=re.escape(message)):
        make()


class _Never(DenoiserAdapter):
    """Fails the test if the replay ever calls it."""

    def __init__(self, layout: str):
        self.cfg_layout, self.module = layout, torch.nn.Identity()

    def forward(self, hidden, timestep, conditions):
        raise AssertionError("the forward ran before the inputs were checked")


class _Rows(DenoiserAdapter):
    """Returns its input: enough to reach the layout check and the forward."""

    def __init__(self, layout: str):
        self.cfg_layout, self.module = layout, torch.nn.Identity()

    def forward(self, hidden, timestep, conditions):
        return self.module(hidden)


def test_conditions_and_cfg_layouts_take_one_sample_and_refuse_bad_ones():
    """Construction checks first, then the adapter's CFG layout against the conditions' before any forward."""
    one = Conditions(batch=1, rows={"e": torch.zeros(1, 2)}, negative=Conditions(batch=1, rows={"e": torch.ones(1, 2)}))
    assert (one.batch, one.guided, one.branches, one.forward_rows) == (1, True, 2, 2)
    assert one.validate() is one
    for batch in (0, -1, True, 1.0):
        _refused(ValueError, f"Conditions.batch must be a positive int, got {batch!r}",
                 lambda b=batch: Conditions(batch=b, rows={}))
    plain = "Conditions.negative must be a plain single-branch Conditions (cfg_factor=1, no negative of its own)"
    fused = Conditions(batch=2, rows={}, cfg_factor=2)
    _refused(ValueError, plain, lambda: Conditions(batch=2, rows={}, negative=fused))
    nested = Conditions(batch=2, rows={}, negative=Conditions(batch=2, rows={}))
    _refused(ValueError, plain, lambda: Conditions(batch=2, rows={}, negative=nested))
    two_rows = Conditions(batch=1, rows={"e": torch.zeros(2, 2)})
    short = Conditions(batch=1, rows={"e": torch.zeros(1, 2)}, negative=two_rows)
    _refused(ValueError, "field 'e' has 2 rows; expected 1 (batch=1, cfg_factor=1)", short.validate)
    _refused(ValueError, "Conditions.negative has batch 3, expected 2",
             lambda: Conditions(batch=2, rows={}, negative=Conditions(batch=3, rows={})))
    x, fused = torch.ones(1, 2), Conditions(batch=1, rows={}, cfg_factor=2)  # one sample from here on
    uncond_first = Conditions(batch=1, rows={}, negative=Conditions(batch=1, rows={}))
    _refused(ValueError, "adapter _Rows has cfg_layout 'cond_last'; expected one of "
                         "('fused_cond_first', 'uncond_first')",
             lambda: predict_velocity(_Rows("cond_last"), x, 0.5, fused, 1.0))
    _refused(ValueError, "adapter _Rows is uncond-first (SD3 style): pass the uncond branch as Conditions.negative",
             lambda: predict_velocity(_Rows(UNCOND_FIRST), x, 0.5, fused, 1.0))
    _refused(ValueError, "adapter _Rows is fused cond-first (HunyuanImage-3 style): pass [cond_B; uncond_B] rows",
             lambda: predict_velocity(_Rows(FUSED_COND_FIRST), x, 0.5, uncond_first, 1.0))
    assert predict_velocity(_Rows(UNCOND_FIRST), x, 0.5, uncond_first, 2.0).tolist() == [[1.0, 1.0]]


def test_payloads_of_one_kind_concatenate_and_other_kinds_do_not():
    assert concat_payloads([[1], [2, 3]]) == [1, 2, 3] and concat_payloads([(1,), (2,)]) == (1, 2)
    for parts, kinds in (([[1], (2,)], "['list', 'tuple']"), ([(1,), [2]], "['tuple', 'list']"),
                         ([{"a": 1}, {"b": 2}], "['dict', 'dict']")):
        _refused(TypeError, f"field 'f': cannot concatenate payload kinds {kinds}",
                 lambda p=parts: concat_payloads(p, "field 'f'"))
    _refused(TypeError, "field 'f': cannot concatenate a tensor payload with ['Tensor', 'list']",
             lambda: concat_payloads([torch.zeros(1), [1]], "field 'f'"))
    _refused(ValueError, "field 'f': nothing to concatenate", lambda: concat_payloads([], "field 'f'"))


def test_schedule_segment_and_targets_validation():
    """The smallest segment (one step, 1-d latent) is valid; bad schedules, latent steps and targets are named."""
    segment = TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), flow_sigmas(1), (0,), torch.zeros(2, 1))
    assert (segment.batch, segment.num_steps, segment.latent_shape, segment.dtype) == (2, 1, (4,), torch.float32)
    assert float(segment.sigma_max) == 0.0 and validate_targets(segment, [0]) == (0,)
    for steps in ((0,), (0, 1, 2), (1, 1)):
        _refused(ValueError, f"latent_steps {steps} must name 2 distinct steps (one per stored latent)",
                 lambda s=steps: TrajectorySegment(torch.zeros(2, 2, 4), s, flow_sigmas(1), (0,), torch.zeros(2, 1)))
    for sigmas in (torch.tensor([1.0]), torch.tensor([[1.0, 0.0]])):
        _refused(ValueError, f"sigmas must be a [T+1] schedule with T >= 1, got shape {tuple(sigmas.shape)}",
                 lambda s=sigmas: TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), s, (0,), torch.zeros(2, 1)))
    _refused(ValueError, "sigmas must decrease strictly, got [1.0, 1.0]",
             lambda: TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), torch.ones(2), (0,), torch.zeros(2, 1)))
    _refused(ValueError, "sde_indices [1] lie outside [0, 0] (T=1 steps)",
             lambda: TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), flow_sigmas(1), (1,), torch.zeros(2, 1)))
    _refused(ValueError, "latents must be [B, K, *latent], got shape (2, 2)",
             lambda: TrajectorySegment(torch.zeros(2, 2), (0, 1), flow_sigmas(1), (0,), torch.zeros(2, 1)))
    for target, kind in (({0}, "set"), (0, "int"), (None, "NoneType"), ("0", "str"), (b"0", "bytes")):
        _refused(TypeError, f"target must be a sequence of step indices, got {kind}",
                 lambda t=target: validate_targets(segment, t))
    for target in ((True,), (0, False), (0.0,)):
        _refused(TypeError, f"target steps must be ints, got [{target[-1]!r}]",
                 lambda t=target: validate_targets(segment, t))
    _refused(ValueError, "target steps [0] appear more than once in [0, 0]", lambda: validate_targets(segment, (0, 0)))


def test_guidance_schedule_lookup():
    assert (guidance_at(3, 7), guidance_at((1.0, 2.5), 1), guidance_at([4.0], 0)) == (3.0, 2.5, 4.0)
    assert type(guidance_at(3, 0)) is float
    for step in (2, 3, -1):
        _refused(ValueError, f"guidance schedule has 2 entries; no scale for step {step}",
                 lambda s=step: guidance_at((1.0, 2.0), s))
    _refused(TypeError, "guidance must be a float or a per-step sequence of floats, got bool",
             lambda: guidance_at(True, 0))


def test_replay_checks_its_inputs_before_any_forward():
    """Both replays validate the conditions (row counts, batch) before the adapter is ever called."""
    segment = TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), flow_sigmas(1), (0,), torch.zeros(2, 1))
    adapter = _Rows(FUSED_COND_FIRST)
    for replay_fn in (replay_serial, replay_batched):
        _refused(ValueError, "field 'e' has 3 rows; expected 2 (batch=2, cfg_factor=1)",
                 lambda f=replay_fn: f(adapter, Conditions(batch=2, rows={"e": torch.zeros(3, 1)}), segment,
                                       FlowGRPOSDE(), (0,)))
        _refused(ValueError, "conditions are for batch 1 but the segment holds 2 samples",
                 lambda f=replay_fn: f(adapter, Conditions(batch=1, rows={}), segment, FlowGRPOSDE(), (0,)))


def test_cfg_conditions_without_a_guidance_scale_are_refused_before_any_forward():
    """Guidance may be left out only for conditions without CFG: a guided batch without one is a usage error, not
    a silent scale."""
    segment = TrajectorySegment(torch.zeros(2, 2, 4), (0, 1), flow_sigmas(1), (0,), torch.zeros(2, 1))
    guided = Conditions(batch=2, rows={}, negative=Conditions(batch=2, rows={}))
    fused = Conditions(batch=2, rows={"e": torch.zeros(4, 1)}, cfg_factor=2)
    cases = ((replay_serial, UNCOND_FIRST, guided), (replay_batched, UNCOND_FIRST, guided),
             (replay, FUSED_COND_FIRST, fused))
    for replay_fn, adapter, conditions in cases:
        _refused(ValueError, "the conditions carry two CFG branches but no guidance scale was given",
                 lambda f=replay_fn, a=adapter, c=conditions: f(_Never(a), c, segment, FlowGRPOSDE(), (0,)))
    _refused(ValueError, "the conditions carry two CFG branches but no guidance scale was given",
             lambda: predict_velocity(_Never(FUSED_COND_FIRST), torch.zeros(2, 4), 0.5, fused, None))
    plain = replay_serial(_Rows(FUSED_COND_FIRST), Conditions(batch=2, rows={}), segment, FlowGRPOSDE(), (0,))
    assert plain.log_probs.shape == (2, 1)


def test_a_guidance_schedule_too_short_for_the_targets_is_refused_before_any_forward():
    """Step 1 has no CFG scale: refused up front, not after step 0's forward already ran."""

    class Counting(_Rows):
        calls = 0

        def forward(self, hidden, timestep, conditions):
            Counting.calls += 1
            return super().forward(hidden, timestep, conditions)

    segment = TrajectorySegment(torch.zeros(2, 3, 4), (0, 1, 2), flow_sigmas(2), (0, 1), torch.zeros(2, 2))
    guided = Conditions(batch=2, rows={}, negative=Conditions(batch=2, rows={}))
    adapter = Counting(UNCOND_FIRST)
    _refused(ValueError, "guidance schedule has 1 entries; no scale for step 1",
             lambda: replay_serial(adapter, guided, segment, FlowGRPOSDE(), (0, 1), guidance=[7.0]))
    assert Counting.calls == 0

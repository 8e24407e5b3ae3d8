"""The HunyuanImage-3 pipeline oracle (harness.replay.hunyuan_oracle) on the tiny fake model: what it records of the
model's own loop, how it judges the adapter against it (timestep room, CFG order, inputs, branch outputs, velocity),
what it refuses, and its helpers on hand-built inputs."""

from __future__ import annotations

import copy
import dataclasses
import math
import sys

import pytest
import torch

from fakes.hunyuan_image_pipeline import FlowMatchDiscreteScheduler, HunyuanImage3Text2ImagePipeline
from fixtures.replay_models import tiny_hunyuan_image3
from harness.judging.compare import holds
from harness.judging.floors import module_reduction_terms, reduction_ceiling_ulps
from harness.replay import denoiser
from harness.replay import hunyuan_oracle as ho
from harness.replay import pipeline_oracle as po
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST
from harness.replay.families import get_family
from harness.replay.families.hunyuan_image3 import TIMESTEP_ARG
from harness.replay.pipeline_oracle import Forward, OracleError, PipelineRecord, PipelineStep

pytestmark = pytest.mark.cpu

FAMILY = get_family("hunyuan_image3")
BATCH, GUIDANCE = 2, 4.5
ORACLE = ho.ORACLE
EPS = float(torch.finfo(torch.float32).eps)


@dataclasses.dataclass
class Setup:
    model: torch.nn.Module
    adapter: object
    prompts: dict
    latents: torch.Tensor
    record: PipelineRecord


def _inputs(adapter):
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(17))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(18))
    return prompts, latents


@pytest.fixture(scope="module")
def setup() -> Setup:
    model = tiny_hunyuan_image3()
    adapter = FAMILY.adapter(model)
    prompts, latents = _inputs(adapter)
    record = ORACLE.run_pipeline(FAMILY, adapter, prompts, latents, GUIDANCE)
    return Setup(model, adapter, prompts, latents, record)


def _judge(s: Setup, step: PipelineStep, first: Forward | None = None, label: str = "step 0"):
    return ORACLE.judge_step(s.adapter, step, first or s.record.steps[0].forwards[0], s.prompts, GUIDANCE, label)


def _with_arguments(forward: Forward, **changes) -> Forward:
    return Forward({**forward.arguments, **changes}, forward.output)


def _fresh_pipeline(monkeypatch, model) -> None:
    """The model's loop built anew at the next ``model.pipeline`` (it reads ``flow_shift`` once, when built)."""
    monkeypatch.setattr(model, "_pipeline", None)


# ------------------------------------------------------------------------------ the record of the loop


def test_the_record_holds_one_step_per_inference_step_with_the_loops_own_calls(setup):
    record, latents = setup.record, setup.latents
    assert len(record.steps) == po.ORACLE_STEPS == 2
    assert record.guidance == GUIDANCE and record.prompts is setup.prompts
    assert torch.equal(record.start, latents) and record.start.dtype == torch.float32
    # the flow-shifted schedule (shift 3 at 2 steps): sigmas 1, 0.75
    assert [float(step.sigma) for step in record.steps] == [1.0, 0.75]
    for i, step in enumerate(record.steps):
        assert len(step.forwards) == 1  # both CFG branches in one call
        call = step.forwards[0]
        assert call.output.shape == (2 * BATCH, *setup.adapter.latent_shape)
        assert call.arguments["first_step"] is (i == 0)
        assert torch.equal(call.arguments["timesteps"], torch.full((2 * BATCH,), 1000.0 * float(step.sigma)))
        assert torch.equal(call.arguments["images"], torch.cat([step.latents] * 2))
        cond, uncond = call.output.chunk(2)
        assert torch.allclose(step.model_output, uncond + GUIDANCE * (cond - uncond), rtol=0, atol=1e-6)
    assert torch.equal(record.steps[0].latents, latents)
    first, second = record.steps
    assert torch.allclose(second.latents, first.latents + first.model_output * (second.sigma - first.sigma), atol=1e-6)


def test_the_family_passes_its_pipeline_oracle(setup):
    verdict = ORACLE.judge_family(FAMILY, setup.adapter, setup.record)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["step 0_timestep_loop"] == 1000.0
    assert verdict.metrics["step 1_timestep_loop"] == 750.0
    assert FAMILY.pipeline.own_oracle() is ORACLE  # what the generic oracle hands the family to
    given = dataclasses.replace(FAMILY.pipeline, oracle=ORACLE)  # an oracle object given as itself, not by name
    assert given.own_oracle() is ORACLE


def test_the_oracle_passes_a_single_sample_whose_two_rows_are_not_the_channel_count(setup):
    prompts = setup.adapter.example_prompts(1, 2, torch.Generator().manual_seed(5))
    latents = torch.randn((1, *setup.adapter.latent_shape), generator=torch.Generator().manual_seed(6))
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, prompts, latents, GUIDANCE, steps=1)
    assert len(record.steps) == 1 and record.steps[0].forwards[0].output.shape[0] == 2
    verdict = ORACLE.judge_family(FAMILY, setup.adapter, record)
    assert verdict.passed, verdict.describe()


def test_judge_family_judges_every_step_against_the_first_call_and_the_start(setup, monkeypatch):
    seen = []

    def judge_step(self, adapter, step, first, prompts, guidance, label):
        seen.append((step, first, label))
        return holds(True, f"{label} judged")

    monkeypatch.setattr(ho.HunyuanPipelineOracle, "judge_step", judge_step)
    record = setup.record
    verdict = ORACLE.judge_family(FAMILY, setup.adapter, record)
    assert verdict.passed
    assert [label for _, _, label in seen] == ["step 0", "step 1"]
    assert all(step is record.steps[i] and first is record.steps[0].forwards[0] for i, (step, first, _) in
               enumerate(seen))
    moved = dataclasses.replace(record, start=record.start + 0.5)
    verdict = ORACLE.judge_family(FAMILY, setup.adapter, moved)
    assert not verdict.passed
    assert verdict.violated_facts == ["step 0: the loop stepped the latents it was given"]


def test_the_loop_is_asked_for_the_latents_batch_and_image_size_and_cannot_touch_the_callers_latents(
        setup, monkeypatch):
    model, adapter = setup.model, setup.adapter
    called, caches = [], []
    original_call = HunyuanImage3Text2ImagePipeline.__call__

    def spy(self, **kwargs):
        called.append(dict(kwargs))
        out = original_call(self, **kwargs)
        kwargs["latents"].add_(100.0)  # a loop that writes its latents in place
        return out

    original_cache = adapter.new_cache

    def new_cache(rows, width):
        caches.append((rows, width))
        return original_cache(rows, width)

    monkeypatch.setattr(HunyuanImage3Text2ImagePipeline, "__call__", spy)
    monkeypatch.setattr(adapter, "new_cache", new_cache)
    monkeypatch.setattr(model.config, "vae_downsample_factor", (8, 16))
    latents = setup.latents.clone()
    record = ORACLE.run_pipeline(FAMILY, adapter, setup.prompts, latents, GUIDANCE)
    assert len(called) == 1
    kwargs = called[0]
    h, w = adapter.latent_size
    assert kwargs["batch_size"] == BATCH
    assert kwargs["image_size"] == [h * 8, w * 16]
    assert kwargs["num_inference_steps"] == 2 and kwargs["guidance_scale"] == GUIDANCE
    assert kwargs["output_type"] == "latent"
    width = setup.prompts["input_ids"].shape[1]
    assert caches == [(2 * BATCH, width)]  # a cache of the fused batch's rows and the sequence's width
    assert kwargs["model_kwargs"]["past_key_values"] is not setup.prompts["past_key_values"]
    assert torch.equal(latents, setup.latents)  # the loop's in-place writes never reach the caller
    latents.mul_(-1.0)  # nor do the caller's reach the record
    assert torch.equal(record.start, setup.latents)
    assert torch.equal(record.steps[0].latents, setup.latents)


def test_the_record_keeps_what_the_loop_handed_its_scheduler_even_if_the_scheduler_reuses_it(setup, monkeypatch):
    original = FlowMatchDiscreteScheduler.step

    def clobbering_step(self, model_output, timestep, sample, *args, **kwargs):
        out = original(self, model_output.clone(), timestep, sample.clone(), *args, **kwargs)
        model_output.zero_()  # a scheduler that reuses its input buffers
        sample.zero_()
        return out

    monkeypatch.setattr(FlowMatchDiscreteScheduler, "step", clobbering_step)
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)
    for got, expected in zip(record.steps, setup.record.steps, strict=True):
        assert torch.equal(got.model_output, expected.model_output)
        assert torch.equal(got.latents, expected.latents)
    assert "step" not in vars(setup.model.pipeline.scheduler)  # the recording step is taken off again


def test_without_a_flow_shift_in_the_generation_config_the_schedule_shifts_by_the_default(setup, monkeypatch):
    model = setup.model
    _fresh_pipeline(monkeypatch, model)
    monkeypatch.delattr(model.generation_config, "flow_shift", raising=False)
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)
    assert ho.FLOW_SHIFT == model.generation_config.flow_shift == model.pipeline.scheduler.shift
    s = 0.5  # the unshifted sigma of step 1 of 2
    assert float(record.steps[1].sigma) == pytest.approx(ho.FLOW_SHIFT * s / (1 + (ho.FLOW_SHIFT - 1) * s))
    assert float(record.steps[1].sigma) == pytest.approx(0.75)  # upstream's default shift is 3


def test_a_flow_shift_the_generation_config_names_is_kept(setup, monkeypatch):
    model = setup.model
    _fresh_pipeline(monkeypatch, model)
    monkeypatch.setattr(model.generation_config, "flow_shift", 5.0, raising=False)
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)
    assert model.generation_config.flow_shift == 5.0 == model.pipeline.scheduler.shift
    assert float(record.steps[1].sigma) == pytest.approx(5.0 * 0.5 / (1 + 4.0 * 0.5))


def test_the_oracle_sets_what_upstreams_generate_sets_before_the_loop(setup, monkeypatch):
    model = setup.model
    monkeypatch.setattr(model, "num_special_tokens", None)
    monkeypatch.setattr(model, "num_image_tokens", None)
    monkeypatch.delattr(model, "post_token_len", raising=False)
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)
    assert model.num_special_tokens == 1
    assert model.num_image_tokens == math.prod(setup.adapter.latent_size)
    assert torch.equal(record.steps[1].model_output, setup.record.steps[1].model_output)


# ------------------------------------------------------------------------------ refusals


def test_a_loop_that_runs_more_steps_is_refused_naming_the_counts(setup, monkeypatch):
    original = FlowMatchDiscreteScheduler.set_timesteps

    def one_more(self, num_inference_steps, device=None):
        original(self, num_inference_steps + 1, device)

    monkeypatch.setattr(FlowMatchDiscreteScheduler, "set_timesteps", one_more)
    with pytest.raises(OracleError, match=r"made 3 model calls and 3 scheduler steps for num_inference_steps=2"):
        ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)


def test_a_loop_whose_scheduler_steps_outnumber_its_model_calls_is_refused(setup, monkeypatch):
    original = HunyuanImage3Text2ImagePipeline.__call__

    def extra_step(self, **kwargs):
        out = original(self, **kwargs)
        self.scheduler._step_index = 0
        self.scheduler.step(out[0], self.scheduler.timesteps[0], out[0])
        return out

    monkeypatch.setattr(HunyuanImage3Text2ImagePipeline, "__call__", extra_step)
    with pytest.raises(OracleError, match=r"made 2 model calls and 3 scheduler steps for num_inference_steps=2"):
        ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE)


def test_latents_other_than_fp32_are_refused_naming_both(setup):
    with pytest.raises(OracleError, match=r"from fp32 latents; the model's dtype is torch.float32 \(its parameters "
                                          r"hold \['torch.float32'\]\), the latents torch.float64"):
        ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents.double(), GUIDANCE)


def test_a_model_without_a_dtype_of_its_own_is_refused_naming_its_parameters(setup):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    adapter = type("Adapter", (), {"module": module})()
    with pytest.raises(OracleError, match=r"dtype is None \(its parameters hold \['torch.bfloat16', "
                                          r"'torch.float32'\]\)"):
        ORACLE.run_pipeline(FAMILY, adapter, setup.prompts, setup.latents, GUIDANCE)


# ------------------------------------------------------------------------------ low precision and autocast


def test_a_bf16_model_is_judged_in_the_autocast_its_loop_needs(setup):
    """Off CUDA the loop's fp32 latents meet bf16 weights only under the device's autocast (upstream's own names
    CUDA): the model call runs under it and the record says so; the adapter's forward and the control run under the
    same (without it they cannot even meet the weights), floors in bf16 ulps; a timestep in the wrong units still
    fails by orders of magnitude."""
    model = copy.deepcopy(setup.model).to(torch.bfloat16)
    adapter = FAMILY.adapter(model)
    record = ORACLE.run_pipeline(FAMILY, adapter, setup.prompts, setup.latents, GUIDANCE, steps=1)
    assert [step.forwards[0].autocast for step in record.steps] == [torch.bfloat16]
    verdict = ORACLE.judge_family(FAMILY, adapter, record)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["step 0_arithmetic"] == "bfloat16" and verdict.metrics["floor_minimum"] == 4 * 2.0 ** -7
    original = denoiser.model_timestep
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(denoiser, "model_timestep", lambda adapter, sigma: original(adapter, sigma) / 1000.0)
        wrong = ORACLE.judge_family(FAMILY, adapter, record)
    assert not wrong.passed and wrong.margin > 1e4 and "step 0 timestep" in wrong.message
    unreplayed = tuple(dataclasses.replace(step, forwards=tuple(dataclasses.replace(f, autocast=None)
                                                                for f in step.forwards)) for step in record.steps)
    with pytest.raises(RuntimeError, match="should be the same"):
        ORACLE.judge_family(FAMILY, adapter, dataclasses.replace(record, steps=unreplayed))


# ------------------------------------------------------------------------------ bugs in the model's own loop


LOOP_BUGS = ("cfg_halves_swapped", "guidance_from_cond", "timestep_over_1000")


def plant_loop_bug(bug: str, model, monkeypatch) -> None:
    """One bug in the model's own sampling loop (the fake's, or upstream's real one: never the adapter): its CFG
    halves swapped, guidance applied from the cond branch, or the loop handing its model t / 1000."""
    loop = sys.modules[type(model.pipeline).__module__]
    guide = loop.ClassifierFreeGuidance.__call__
    if bug == "cfg_halves_swapped":
        monkeypatch.setattr(loop.ClassifierFreeGuidance, "__call__",
                            lambda self, cond, uncond, scale, step=None: guide(self, uncond, cond, scale, step=step))
    elif bug == "guidance_from_cond":
        monkeypatch.setattr(loop.ClassifierFreeGuidance, "__call__",
                            lambda self, cond, uncond, scale, step=None: cond + scale * (cond - uncond))
    else:
        prepare, name = model.prepare_inputs_for_generation, TIMESTEP_ARG[FAMILY.adapter(model).generation]

        def thousandth(*args, **kwargs):
            kwargs[name] = kwargs[name] / 1000.0
            return prepare(*args, **kwargs)

        monkeypatch.setattr(model, "prepare_inputs_for_generation", thousandth)


@pytest.mark.parametrize(("bug", "failing"), [("cfg_halves_swapped", "step 0 combine (relative)"),
                                              ("guidance_from_cond", "step 0 combine (relative)"),
                                              ("timestep_over_1000", "step 0 timestep")])
def test_a_bug_in_the_models_own_loop_fails_the_oracle_naming_the_step_and_the_numbers(setup, monkeypatch, bug,
                                                                                          failing):
    """What the pipeline oracle is for beside parity: the replay family and its batched path agree with each other
    whatever the loop does, so a loop that guides the wrong way or feeds its model other timesteps is caught only
    here, and the failure reads like any verdict: what failed, at which step, the numbers and their bound."""
    plant_loop_bug(bug, setup.model, monkeypatch)
    record = ORACLE.run_pipeline(FAMILY, setup.adapter, setup.prompts, setup.latents, GUIDANCE, steps=1)  # step 0
    verdict = ORACLE.judge_family(FAMILY, setup.adapter, record)
    assert not verdict.passed and verdict.margin > 1e3, verdict.describe()
    first = verdict.message.splitlines()[0]
    assert first.startswith(failing) and (" exceeds " in first or " allowed)" in first), verdict.message


# ------------------------------------------------------------------------------ judging a step


def _retimed(step: PipelineStep, ulps: float) -> PipelineStep:
    call = step.forwards[0]
    t = call.arguments["timesteps"].double()
    moved = t + ulps * EPS * t.abs()
    return dataclasses.replace(step, forwards=(_with_arguments(call, timesteps=moved),))


def test_the_timestep_room_is_timestep_ulps_fp32_ulps_of_its_magnitude(setup):
    step = setup.record.steps[0]
    inside = _judge(setup, _retimed(step, po.TIMESTEP_ULPS / 2))
    assert inside.passed, inside.describe()
    assert inside.metrics["atol"] == pytest.approx(po.TIMESTEP_ULPS * po.FP32_EPS * 1000.0)
    assert inside.metrics["rtol"] == 0.0
    outside = _judge(setup, _retimed(step, 1.5 * po.TIMESTEP_ULPS))
    assert not outside.passed
    assert "step 0 timestep" in outside.message
    assert "branch outputs" not in outside.message and "velocity" not in outside.message


def test_the_timestep_room_is_taken_of_the_magnitude_of_negative_timesteps(setup):
    step = setup.record.steps[0]
    call = step.forwards[0]
    t = -call.arguments["timesteps"].double()
    flipped = PipelineStep(-step.sigma, step.latents, step.model_output,
                           (_with_arguments(call, timesteps=t - 4 * EPS * t.abs()),))
    verdict = _judge(setup, flipped)
    assert "step 0 timestep" not in verdict.message
    assert verdict.metrics["step 0_timestep_loop"] == pytest.approx(1000.0, rel=1e-6)


def test_a_timestep_in_the_wrong_units_fails_naming_the_timestep(setup, monkeypatch):
    original = denoiser.model_timestep
    monkeypatch.setattr(denoiser, "model_timestep", lambda adapter, sigma: original(adapter, sigma) / 1000.0)
    verdict = _judge(setup, setup.record.steps[1], label="step 1")
    assert not verdict.passed
    assert "step 1 timestep" in verdict.message


def test_swapped_cfg_order_fails_naming_the_cfg_order(setup, monkeypatch):
    original = denoiser.declared_layout
    monkeypatch.setattr(denoiser, "declared_layout", lambda adapter: UNCOND_FIRST if original(adapter) ==
                        FUSED_COND_FIRST else FUSED_COND_FIRST)
    verdict = _judge(setup, setup.record.steps[0])
    assert not verdict.passed
    assert any(fact.startswith("step 0: CFG order") for fact in verdict.violated_facts)
    assert any(fact.startswith("step 0: every other model input") for fact in verdict.violated_facts)


def test_a_first_call_of_another_width_fails_the_cfg_order(setup):
    step = setup.record.steps[0]
    call = step.forwards[0]
    ids = call.arguments["input_ids"]
    wider = _with_arguments(call, input_ids=torch.cat([ids, ids[:, :1]], dim=1))
    verdict = _judge(setup, step, first=wider)
    assert not verdict.passed
    assert any(fact.startswith("step 0: CFG order") for fact in verdict.violated_facts)


def test_a_velocity_off_the_loops_fails_the_velocity_only(setup, monkeypatch):
    original = denoiser.predict_velocity
    monkeypatch.setattr(denoiser, "predict_velocity", lambda *a, **k: original(*a, **k) * (1 + 1e-3))
    verdict = _judge(setup, setup.record.steps[0])
    assert not verdict.passed
    assert "step 0 velocity (relative)" in verdict.message
    assert "branch outputs" not in verdict.message


def test_a_branch_prediction_off_the_loops_fails_the_branch_outputs(setup, monkeypatch):
    def scaled(module, args, kwargs, output):
        return {**output, "diffusion_prediction": output["diffusion_prediction"] * (1 + 1e-3)}

    handle = setup.model.register_forward_hook(scaled, with_kwargs=True)  # only while the adapter is judged
    try:
        verdict = _judge(setup, setup.record.steps[1], label="step 1")
    finally:
        handle.remove()
    assert not verdict.passed
    assert "step 1 branch outputs (relative)" in verdict.message
    assert "step 1 velocity (relative)" in verdict.message


def test_a_sign_flipped_velocity_is_named(setup, monkeypatch):
    original = denoiser.model_velocity
    monkeypatch.setattr(denoiser, "model_velocity", lambda *a: -original(*a))
    verdict = _judge(setup, setup.record.steps[0])
    assert not verdict.passed
    assert "step 0 velocity: not a sign flip of the pipeline's" in verdict.violated_facts


def test_a_denoiser_that_runs_the_model_twice_is_refused_before_alignment(setup, monkeypatch):
    original = denoiser.predict_velocity

    def twice(*args, **kwargs):
        original(*args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(denoiser, "predict_velocity", twice)
    verdict = _judge(setup, setup.record.steps[0])
    assert not verdict.passed
    assert verdict.violated_facts == [f"step 0: the denoiser ran one forward of both CFG branches ({2 * BATCH} rows)"]
    assert verdict.metrics["forwards"] == str([2 * BATCH, 2 * BATCH])


def test_the_velocity_ceiling_counts_the_latent_channels(setup, monkeypatch):
    channels = setup.adapter.latent_shape[0]
    # a grid of another size than the channel count tells the two apart (the judge reads only the channels)
    monkeypatch.setattr(type(setup.adapter), "latent_shape", property(lambda self: (channels, 9, 9)))
    verdict = _judge(setup, setup.record.steps[0])
    assert verdict.passed, verdict.describe()
    terms = module_reduction_terms(setup.model, sequence=int(setup.prompts["input_ids"].shape[1]))
    # the velocity is judged last: its floor's metrics are the verdict's
    assert verdict.metrics["floor_ceiling_ulps"] == max(reduction_ceiling_ulps(terms + channels),
                                                         po.RESOLUTION / po.FP32_EPS)
    assert verdict.metrics["step 0_branch_floor_ceiling"] == pytest.approx(
        max(reduction_ceiling_ulps(terms), po.RESOLUTION / po.FP32_EPS) * po.FP32_EPS)


# ------------------------------------------------------------------------------ align


def _hand_step() -> PipelineStep:
    rows = 4
    arguments = {
        "input_ids": torch.arange(rows)[:, None] * 10 + torch.arange(3),
        "rope_image_info": [f"rope{r}" for r in range(rows)],
        "custom_pos_emb": (torch.arange(rows * 2.0).reshape(rows, 2), torch.arange(rows * 5.0).reshape(rows, 5)),
        "position_ids": torch.arange(3)[None],
        "timestep": torch.tensor(500.0),
        "mode": "gen_image",
        "first_step": True,
    }
    output = torch.arange(rows * 2.0).reshape(rows, 2)
    return PipelineStep(torch.tensor(0.5), torch.zeros(2, 2), torch.zeros(2, 2), (Forward(arguments, output),))


@pytest.mark.parametrize(("order", "index"), [
    ([("cond", 0), ("cond", 1), ("uncond", 0), ("uncond", 1)], [0, 1, 2, 3]),
    ([("uncond", 0), ("uncond", 1), ("cond", 0), ("cond", 1)], [2, 3, 0, 1]),
    ([("cond", 1), ("uncond", 1), ("cond", 0), ("uncond", 0)], [1, 3, 0, 2]),
])
def test_align_lays_the_loops_rows_out_in_the_adapters_order(order, index):
    step = _hand_step()
    args = step.forwards[0].arguments
    aligned = ORACLE.align(step, {}, order)
    assert aligned.order == order
    assert set(aligned.rows) == {"input_ids", "rope_image_info", "custom_pos_emb"}
    assert set(aligned.shared) == {"position_ids", "timestep", "mode", "first_step"}
    assert torch.equal(aligned.rows["input_ids"], args["input_ids"][index])
    assert aligned.rows["rope_image_info"] == [f"rope{i}" for i in index]
    assert all(torch.equal(got, part[index]) for got, part in zip(aligned.rows["custom_pos_emb"],
                                                                  args["custom_pos_emb"], strict=True))
    assert aligned.shared["mode"] == "gen_image" and aligned.shared["position_ids"] is args["position_ids"]
    assert torch.equal(aligned.output, step.forwards[0].output[index])


def test_align_refuses_a_call_without_both_branches():
    step = _hand_step()
    with pytest.raises(OracleError, match=r"ran 4 rows at a step; expected both CFG branches of 3 samples \(6 rows\)"):
        ORACLE.align(step, {}, [("cond", b) for b in range(3)] + [("uncond", b) for b in range(3)])


# ------------------------------------------------------------------------------ input mismatches


def _loop_call(first_step: bool = True) -> Forward:
    rows = 4
    arguments = {
        "input_ids": torch.arange(rows)[:, None] * 10 + torch.arange(3),
        "image_mask": torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 0, 1]], dtype=torch.bool),
        "images": torch.arange(rows * 2.0).reshape(rows, 2),
        "timesteps": torch.full((rows,), 750.0),
        "rope_image_info": [f"rope{r}" for r in range(rows)],
        "past_key_values": object(),
        "use_cache": True,
        "return_dict": True,
        "mode": "gen_image",
        "first_step": first_step,
    }
    return Forward(arguments, torch.zeros(rows, 3))  # 3 channels: not the row count


INDEX = [2, 3, 0, 1]  # the adapter's rows uncond-first


def _adapters_call(loop: Forward, **changes) -> Forward:
    arguments = {name: ho._pick(value, INDEX) for name, value in loop.arguments.items()}
    arguments.update(past_key_values=None, use_cache=False, return_dict=None, first_step=True)
    arguments.update(changes)
    return Forward(arguments, torch.zeros(4, 3))


def test_input_mismatches_compare_every_row_argument_in_the_adapters_order_at_the_first_step():
    loop = _loop_call()
    mine = _adapters_call(loop)
    assert ho.HunyuanPipelineOracle._input_mismatches(mine, loop, loop, INDEX, True) == {}
    # the timestep is judged on its own, the cache and its flags only the loop keeps
    ignored = _adapters_call(loop, timesteps=torch.zeros(4))
    assert ho.HunyuanPipelineOracle._input_mismatches(ignored, loop, loop, INDEX, True) == {}
    mask = ~mine.arguments["image_mask"]
    found = ho.HunyuanPipelineOracle._input_mismatches(_adapters_call(loop, image_mask=mask, mode="gen_text"),
                                                       loop, loop, INDEX, True)
    assert found == {"image_mask": "differs from the loop's (rows in the adapter's order)",
                     "mode": "differs from the loop's (rows in the adapter's order)"}
    unpicked = _adapters_call(loop, input_ids=loop.arguments["input_ids"])
    assert set(ho.HunyuanPipelineOracle._input_mismatches(unpicked, loop, loop, INDEX, True)) == {"input_ids"}


def test_input_mismatches_at_a_later_step_compare_the_latents_only():
    first, now = _loop_call(), _loop_call(first_step=False)
    mine = _adapters_call(first, image_mask=~ho._pick(first.arguments["image_mask"], INDEX))
    assert ho.HunyuanPipelineOracle._input_mismatches(mine, first, now, INDEX, False) == {}
    moved = _adapters_call(first, images=ho._pick(now.arguments["images"], INDEX) + 1.0)
    expected = {"images": "the latents differ from the loop's"}
    assert ho.HunyuanPipelineOracle._input_mismatches(moved, first, now, INDEX, False) == expected
    assert ho.HunyuanPipelineOracle._input_mismatches(moved, first, now, INDEX, True) == expected


def test_generation_ones_timestep_is_left_to_the_timestep_judge():
    loop = _loop_call()
    arguments = {("timestep" if k == "timesteps" else k): v for k, v in loop.arguments.items()}
    arguments["custom_pos_emb"] = (torch.zeros(4, 2), torch.ones(4, 2))
    loop = Forward(arguments, loop.output)
    mine = _adapters_call(loop, timestep=torch.zeros(4))
    assert ho.HunyuanPipelineOracle._input_mismatches(mine, loop, loop, INDEX, True) == {}


# ------------------------------------------------------------------------------ helpers


def test_same_compares_tensors_by_shape_and_value_dtype_aside():
    a = torch.tensor([1, 2, 3])
    assert ho._same(a, a.to(torch.float32)) is True
    assert ho._same(a.to(torch.float32), a) is True
    assert ho._same(a, torch.tensor([1, 2, 4])) is False
    assert ho._same(a, a[None]) is False
    assert ho._same(a, [1, 2, 3]) is False
    assert ho._same([1, 2, 3], a) is False
    assert ho._same(None, a) is False
    assert ho._same(torch.tensor(1), 1) is False and ho._same(1, torch.tensor(1)) is False  # a tensor is no number


def test_same_compares_containers_item_by_item():
    t = torch.ones(2)
    assert ho._same([t, "x"], (t.clone(), "x")) is True
    assert ho._same([t, "x"], [t, "y"]) is False
    assert ho._same([1, 2], [1, 3]) is False
    assert ho._same([1, 2], [1]) is False
    assert ho._same([1], 1) is False
    assert ho._same("gen_image", "gen_image") is True and ho._same(None, None) is True


def test_count_counts_rows():
    assert ho._count(torch.zeros(4, 2)) == 4
    assert ho._count(torch.tensor(3.0)) is None
    assert ho._count([1, 2, 3]) == 3
    assert ho._count((torch.zeros(4, 2), torch.zeros(4, 3))) == 4
    assert ho._count((torch.zeros(4, 2), torch.zeros(3, 2))) is None
    assert ho._count(()) is None and ho._count((1, 2)) is None
    assert ho._count("gen_image") is None and ho._count(None) is None


def test_pick_and_rows_select_rows_of_every_kind_of_argument():
    t = torch.arange(8.0).reshape(4, 2)
    pair = (t, t * 10)
    assert torch.equal(ho._pick(t, [3, 1]), t[[3, 1]])
    assert ho._pick(["a", "b", "c", "d"], [2, 0]) == ["c", "a"]
    picked = ho._pick(pair, [1, 0])
    assert isinstance(picked, tuple) and all(torch.equal(g, p[[1, 0]]) for g, p in zip(picked, pair, strict=True))
    scalar = torch.tensor(5.0)
    assert ho._pick(scalar, [1, 0]) is scalar and ho._pick("gen_image", [1, 0]) == "gen_image"
    assert ho._pick((1, 2), [1, 0]) == (1, 2)
    assert torch.equal(ho._rows(t, 1, 3), t[1:3])
    assert ho._rows(["a", "b", "c", "d"], 1, 3) == ["b", "c"]
    rows = ho._rows(pair, 1, 3)
    assert isinstance(rows, tuple) and all(torch.equal(g, p[1:3]) for g, p in zip(rows, pair, strict=True))
    assert ho._rows(scalar, 1, 3) is scalar and ho._rows(True, 1, 3) is True


def test_row_index_reads_the_loops_cond_then_uncond_batch():
    assert ho._row_index([("uncond", 0), ("uncond", 1), ("cond", 0), ("cond", 1)], 2) == [2, 3, 0, 1]
    assert ho._row_index([("cond", 1), ("uncond", 0)], 1) == [1, 1]


class _Predicting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2,), 3.0))

    def forward(self, images, timesteps=None, *, mode="gen_image"):
        return {"diffusion_prediction": images * self.weight}


def test_record_image_forwards_records_bound_arguments_and_a_detached_copy_while_the_block_runs():
    module = _Predicting()
    x = torch.ones(2)
    with ho.record_image_forwards(module) as calls:
        out = module(x)
        module(images=x * 2, timesteps=torch.tensor(1.0), mode="gen_text")
    assert len(calls) == 2
    assert calls[0].arguments == {"images": x, "timesteps": None, "mode": "gen_image"}  # defaults applied
    assert calls[1].arguments["mode"] == "gen_text" and float(calls[1].arguments["timesteps"]) == 1.0
    assert torch.equal(calls[0].output, torch.full((2,), 3.0))
    assert out["diffusion_prediction"].requires_grad and not calls[0].output.requires_grad  # no graph kept
    with torch.no_grad():
        out["diffusion_prediction"].add_(1.0)
    assert torch.equal(calls[0].output, torch.full((2,), 3.0))  # a copy
    module(x)
    assert len(calls) == 2  # nothing recorded after the block


def test_the_loop_ends_at_its_vae_decode_and_a_pipe_without_one_is_left_alone():
    """Inside the block the VAE's decode ends the loop (and is its own again after); a pipe with no VAE, or a VAE
    without ``decode``, runs through untouched."""
    import types

    class Vae:
        def decode(self, latents):
            return "decoded"

    pipe = types.SimpleNamespace(vae=Vae())
    with pytest.raises(ho._LoopEnded), ho._ends_at_the_vae(pipe):
        pipe.vae.decode(None)
    assert pipe.vae.decode(None) == "decoded"
    for bare in (types.SimpleNamespace(), types.SimpleNamespace(vae=types.SimpleNamespace())):
        with ho._ends_at_the_vae(bare):
            assert not hasattr(getattr(bare, "vae", bare), "decode")  # nothing given a decode to end the loop at


def test_the_autocast_a_forward_ran_under_is_read_off_its_device():
    cpu = torch.device("cpu")
    assert ho._autocast_of(cpu) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ho._autocast_of(cpu) == torch.bfloat16

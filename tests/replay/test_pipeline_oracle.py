"""The pipeline oracle's own tests: two adapter bugs that pass batched-vs-serial parity and the combine check
alike (a CogView4 timestep in sigma units, a Sana adapter that declares cond-first while building its rows
uncond-first, as SanaPipeline concatenates them) are caught by the oracle; and its refusals."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch

from fixtures.replay_models import tiny_model
from harness.judging.compare import exact
from harness.judging.floors import module_reduction_terms, reduction_ceiling_ulps
from harness.plugins.entry_points import CheckpointKind
from harness.replay import cfg, denoiser, pipeline_oracle
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


def _one_step_verdict(family: ReplayFamily, *, recorded_by_it: bool = False):
    """One step of Sana's pipeline, recorded with the shipped adapter (or with ``family``'s own when what it hands
    the pipeline is the bug), judged against ``family``'s adapter."""
    adapter = family.adapter(tiny_model("sana"))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    recorder = (family, adapter) if recorded_by_it else (SANA, SANA.adapter(tiny_model("sana")))
    record = pipeline_oracle.run_pipeline(*recorder, prompts, latents, GUIDANCE, steps=1)
    return pipeline_oracle.judge_family(family, adapter, record)


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
    facts = [fact for fact in verdict.violated_facts if "CFG order: the rows the adapter declares cond" in fact]
    assert facts and all(" its negative prompt; cond[0] carries uncond[0], " in fact for fact in facts), facts
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


def test_cogview4_size_conditioning_is_the_pipelines_own_default():
    """CogView4Pipeline conditions on original_size = target_size = (height, width) and crops (0, 0) unless it is
    told otherwise: the example prompts state exactly that, and prompts that leave the sizes out are conditioned
    the same way by the adapter as by the pipeline's own defaults."""
    adapter = COGVIEW4.adapter(tiny_model("cogview4"))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    bare = {k: v for k, v in prompts.items() if k not in ("original_size", "crops_coords_top_left")}
    stated, defaulted = adapter.conditions_from_prompts(prompts, 2), adapter.conditions_from_prompts(bare, 2)
    assert {k: v.tolist() for k, v in stated.shared.items()} == {k: v.tolist() for k, v in defaulted.shared.items()}
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    record = pipeline_oracle.run_pipeline(COGVIEW4, adapter, bare, latents, GUIDANCE)
    verdict = pipeline_oracle.judge_family(COGVIEW4, adapter, record)
    assert verdict.passed, verdict.describe()


def test_a_learned_sigma_sana_head_is_cut_to_the_latent_channels_as_the_pipeline_cuts_it():
    """A Sana checkpoint whose transformer predicts 2 x the latent channels (a learned-sigma head): the adapter
    keeps the first half, SanaPipeline does the same, and the oracle reads the pipeline's outputs the same way."""
    tiny = tiny_model("sana")
    config = {**tiny.config, "out_channels": 2 * tiny.config.in_channels}
    torch.manual_seed(0)
    model = type(tiny).from_config(config).eval()
    adapter = SANA.adapter(model)
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    conditions = adapter.conditions_from_prompts(prompts, 1)
    timestep = adapter.timestep(torch.full((BATCH,), 0.6))
    out = adapter.forward(latents, timestep, conditions)
    raw = model(latents, encoder_hidden_states=conditions.rows["encoder_hidden_states"],
                encoder_attention_mask=conditions.rows["encoder_attention_mask"], timestep=timestep,
                return_dict=False)[0]
    assert tuple(raw.shape[1:2]) == (2 * latents.shape[1],) and torch.equal(out, raw[:, :latents.shape[1]])
    taller = latents.shape[2] + model.config.patch_size  # a height that is not twice the channels: the cut is the
    assert taller != 2 * latents.shape[1]  # channel axis's, whatever the latent's spatial size
    grown = torch.randn((BATCH, latents.shape[1], taller, latents.shape[3]), generator=torch.Generator().manual_seed(6))
    assert adapter.forward(grown, timestep, conditions).shape == grown.shape
    record = pipeline_oracle.run_pipeline(SANA, adapter, prompts, latents, GUIDANCE)
    verdict = pipeline_oracle.judge_family(SANA, adapter, record)
    assert verdict.passed, verdict.describe()


@pytest.mark.parametrize(("calls", "per_step", "steps"), [(0, 0, 2), (3, 1, 2), (4, 0, 2)])
def test_a_pipeline_whose_transformer_calls_do_not_split_evenly_over_its_steps_is_an_oracle_error(calls, per_step,
                                                                                                  steps):
    forwards = [pipeline_oracle.Forward({}, torch.zeros(1)) for _ in range(calls)]
    with pytest.raises(pipeline_oracle.OracleError, match=f"made {calls} transformer calls over {steps} steps"):
        pipeline_oracle._group_by_step(forwards, per_step, steps)
    whole = [pipeline_oracle.Forward({}, torch.zeros(1)) for _ in range(4)]
    assert pipeline_oracle._group_by_step(whole, 2, 2) == [tuple(whole[:2]), tuple(whole[2:])]


class ShiftedCogView4(CogView4Adapter):
    """The right units, off by ``FACTOR`` x 16 fp32 ulps (relative): the room the oracle should allow."""

    FACTOR = 0.0

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        room = 16 * torch.finfo(torch.float32).eps
        return (super().timestep(sigma).double() * (1.0 + self.FACTOR * room)).float()


@pytest.mark.parametrize(("factor", "passed"), [(0.9, True), (1.03, False)])
def test_the_timestep_room_is_relative_to_the_pipelines_own_magnitude(factor, passed):
    """16 fp32 ulps of max |t| (t = 1000 at the first step): a timestep 0.9 of that off passes; 1.03 of it off,
    which rounds to 16.4 ulps of the magnitude, does not."""
    adapter_class = type(f"ShiftedCogView4x{factor}", (ShiftedCogView4,), {"FACTOR": factor})
    _, verdict = _oracle(_variant(COGVIEW4, f"cogview4_shifted_{factor}", adapter_class), "cogview4")
    assert verdict.passed is passed, verdict.describe()


def test_arguments_compare_by_kind_shape_and_value():
    same = pipeline_oracle._same
    assert same({"ids": torch.ones(2, dtype=torch.long)}, {"ids": torch.ones(2, dtype=torch.float64)})  # dtype aside
    assert same({}, None) and same([1, (2, 3)], (1, [2, 3]))  # an empty mapping is an argument left out
    assert same({"a": 1}, 3) is False and same(3, {"a": 1}) is False and same({"a": 1}, {"b": 1}) is False
    assert same(torch.ones(2), torch.ones(1, 2)) is False and same(torch.ones(2), [1.0, 1.0]) is False


def test_relative_error_is_over_each_row_s_largest_magnitude_whatever_its_sign():
    expected = torch.tensor([[-4.0, 1.0], [2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    actual = expected + torch.tensor([[1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [0.0, 0.5]])
    assert pipeline_oracle.relative_error(actual, expected).tolist() == [[0.25, 0.0], [0.0, 0.5], [0.0, 0.0],
                                                                         [0.0, math.inf]]  # any error of a 0 row
    with pytest.raises(pipeline_oracle.OracleError, match=r"shapes \(4, 2\) and \(2, 4\) differ"):
        pipeline_oracle.relative_error(actual, expected.reshape(2, 4))


class MirroredStartSana(SanaAdapter):
    """Hands the pipeline its latents mirrored: every step is judged on the pipeline's own samples, so only the
    start can tell that the pipeline never ran from the replay latents."""

    def to_pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        return super().to_pipeline_latents(x).flip(-1)


def test_a_pipeline_started_from_other_latents_than_the_replay_ones_fails_the_oracle_and_prints_nothing(capfd):
    verdict = _one_step_verdict(_variant(SANA, "sana_mirrored_start", MirroredStartSana), recorded_by_it=True)
    assert not verdict.passed
    assert verdict.violated_facts == ["step 0: the pipeline stepped the replay latents it was given (the adapter's "
                                      "to_pipeline_latents is the inverse of its from_pipeline_latents)"], \
        verdict.describe()
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), "the pipeline's progress bar is off: a report is the same bytes on every run"


def test_the_oracle_judges_fp32_pipelines_only():
    adapter = SANA.adapter(copy.deepcopy(tiny_model("sana")).to(torch.bfloat16))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    with pytest.raises(pipeline_oracle.OracleError, match=r"judges fp32 pipelines .* hold \['torch.bfloat16', "
                                                          r"'torch.float32'\]"):
        pipeline_oracle.run_pipeline(SANA, adapter, prompts, latents, GUIDANCE)
    fp32 = SANA.adapter(tiny_model("sana"))
    with pytest.raises(pipeline_oracle.OracleError, match=r"hold \['torch.float32', 'torch.float64'\]"):
        pipeline_oracle.run_pipeline(SANA, fp32, prompts, latents.double(), GUIDANCE)


class _Doubler(torch.nn.Module):
    """Writes each result into one buffer it returns, as a kernel with a static output does."""

    def __init__(self):
        super().__init__()
        self.out = torch.zeros(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.copy_(2 * x)


def test_recorded_forwards_keep_each_output_as_it_was_and_stop_with_the_block():
    module = _Doubler()
    with pipeline_oracle.record_forwards(module) as calls:
        module(torch.ones(2))
        module(torch.full((2,), 3.0))
    module(torch.full((2,), 5.0))
    assert [c.output.tolist() for c in calls] == [[2.0, 2.0], [6.0, 6.0]]
    assert [c.arguments["x"].tolist() for c in calls] == [[1.0, 1.0], [3.0, 3.0]]


@pytest.mark.parametrize(("ulps", "passed"), [(15.9, True), (16.5, False)])
def test_an_output_may_be_off_by_4_resolutions_of_4_fp32_ulps_where_the_floor_is_lower(ulps, passed):
    expected = torch.tensor([[1.0, -0.5], [0.25, 0.125]], dtype=torch.float64)
    actual = expected + ulps * pipeline_oracle.FP32_EPS * expected.abs().amax(dim=1, keepdim=True)
    verdict = pipeline_oracle.judge_combine("output", actual, expected, "a floor below the resolution")
    assert verdict.passed is passed, verdict.describe()


def test_the_combine_floor_is_rounding_of_one_term_no_model_runs():
    """Branch outputs combined as the pipeline did: the ceiling is one term's, nothing accumulates."""
    from harness.judging.floors import reduction_ceiling_ulps

    values = torch.tensor([[1.0, -0.5], [0.25, 0.125]], dtype=torch.float64)
    verdict = pipeline_oracle.judge_combine("velocity", values, values, "same")
    assert verdict.passed and verdict.metrics["floor_ceiling_ulps"] == reduction_ceiling_ulps(1)


def test_an_exact_negation_is_named_a_sign_flip_before_its_numbers():
    expected = torch.tensor([[1.0, -0.5], [0.25, 0.125]], dtype=torch.float64)
    verdict = pipeline_oracle.judge_combine("velocity", -expected, expected, "negated")
    assert not verdict.passed and verdict.metrics["max_abs"] == 2.0
    assert verdict.message.startswith("expected: velocity: not a sign flip"), verdict.message
    assert "relative error 2" in verdict.message
    # the flip is the cause named, and the bound it is judged at stays the rounding bound: no "too loose" beside it
    assert verdict.violated_facts == ["velocity: not a sign flip of the pipeline's"], verdict.violated_facts
    assert pipeline_oracle.sign_flipped(-2 * expected, expected) is False  # a scale, not a sign
    assert pipeline_oracle.sign_flipped(torch.zeros(2, 2), torch.zeros(2, 2)) is False  # nothing to flip
    edge = torch.tensor([[1000.0]], dtype=torch.float64)  # 1 off in 1000: exactly its room, still a flip
    assert pipeline_oracle.SIGN_FLIP_ROOM == 1 / 1000 and pipeline_oracle.sign_flipped(-(edge + 1), edge) is True


def test_a_floor_above_its_ceiling_fails_the_output_even_within_k_times_it():
    """A control that differs from the pipeline by more than rounding is not a floor: the verdict fails on it."""
    expected = torch.tensor([[1.0, -0.5]], dtype=torch.float64)
    actual = expected * (1 + 1e-3)
    floor = pipeline_oracle._rounding_floor(1e-3, 100, "a control that shares a bug")
    verdict = pipeline_oracle._within("output", actual, expected, floor, 0.0, "bug-sized floor")
    assert verdict.margin is not None and verdict.margin <= 1.0  # the numbers alone would pass
    assert not verdict.passed
    assert any("the stock path itself depends on the batch composition" in f for f in verdict.violated_facts)


class TwoForwardSana(SanaAdapter):
    """Runs its CFG branches as two forwards of B rows instead of one of 2B."""

    def forward(self, hidden, timestep, conditions):
        half = hidden.shape[0] // 2
        rows = {name: value for name, value in conditions.rows.items()}
        parts = [super(TwoForwardSana, self).forward(
            hidden[i * half:(i + 1) * half], timestep[i * half:(i + 1) * half],
            Conditions(batch=half, rows={n: v[i * half:(i + 1) * half] for n, v in rows.items()}))
            for i in range(2)]
        return torch.cat(parts)


def test_a_denoiser_that_splits_its_cfg_branches_over_two_forwards_fails_the_oracle():
    verdict = _one_step_verdict(_variant(SANA, "sana_two_forwards", TwoForwardSana))
    assert not verdict.passed
    assert "step 0: the denoiser ran one forward of both CFG branches (4 rows)" in verdict.violated_facts, \
        verdict.describe()
    assert verdict.metrics["forwards"] == "[2, 2]"


class SwappedMaskSana(SanaAdapter):
    """Gives each branch the other branch's padding mask; the embeddings, and so the CFG order, stay right."""

    def conditions_from_prompts(self, prompts, cfg):
        swapped = {**prompts, "prompt_attention_mask": prompts["negative_prompt_attention_mask"],
                   "negative_prompt_attention_mask": prompts["prompt_attention_mask"]}
        return super().conditions_from_prompts(swapped, cfg)


def test_a_row_input_that_differs_from_the_pipelines_is_named():
    verdict = _one_step_verdict(_variant(SANA, "sana_swapped_mask", SwappedMaskSana))
    assert ("step 0: every other transformer input equals the pipeline's, row by row; encoder_attention_mask: rows "
            "uncond[0] (values), uncond[1] (values), cond[0] (values), cond[1] (values)") in verdict.violated_facts
    assert verdict.metrics["input_encoder_attention_mask"] == ("rows uncond[0] (values), uncond[1] (values), "
                                                               "cond[0] (values), cond[1] (values)"), verdict.describe()
    assert "cfg_order_crossed" in verdict.metrics and not verdict.metrics["cfg_order_crossed"]  # the prompts are right


def test_arguments_compare_in_a_normal_form():
    """An empty mapping reads as left out; sequences compare element by element in that form, mappings by key."""
    assert pipeline_oracle._normal({}) is None
    assert pipeline_oracle._normal({"b": [1, {}], "a": (2, {"c": {}})}) == {"a": [2, {"c": None}], "b": [1, None]}
    assert pipeline_oracle._normal((1, [2])) == [1, [2]]


def test_arguments_are_the_same_only_item_by_item():
    assert pipeline_oracle._same([1, torch.ones(2)], [1, torch.ones(2, dtype=torch.long)])  # dtype aside
    assert not pipeline_oracle._same([1, 2], [1, 3])
    assert not pipeline_oracle._same([1, 2], [1, 2, 3])
    assert pipeline_oracle._same(["a", "b"], "ab") is False  # a list equals only a list, item by item


def test_a_relative_error_takes_a_tensor_against_a_list_of_its_rows():
    expected = torch.tensor([[1.0, -2.0], [0.5, 0.25]], dtype=torch.float64)
    actual = expected + torch.tensor([[0.5, 0.0], [0.0, 0.125]], dtype=torch.float64)
    both = pipeline_oracle.relative_error(actual, expected)
    assert both.tolist() == [[0.25, 0.0], [0.0, 0.25]]
    assert torch.equal(pipeline_oracle.relative_error(actual, list(expected)), both)
    assert torch.equal(pipeline_oracle.relative_error(list(actual), expected), both)


def test_a_row_value_is_a_tensor_of_rows_or_a_list_of_row_tensors():
    rows = torch.arange(6).reshape(2, 3)
    assert [row.tolist() for row in pipeline_oracle.row_list(rows)] == [[0, 1, 2], [3, 4, 5]]
    assert pipeline_oracle.row_list((rows[0], rows[1][:2]))[1].tolist() == [3, 4]  # ragged rows stay apart
    for value in ([1, 2], torch.tensor(3.0), "rows"):
        with pytest.raises(pipeline_oracle.OracleError, match="expected a tensor of rows or a list of per-row tensors"):
            pipeline_oracle.row_list(value)
    for tensor, other in ((torch.ones(2), 1.0), (torch.ones(2), [1.0, 1.0]), (1.0, torch.ones(1))):
        assert pipeline_oracle._same(tensor, other) is False  # a tensor equals only a tensor, whatever it holds


def test_a_row_that_differs_is_named_by_its_shape_before_its_values():
    row = pipeline_oracle._row_difference
    assert row(torch.ones(2, 3), torch.ones(2, 4)) == "shape (2, 3) vs the pipeline's (2, 4)"
    assert row(torch.ones(2, 3), torch.zeros(2, 3)) == row([1], torch.ones(1)) == "values"
    assert not pipeline_oracle._same(torch.ones(2), torch.ones(3))


def test_a_learned_sigma_heads_second_half_of_the_channels_is_cut() -> None:
    """The channel axis is the second in replay's layout, whatever the spatial sizes are."""
    from types import SimpleNamespace

    adapter = SimpleNamespace(latent_shape=(4, 6, 6), from_pipeline_latents=lambda out: out)
    doubled = torch.arange(8 * 6 * 6, dtype=torch.float32).reshape(1, 8, 6, 6)
    assert torch.equal(pipeline_oracle.to_replay(adapter, doubled), doubled[:, :4])
    plain = doubled[:, :4]
    assert pipeline_oracle.to_replay(adapter, plain) is plain


# ------------------------------------------------------------------ list-valued and ragged rows


def _ragged_step() -> tuple[pipeline_oracle.PipelineStep, dict]:
    """One pipeline step that called its transformer once per branch with list-valued rows: one latent per sample
    and captions of different lengths (no mask), as ZImagePipeline does (there in one call of both branches)."""
    gen = torch.Generator().manual_seed(0)
    prompts = {"prompt_embeds": [torch.randn(n, 3, generator=gen) for n in (2, 4)],
               "negative_prompt_embeds": [torch.randn(n, 3, generator=gen) for n in (1, 5)]}
    forwards = []
    for branch in ("negative_prompt_embeds", "prompt_embeds"):  # the pipeline runs uncond first here
        latents = [torch.full((4, 1, 2, 2), float(i)) for i in range(2)]
        forwards.append(pipeline_oracle.Forward(
            {"x": latents, "t": torch.tensor([0.5, 0.5]), "cap_feats": list(prompts[branch]), "patch_size": 2},
            [caption.sum() * torch.ones(4, 1, 2, 2) for caption in prompts[branch]]))
    step = pipeline_oracle.PipelineStep(torch.tensor(0.5), torch.zeros(2, 4, 2, 2), torch.zeros(2, 4, 2, 2),
                                        tuple(forwards))
    return step, prompts


def test_list_valued_and_ragged_rows_are_lined_up_row_by_row_in_the_kind_the_transformer_took_them():
    step, prompts = _ragged_step()
    order = pipeline_oracle.adapter_order(FUSED_COND_FIRST, 2)  # cond rows first
    aligned = pipeline_oracle.align(step, prompts, "cap_feats", order)
    with pytest.raises(pipeline_oracle.OracleError, match="no row argument 'caption'.*its arguments: \\['cap_feats'"):
        pipeline_oracle.align(step, prompts, "caption", order)  # PipelineSpec.prompt_arg names no argument
    assert isinstance(aligned.rows["cap_feats"], list) and isinstance(aligned.output, list)
    assert [tuple(c.shape) for c in aligned.rows["cap_feats"]] == [(2, 3), (4, 3), (1, 3), (5, 3)]
    assert aligned.rows["t"].tolist() == [0.5] * 4 and aligned.shared == {"patch_size": 2}
    assert [float(o[0, 0, 0, 0]) for o in aligned.output] == [float(c.sum()) for c in aligned.rows["cap_feats"]]


def test_the_tokens_attended_over_count_the_longest_ragged_caption():
    from types import SimpleNamespace

    step, prompts = _ragged_step()
    aligned = pipeline_oracle.align(step, prompts, "cap_feats", pipeline_oracle.adapter_order(FUSED_COND_FIRST, 2))
    adapter = SimpleNamespace(latent_size=(2, 2))
    assert pipeline_oracle._tokens(aligned, "cap_feats", adapter) == 5 + 2 * 2
    # rows with no [tokens, channels] item (a pooled vector per row) attend over no caption tokens
    pooled = dataclasses.replace(aligned, rows={"cap_feats": [torch.zeros(7), torch.zeros(7)]})
    assert pipeline_oracle._tokens(pooled, "cap_feats", adapter) == 2 * 2


def test_the_relative_error_of_ragged_rows_is_taken_row_by_row():
    expected = [torch.tensor([2.0, -4.0]), torch.tensor([1.0, 1.0, 8.0])]
    actual = [torch.tensor([2.0, -3.0]), torch.tensor([1.0, 1.0, 8.0])]
    assert pipeline_oracle.relative_error(actual, expected).tolist() == [[0.0, 0.25, 0.0], [0.0, 0.0, 0.0]]
    same_shape = pipeline_oracle.relative_error([torch.ones(2, 2)], [torch.ones(2, 2)])
    assert same_shape.shape == (1, 2, 2)  # rows of one shape keep their shape (where an element sits is named)
    with pytest.raises(pipeline_oracle.OracleError, match=r"shapes differ \(row 1: \(2,\) vs \(3,\)\)"):
        pipeline_oracle.relative_error([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(3)])
    assert pipeline_oracle.sign_flipped([-row for row in expected], expected)
    assert pipeline_oracle.sign_flipped(expected, [torch.ones(2), torch.ones(2)]) is False  # another shape: no sign


class _ListModel(torch.nn.Module):
    """Returns one prediction per sample, in a list, inside diffusers' return_dict=False tuple."""

    def forward(self, x: list, scale: float = 2.0) -> tuple:
        return ([scale * item for item in x],)


def test_the_prediction_is_read_from_a_tuple_an_output_object_or_the_value_itself():
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    rows = [torch.ones(2)]
    assert pipeline_oracle.model_output((rows, "extra")) is rows
    assert pipeline_oracle.model_output(Transformer2DModelOutput(sample=rows)) is rows
    tensor = torch.ones(2)
    assert pipeline_oracle.model_output(tensor) is tensor and pipeline_oracle.model_output(rows) is rows
    plain = {"not": "a prediction object"}  # no sample: the value itself
    assert pipeline_oracle.model_output(plain) is plain
    copied = pipeline_oracle._copied((tensor, [tensor], None, 2))
    assert isinstance(copied, tuple) and copied[0] is not tensor and copied[1][0] is not tensor
    assert copied[2:] == (None, 2)  # what is not a tensor is kept as it is


def test_a_transformer_that_returns_lists_is_recorded_as_it_returned_them():
    module, rows = _ListModel(), [torch.ones(2), torch.zeros(3)]
    with pipeline_oracle.record_forwards(module) as calls:
        module(rows)
    (call,) = calls
    assert [r.tolist() for r in call.output] == [[2.0, 2.0], [0.0, 0.0, 0.0]] and call.arguments["scale"] == 2.0


def test_a_from_pipeline_latents_that_leaves_a_list_is_named():
    from types import SimpleNamespace

    adapter = SimpleNamespace(latent_shape=(4, 2, 2), from_pipeline_latents=lambda out: out)
    with pytest.raises(pipeline_oracle.OracleError, match=r"from_pipeline_latents returned list: it receives the "
                                                          r"transformer's outputs as the transformer returns them"):
        pipeline_oracle.to_replay(adapter, [torch.zeros(4, 2, 2)])


def test_a_prompt_row_is_a_cfg_order_crossing_only_when_it_carries_the_other_branch_s_prompt():
    order = pipeline_oracle.adapter_order(FUSED_COND_FIRST, 2)
    pipeline = [torch.full((n,), float(n)) for n in (1, 2, 3, 4)]  # cond[0], cond[1], uncond[0], uncond[1]
    swapped = [pipeline[2], pipeline[3], pipeline[0], pipeline[1]]
    assert pipeline_oracle._branch_crossings(swapped, pipeline, order) == [
        "cond[0] carries uncond[0]", "cond[1] carries uncond[1]", "uncond[0] carries cond[0]",
        "uncond[1] carries cond[1]"]
    truncated = [row[:1] for row in pipeline]
    assert pipeline_oracle._branch_crossings(truncated, pipeline, order) == []  # no row is another branch's
    assert pipeline_oracle._branch_crossings(pipeline, pipeline, order) == []
    assert pipeline_oracle._branch_crossings(pipeline[:3], pipeline, order) == []  # a row short: not crossings
    one_negative = [pipeline[0], pipeline[1], pipeline[2], pipeline[2]]  # both samples share their negative prompt
    assert pipeline_oracle._branch_crossings([one_negative[2], *one_negative[1:]], one_negative, order) == [
        "cond[0] carries uncond[0]"]  # the first row it matches names it


class CondAnchoredSana(SanaAdapter):
    """Declares a cond-anchored combine, which SanaPipeline does not compute."""

    cfg_combine = cfg.COND_ANCHORED


def test_a_combine_that_is_not_the_pipeline_s_is_named_with_its_formula_never_as_a_batch_composition():
    verdict = _one_step_verdict(_variant(SANA, "sana_cond_anchored", CondAnchoredSana))
    assert not verdict.passed
    assert verdict.violated_facts == ["step 0 combine: the family's declared CFG combine (cond_anchored: cond + g * "
                                      "(cond - uncond)) gives the prediction the pipeline handed its scheduler"], \
        verdict.describe()
    assert "batch composition" not in verdict.message and "CFG order" not in verdict.message
    assert verdict.metrics["samples_differing"] == "sample 0, sample 1"


def test_the_stated_ceilings_count_the_transformers_reduction_and_the_combines_channels_on_top():
    """The branch outputs' ceiling is a reduction over every Linear fan-in plus the tokens attended over (the
    caption's and the latent grid's); the velocity's adds one term per latent channel the combine reads."""
    adapter = SANA.adapter(tiny_model("sana"))
    prompts = adapter.example_prompts(BATCH, 2, torch.Generator().manual_seed(4))
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(5))
    record = pipeline_oracle.run_pipeline(SANA, adapter, prompts, latents, GUIDANCE, steps=1)
    verdict = pipeline_oracle.judge_family(SANA, adapter, record)
    height, width = adapter.latent_size
    channels, _, _ = adapter.latent_shape
    assert channels not in (height, width)  # so a ceiling counted over another latent axis shows
    branch = module_reduction_terms(adapter.module, sequence=prompts["prompt_embeds"].shape[1] + height * width)
    stated = {int(k) for k in re.findall(r"\(K = (\d+): the transformer's Linear/Conv fan-ins", verdict.describe())}
    assert {branch, branch + channels} <= stated, verdict.describe()
    assert verdict.metrics["step 0_branch_floor_ceiling"] == reduction_ceiling_ulps(branch) * torch.finfo().eps


def test_a_forward_output_is_copied_as_a_value_without_its_graph():
    """What the oracle keeps of a forward is its value then: cloned (a module may reuse its buffer) and detached."""
    output = torch.ones(2, requires_grad=True) * 3
    kept = pipeline_oracle._copied([output, (output,)])
    assert not kept[0].requires_grad and not kept[1][0].requires_grad and isinstance(kept[1], tuple)
    assert kept[0].data_ptr() != output.data_ptr() and torch.equal(kept[0], output.detach())


def test_a_value_s_shape_is_named_for_a_tensor_and_its_type_otherwise():
    assert pipeline_oracle._shape(torch.zeros(2, 3)) == "(2, 3)"
    assert pipeline_oracle._shape([torch.zeros(2)]) == "list"

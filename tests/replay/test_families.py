"""The replay-family registry, the CFG combines, the harness's row broadcast and the adapters' refusals:
lookups, errors, contracts, discriminating example conditions."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from diffusers import SanaTransformer2DModel

import harness.plugins.entry_points
from fixtures.replay_cases import real_problem
from fixtures.replay_families import family_names
from fixtures.replay_models import LATENT_SHAPE, tiny_flux, tiny_model
from harness.plugins.entry_points import CheckpointKind
from harness.replay import cfg, discriminating, families
from harness.replay import denoiser as denoiser_module
from harness.replay.conditions import Conditions, broadcast_field, broadcast_rows
from harness.replay.denoiser import DenoiserAdapter
from harness.replay.families import COGVIEW4, FLUX, QWEN_IMAGE, SANA, SD3, family_for_class, get_family
from harness.replay.families.base import LatentShapeUnknown, distinct_lengths, padded_prompts, uncond_first_conditions
from harness.replay.families.cogview4 import CogView4Adapter
from harness.replay.families.flux import FluxAdapter
from harness.replay.spy import spy_forwards

pytestmark = pytest.mark.cpu


def test_register_is_idempotent_and_fills_both_registries():
    families.register(harness.plugins.entry_points)
    families.register(harness.plugins.entry_points)
    for family in families.SHIPPED:
        assert harness.plugins.entry_points.REPLAY_FAMILIES.get(family.name) is family
        assert family.pipeline is not None and family.pipeline.pipeline_class().__name__ == family.pipeline.class_name
        kind = harness.plugins.entry_points.CHECKPOINT_KINDS.get(family.checkpoint_kind.name)
        assert (kind.feeds, kind.family, kind.source) == ("replay", family.name, "diffusers")


def test_families_choose_layout_and_combine():
    assert (SD3.cfg_layout, SD3.cfg_combine) == ("uncond_first", cfg.STANDARD)
    assert (FLUX.cfg_layout, FLUX.cfg_combine) == ("fused_cond_first", cfg.STANDARD)
    assert (QWEN_IMAGE.cfg_layout, QWEN_IMAGE.cfg_combine) == ("uncond_first", cfg.TRUE_CFG_NORM_RESCALE)
    assert (COGVIEW4.cfg_layout, COGVIEW4.cfg_combine) == ("fused_cond_first", cfg.STANDARD)
    assert (SANA.cfg_layout, SANA.cfg_combine) == ("uncond_first", cfg.STANDARD)


def test_lookup_by_model_class():
    assert family_for_class("QwenImageTransformer2DModel") is QWEN_IMAGE
    assert family_for_class("SD3Transformer2DModel") is SD3
    assert family_for_class("CogView4Transformer2DModel") is COGVIEW4
    assert family_for_class("SanaTransformer2DModel") is SANA


def test_unregistered_family_names_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown replay family 'hunyuan'; registered: (.+, )?flux, (.+, )?qwen_image, "
                                       r"(.+, )?sd3"):
        get_family("hunyuan")
    with pytest.raises(LookupError, match=r"no registered replay family drives WanTransformer3DModel; registered "
                                          r"replay families: (.+, )?flux \(FluxTransformer2DModel\), "
                                          r"(.+, )?qwen_image"):
        family_for_class("WanTransformer3DModel")


def test_two_families_claiming_one_class_name_both_kinds_and_no_way_to_add_one():
    kind = CheckpointKind("sana_again", "replay", ("SanaTransformer2DModel",), "diffusers", family="sana_again")
    again = families.ReplayFamily("sana_again", SANA.adapter_class, kind, SANA.pipeline)
    harness.plugins.entry_points.REPLAY_FAMILIES.register(again.name, again, origin="tests: a second package")
    harness.plugins.entry_points.CHECKPOINT_KINDS.register(kind.name, kind, origin="tests: a second package")
    try:
        with pytest.raises(LookupError) as caught:
            family_for_class("SanaTransformer2DModel")
    finally:
        harness.plugins.entry_points.REPLAY_FAMILIES.unregister(again.name)
        harness.plugins.entry_points.CHECKPOINT_KINDS.unregister(kind.name)
    text = str(caught.value)
    assert "replay families ['sana', 'sana_again'] all claim SanaTransformer2DModel" in text
    assert "sana_again (family sana_again, tests: a second package)" in text
    assert "sana_transformer (family sana, harness.replay.families)" in text
    assert text.count("(family ") == 2, text  # the two claims, no other kind
    assert "Add one by registering" not in text and text.endswith("narrow its kind's class_names")


def test_family_kind_must_feed_replay_with_its_name():
    with pytest.raises(ValueError, match="must feed 'replay' with family='mine'"):
        families.ReplayFamily("mine", families.SD3.adapter_class, SD3.checkpoint_kind)


def test_true_cfg_rescale_keeps_the_cond_norm_over_channels():
    gen = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    out = cfg.combine(cfg.TRUE_CFG_NORM_RESCALE, cond, uncond, 4.0, channel_dim=-1)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    plain = cfg.combine(cfg.STANDARD, cond, uncond, 4.0, channel_dim=-1)
    torch.testing.assert_close(out / out.norm(dim=-1, keepdim=True), plain / plain.norm(dim=-1, keepdim=True))


class _ChannelsFirstRescale(DenoiserAdapter):
    """A norm-rescaling family that leaves ``channel_dim`` as the base adapter sets it."""

    cfg_combine = cfg.TRUE_CFG_NORM_RESCALE


def test_an_adapter_rescales_over_the_channels_of_replays_channels_first_layout_unless_it_says_otherwise():
    """Replay latents are (B, C, *spatial): the combine keeps the cond norm over C at every position."""
    gen = torch.Generator().manual_seed(1)
    cond, uncond = torch.randn(2, 4, 3, 5, generator=gen), torch.randn(2, 4, 3, 5, generator=gen)
    out = _ChannelsFirstRescale().combine(cond, uncond, 4.0)
    torch.testing.assert_close(out.norm(dim=1), cond.norm(dim=1))


def test_combine_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown CFG combine 'cfg_pp'; known: standard, cond_anchored, "
                                         r"true_cfg_norm_rescale, or declare the pipeline's own as CfgCombine"):
        cfg.combine("cfg_pp", x, x, 2.0, channel_dim=1)
    with pytest.raises(ValueError, match=r"cond \(2, 3\) and uncond \(3, 3\) differ"):
        cfg.combine(cfg.STANDARD, x, torch.zeros(3, 3), 2.0, channel_dim=1)


def test_broadcast_uses_a_sample_row_once_per_branch_and_refuses_other_counts():
    value = torch.arange(3.0)
    assert broadcast_field("pooled", value, 3, 2).tolist() == [0, 1, 2, 0, 1, 2]
    assert broadcast_field("prompt", torch.arange(6.0), 3, 2).tolist() == list(range(6))
    assert broadcast_field("imgs", [1, 2, 3], 3, 2) == [1, 2, 3, 1, 2, 3]
    with pytest.raises(ValueError, match=r"field 'prompt' has 4 rows; a forward of 6 rows .* takes 3"):
        broadcast_field("prompt", torch.zeros(4), 3, 2)
    fused = Conditions(batch=2, rows={"a": torch.zeros(2), "b": torch.zeros(4)}, cfg_factor=2)
    assert {k: v.shape[0] for k, v in broadcast_rows(fused).rows.items()} == {"a": 4, "b": 4}


def test_flux_guidance_embeds_checkpoint_needs_the_shared_guidance():
    assert tiny_flux().config.guidance_embeds is True
    problem = real_problem("flux", 1)
    conditions = problem.conditions
    assert float(conditions.shared["guidance"]) == 3.5 and "guidance" not in conditions.rows
    shared = {k: v for k, v in conditions.shared.items() if k != "guidance"}
    x = problem.segment.latent_at(0).float()
    with pytest.raises(ValueError, match="guidance_embeds=True; its conditions need a shared 'guidance' field"):
        problem.adapter.forward(x, torch.full((x.shape[0],), 0.5), dataclasses.replace(conditions, shared=shared))


def test_qwen_image_masks_differ_per_row_and_branch_and_img_shape_is_shared():
    conditions = real_problem("qwen_image", 2).conditions
    lengths = [branch.rows["encoder_hidden_states_mask"].sum(dim=1).tolist()
               for branch in (conditions, conditions.negative)]
    assert len(set(lengths[0] + lengths[1])) == 2 * conditions.batch
    assert conditions.shared["img_shape"] == ((1, 4, 4),) and "img_shapes" not in conditions.rows


def test_flux_guidance_reaches_the_model():
    """The distilled guidance is an input of the forward: another value gives another velocity."""
    problem = real_problem("flux", 1)
    conditions = problem.conditions
    x = problem.segment.latent_at(0).float()
    timestep = torch.full((x.shape[0],), 0.5)
    other = dataclasses.replace(conditions, shared={**conditions.shared, "guidance": torch.tensor(1.0)})
    assert not torch.equal(problem.adapter.forward(x, timestep, conditions),
                           problem.adapter.forward(x, timestep, other))


# every registered family, shipped or installed: a plugin family gets these unit tests as it gets the catalogue
REGISTERED = family_names()


@pytest.mark.parametrize("family", REGISTERED)
def test_a_missing_shared_field_is_refused_or_unused(family):
    """Dropping any shared field either leaves the velocity bit-for-bit as it was (the forward does not read it)
    or is refused with a ValueError before the transformer runs (``require_shared``), never a bare KeyError from
    inside the model call. Judged by behaviour: the exception's type and the forward spy, not the wording."""
    problem = real_problem(family, 1)
    conditions = broadcast_rows(problem.conditions)
    x = problem.segment.latent_at(0).float()
    timestep = problem.adapter.timestep(torch.full((x.shape[0],), 0.5))
    full = problem.adapter.forward(x, timestep, conditions)
    for name in sorted(conditions.shared):
        fewer = dataclasses.replace(conditions, shared={k: v for k, v in conditions.shared.items() if k != name})
        outcome, forwards = _forward_or_refusal(problem.adapter, x, timestep, fewer)
        if isinstance(outcome, ValueError):
            assert forwards == [], f"{family}: without {name!r} the transformer ran before the refusal: {outcome}"
        else:
            assert torch.equal(outcome, full), f"{family}: without shared field {name!r} the velocity changed silently"


def _forward_or_refusal(adapter, x: torch.Tensor, timestep: torch.Tensor, conditions: Conditions):
    """(the adapter's velocity or its ValueError, the batch sizes of the transformer forwards it ran); any other
    exception escapes."""
    with spy_forwards(adapter.module) as spy:
        try:
            outcome = adapter.forward(x, timestep, conditions)
        except ValueError as err:
            outcome = err
    return outcome, spy.batch_sizes


@pytest.mark.parametrize("family", ["sd3", "cogview4"])
def test_a_latent_that_does_not_fit_the_patch_size_is_refused_before_the_model_runs(family):
    problem = real_problem(family, 1)
    channels, height, width = problem.adapter.latent_shape
    patch = problem.adapter.module.config.patch_size
    x = torch.zeros(problem.conditions.batch, channels, height - 1, width)
    timestep = problem.adapter.timestep(torch.full((x.shape[0],), 0.5))
    with pytest.raises(ValueError, match=rf"latents of shape \(3, 4, {height - 1}, {width}\) do not fit the model's "
                                         rf"patch size {patch}: the spatial dims \({height - 1}, {width}\) must"):
        problem.adapter.forward(x, timestep, broadcast_rows(problem.conditions))


@pytest.mark.parametrize("family", REGISTERED)
def test_every_registered_adapter_refuses_latents_one_short_or_keeps_their_shape(family):
    """Latents one row (or one packed token) short of the family's latent shape are either refused with a
    ValueError before the transformer runs, or (a patch that divides any size) denoised at their own shape: never
    silently cropped. Judged by behaviour (the exception's type, the forward spy), not the wording."""
    problem = real_problem(family, 1)
    shape = list(problem.adapter.latent_shape)
    shape[-2 if len(shape) >= 3 else 0] -= 1
    x = torch.zeros(problem.conditions.batch, *shape)
    timestep = problem.adapter.timestep(torch.full((x.shape[0],), 0.5))
    outcome, forwards = _forward_or_refusal(problem.adapter, x, timestep, broadcast_rows(problem.conditions))
    if isinstance(outcome, ValueError):
        assert forwards == [], f"{family}: the transformer ran before the refusal: {outcome}"
    else:
        assert tuple(outcome.shape) == tuple(x.shape), f"{family}: {tuple(x.shape)} came back {tuple(outcome.shape)}"


def test_packed_latents_of_another_size_are_refused_by_qwen_image():
    problem = real_problem("qwen_image", 1)
    x = torch.zeros(problem.conditions.batch, 9, 16)
    with pytest.raises(ValueError, match=r"packed latents of shape \(3, 9, 16\) do not fit 8 x 8 latents"):
        problem.adapter.forward(x, torch.full((3,), 0.5), problem.conditions)


# ------------------------------------------------------------------------- discriminating conditions


def _masked(lengths_cond, lengths_uncond, fused=False):
    tokens = 6
    def mask(lengths):
        return (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).long()
    embeds = torch.randn(2 * len(lengths_cond), tokens, 4, generator=torch.Generator().manual_seed(0))
    batch = len(lengths_cond)
    if fused:
        return Conditions(batch=batch, rows={"embeds": embeds, "mask": torch.cat([mask(lengths_cond),
                                                                                   mask(lengths_uncond)])},
                          cfg_factor=2)
    negative = Conditions(batch=batch, rows={"embeds": embeds[batch:], "mask": mask(lengths_uncond)})
    return Conditions(batch=batch, rows={"embeds": embeds[:batch], "mask": mask(lengths_cond)}, negative=negative)


@pytest.mark.parametrize("fused", [False, True], ids=["uncond_first", "fused"])
def test_identical_masks_across_branches_are_refused_naming_the_field(fused):
    """Two masks that come out equal by chance make a mask bug invisible: the harness refuses them."""
    with pytest.raises(discriminating.NotDiscriminating,
                       match=r"row field 'mask': row 0 of the cond branch equals row 0 of the uncond branch"):
        discriminating.require_discriminating(_masked([3, 5], [3, 2], fused), "sana example")
    with pytest.raises(discriminating.NotDiscriminating, match=r"row field 'mask': rows 0 and 1 of the cond branch"):
        discriminating.require_discriminating(_masked([4, 4], [3, 2], fused), "sana example")
    assert discriminating.require_discriminating(_masked([4, 5], [3, 2], fused), "sana example") is not None


def test_a_fused_field_both_branches_use_only_needs_distinct_rows():
    conditions = Conditions(batch=2, rows={"prompt": torch.arange(4.0), "pooled": torch.arange(2.0)}, cfg_factor=2)
    assert discriminating.problems(conditions) == []
    same = Conditions(batch=2, rows={"prompt": torch.arange(4.0), "pooled": torch.zeros(2)}, cfg_factor=2)
    assert discriminating.problems(same) == ["row field 'pooled': rows 0 and 1 of the both branch are identical"]


def test_rows_that_require_grad_or_are_strided_views_are_keyed_by_their_values():
    """A row field may come from a module (it requires grad) or a column slice of a wider tensor (a strided row):
    either is keyed as its plain contiguous copy, so a repeat is still found."""
    wide = torch.tensor([[1.0, 9.0, 2.0, 9.0], [3.0, 8.0, 4.0, 8.0], [1.0, 7.0, 2.0, 7.0]])
    strided = wide[:, ::2]
    assert discriminating.row_key(strided[0]) == discriminating.row_key(torch.tensor([1.0, 2.0]))
    assert discriminating.first_repeat([strided[0], strided[1], strided[2]]) == (0, 2)
    learned = torch.nn.Parameter(torch.tensor([[0.5, 1.5], [0.5, 1.5]]))
    assert discriminating.row_key(learned[1]) == discriminating.row_key(torch.tensor([0.5, 1.5]))
    assert discriminating.first_repeat([learned[0], learned[1]]) == (0, 1)


@pytest.mark.parametrize("family", REGISTERED)
@pytest.mark.parametrize("seed", [0, 102])
def test_every_registered_family_draws_discriminating_conditions(family, seed):
    registered = get_family(family)
    adapter = registered.adapter(tiny_model(family))
    for batch in (1, 2, 3):
        registered.example_conditions(adapter, batch, 2, torch.Generator().manual_seed(seed))
    with pytest.raises(ValueError, match="cfg must be 1 .* got 3"):  # a third branch is refused, whatever draws it
        registered.example_conditions(adapter, 2, 3, torch.Generator().manual_seed(seed))
    prompts = adapter.example_prompts(2, 2, torch.Generator().manual_seed(seed))
    with pytest.raises(ValueError, match="cfg must be 1 .* got 3"):  # and by each family's own conversion
        adapter.conditions_from_prompts(prompts, 3)


def test_example_conditions_refuse_a_third_branch_before_an_adapter_draws_its_prompts():
    """A plugin family's own prompt drawer may not check the branch count: the base method does."""
    from harness.replay.families.base import ModelAdapter

    lenient = types.SimpleNamespace(example_prompts=lambda batch, cfg, generator: {},
                                    conditions_from_prompts=lambda prompts, cfg: prompts)
    assert ModelAdapter.example_conditions(lenient, 2, 2, torch.Generator()) == {}
    with pytest.raises(ValueError, match="cfg must be 1 .* got 3"):
        ModelAdapter.example_conditions(lenient, 2, 3, torch.Generator())


def test_distinct_lengths_refuse_a_batch_the_tokens_cannot_serve():
    lengths = distinct_lengths(3, 6, torch.Generator().manual_seed(1), avoid=(1, 2, 3))
    assert sorted(lengths) == [4, 5, 6]
    with pytest.raises(ValueError, match="4 distinct prompt lengths need more than 6 padded tokens"):
        distinct_lengths(4, 6, torch.Generator().manual_seed(1), avoid=(1, 2, 3))


@pytest.mark.parametrize("cfg", [0, 3])
def test_prompts_and_conditions_refuse_a_cfg_other_than_one_or_two(cfg):
    """A third branch would silently reuse the negative prompts, and none would build an empty batch."""
    with pytest.raises(ValueError, match=f"cfg must be 1 .* got {cfg}"):
        padded_prompts(2, cfg, 4, 3, torch.Generator().manual_seed(0), "prompt_attention_mask")
    prompts = padded_prompts(2, 2, 4, 3, torch.Generator().manual_seed(0), "prompt_attention_mask")
    with pytest.raises(ValueError, match=f"cfg must be 1 .* got {cfg}"):
        uncond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds"})


def test_padded_prompts_carry_long_masks_and_keep_the_padded_embeddings_unless_told_to_zero_them():
    drawn = {zero: padded_prompts(2, 1, 4, 3, torch.Generator().manual_seed(0), "prompt_attention_mask",
                                  **({"zero_padding": True} if zero else {})) for zero in (False, True)}
    mask = drawn[False]["prompt_attention_mask"]
    assert mask.dtype == torch.long and 0 < int(mask.sum()) < mask.numel()  # some rows padded
    padded = (1 - mask)[..., None].bool()
    assert bool(drawn[False]["prompt_embeds"].masked_select(padded).ne(0).all())  # the default leaves them as drawn
    assert bool(drawn[True]["prompt_embeds"].masked_select(padded).eq(0).all())


def test_a_flux_transformer_whose_config_is_silent_on_guidance_embeds_has_none():
    """diffusers' FluxTransformer2DModel defaults guidance_embeds to False; so does the adapter for a config
    (a user's port, an older export) that leaves it out."""
    module = torch.nn.Linear(1, 1)
    module.config = types.SimpleNamespace(in_channels=64)
    assert FluxAdapter(module).guidance_embeds is False
    module.config.guidance_embeds = True
    assert FluxAdapter(module).guidance_embeds is True


def test_rows_held_as_python_values_are_told_apart_by_value_and_tensors_inside_them_by_bytes():
    ids = Conditions(batch=2, rows={"prompt": torch.arange(2.0), "ids": [3, 3]})
    assert discriminating.problems(ids) == ["row field 'ids': rows 0 and 1 of the cond branch are identical"]
    assert discriminating.problems(Conditions(batch=2, rows={"prompt": torch.arange(2.0), "ids": [3, 4]})) == []
    nested = Conditions(batch=2, rows={"prompt": torch.arange(2.0),
                                       "parts": [(1, torch.zeros(2)), (1, torch.tensor([0.0, -0.0]))]})
    assert discriminating.problems(nested) == []  # -0.0 is another row than 0.0: bytes, not ==


@pytest.mark.parametrize("name", REGISTERED)
def test_every_registered_adapter_refuses_a_cfg_other_than_one_or_two_when_building_conditions(name):
    """Behaviour, not wording: an adapter that builds its Conditions itself refuses in its own words; what every
    correct adapter does is refuse cfg = 3 with a ValueError (the toolkit's check_cfg raises one)."""
    family = get_family(name)
    adapter = family.adapter(tiny_model(family.name))
    prompts = adapter.example_prompts(2, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        adapter.conditions_from_prompts(prompts, 3)


def test_a_sana_latent_the_patch_size_does_not_divide_is_refused_before_the_model_runs():
    """Sana embeds patches with a strided convolution, which floors an odd side instead of failing: without the
    refusal a 7 x 7 latent would come back 6 x 6."""
    channels, size, _ = LATENT_SHAPE
    model = SanaTransformer2DModel(
        in_channels=channels, out_channels=channels, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=12,
        sample_size=size, patch_size=2)
    adapter = SANA.adapter(model)
    conditions = adapter.conditions_from_prompts(adapter.example_prompts(1, 1, torch.Generator().manual_seed(0)), 1)
    with pytest.raises(ValueError, match=r"latents of shape \(1, 4, 7, 7\) do not fit the model.s patch size 2: "
                                         r"the spatial dims \(7, 7\)"):
        adapter.forward(torch.zeros(1, channels, 7, 7), torch.ones(1), conditions)


@pytest.mark.parametrize("patch", [1, 2, 4])
def test_cogview4_shifts_by_the_image_tokens_the_pipeline_counts(patch):
    """CogView4Pipeline's mu comes from image_seq_len = (H/8)(W/8) / patch_size**2 tokens, through its
    calculate_shift (read from the installed diffusers)."""
    from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift

    module = torch.nn.Linear(1, 1)
    module.config = types.SimpleNamespace(patch_size=patch, in_channels=4, sample_size=16)
    assert CogView4Adapter(module).mu == pytest.approx(calculate_shift(16 * 16 // patch**2), rel=1e-15)


def test_flux_example_prompts_carry_the_embedded_guidance_only_to_a_distilled_checkpoint():
    distilled = FluxAdapter(tiny_flux())
    prompts = distilled.example_prompts(1, 2, torch.Generator().manual_seed(0), guidance_scale=5.0)
    assert prompts["guidance_scale"] == 5.0
    assert float(distilled.conditions_from_prompts(prompts, 2).shared["guidance"]) == 5.0
    module = torch.nn.Linear(1, 1)
    module.config = types.SimpleNamespace(**{**tiny_flux().config, "guidance_embeds": False})
    plain = FluxAdapter(module)
    assert "guidance_scale" not in plain.example_prompts(1, 2, torch.Generator().manual_seed(0), guidance_scale=5.0)


def test_qwen_image_example_embeddings_are_zero_past_each_mask_as_its_text_encoder_pads_them():
    adapter = QWEN_IMAGE.adapter(tiny_model("qwen_image"))
    prompts = adapter.example_prompts(2, 2, torch.Generator().manual_seed(0))
    for prefix in ("", "negative_"):
        embeds, mask = prompts[f"{prefix}prompt_embeds"], prompts[f"{prefix}prompt_embeds_mask"]
        assert bool((mask == 0).any()) and bool((embeds[mask == 1] != 0).all(dim=-1).all())
        assert torch.count_nonzero(embeds[mask == 0]) == 0


def test_cogview4_timesteps_are_the_shift_formula_rounded_once_to_fp32():
    """t = 1000 s / (s + mu (1 - s)) is worked out in fp64 and rounded once: fp32 arithmetic would be several ulps
    off on some sigmas, eating the oracle's timestep room."""
    adapter = COGVIEW4.adapter(tiny_model("cogview4"))
    sigma = torch.linspace(0.001, 0.999, 997, dtype=torch.float32)
    mu = adapter.mu
    exact = torch.tensor([1000.0 * s / (s + mu * (1.0 - s)) for s in sigma.tolist()], dtype=torch.float64)
    assert torch.equal(adapter.timestep(sigma), exact.to(torch.float32))


@pytest.mark.parametrize("family", [SD3, FLUX, QWEN_IMAGE, COGVIEW4, SANA], ids=lambda f: f.name)
def test_every_shipped_adapter_refuses_example_prompts_for_a_cfg_other_than_one_or_two(family):
    adapter = family.adapter(tiny_model(family.name))
    with pytest.raises(ValueError, match="cfg must be 1 .* got 3"):
        adapter.example_prompts(2, 3, torch.Generator().manual_seed(0))


def test_a_shipped_kind_is_a_diffusers_replay_kind_and_a_scheduler_factory_builds_a_fresh_configured_scheduler():
    kind = families._kind("k", "SomeTransformer2DModel", "fam")
    assert (kind.name, kind.feeds, kind.class_names, kind.source, kind.family) == (
        "k", "replay", ("SomeTransformer2DModel",), "diffusers", "fam")
    factory = families._flow_match(shift=3.0)
    first, second = factory(), factory()
    assert first is not second and first.config.shift == second.config.shift == 3.0


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_sana_timesteps_are_scaled_by_the_config_as_its_pipeline_scales_them(scale):
    """SanaPipeline hands the transformer t = 1000 sigma times transformer.config.timestep_scale."""
    module = torch.nn.Linear(1, 1)
    module.config = types.SimpleNamespace(timestep_scale=scale, in_channels=4, sample_size=8)
    sigma = torch.tensor([1.0, 0.25])
    assert torch.equal(SANA.adapter(module).timestep(sigma), torch.tensor([1000.0, 250.0]) * scale)


# ------------------------------------------------------------------ declared combines, latent shapes, spies


def test_a_combine_is_declared_as_the_pipeline_s_formula_and_evaluated_as_written():
    gen = torch.Generator().manual_seed(2)
    cond, uncond = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    anchored = cfg.combine(cfg.COND_ANCHORED, cond, uncond, 4.0, channel_dim=1)
    assert torch.equal(anchored, cond + 4.0 * (cond - uncond))
    assert torch.equal(cfg.combine(cfg.COND_ANCHORED, cond, uncond, 0.0, channel_dim=1), cond)  # anchored on cond
    assert torch.equal(cfg.combine(cfg.STANDARD, cond, uncond, 0.0, channel_dim=1), uncond)
    for formula in ("-g * uncond + (1 + g) * cond * 2 / 2.0", "+(g * (cond - uncond)) + cond"):
        own = cfg.CfgCombine(formula)  # any arithmetic of the three names, unary signs included
        torch.testing.assert_close(own.apply(cond, uncond, 4.0, 1), anchored, rtol=0, atol=1e-6)
    assert str(cfg.COND_ANCHORED) == "cond_anchored: cond + g * (cond - uncond)"
    assert str(cfg.TRUE_CFG_NORM_RESCALE).endswith("rescaled to ||cond|| over the channel dim")
    assert cfg.resolve("cond_anchored") is cfg.COND_ANCHORED and cfg.resolve(own) is own


@pytest.mark.parametrize(("formula", "message"), [
    ("uncond + g * (cond - ", "does not parse as a formula"),
    ("uncond + scale * (cond - uncond)", r"'scale' is not arithmetic .* of cond, uncond, g"),
    ("cond ** g", r"'cond \*\* g' is not arithmetic"),
    ("torch.lerp(uncond, cond, g)", "is not arithmetic"),
    ("cond + g * cond", "never reads uncond"),
])
def test_a_combine_formula_that_is_not_arithmetic_of_both_branches_and_the_scale_is_refused(formula, message):
    with pytest.raises(ValueError, match=message):
        cfg.CfgCombine(formula)
    with pytest.raises(ValueError, match="rescale must be one of"):
        cfg.CfgCombine("uncond + g * (cond - uncond)", rescale="max_norm")


class _OwnCombine(DenoiserAdapter):
    def combine(self, cond, uncond, guidance_scale):
        return cond + guidance_scale * (cond - uncond)


def test_reports_name_the_declared_combine_or_the_adapter_s_own_code():
    assert denoiser_module.declared_combine(SD3.adapter(tiny_model("sd3"))) == str(cfg.STANDARD)
    assert denoiser_module.declared_combine(_OwnCombine()) == (
        "_OwnCombine.combine (the adapter's own code; its cfg_combine says standard: uncond + g * (cond - uncond))")
    wrapped = denoiser_module.WrappedAdapter(SD3.adapter(tiny_model("sd3")))
    assert denoiser_module.declared_combine(wrapped) == str(cfg.STANDARD)


class _DefaultShape(families.ModelAdapter):
    """An adapter that keeps the base class's latent_shape."""


def test_the_default_latent_shape_names_the_config_field_it_lacks():
    module = torch.nn.Linear(1, 1)
    module.config = types.SimpleNamespace(in_channels=16)  # Z-Image's config: no sample_size, the call sizes it
    with pytest.raises(LatentShapeUnknown, match=r"_DefaultShape: the default latent_shape is \[in_channels, "
                                                 r"sample_size, sample_size\] .* Linear's config has no "
                                                 "'sample_size': override latent_shape"):
        _ = _DefaultShape(module).latent_shape
    module.config = {"in_channels": 4, "sample_size": 8}  # a diffusers FrozenDict is a mapping
    assert SANA.adapter(module).latent_shape == (4, 8, 8)


def test_the_forward_spy_counts_the_rows_of_a_transformer_that_takes_lists():
    class Lists(torch.nn.Module):
        def forward(self, x, t, captions):
            return t

    module = Lists()
    with spy_forwards(module) as spy:
        module([torch.ones(1)] * 5, torch.zeros(5), [torch.ones(2)] * 5)
        module(torch.ones(3, 2), torch.tensor(0.0), None)
        module(torch.tensor(0.0), torch.zeros(4), [])  # a 0-d value and an empty list are no rows
    assert spy.batch_sizes == [5, 3, 4]

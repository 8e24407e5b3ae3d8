"""The replay-family registry, the CFG combines and the harness's row broadcast: lookups, errors, contracts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import harness.plugins
from fixtures.replay_cases import real_problem
from fixtures.replay_models import tiny_flux
from harness.replay import cfg, families
from harness.replay.conditions import Conditions, broadcast_field, broadcast_rows
from harness.replay.families import FLUX, QWEN_IMAGE, SD3, family_for_class, get_family

pytestmark = pytest.mark.cpu


def test_register_is_idempotent_and_fills_both_registries():
    families.register(harness.plugins)
    families.register(harness.plugins)
    for family in (SD3, FLUX, QWEN_IMAGE):
        assert harness.plugins.REPLAY_FAMILIES.get(family.name) is family
        kind = harness.plugins.CHECKPOINT_KINDS.get(family.checkpoint_kind.name)
        assert (kind.feeds, kind.family, kind.source) == ("replay", family.name, "diffusers")


def test_families_choose_layout_and_combine():
    assert (SD3.cfg_layout, SD3.cfg_combine) == ("uncond_first", cfg.STANDARD)
    assert (FLUX.cfg_layout, FLUX.cfg_combine) == ("fused_cond_first", cfg.STANDARD)
    assert (QWEN_IMAGE.cfg_layout, QWEN_IMAGE.cfg_combine) == ("uncond_first", cfg.TRUE_CFG_NORM_RESCALE)


def test_lookup_by_model_class():
    assert family_for_class("QwenImageTransformer2DModel") is QWEN_IMAGE
    assert family_for_class("SD3Transformer2DModel") is SD3


def test_unregistered_family_names_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown replay family 'hunyuan'; registered: flux, (.+, )?qwen_image, sd3"):
        get_family("hunyuan")
    with pytest.raises(LookupError, match=r"no registered replay family drives WanTransformer3DModel; registered "
                                          r"replay families: flux \(FluxTransformer2DModel\), (.+, )?qwen_image"):
        family_for_class("WanTransformer3DModel")


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


def test_combine_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown CFG combine 'cfg_pp'; known: standard, true_cfg_norm_rescale"):
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


def test_flux_guidance_embeds_checkpoint_needs_the_guidance_row():
    assert tiny_flux().config.guidance_embeds is True
    problem = real_problem("flux", 1)
    conditions = problem.conditions
    assert conditions.rows["guidance"].tolist() == [3.5] * conditions.batch
    rows = {k: v for k, v in conditions.rows.items() if k != "guidance"}
    x = problem.segment.latent_at(0).float()
    with pytest.raises(ValueError, match="guidance_embeds=True; its conditions need a 'guidance' row field"):
        problem.adapter.forward(x, torch.full((x.shape[0],), 0.5), dataclasses.replace(conditions, rows=rows))


def test_qwen_image_masks_are_padded_with_unequal_lengths():
    conditions = real_problem("qwen_image", 2).conditions
    for branch in (conditions, conditions.negative):
        lengths = branch.rows["encoder_hidden_states_mask"].sum(dim=1).tolist()
        assert len(set(lengths)) > 1 and max(lengths) == branch.rows["encoder_hidden_states"].shape[1]
        assert branch.rows["img_shapes"] == [[(1, 4, 4)]] * branch.batch


def test_flux_guidance_row_reaches_the_model():
    """The distilled guidance is an input of the forward: another value gives another velocity."""
    problem = real_problem("flux", 1)
    conditions = problem.conditions
    x = problem.segment.latent_at(0).float()
    timestep = torch.full((x.shape[0],), 0.5)
    other = dataclasses.replace(conditions, rows={**conditions.rows, "guidance": torch.ones(x.shape[0])})
    assert not torch.equal(problem.adapter.forward(x, timestep, conditions),
                           problem.adapter.forward(x, timestep, other))

"""The family author's toolkit: one import holds what a family needs, and its fused cond-first helper lays the
branches out as HunyuanImage-3's model splits them."""

from __future__ import annotations

import pytest
import torch

from harness.replay import toolkit
from harness.replay.tiling import tile_conditions

pytestmark = pytest.mark.cpu


def test_fused_cond_first_conditions_put_cond_rows_first_and_keep_branch_independent_fields_once():
    prompts = toolkit.padded_prompts(3, 2, 6, 4, torch.Generator().manual_seed(0), "prompt_attention_mask")
    prompts["rope"] = torch.arange(3.0)[:, None]
    conditions = toolkit.fused_cond_first_conditions(
        prompts, 2, {"text": "prompt_embeds", "mask": "prompt_attention_mask", "rope": "rope"},
        branch_independent=("rope",), shared={"size": 64}).validate()
    assert (conditions.batch, conditions.cfg_factor, conditions.shared) == (3, 2, {"size": 64})
    assert torch.equal(conditions.rows["text"][:3], prompts["prompt_embeds"])
    assert torch.equal(conditions.rows["text"][3:], prompts["negative_prompt_embeds"])
    assert torch.equal(conditions.rows["rope"], prompts["rope"])
    tiled = tile_conditions(conditions, 2)  # the harness owns the layout from here: branch-major, step-major inside
    assert torch.equal(tiled.rows["text"][:6], prompts["prompt_embeds"].repeat(2, 1, 1))
    single = toolkit.fused_cond_first_conditions(prompts, 1, {"text": "prompt_embeds"})
    assert (single.cfg_factor, single.rows["text"].shape[0]) == (1, 3)
    with pytest.raises(ValueError, match="cfg must be 1 .* got 3"):
        toolkit.fused_cond_first_conditions(prompts, 3, {"text": "prompt_embeds"})


def test_the_toolkit_exports_every_piece_a_family_is_built_from():
    for name in ("ModelAdapter", "ReplayFamily", "PipelineSpec", "CheckpointKind", "UNCOND_FIRST", "FUSED_COND_FIRST",
                 "STANDARD", "COND_ANCHORED", "TRUE_CFG_NORM_RESCALE", "CfgCombine", "padded_prompts",
                 "ragged_prompts", "distinct_lengths", "uncond_first_conditions", "fused_cond_first_conditions",
                 "flow_match_scheduler"):
        assert name in toolkit.__all__ and getattr(toolkit, name) is not None


def test_ragged_prompts_are_one_caption_per_sample_every_length_different_and_they_tile_row_by_row():
    prompts = toolkit.ragged_prompts(3, 2, 6, 4, torch.Generator().manual_seed(0))
    assert set(prompts) == {"prompt_embeds", "negative_prompt_embeds"}
    lengths = [len(caption) for key in ("prompt_embeds", "negative_prompt_embeds") for caption in prompts[key]]
    assert len(set(lengths)) == 6 and max(lengths) <= 6
    conditions = toolkit.fused_cond_first_conditions(prompts, 2, {"captions": "prompt_embeds"}).validate()
    tiled = tile_conditions(conditions, 2).rows["captions"]
    assert isinstance(tiled, list) and [len(c) for c in tiled] == lengths[:3] * 2 + lengths[3:] * 2
    assert set(toolkit.ragged_prompts(2, 1, 6, 4, torch.Generator().manual_seed(0))) == {"prompt_embeds"}

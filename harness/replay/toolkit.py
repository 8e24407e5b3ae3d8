"""The replay family author's toolkit: everything a family from outside the suite needs, in one import.

A family is an adapter (its model's call, in replay's layout), example conditions that tell rows and CFG branches
apart, the CFG combine its pipeline uses, a checkpoint kind and the pipeline it is tied to. The pieces below are
the ones the shipped families are built from; ``docs/extending.md`` walks through a family made of them.

- ``ModelAdapter``, ``ReplayFamily``, ``PipelineSpec``, ``CheckpointKind``: what a family registers;
- ``UNCOND_FIRST`` / ``FUSED_COND_FIRST`` (``cfg_layout``): the two CFG layouts; ``CfgCombine`` (``cfg_combine``):
  a pipeline's CFG combine declared as its formula over cond, uncond and g, and the ones the suite's families use,
  ``STANDARD``, ``COND_ANCHORED`` and ``TRUE_CFG_NORM_RESCALE``;
- ``padded_prompts``, ``ragged_prompts``, ``distinct_lengths``, ``padding_mask``, ``check_cfg``: seeded example
  prompts whose rows and branches differ (the harness refuses example conditions that do not), padded with masks
  or, for a transformer that takes lists, one caption per sample with its padding cut off;
- ``uncond_first_conditions`` and ``fused_cond_first_conditions``: conditions in either layout from those
  prompts;
- ``flow_match_scheduler``: the flow-matching Euler scheduler most DiT pipelines step with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.plugins.entry_points import CheckpointKind
from harness.replay.cfg import COND_ANCHORED, STANDARD, TRUE_CFG_NORM_RESCALE, CfgCombine
from harness.replay.conditions import Conditions, concat_payloads, payload_rows
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST
from harness.replay.families import flow_match_scheduler
from harness.replay.families.base import (
    ModelAdapter,
    PipelineSpec,
    Prompts,
    ReplayFamily,
    check_cfg,
    distinct_lengths,
    padded_prompts,
    padding_mask,
    ragged_prompts,
    uncond_first_conditions,
)

__all__ = ["COND_ANCHORED", "FUSED_COND_FIRST", "STANDARD", "TRUE_CFG_NORM_RESCALE", "UNCOND_FIRST", "CfgCombine",
           "CheckpointKind", "Conditions", "ModelAdapter", "PipelineSpec", "Prompts", "ReplayFamily", "check_cfg",
           "distinct_lengths", "flow_match_scheduler", "fused_cond_first_conditions", "padded_prompts", "padding_mask",
           "ragged_prompts", "uncond_first_conditions"]


def fused_cond_first_conditions(prompts: Prompts, cfg: int, fields: Mapping[str, str],
                                branch_independent: Sequence[str] = (),
                                shared: Mapping[str, Any] | None = None) -> Conditions:
    """Fused cond-first conditions (HunyuanImage-3's layout) from pipeline prompts.

    ``fields`` maps a row field to its prompt key; with cfg=2 each such field holds ``[cond_B; uncond_B]``, the
    ``negative_`` key's rows second, as the model splits its batch at the midpoint. ``branch_independent`` fields
    (their prompt key only, B rows) are used once per branch by the harness; ``shared`` passes through untiled.
    """
    check_cfg(cfg)
    rows: dict[str, Any] = {}
    for name, key in fields.items():
        if name in branch_independent or cfg == 1:
            rows[name] = prompts[key]
        else:
            rows[name] = concat_payloads([prompts[key], prompts[f"negative_{key}"]], f"field {name!r}")
    batch = payload_rows(prompts[next(iter(fields.values()))])
    return Conditions(batch=batch, rows=rows, shared=dict(shared or {}), cfg_factor=cfg)

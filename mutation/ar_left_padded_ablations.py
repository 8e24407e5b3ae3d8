"""Ablations of the ar path's left-padded layout: the reported bugs of left-padded batched generation, re-introduced
over the seams of ``harness.ar.left_padded``.

The bugs of the pieces both layouts share (the recorded log-prob, the KV freeze of finished rows) are the
right-padded catalogue's ablations, which claim the left-padded checks too (``mutation.ar_ablations``). Each
ablation here claims only checks it was measured to kill, far over their tolerances on every model; the reasons
say what else it breaks.
"""

from __future__ import annotations

import torch

from fixtures import ar_space
from fixtures.ar_models import BACKENDS as MODELS
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId

_BATCHED = ("unequal_real_pos", "length_skew", "all_padded")
_TOKENS_FACT = "batched tokens equal B=1 on every step"


def _ids(models, cases, quantities) -> list[str]:
    return [str(check) for check in CheckId.grid("ar", models, [f"left.{c}" for c in cases], quantities)]


def _rollouts(models, whats) -> list[str]:
    return [str(check) for check in CheckId.grid("ar", models, ["left"], whats)]


def _shared_cache_position(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.full_like(lengths, width)


def _pad_keys_visible(written: torch.Tensor, pad_keys: torch.Tensor) -> torch.Tensor:
    return written.reshape(*written.shape[:-1], 1, 1, written.shape[-1])


def _mask_dropped(written: torch.Tensor, pad_keys: torch.Tensor) -> None:
    return None


def _column_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    width = attention_mask.shape[-1]
    return torch.arange(width, device=attention_mask.device)[None].expand(attention_mask.shape[0], -1)


def _right_padded_column(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return lengths - 1


_GROWTH = _ids(MODELS, ("growth",), ("logp",))
_NAN = _rollouts(MODELS, ("nan_unused_slots",))

ablation(
    "ar.left.positions_from_shared_cache_position", "harness.ar.left_padded:decode_start", _shared_cache_position,
    kills=[*_ids(MODELS, _BATCHED, ("logp",)), *_ids(MODELS, ("padded_b1",), ("equals_unpadded",)), *_GROWTH],
    modes=dict.fromkeys(_GROWTH, "fact"), fact=dict.fromkeys(_GROWTH, _TOKENS_FACT),
    why=("decode positions taken from the shared cache position (the column every row writes, the batch's width) "
         "instead of each row's own length: every padded row's queries sit its pad count too far from its prompt's "
         "keys (RoPE), and on the per-row-slot fake its tokens are written there too. The unpadded row is right. The "
         "growth check sees its tokens diverge (a fact), whatever its error curve does."),
    kill_mode="tolerance",
)

ablation(
    "ar.left.pad_keys_visible", "harness.ar.left_padded:decode_key_mask", _pad_keys_visible,
    kills=["ar.gpu.left.batched_vs_b1", *_ids(MODELS, _BATCHED, ("tokens",)), *_NAN],
    modes=dict.fromkeys(_NAN, "fact"),
    fact="every logit finite: no masked-out slot was read",
    why=("decode masks admit every slot the row wrote, its pads' KV from the prefill included (a static cache keeps "
         "it; a model's own causal mask admits it): each padded row attends its pads at every decode step. The "
         "prefill is untouched (prefill_kv survives); the NaN planted in the pads' slots reaches the logits. On the "
         "fake's B=1 the dynamic cache trims the pads away, so its padded_b1 survives."),
    kill_mode="tolerance",
)

ablation(
    "ar.left.decode_mask_dropped", "harness.ar.left_padded:decode_key_mask", _mask_dropped,
    kills=["ar.gpu.left.batched_vs_b1", *_ids(MODELS, _BATCHED, ("logp",)), *_rollouts(MODELS, ("finished_rows",))],
    why=("the mask is applied at the prefill only and decode steps run unmasked: the transformers models fall back to "
         "their own causal mask over the static cache (pads included), the fake attends every slot (pads and the "
         "never-written tail). Prefill KV survives."),
    kill_mode="tolerance",
)

ablation(
    "ar.left.positions_not_shifted", "harness.ar.left_padded:left_positions", _column_positions,
    kills=[*_ids(MODELS, _BATCHED, ("prefill_kv",)), *_ids(MODELS, ("padded_b1",), ("equals_unpadded",))],
    why=("prefill position_ids are the column index, not shifted by each row's pad count: a padded row's keys are "
         "rotated (RoPE) for positions its B=1 run never gives them, so its prefill KV differs, and its decode "
         "positions (its own length onward) no longer continue its prompt's; on the per-row-slot fake its prompt is "
         "written past its length, where decode overwrites it."),
    kill_mode="tolerance",
)

ablation(
    "ar.left.first_logits_at_real_pos", "harness.ar.left_padded:first_logits_column", _right_padded_column,
    kills=_ids(MODELS, _BATCHED, ("tokens",)),
    why=("the first token is read at column real_pos - 1, the right-padded layout's rule: in a left-padded row that "
         "column is a pad or a token inside the prompt; only unpadded rows are read right."),
    kill_mode="tolerance",
)


def _pad_queries_admit_nothing(attention_mask: torch.Tensor, slots: torch.Tensor, key_length: int) -> torch.Tensor:
    bsz, width = attention_mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    by_column = causal[None] & attention_mask[:, None, :] & attention_mask[:, :, None]
    out = torch.zeros(bsz, width, max(key_length, width), dtype=torch.bool, device=attention_mask.device)
    out.scatter_(2, slots[:, None, :].expand(bsz, width, width), by_column)
    return out[..., :key_length][:, None]


_PADDED = _ids(MODELS, ("unequal_real_pos", "length_skew", "all_padded"), ("tokens",))
_EAGER = ar_space.ids(padding_side="left", kernel="eager")
ablation(
    "ar.left.pad_queries_admit_nothing", "harness.ar.left_padded:prefill_mask", _pad_queries_admit_nothing,
    kills=[*_PADDED, *ar_space.ids(padding_side="left")], modes=dict.fromkeys(_EAGER, "tolerance"),
    why=("a pad's query row of the prefill mask admits no key: torch's SDPA gives such a row zeros, so the numbers "
         "pass there, but an eager -inf softmax (and some fused kernels) turns it to NaN, which the next layer writes "
         "into the pad's KV, where a masked-out read still multiplies it in: the left-padded points of the ar space "
         "under the eager kernel fail in their numbers (NaN logits). The fact on the mask the model received "
         "catches it whatever the kernel."),
    kill_mode="fact",
    fact="every query row of the prefill mask admits a key",
)

"""Right-padded AR batches: the tokenizer-style layout and the concat of separately embedded rows.

Both layouts carry what upstream's ``prepare_model_inputs`` carries for ``gen_text``: ``input_ids [B, L]``,
``position_ids [B, L]`` (also the KV-cache write index), a bool prefill mask ``[B, 1, L, L]`` (True = may
attend) and ``tokenizer_output.real_pos [B, 1]``, each row's unpadded length (its first pad index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ARBatch", "ARRow", "concat", "embed_row", "pad_positions", "pad_seq", "right_padded_batch"]


@dataclass(frozen=True)
class ARRow:
    """One prompt embedded on its own (upstream's ``embed_for_ar`` at B=1): no padding, real_pos == L."""

    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long
    attention_mask: torch.Tensor  # [1, 1, L, L] bool
    real_pos: torch.Tensor  # [1, 1] long


@dataclass(frozen=True)
class ARBatch:
    """A right-padded batch; ``real_pos`` may be None only to exercise the missing-real_pos error."""

    input_ids: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, 1, L, L] bool
    real_pos: torch.Tensor | None  # [B, 1] long
    pad_id: int

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def prompts(self) -> list[torch.Tensor]:
        """Each row's unpadded prompt ``input_ids[i, :real_pos_i]`` (what a B=1 run is given)."""
        if self.real_pos is None:
            raise ValueError("ARBatch.prompts() needs tokenizer_output.real_pos [B, 1]; it is None")
        return [self.input_ids[i, : int(self.real_pos[i, 0])] for i in range(self.batch_size)]

    def without_real_pos(self) -> ARBatch:
        return ARBatch(self.input_ids, self.position_ids, self.attention_mask, None, self.pad_id)


def _as_prompt(prompt: Sequence[int] | torch.Tensor, index: int) -> torch.Tensor:
    ids = torch.as_tensor(prompt, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"prompt {index} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"prompt {index} is empty; every AR row needs at least one token")
    return ids


def _causal(length: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def embed_row(prompt: Sequence[int] | torch.Tensor) -> ARRow:
    """Embed one text prompt alone: arange positions, causal mask, real_pos = L."""
    ids = _as_prompt(prompt, 0)
    length = ids.numel()
    return ARRow(ids[None], torch.arange(length)[None], _causal(length)[None, None],
                 torch.tensor([[length]], dtype=torch.long))


def right_padded_batch(prompts: Sequence[Sequence[int] | torch.Tensor], pad_id: int,
                       width: int | None = None) -> ARBatch:
    """Tokenizer-style batch: rows right-padded to ``width`` (default the longest), ``position_ids =
    arange(width)`` for every row and a causal mask over the whole width, as upstream's generation prep builds.
    ``width`` larger than the longest prompt pads every row ("all rows padded")."""
    if not prompts:
        raise ValueError("right_padded_batch needs at least one prompt")
    rows = [_as_prompt(p, i) for i, p in enumerate(prompts)]
    longest = max(r.numel() for r in rows)
    width = longest if width is None else int(width)
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : row.numel()] = row
    position_ids = torch.arange(width)[None].expand(len(rows), -1)
    mask = _causal(width)[None, None].expand(len(rows), -1, -1, -1)
    real_pos = torch.tensor([[r.numel()] for r in rows], dtype=torch.long)
    return ARBatch(input_ids, position_ids, mask, real_pos, int(pad_id))


def pad_seq(tensor: torch.Tensor, length: int, dim: int, value: int | float | bool) -> torch.Tensor:
    """Right-pad ``tensor`` along ``dim`` to ``length`` with a constant."""
    missing = length - tensor.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad dim {dim} of size {tensor.shape[dim]} down to {length}")
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


def pad_positions(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Pad one row's ``position_ids [1, L_i]`` to ``length`` with the row's own continuing indices.

    position_ids are the KV-cache write indices (upstream passes them to ``index_copy_`` as cache_position),
    so a constant pad would write every pad's KV onto one slot, last write wins (the AR PR saw slot 0 off by ~4).
    """
    missing = length - position_ids.shape[-1]
    if missing < 0:
        raise ValueError(f"cannot pad position_ids of length {position_ids.shape[-1]} down to {length}")
    start = position_ids[..., -1:] + 1
    tail = start + torch.arange(missing, device=position_ids.device)
    return torch.cat([position_ids, tail], dim=-1)


def concat(rows: Sequence[ARRow], pad_id: int) -> ARBatch:
    """Merge separately embedded rows into one right-padded batch (the AR issue's construction, docs/contracts.md).

    input_ids are padded with ``pad_id``, the mask with False on both axes, position_ids through
    ``pad_positions`` (looked up at call time: it is a seam), and real_pos rows are stacked.
    """
    if not rows:
        raise ValueError("concat needs at least one embedded row")
    for i, row in enumerate(rows):
        if row.input_ids.dim() != 2 or row.input_ids.shape[0] != 1:
            raise ValueError(f"row {i}: input_ids must be [1, L], got {tuple(row.input_ids.shape)}")
        if row.real_pos is None:
            raise ValueError(f"row {i}: tokenizer_output.real_pos is missing; embed each row with real_pos [1, 1]")
    width = max(int(r.input_ids.shape[1]) for r in rows)
    input_ids = torch.cat([pad_seq(r.input_ids, width, 1, int(pad_id)) for r in rows])
    position_ids = torch.cat([pad_positions(r.position_ids, width) for r in rows])
    masks = [pad_seq(pad_seq(r.attention_mask, width, 2, False), width, 3, False) for r in rows]
    real_pos = torch.cat([r.real_pos for r in rows])
    return ARBatch(input_ids, position_ids, torch.cat(masks), real_pos, int(pad_id))

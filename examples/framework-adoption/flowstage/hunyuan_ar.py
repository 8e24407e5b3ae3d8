"""HunyuanImage-3's text generation, batched: right-padded prompts decoded together over upstream's static cache.

The model's own cache class (``HunyuanStaticCache``) writes each row at its ``position_ids``. Its ``dynamic`` mode
trims the keys it returns to one row's length, which is right for one prompt and wrong for several, so the stage
takes it at batch size 1 only (upstream's generate does, for a single prompt) and a static cache padded to
prompt + new tokens otherwise, masking every row's keys to ``[0, its length)`` itself. Sampling is greedy; a row that
emits an EOS id stops there (pads after it, its cache slots left as they were).

This framework runs HunyuanImage-3 only, and speaks the Instruct code's text forward (``rope_image_info``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ARPromptBatch", "ARTrajectory", "HunyuanImage3ARStage"]


@dataclass(frozen=True)
class ARPromptBatch:
    """Right-padded prompts: ``input_ids [B, W]``, ``position_ids [B, W]``, bool ``attention_mask [B, 1, W, W]`` and
    each row's unpadded length ``real_pos [B]`` (the tokenizer's)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    real_pos: torch.Tensor


@dataclass(frozen=True)
class ARTrajectory:
    """What a rollout produced: tokens and log-probs ``[B, N]`` (pads and 0 after a row's EOS), the logits each
    token was drawn from ``[B, N, V]``, tokens emitted per row, and the cache with each row's slots
    ``[0, real_pos + kept)`` holding its prompt and generated tokens."""

    tokens: torch.Tensor
    logp: torch.Tensor
    logits: torch.Tensor
    lengths: torch.Tensor
    real_pos: torch.Tensor
    kept: torch.Tensor
    cache: Any

    def kv_rows(self) -> tuple[torch.Tensor, ...]:
        """Each row's KV ``[layers, 2, H, T, hd]`` in the order its tokens came (prompt, then generated)."""
        rows = []
        for row in range(self.tokens.shape[0]):
            slots = torch.arange(int(self.real_pos[row] + self.kept[row]))
            rows.append(torch.stack([torch.stack([layer.keys[row][:, slots], layer.values[row][:, slots]])
                                     for layer in self.cache.layers]).float().cpu())
        return tuple(rows)


class HunyuanImage3ARStage:
    """Greedy batched decoding on a HunyuanImage-3 model (``mode="gen_text"``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache_cls = sys.modules[type(model).__module__].HunyuanStaticCache
        self.pad_id = int(model.config.pad_id)

    def _cache(self, rows: int, slots: int) -> Any:
        """A dynamic cache holds one prompt only: batch size 1 takes it, every larger batch the static cache."""
        return self.cache_cls(config=self.model.config, max_batch_size=rows, max_cache_len=slots,
                              dtype=self.model.dtype, dynamic=rows == 1)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: Any) -> Any:
        self.model.post_token_len = None  # what generate sets for text: no image tokens follow
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=True, mode="gen_text", rope_image_info=[[] for _ in range(ids.shape[0])]).logits

    @torch.no_grad()
    def rollout(self, prompts: ARPromptBatch, *, max_new_tokens: int, eos_ids: Sequence[int] = ()) -> ARTrajectory:
        ids, real_pos = prompts.input_ids, prompts.real_pos.reshape(-1).long()
        rows, width = ids.shape
        cache = self._cache(rows, width + max_new_tokens)
        dynamic = rows == 1
        everyone = torch.arange(rows)
        stop = torch.tensor(list(eos_ids), dtype=torch.long)
        tokens = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long)
        logp = torch.zeros(rows, max_new_tokens)
        logits_seen = None
        lengths = torch.zeros(rows, dtype=torch.long)
        kept = torch.zeros(rows, dtype=torch.long)  # generated tokens whose KV each row holds
        done = torch.zeros(rows, dtype=torch.bool)
        keys = width + max_new_tokens
        for step in range(max_new_tokens):
            if step == 0:
                mask = torch.zeros(rows, 1, width, width if dynamic else keys, dtype=torch.bool)
                mask[..., :width] = prompts.attention_mask
                out = self._forward(ids, mask, prompts.position_ids, cache)
                picked = out[everyone, real_pos - 1].float()
            else:
                writes = ~done
                positions = real_pos + step - 1
                finished = done.nonzero().flatten().tolist()
                frozen = self._held(cache, finished, positions)
                mask = None
                if not dynamic:
                    valid = torch.arange(keys)[None] < (real_pos + kept + writes.long())[:, None]
                    mask = valid[:, None, None, :]
                out = self._forward(tokens[:, step - 1:step], mask, positions[:, None], cache)
                self._restore(cache, finished, positions, frozen)
                kept = kept + writes.long()
                picked = out[:, -1].float()
            logits_seen = picked.new_zeros(rows, max_new_tokens, picked.shape[-1]) if logits_seen is None \
                else logits_seen
            logits_seen[:, step] = picked
            token = picked.argmax(dim=-1)
            live = ~done
            tokens[:, step] = torch.where(live, token, self.pad_id)
            logp[:, step] = torch.where(live, torch.log_softmax(picked, dim=-1)[everyone, token], 0.0)
            lengths = torch.where(live, step + 1, lengths)
            done = done | (live & torch.isin(token, stop))
            if bool(done.all()):
                break
        return ARTrajectory(tokens, logp, logits_seen, lengths, real_pos, kept, cache)

    @staticmethod
    def _held(cache: Any, rows: list[int], positions: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """What the finished ``rows`` hold at the slots this step's forward writes (every row writes one)."""
        return [[(layer.keys[r][:, positions[r]].clone(), layer.values[r][:, positions[r]].clone()) for r in rows]
                for layer in cache.layers]

    @staticmethod
    def _restore(cache: Any, rows: list[int], positions: torch.Tensor,
                 held: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Put back what finished rows held: a finished row writes no more KV."""
        for layer, kept in zip(cache.layers, held, strict=True):
            for row, (keys, values) in zip(rows, kept, strict=True):
                layer.keys[row][:, positions[row]] = keys
                layer.values[row][:, positions[row]] = values

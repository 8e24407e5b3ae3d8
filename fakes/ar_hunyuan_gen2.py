"""Fake HunyuanImage-3 upstream, generation 2 (the Instruct ``modeling_hunyuan_image_3.py``).

What sets this generation apart (each row of docs/ar-contract.md):

- RoPE is built inside ``forward`` from ``rope_image_info`` (one entry per row; ``None`` builds one table) by a
  ``CachedRoPE`` over ``max_position_embeddings`` positions and gathered per row at ``position_ids`` with
  ``torch.gather``: at B > 1 a ``None`` (one table) cannot be gathered for B rows and fails.
- ``prepare_inputs_for_generation`` forwards ``rope_image_info`` (no ``use_cache``); the kwargs update keeps it,
  stores the cache under the first ``ALL_CACHE_NAMES`` name found in the outputs, and after the prefill drops
  ``tokenizer_output`` and the mask.
- The cache's lazy init takes the installed transformers' arity (seed 002 ran this generation on 5.12).
- ``generate`` gets its 4-D mask from ``_prepare_attention_mask_for_generation``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin

from harness import compat

from .ar_hunyuan_common import (
    HunyuanImage3Config,
    HunyuanStaticCacheBase,
    HunyuanTextModel,
    build_batch_2d_rope,
    carry_cache_and_positions,
    causal_generation_mask,
)

__all__ = ["CachedRoPE", "HunyuanImage3Config", "HunyuanImage3ForCausalMM", "HunyuanStaticCache"]


class HunyuanStaticCache(HunyuanStaticCacheBase):
    """Generation 2's cache: lazy init with the installed transformers' arity."""

    def _lazy_init(self, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        compat.lazy_init_layer(layer, key_states, value_states)


class CachedRoPE:
    """Tables for ``(seq_len, rope_image_info)``, rebuilt when either changes; gathered at ``position_ids``."""

    def __init__(self, config: HunyuanImage3Config) -> None:
        self.config = config
        self.key: tuple[int, Any] | None = None
        self.cos = self.sin = None

    def __call__(self, seq_len: int, device: torch.device, rope_image_info: list | None,
                 position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, rope_image_info)
        if self.key != key or self.cos is None or self.cos.device != device:
            self.cos, self.sin = build_batch_2d_rope(seq_len, self.config.attention_head_dim, rope_image_info,
                                                     device, self.config.rope_theta)
            self.key = key
        assert position_ids.dim() == 2, f"{position_ids.shape=}"
        index = position_ids[..., None].expand(-1, -1, self.cos.size(-1))
        return torch.gather(self.cos, 1, index), torch.gather(self.sin, 1, index)


class HunyuanImage3ForCausalMM(HunyuanTextModel, GenerationMixin):
    """Generation 2's text path: RoPE from ``rope_image_info``."""

    def __init__(self, config: HunyuanImage3Config) -> None:
        super().__init__(config)
        self.cached_rope = CachedRoPE(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: HunyuanStaticCache | None = None,
                rope_image_info: list | None = None, mode: str = "gen_text", **kwargs: Any):
        seq_len = self.config.max_position_embeddings  # inference: the whole table, as upstream
        if position_ids is None:
            raise ValueError("position_ids are required (they are also the KV write index)")
        cos, sin = self.cached_rope(seq_len, input_ids.device, rope_image_info, position_ids)
        return self.text_forward(input_ids, attention_mask, position_ids, past_key_values, cos, sin, mode)

    def _prepare_attention_mask_for_generation(self, inputs_tensor: torch.Tensor, generation_config: Any,
                                               model_kwargs: dict[str, Any]) -> torch.Tensor:
        return causal_generation_mask(inputs_tensor)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, tokenizer_output=None, batch_gen_image_info=None,
                                      batch_cond_images=None, generator=None, **kwargs: Any) -> dict[str, Any]:
        position_ids = kwargs.get("position_ids")
        assert position_ids is not None, "position_ids must be provided in kwargs."
        if input_ids.shape[1] != position_ids.shape[1]:  # decode steps re-read the input at position_ids
            input_ids = torch.gather(input_ids, dim=1, index=position_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "rope_image_info": kwargs["rope_image_info"],
            "mode": kwargs["mode"],
        }

    def _update_model_kwargs_for_generation(self, outputs: Any, model_kwargs: dict[str, Any],
                                            is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict[str, Any]:
        kept = {"mode": model_kwargs["mode"], "rope_image_info": model_kwargs["rope_image_info"]}
        return carry_cache_and_positions(outputs, model_kwargs, kept, self.device)

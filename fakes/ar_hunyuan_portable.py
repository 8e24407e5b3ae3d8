"""Fake HunyuanImage-3 text path on any supported transformers: generation 2's plumbing, routing that ignores the
batch.

Neither real generation imports on transformers 5.x (both need ``transformers.modeling_attn_mask_utils``), yet
the CPU tier must hold the batched loop to the per-row-slot contract on every stack. This module is that contract
and nothing more: generation 2's hooks (``ar_hunyuan_gen2`` subclasses them), its cache with the installed
transformers' lazy-init arity, and a MoE that routes each token alone (no capacity, no single-token path), so
batched and B=1 compute one function. It models no released file; docs/ar-contract.md says where each
generation departs from it.

What it shares with generation 2 (rows of docs/ar-contract.md):

- RoPE is built inside ``forward`` from ``rope_image_info`` (one entry per row; ``None`` builds one table) by a
  ``CachedRoPE`` over ``max_position_embeddings`` positions and gathered per row at ``position_ids`` with
  ``torch.gather``: at B > 1 a ``None`` (one table) cannot be gathered for B rows and fails.
- ``forward`` reads ``self.post_token_len``, which only upstream's ``generate`` assigns: a caller that drives the
  hooks itself must set it, or the forward fails as upstream's does.
- ``_prepare_attention_mask_for_generation`` reads ``model_kwargs["tokenizer_output"]`` and asks the image
  processor for each row's full-attention slices (``vae_image_slices`` + ``vit_image_slices`` for
  ``cond_token_attn_type="full"``, plus ``gen_image_slices``), on the inputs' device.
- ``prepare_inputs_for_generation`` forwards ``rope_image_info`` (no ``use_cache``); the kwargs update keeps it,
  stores the cache under the first ``ALL_CACHE_NAMES`` name found in the outputs, and after the prefill drops
  ``tokenizer_output`` and the mask.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import GenerationMixin

from harness.inputs import compat

from .ar_hunyuan_common import (
    HunyuanImage3Config,
    HunyuanStaticCacheBase,
    HunyuanTextModel,
    build_batch_2d_rope,
    carry_cache_and_positions,
    causal_generation_mask,
)

# transformers 4.x copies only the modules a checkpoint's modeling file imports itself: its helpers' too
from .hunyuan_image_gen import timestep_embedding
from .hunyuan_image_pipeline import HunyuanImage3Text2ImagePipeline  # noqa: F401

__all__ = ["CachedRoPE", "FullAttentionSlices", "HunyuanImage3Config", "HunyuanImage3ForCausalMM",
           "HunyuanStaticCache", "build_batch_2d_rope", "timestep_embedding"]


class HunyuanStaticCache(HunyuanStaticCacheBase):
    """The cache with the installed transformers' lazy-init arity."""

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


class FullAttentionSlices:
    """Generation 2's image processor, as far as the mask builder asks it: each row's full-attention slices,
    read from ``tokenizer_output`` by ``cond_image_type`` and ``cond_token_attn_type``. Like upstream it reads
    every choice of its ``cond_image_type`` before picking one (``vae_vit`` reads the joint slices too)."""

    # cond_image_type -> cond_token_attn_type -> the tokenizer_output fields whose slices attend fully
    CHOICES: ClassVar[dict[str, dict[str, tuple[str, ...]]]] = {
        "vae": {"causal": (), "full": ("vae_image_slices",)},
        "vit": {"causal": (), "full": ("vit_image_slices",)},
        "vae_vit": {"causal": (), "full": ("vae_image_slices", "vit_image_slices"),
                    "joint_full": ("joint_image_slices",), "full_causal": ("vae_image_slices",)},
    }

    def __init__(self, config: HunyuanImage3Config) -> None:
        self.cond_image_type = config.cond_image_type
        self.cond_token_attn_type = config.cond_token_attn_type

    def prepare_full_attn_slices(self, output: Any, batch_idx: int, with_gen: bool = True) -> list[slice]:
        if self.cond_image_type not in self.CHOICES:
            raise ValueError(f"Unknown cond_image_type: {self.cond_image_type}")
        choices = {choice: [span for name in fields for span in getattr(output, name)[batch_idx]]
                   for choice, fields in self.CHOICES[self.cond_image_type].items()}
        slices = choices[self.cond_token_attn_type]
        return slices + output.gen_image_slices[batch_idx] if with_gen else slices


#: what ``prepare_inputs_for_generation`` passes on for ``mode="gen_image"`` (None when absent), as upstream's does
GEN_IMAGE_INPUTS = ("images", "image_mask", "timesteps", "timesteps_index", "cond_vae_images", "cond_vae_image_mask",
                    "cond_timesteps", "cond_timesteps_index", "gen_timestep_scatter_index")


class HunyuanImage3ForCausalMM(HunyuanTextModel, GenerationMixin):
    """Generation 2's text path: RoPE from ``rope_image_info``."""

    def __init__(self, config: HunyuanImage3Config) -> None:
        super().__init__(config)
        self.image_processor = FullAttentionSlices(config)
        self.cached_rope = CachedRoPE(config)
        self.num_image_tokens = None  # set by upstream's generate for gen_image only
        self.num_special_tokens = None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: HunyuanStaticCache | None = None,
                rope_image_info: list | None = None, mode: str = "gen_text", images: Any = None,
                image_mask: torch.Tensor | None = None, timesteps: Any = None, timesteps_index: Any = None,
                cond_vae_images: Any = None, cond_vae_image_mask: torch.Tensor | None = None,
                cond_timesteps: Any = None, cond_timesteps_index: Any = None, first_step: bool | None = None,
                use_cache: bool | None = None, gen_timestep_scatter_index: torch.Tensor | None = None,
                cond_vit_images: Any = None, cond_vit_image_mask: torch.Tensor | None = None, **kwargs: Any):
        self._check_inputs(mode == "gen_image", "in `gen_image` mode", [("images", images), ("timesteps", timesteps)])
        self._check_inputs(mode == "gen_image" and first_step, "in `gen_image` mode at the first step", [
            ("image_mask", image_mask), ("timesteps_index", timesteps_index)])
        self._check_inputs(cond_vae_images is not None, "`cond_vae_images` is provided", [
            ("cond_timesteps", cond_timesteps), ("cond_vae_image_mask", cond_vae_image_mask),
            ("cond_timesteps_index", cond_timesteps_index)])
        self._check_inputs(cond_vit_images is not None, "`cond_vit_images` is provided", [
            ("cond_vit_image_mask", cond_vit_image_mask)])
        if cond_vit_images is not None:
            raise NotImplementedError("this fake has no ViT encoder: it takes conditional images as VAE latents only")
        if input_ids is None and images is None:
            raise ValueError("either input_ids or images must be given")
        seq_len = self.config.max_position_embeddings  # inference: the whole table, as upstream
        if position_ids is None:
            raise ValueError("position_ids are required (they are also the KV write index)")
        device = input_ids.device if input_ids is not None else images.device
        cos, sin = self.cached_rope(seq_len, device, rope_image_info, position_ids)
        self.post_token_len  # noqa: B018  (upstream passes it on; only its generate assigns it)
        if mode == "gen_image":
            return self.image_forward(input_ids, attention_mask, position_ids, past_key_values, cos, sin,
                                      images=images, image_mask=image_mask, timesteps=timesteps,
                                      timesteps_index=timesteps_index, first_step=first_step,
                                      cond_vae_images=cond_vae_images, cond_vae_image_mask=cond_vae_image_mask,
                                      cond_timesteps=cond_timesteps, cond_timesteps_index=cond_timesteps_index,
                                      num_special_tokens=self.num_special_tokens)
        return self.text_forward(input_ids, attention_mask, position_ids, past_key_values, cos, sin, mode)

    def _prepare_attention_mask_for_generation(self, inputs_tensor: torch.Tensor, generation_config: Any,
                                               model_kwargs: dict[str, Any]) -> torch.Tensor:
        tokenizer_output = model_kwargs["tokenizer_output"]
        slices = [self.image_processor.prepare_full_attn_slices(tokenizer_output, i)
                  for i in range(inputs_tensor.shape[0])]
        return causal_generation_mask(inputs_tensor, slices, device=inputs_tensor.device)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor | None, past_key_values=None,
                                      attention_mask=None, inputs_embeds=None, tokenizer_output=None,
                                      batch_gen_image_info=None, batch_cond_images=None, generator=None,
                                      **kwargs: Any) -> dict[str, Any]:
        position_ids = kwargs.get("position_ids")
        assert position_ids is not None, "position_ids must be provided in kwargs."
        if input_ids is not None and input_ids.shape[1] != position_ids.shape[1]:  # decode steps re-read the input
            input_ids = torch.gather(input_ids, dim=1, index=position_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "rope_image_info": kwargs["rope_image_info"],
            "mode": kwargs["mode"],
            **{name: kwargs.get(name) for name in GEN_IMAGE_INPUTS},
        }

    def _update_model_kwargs_for_generation(self, outputs: Any, model_kwargs: dict[str, Any],
                                            is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict[str, Any]:
        kept = {"mode": model_kwargs["mode"], "rope_image_info": model_kwargs["rope_image_info"]}
        return carry_cache_and_positions(outputs, model_kwargs, kept, self.device, "timesteps_index")

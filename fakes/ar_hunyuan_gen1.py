"""Fake HunyuanImage-3 upstream, generation 1 (``hunyuan_image_3/hunyuan.py``, the code the AR PR and issue cite).

What sets this generation apart (each row of docs/ar-contract.md, checked against the real file):

- RoPE comes in as ``custom_pos_emb = (cos, sin)``, built by the caller with ``build_batch_2d_rope`` (one table
  per row, ``[B, S, D]``) and gathered per row at ``position_ids`` by ``real_batched_index_select``; forward
  without it fails (upstream unpacks it unconditionally).
- ``HunyuanStaticCache`` calls ``lazy_initialization(key_states)`` with one argument: transformers 4.x's arity.
- Upstream's modules import ``transformers.modeling_attn_mask_utils`` (gone in 5.x), so this generation only
  loads on transformers 4.x; this fake imports it the same way and fails on 5.x just as the real code does.
- ``prepare_inputs_for_generation`` forwards ``custom_pos_emb`` and ``use_cache``; the kwargs update keeps
  ``custom_pos_emb``, stores the cache under the first ``ALL_CACHE_NAMES`` name found in the outputs, and after
  the prefill drops ``tokenizer_output`` and the mask (decode steps run unmasked).
- ``generate`` gets its 4-D mask from ``_prepare_attention_mask_for_generation`` (a passed mask must be 2-D),
  which reads ``model_kwargs["tokenizer_output"]``'s ``joint_image_slices`` and ``gen_image_slices`` per row and
  builds the mask on the CPU (no device given), whatever device the inputs are on.
- The MoE (``moe_impl="eager"``) routes through ``topkgating``: top-k weights normalised when k > 1 (raw softmax
  probabilities at k = 1), and with ``moe_drop_tokens`` every expert keeps at most
  ``int(max(k, k * tokens // experts) * capacity_factor)`` choices, first choices before second ones, earlier
  tokens first: a token's routing then depends on every other token of its forward. Without it, nothing drops.
- ``mode="gen_image"`` takes ``timestep`` and ``gen_timestep_scatter_index`` (``fixtures.gen_image_contract``); a row of
  conditional images is one ``[n, C, H, W]`` tensor: upstream's per-row list-of-images path fails (it appends to a
  tuple), and so does this fake's.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers.modeling_attn_mask_utils  # noqa: F401  (as upstream: 4.x only)
from transformers import GenerationMixin

from .ar_hunyuan_common import (
    HunyuanImage3Config,
    HunyuanMoE,
    HunyuanStaticCacheBase,
    HunyuanTextModel,
    build_batch_2d_rope,
    carry_cache_and_positions,
    causal_generation_mask,
)

# transformers 4.x copies only the modules a checkpoint's modeling file imports itself: its helpers' too
from .hunyuan_image_gen import timestep_embedding
from .hunyuan_image_pipeline import HunyuanImage3Text2ImagePipeline  # noqa: F401

__all__ = [
    "HunyuanImage3Config",
    "HunyuanImage3ForCausalMM",
    "HunyuanStaticCache",
    "TopKGatingMoE",
    "build_batch_2d_rope",
    "real_batched_index_select",
    "timestep_embedding",
]


class HunyuanStaticCache(HunyuanStaticCacheBase):
    """Generation 1's cache: lazy init with the key only (transformers 4.x's ``StaticLayer`` arity)."""

    def _lazy_init(self, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        layer.lazy_initialization(key_states)


def real_batched_index_select(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """Per-row ``index_select``: row i of ``t`` at ``idx[i]`` (the batch sizes must match)."""
    assert t.ndim >= 2 and idx.ndim >= 2, f"{t.ndim=} {idx.ndim=}"
    assert len(t) == len(idx), f"{len(t)=} != {len(idx)=}"
    return torch.stack([torch.index_select(t[i], dim - 1, idx[i]) for i in range(len(t))])


class TopKGatingMoE(HunyuanMoE):
    """Generation 1's eager MoE (``topkgating``): raw weights at k = 1, and capacity when ``moe_drop_tokens``."""

    def weights(self, top: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
        return super().weights(top, bsz, seq_len) if self.moe_topk > 1 else top

    def kept(self, index: torch.Tensor) -> torch.Tensor:
        if not self.config.moe_drop_tokens:
            return super().kept(index)
        tokens, k = index.shape
        capacity = int(max(k, k * tokens // self.num_experts) * self.config.capacity_factor)
        choice_major = torch.nn.functional.one_hot(index.t().reshape(-1), self.num_experts)  # [k * N, E]
        priority = (choice_major.cumsum(dim=0) * choice_major).sum(dim=-1) - 1  # rank within its expert
        return (priority < capacity).reshape(k, tokens).t()


#: what ``prepare_inputs_for_generation`` passes on for ``mode="gen_image"`` (None when absent), as upstream's does
GEN_IMAGE_INPUTS = ("images", "image_mask", "timestep", "gen_timestep_scatter_index", "cond_vae_images",
                    "cond_timestep", "cond_vae_image_mask", "cond_timestep_scatter_index")


class HunyuanImage3ForCausalMM(HunyuanTextModel, GenerationMixin):
    """Generation 1's text path: RoPE passed in as ``custom_pos_emb``."""

    moe_class = TopKGatingMoE
    gen_image_timestep_arg = "timestep"
    gen_image_keeps_input_ids = True

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: HunyuanStaticCache | None = None,
                use_cache: bool | None = None, custom_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                mode: str = "gen_text", first_step: bool | None = None, images: Any = None,
                image_mask: torch.Tensor | None = None, timestep: Any = None,
                gen_timestep_scatter_index: torch.Tensor | None = None, cond_vae_images: Any = None,
                cond_timestep: Any = None, cond_vae_image_mask: torch.Tensor | None = None,
                cond_timestep_scatter_index: torch.Tensor | None = None, cond_vit_images: Any = None,
                cond_vit_image_mask: torch.Tensor | None = None, vit_kwargs: Any = None, **kwargs: Any):
        self._check_inputs(mode == "gen_image", "in `gen_image` mode", [
            ("images", images), ("timestep", timestep), ("gen_timestep_scatter_index", gen_timestep_scatter_index)])
        self._check_inputs(mode == "gen_image" and first_step, "in `gen_image` mode at the first step", [
            ("image_mask", image_mask)])
        self._check_inputs(cond_vae_images is not None, "`cond_vae_images` is provided", [
            ("cond_timestep", cond_timestep), ("cond_vae_image_mask", cond_vae_image_mask),
            ("cond_timestep_scatter_index", cond_timestep_scatter_index)])
        self._check_inputs(cond_vit_images is not None, "`cond_vit_images` is provided", [
            ("cond_vit_image_mask", cond_vit_image_mask), ("vit_kwargs", vit_kwargs)])
        if cond_vit_images is not None:
            raise NotImplementedError("this fake has no ViT encoder: it takes conditional images as VAE latents only")
        cos, sin = custom_pos_emb  # upstream's get_pos_emb: no default
        cos = real_batched_index_select(cos, dim=1, idx=position_ids)
        sin = real_batched_index_select(sin, dim=1, idx=position_ids)
        for given in (images, cond_vae_images):
            if isinstance(given, list) and any(isinstance(row, list) for row in given):
                # upstream's per-row list-of-images path starts its token list as a tuple and fails appending
                raise AttributeError("generation 1 embeds a row's images only as one [n, C, H, W] tensor: its "
                                     "per-row list-of-images path appends to a tuple")
        if mode == "gen_image":
            return self.image_forward(input_ids, attention_mask, position_ids, past_key_values, cos, sin,
                                      images=images, image_mask=image_mask, timesteps=timestep,
                                      timesteps_index=gen_timestep_scatter_index, first_step=first_step,
                                      cond_vae_images=cond_vae_images, cond_vae_image_mask=cond_vae_image_mask,
                                      cond_timesteps=cond_timestep, cond_timesteps_index=cond_timestep_scatter_index)
        return self.text_forward(input_ids, attention_mask, position_ids, past_key_values, cos, sin, mode)

    def _prepare_attention_mask_for_generation(self, inputs_tensor: torch.Tensor, generation_config: Any,
                                               model_kwargs: dict[str, Any]) -> torch.Tensor:
        tokenizer_output = model_kwargs["tokenizer_output"]
        slices = [tokenizer_output.joint_image_slices[i] + tokenizer_output.gen_image_slices[i]
                  for i in range(inputs_tensor.shape[0])]
        return causal_generation_mask(inputs_tensor, slices)  # on the CPU, as upstream builds it

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, tokenizer_output=None, batch_gen_image_info=None,
                                      generator=None, **kwargs: Any) -> dict[str, Any]:
        if input_ids.shape[1] != kwargs["position_ids"].shape[1]:  # decode steps re-read the input
            input_ids = torch.gather(input_ids, dim=1, index=kwargs["position_ids"])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": kwargs["position_ids"],
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache"),
            "custom_pos_emb": kwargs["custom_pos_emb"],
            "mode": kwargs["mode"],
            **{name: kwargs.get(name) for name in GEN_IMAGE_INPUTS},
        }

    def _update_model_kwargs_for_generation(self, outputs: Any, model_kwargs: dict[str, Any],
                                            is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict[str, Any]:
        kept = {"mode": model_kwargs["mode"], "custom_pos_emb": model_kwargs["custom_pos_emb"]}
        return carry_cache_and_positions(outputs, model_kwargs, kept, self.device)

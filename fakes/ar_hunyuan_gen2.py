"""Fake HunyuanImage-3 upstream, generation 2 (the Instruct ``modeling_hunyuan_image_3.py`` of the official
repository, commit 5848fb47, with its sibling modules).

Generation 2's hooks, RoPE plumbing and mask builder are ``ar_hunyuan_portable``'s (see its docstring); what this
generation adds (each row of docs/ar-contract.md, checked by running the real file):

- Its modules import ``transformers.modeling_attn_mask_utils`` (its ``siglip2.py`` does), gone in transformers 5.x,
  so this generation only loads on 4.x; this fake imports it the same way and fails on 5.x as the real code does.
- ``HunyuanStaticCache`` calls ``lazy_initialization(key_states)`` with one argument: 4.x's ``StaticLayer`` arity.
- The MoE (``moe_impl="eager"``) routes every forward with per-token normalised top-k weights, except a forward of
  one token in a batch of one (``bsz == 1 and seq_len == 1``: every B=1 decode step), which takes its own path and
  weights the top-k experts by their raw softmax probabilities. A token alone is therefore weighted differently
  from the same token in a batch: batched decoding and upstream's B=1 generation compute different functions.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers.modeling_attn_mask_utils  # noqa: F401  (as upstream's siglip2.py: 4.x only)

from .ar_hunyuan_common import HunyuanImage3Config, HunyuanMoE, build_batch_2d_rope
from .ar_hunyuan_portable import CachedRoPE
from .ar_hunyuan_portable import HunyuanImage3ForCausalMM as PortableCausalMM
from .ar_hunyuan_portable import HunyuanStaticCache as PortableStaticCache

# transformers 4.x copies only the modules a checkpoint's modeling file imports itself: its helpers' too
from .hunyuan_image_gen import timestep_embedding
from .hunyuan_image_pipeline import HunyuanImage3Text2ImagePipeline  # noqa: F401

__all__ = ["CachedRoPE", "HunyuanImage3Config", "HunyuanImage3ForCausalMM", "HunyuanStaticCache",
           "SingleTokenMoE", "build_batch_2d_rope", "timestep_embedding"]

class HunyuanStaticCache(PortableStaticCache):
    """Generation 2's cache: lazy init with the key only (transformers 4.x's ``StaticLayer`` arity)."""

    def _lazy_init(self, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        layer.lazy_initialization(key_states)


class SingleTokenMoE(HunyuanMoE):
    """Generation 2's eager MoE: normalised top-k weights, except one token in a batch of one (raw probabilities)."""

    def weights(self, top: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
        return top if bsz == 1 and seq_len == 1 else super().weights(top, bsz, seq_len)


class HunyuanImage3ForCausalMM(PortableCausalMM):
    """Generation 2's text path: RoPE from ``rope_image_info``, the single-token MoE path."""

    moe_class = SingleTokenMoE

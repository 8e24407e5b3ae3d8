"""The two attention primitives every kernel launches, as module-level functions.

Kernels call them through this module, so a check can record what a kernel launched (shapes, mask
kind, GQA) and prove the fast path ran rather than a silent fallback to the dense masked reference.

flex attention on CPU: torch 2.13 runs it eagerly (a dense, unfused math path that applies the
mask_mod under vmap; ~1.3 s per head at S = 5348 on 2 cores). ``torch.compile(flex_attention)``
works on CPU too but its first call compiles for ~16 s, too slow for the CPU tier, so compilation is
used only on CUDA, where the fused kernel honours the BlockMask's block sparsity.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["flex", "sdpa"]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask=None, is_causal: bool = False,
         scale: float) -> torch.Tensor:
    """torch SDPA; key/value may carry fewer heads (GQA) than the query."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, block_mask: BlockMask,
         scale: float) -> torch.Tensor:
    """flex attention under ``block_mask``: compiled on CUDA, eager elsewhere (see the module doc)."""
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)

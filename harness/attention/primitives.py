"""The two attention primitives every kernel launches, as module-level functions.

Kernels call ``sdpa`` / ``flex`` through this module; those decide how key/value reach the launch
(``gqa_operands``) and hand over to ``launch_sdpa`` / ``launch_flex``, the calls into torch. The spy
records the launches, so a check sees what a kernel really launched (shapes, mask kind, key/value
heads) and can prove the fast path ran rather than a silent fallback to the dense masked reference.

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

__all__ = ["flex", "gqa_operands", "launch_flex", "launch_sdpa", "sdpa"]


def gqa_operands(query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Key/value as a launch takes them, and whether it must broadcast GQA groups itself.

    Both primitives map query head h onto key/value head h // group natively (``enable_gqa``), so the
    compressed heads go in as they are: no repeat_kv copy of H / Hkv times the cache.
    """
    return key, value, query.shape[1] != key.shape[1]


def launch_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask=None,
                is_causal: bool = False, scale: float, enable_gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def launch_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, block_mask: BlockMask,
                scale: float, enable_gqa: bool) -> torch.Tensor:
    """flex attention under ``block_mask``: compiled on CUDA, eager elsewhere (see the module doc)."""
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask=None, is_causal: bool = False,
         scale: float) -> torch.Tensor:
    """torch SDPA; key/value may carry fewer heads (GQA) than the query."""
    key, value, gqa = gqa_operands(query, key, value)
    return launch_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, block_mask: BlockMask,
         scale: float) -> torch.Tensor:
    """flex attention under ``block_mask``; key/value may carry fewer heads (GQA) than the query."""
    key, value, gqa = gqa_operands(query, key, value)
    return launch_flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)

"""2 x 2 latent patch packing, as the Flux and Qwen-Image pipelines lay latents out for their DiTs.

``[N, C, H, W] -> [N, (H/2)(W/2), 4C]``: token t is patch (t // (W/2), t % (W/2)); its channels are
ordered (c, dy, dx). The same permutation as the pipelines' ``_pack_latents`` / ``_unpack_latents``.
"""

from __future__ import annotations

import torch

__all__ = ["pack_latents", "unpack_latents"]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` -> ``[N, (H/2)(W/2), 4C]``; H and W must be even."""
    if latents.dim() != 4:
        raise ValueError(f"pack_latents takes [N, C, H, W] latents, got shape {tuple(latents.shape)}")
    n, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"2 x 2 patch packing needs even H and W, got H={h}, W={w}")
    patches = latents.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """``[N, (H/2)(W/2), 4C]`` -> ``[N, C, H, W]`` for ``shape = (C, H, W)``."""
    c, h, w = shape
    if h % 2 or w % 2:
        raise ValueError(f"2 x 2 patch packing needs even H and W, got H={h}, W={w}")
    n, rows, cols = tokens.shape[0], h // 2, w // 2
    expected = (n, rows * cols, c * 4)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"packed tokens have shape {tuple(tokens.shape)}; latents {shape} pack to {expected}")
    return tokens.reshape(n, rows, cols, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)

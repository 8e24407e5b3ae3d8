"""The image-generation parts of the fake HunyuanImage-3 upstream (``mode="gen_image"``), CPU-sized.

Held to the real remote code by ``fixtures.gen_image_contract`` (both generations' ``forward(mode="gen_image")``):
what the replay family and the attention capture rely on is reproduced point by point, the layers that compute
it are small stand-ins of our own.

- Latents enter the token sequence: ``patch_embed(images, time_embed(t))`` turns ``[N, C, H, W]`` latents into
  ``(H/p)(W/p)`` tokens per image, scattered into the positions ``image_mask`` marks, row by row in order (a list
  of per-row images, each row its own sizes, for conditional images).
- The timestep enters as a token of its own: ``timestep_emb(t)`` scattered at the positions the caller's index
  names (generation 1: ``gen_timestep_scatter_index``; generation 2: ``timesteps_index``), overwriting whatever
  embedding ``input_ids`` put there.
- The prediction comes from the image tokens only: on the first step (the whole sequence) the ``image_mask``
  positions of the last hidden states, on a later step (``[timestep, image]`` tokens over the cached prefix)
  everything after the special tokens; ``final_layer(tokens, time_embed_2(t), h, w)`` maps them back to latents.
- The 2-D RoPE gives text tokens the position ``(t, t)`` and image tokens a ``(y, x)`` grid centred on the span:
  ``build_2d_rope_positions``.
- Clean conditional images carry timestep 0 (``cond_timestep(s)``), embedded the same way.

Every per-row operation here depends on that row alone, so a row's output does not change with the rows beside
it beyond rounding. The module imports only torch and the standard library.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FinalLayer",
    "PatchEmbed",
    "TimestepEmbedder",
    "build_2d_rope_positions",
    "image_parts",
    "scatter_image_tokens",
    "scatter_timestep_tokens",
    "timestep_embedding",
]

FREQUENCY_DIM = 256  # upstream's TimestepEmbedder default


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[N, dim]`` of the (possibly fractional) timesteps ``t [N]``: cosines then sines."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t.reshape(-1, 1).float() * freqs[None]
    features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(features, (0, dim % 2))


class TimestepEmbedder(nn.Module):
    """Timesteps ``[N]`` to vectors ``[N, hidden]``: sinusoidal features through a two-layer GELU MLP."""

    def __init__(self, hidden_size: int, frequency_dim: int = FREQUENCY_DIM) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_dim).to(self.mlp[0].weight.dtype))


def _groups(channels: int) -> int:
    return math.gcd(32, channels)


class _Modulation(nn.Module):
    """A per-sample norm whose scale and shift come from the timestep embedding (one pair per sample)."""

    def __init__(self, channels: int, emb_channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(_groups(channels), channels)
        self.emb = nn.Linear(emb_channels, 2 * channels)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.emb(F.silu(emb)).chunk(2, dim=1)
        return F.silu(self.norm(h) * (1.0 + scale[..., None, None]) + shift[..., None, None])


class PatchEmbed(nn.Module):
    """Latents ``[N, C, H, W]`` to tokens ``[N, (H/p)(W/p), hidden]`` and the token grid ``(H/p, W/p)``, conditioned
    on a timestep embedding per sample (the role of upstream's ``UNetDown``)."""

    def __init__(self, patch_size: int, in_channels: int, emb_channels: int, hidden_channels: int,
                 out_channels: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.stem = nn.Conv2d(in_channels, hidden_channels, 3, padding=1)
        self.modulation = _Modulation(hidden_channels, emb_channels)
        self.proj = nn.Conv2d(hidden_channels, out_channels, patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        p = self.patch_size
        assert x.shape[2] % p == 0 and x.shape[3] % p == 0, f"latents {tuple(x.shape)} do not fit patch size {p}"
        h = self.proj(self.modulation(self.stem(x), emb))
        _, _, token_h, token_w = h.shape
        return h.flatten(2).transpose(1, 2), token_h, token_w


class FinalLayer(nn.Module):
    """Image tokens ``[N, h w, hidden]`` back to latents ``[N, C, h p, w p]`` (the role of upstream's ``UNetUp``)."""

    def __init__(self, patch_size: int, in_channels: int, emb_channels: int, hidden_channels: int,
                 out_channels: int) -> None:
        super().__init__()
        self.modulation = _Modulation(in_channels, emb_channels)
        self.up = nn.ConvTranspose2d(in_channels, hidden_channels, patch_size, stride=patch_size)
        self.out_norm = nn.GroupNorm(_groups(hidden_channels), hidden_channels)
        self.out = nn.Conv2d(hidden_channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, token_h: int, token_w: int) -> torch.Tensor:
        n, tokens, channels = x.shape
        assert tokens == token_h * token_w, f"{tokens} image tokens do not make a {token_h} x {token_w} grid"
        h = x.transpose(1, 2).reshape(n, channels, token_h, token_w)
        h = self.up(self.modulation(h, emb))
        return self.out(F.silu(self.out_norm(h)))


def image_parts(config: Any) -> dict[str, nn.Module]:
    """The image-generation modules upstream's model holds, by upstream's attribute names."""
    hidden, latent = config.hidden_size, int(config.vae["latent_channels"])
    width, patch = int(config.patch_embed_hidden_dim), int(config.patch_size)
    return {
        "timestep_emb": TimestepEmbedder(hidden),  # the <timestep> token's embedding
        "time_embed": TimestepEmbedder(hidden),  # conditions the patch embedding
        "patch_embed": PatchEmbed(patch, latent, hidden, width, hidden),
        "time_embed_2": TimestepEmbedder(hidden),  # conditions the final layer
        "final_layer": FinalLayer(patch, hidden, hidden, width, latent),
    }


def scatter_image_tokens(model: nn.Module, hidden: torch.Tensor, timesteps: Any, images: Any,
                         image_mask: torch.Tensor) -> torch.Tensor:
    """Upstream's ``instantiate_vae_image_tokens``: each row's image tokens written, in order, into the positions
    its ``image_mask`` row marks. ``images`` is a ``[B, C, H, W]`` tensor with ``timesteps [B]``, or one entry per
    row: a ``[n, C, H, W]`` tensor or a list of ``[C, H, W]`` images of their own sizes, with that row's ``n``
    timesteps."""
    bsz, seq_len, n_embd = hidden.shape
    index = torch.arange(seq_len, device=hidden.device).unsqueeze(0).repeat(bsz, 1)
    if isinstance(images, torch.Tensor):
        tokens, _, _ = model.patch_embed(images, model.time_embed(timesteps))
        where = index.masked_select(image_mask.bool()).reshape(bsz, -1)
        return hidden.scatter(1, where.unsqueeze(-1).repeat(1, 1, n_embd), tokens)
    per_row = [list(image_i) for image_i in images]  # a [n, C, H, W] tensor or a list: n images
    if len(per_row) != bsz:
        raise ValueError(f"{len(per_row)} rows of images for a batch of {bsz}")
    row_tokens = _embed_ragged(model, per_row, timesteps)
    out = hidden.clone()
    for i, tokens in enumerate(row_tokens):
        where = index[i:i + 1].masked_select(image_mask[i:i + 1].bool()).reshape(1, -1)
        out[i:i + 1] = out[i:i + 1].scatter(1, where.unsqueeze(-1).repeat(1, 1, n_embd), tokens.reshape(1, -1, n_embd))
    return out


def _embed_ragged(model: nn.Module, per_row: list[list[torch.Tensor]], timesteps: Any) -> list[torch.Tensor]:
    """Each row's images (``[C, h, w]`` each, their own sizes) embedded with that row's timesteps, the tokens of a
    row concatenated in order. Images of one size are embedded together (every step is per sample, so this is the
    per-image computation upstream loops over, in fewer calls)."""
    flat = [(i, j, image) for i, row in enumerate(per_row) for j, image in enumerate(row)]
    times = torch.cat([torch.as_tensor(timesteps[i]).reshape(-1)[:len(row)] for i, row in enumerate(per_row)])
    emb = model.time_embed(times)
    tokens: dict[tuple[int, int], torch.Tensor] = {}
    for size in sorted({tuple(image.shape) for _, _, image in flat}):
        group = [k for k, (_, _, image) in enumerate(flat) if tuple(image.shape) == size]
        out, _, _ = model.patch_embed(torch.stack([flat[k][2] for k in group]), emb[group])
        for k, row_out in zip(group, out, strict=True):
            tokens[flat[k][:2]] = row_out
    return [torch.cat([tokens[(i, j)] for j in range(len(row))]) for i, row in enumerate(per_row)]


def scatter_timestep_tokens(model: nn.Module, hidden: torch.Tensor, timesteps: Any, index: Any) -> torch.Tensor:
    """Upstream's timestep tokens: ``timestep_emb(t)`` written at ``index`` (``[B, k]``, or one index per row with a
    list of per-row timesteps)."""
    bsz, _, n_embd = hidden.shape
    if isinstance(timesteps, list):
        out = hidden.clone()
        for i, t_i in enumerate(timesteps):
            src = model.timestep_emb(t_i.reshape(-1)).reshape(1, -1, n_embd)
            where = torch.as_tensor(index[i]).reshape(1, -1, 1).repeat(1, 1, n_embd)
            out[i:i + 1] = out[i:i + 1].scatter(1, where, src)
        return out
    src = model.timestep_emb(timesteps.reshape(-1)).reshape(bsz, -1, n_embd)
    return hidden.scatter(1, index.unsqueeze(-1).repeat(1, 1, n_embd), src)


def build_2d_rope_positions(seq_len: int, image_infos: list | None) -> torch.Tensor:
    """``[seq_len, 2]`` (y, x) positions of upstream's 2-D RoPE for one row: text at ``(t, t)``; an image of ``h x w``
    tokens starting at ``L`` on the grid ``(L + (wh - h)/2 + r, L + (wh - w)/2 + c)``, truncated to integers, and the
    text after it resuming at ``L + wh``."""
    ys: list[torch.Tensor] = []
    xs: list[torch.Tensor] = []
    last = 0
    for span, (h, w) in image_infos or []:
        start = span.start
        if h is None:
            raise NotImplementedError("the fake builds 2-D RoPE for image spans with a known (h, w) only")
        if last < start:
            ys.append(torch.arange(last, start))
            xs.append(torch.arange(last, start))
        beta_y, beta_x = start + (w * h - h) / 2, start + (w * h - w) / 2
        grid_y = (beta_y + torch.arange(h, dtype=torch.float64)).reshape(h, 1).expand(h, w)
        grid_x = (beta_x + torch.arange(w, dtype=torch.float64)).reshape(1, w).expand(h, w)
        ys.append(grid_y.reshape(-1).long())
        xs.append(grid_x.reshape(-1).long())
        last = start + w * h
    ys.append(torch.arange(last, seq_len))
    xs.append(torch.arange(last, seq_len))
    return torch.stack([torch.cat(ys)[:seq_len], torch.cat(xs)[:seq_len]], dim=1)

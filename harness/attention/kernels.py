"""The kernels behind one signature, what each claims (GQA), how many pairs each computes, and the
launch facts that prove it ran its own way (not a silent fall back to the dense masked reference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.attention import decomposed, flex, padded, reference
from harness.attention.layout import AttentionLayout
from harness.attention.spy import Launch

__all__ = ["KERNELS", "Fact", "KernelSpec", "block_coverage", "get_kernel", "gqa_fact"]

Fact = tuple[bool, str, dict[str, Any]]


@dataclass(frozen=True)
class KernelSpec:
    """A kernel and what it claims. ``pairs`` counts the (query, key) scores it computes."""

    name: str
    fn: reference.Kernel
    gqa: bool
    pairs: Callable[[AttentionLayout], int]
    proof: Callable[[Sequence[Launch], AttentionLayout, torch.Tensor], list[Fact]]
    doc: str

    def __call__(self, query, key, value, layout, *, scale=None):
        return self.fn(query, key, value, layout, scale=scale)


def _one(launches: Sequence[Launch], primitive: str) -> Fact:
    kinds = [launch.primitive for launch in launches]
    return (kinds == [primitive], f"exactly one {primitive} launch", {"launches": len(launches)})


def _sdpa_proof(launches, layout, mask) -> list[Fact]:
    ok = bool(launches) and launches[0].mask == "bool" and launches[0].mask_shape[-2:] == (layout.q_len, layout.kv_len)
    return [_one(launches, "sdpa"), (ok, "the launch carries the dense (Q, KV) bool mask", {})]


def _decomposed_proof(launches, layout, mask) -> list[Fact]:
    blocks = decomposed.split_rows(layout)
    rows = [launch.rows for launch in launches]
    kinds = sorted({launch.mask for launch in launches})
    pairs = sum(launch.rows * launch.keys for launch in launches)
    return [
        (len(launches) == len(blocks) and all(launch.primitive == "sdpa" for launch in launches),
         "one sdpa launch per row block", {"launches": len(launches), "row_blocks": len(blocks)}),
        (rows == [b.rows for b in blocks] and sum(rows) == layout.q_len,
         "launch rows partition the query rows in order", {"launch_rows": rows}),
        (set(kinds) <= {"none", "causal_bias"} and "none" in kinds,
         "no dense mask is materialised and the span rows run unmasked", {"mask_kinds": ",".join(kinds)}),
        (pairs < layout.q_len * layout.kv_len, "computes fewer pairs than the dense reference",
         {"pairs": pairs, "dense_pairs": layout.q_len * layout.kv_len}),
    ]


def block_coverage(block_mask, mask: torch.Tensor) -> dict[str, int]:
    """Tiles the BlockMask gets wrong against a dense mask: visible pairs in skipped tiles, and
    tiles declared full that hold a masked pair (a fused kernel would skip the mask there)."""
    block = block_mask.BLOCK_SIZE[0]
    any_visible, all_visible = flex.tile_grids(mask, block)
    q_tiles, kv_tiles = any_visible.shape

    def dense(num, idx) -> torch.Tensor:
        num, idx = num[0, 0].cpu(), idx[0, 0].cpu().long()
        keep = torch.arange(idx.shape[-1])[None, :] < num[:, None]
        out = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
        out.scatter_(1, idx.clamp(max=kv_tiles - 1), keep)
        return out

    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return {"skipped_visible_tiles": int((any_visible.cpu() & ~(partial | full)).sum()),
            "false_full_tiles": int((full & ~all_visible.cpu()).sum()),
            "computed_tiles": int((partial | full).sum()), "tiles": q_tiles * kv_tiles}


def _flex_proof(launches, layout, mask) -> list[Fact]:
    facts = [_one(launches, "flex")]
    if launches and launches[0].block_mask is not None:
        launch = launches[0]
        cover = block_coverage(launch.block_mask, mask)
        facts.append((launch.mask_shape[-2:] == (layout.q_len, layout.kv_len)
                      and cover["skipped_visible_tiles"] == 0 and cover["false_full_tiles"] == 0,
                      "the BlockMask covers every visible pair and declares no masked tile full", cover))
    return facts


def _padded_proof(launches, layout, mask) -> list[Fact]:
    facts = [_one(launches, "sdpa")]
    if launches:
        launch = launches[0]
        q_pad = padded.padded_length(layout.q_len)
        kv_pad = padded.padded_length(layout.kv_len)
        facts.append(((launch.rows, launch.keys) == (q_pad, kv_pad) and launch.mask == "bool",
                      f"the launch runs block-aligned ({padded.BLOCK}) lengths under a bool mask",
                      {"padded_q": launch.rows, "padded_kv": launch.keys}))
    return facts


def _mask_free_proof(launches, layout, mask) -> list[Fact]:
    ok = bool(launches) and launches[0].mask in {"is_causal", "causal_bias"}
    return [_one(launches, "sdpa"), (ok, "the launch is causal only (no structured mask)", {})]


def _flex_pairs(layout: AttentionLayout) -> int:
    block_mask = flex.block_mask_for(layout)
    tiles = int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
    return tiles * padded.BLOCK * padded.BLOCK


KERNELS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("sdpa", reference.masked_sdpa, True, lambda lay: lay.q_len * lay.kv_len, _sdpa_proof,
               "masked SDPA with the dense structured mask (reference)"),
    KernelSpec("decomposed", decomposed.decomposed, True,
               lambda lay: sum(b.pairs for b in decomposed.split_rows(lay)), _decomposed_proof,
               "causal rows / span rows, concatenated"),
    KernelSpec("flex", flex.flex_structured, True, _flex_pairs, _flex_proof,
               "flex_attention with mask_mod + BlockMask (block-sparse pairs; eager CPU computes all)"),
    KernelSpec("block_padded", padded.block_padded, True,
               lambda lay: padded.padded_length(lay.q_len) * padded.padded_length(lay.kv_len), _padded_proof,
               "padded to multiples of 128 under a consistent mask"),
    KernelSpec("mask_free", reference.mask_free, True, lambda lay: lay.q_len * lay.kv_len, _mask_free_proof,
               "is_causal only: not a valid approximation"),
)}


def get_kernel(name: str) -> KernelSpec:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown attention kernel {name!r}; known: {sorted(KERNELS)}") from None


def gqa_fact(launches: Sequence[Launch], kv_heads: int) -> Fact:
    """Every launch received the compressed key/value heads (no expansion before the kernel)."""
    heads = sorted({launch.kv_shape[1] for launch in launches})
    return (heads == [kv_heads], f"every launch receives the {kv_heads} compressed key/value heads",
            {"launch_kv_heads": ",".join(map(str, heads))})

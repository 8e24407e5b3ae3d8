"""The kernels behind one signature, what each claims (GQA), how many pairs each computes, and the
launch facts that prove it ran its own way (not a silent fall back to the dense masked reference).

Kernels live in ``harness.plugins.entry_points.ATTENTION_KERNELS``: the shipped ones register through the
entry point ``attention = "harness.attention.kernels:register"`` (and on first lookup, so a source
checkout works uninstalled); an installed package registers its own ``KernelSpec`` the same way
and ``parity.compare_kernel`` judges it exactly like the shipped ones. A block-tiled kernel takes
``block=`` (64, 128, ...) and its pairs and launch proof are computed at that block size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.attention import capture, decomposed, flex, padded, reference
from harness.attention.layout import AttentionLayout
from harness.attention.spy import Launch
from harness.plugins import entry_points as plugins

__all__ = ["BLOCK", "KERNELS", "Fact", "KernelSpec", "block_coverage", "check_block", "get_kernel", "gqa_fact",
           "kernels_under_test", "register"]

Fact = tuple[bool, str, dict[str, Any]]
BLOCK = padded.BLOCK
ORIGIN = "harness.attention.kernels:register"


def check_block(block: int) -> int:
    """A block size is a positive int (64, 128, ...); anything else is named."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block size must be a positive int (e.g. 64 or 128), got {block!r}")
    return block


@dataclass(frozen=True)
class KernelSpec:
    """A kernel and what it claims.

    ``fn(query, key, value, layout, *, scale=None)`` (plus ``block=`` when ``blocked``). ``pairs(layout,
    block)`` counts the (query, key) scores it computes; ``proof(launches, layout, mask, block)`` turns
    the recorded launches into facts proving it ran its own way. ``under_test``: ``--impl attention=...``
    replaces it (False for the reference and the negative control, which judge, not get judged).
    ``records_launches``: it launches through ``harness.attention.primitives``, so the spy sees its
    launches (GQA heads included); a bare registered callable calls torch directly and is proven to
    run by its call count only.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    gqa: bool
    pairs: Callable[[AttentionLayout, int], int]
    proof: Callable[[Sequence[Launch], AttentionLayout, torch.Tensor, int], list[Fact]]
    doc: str
    blocked: bool = False
    under_test: bool = True
    records_launches: bool = True

    @classmethod
    def from_callable(cls, name: str, fn: Callable[..., torch.Tensor]) -> KernelSpec:
        """A registered bare ``kernel(query, key, value, layout, *, scale=None)``: judged on its numbers."""
        doc = (fn.__doc__ or "").strip().splitlines()
        return cls(name, fn, True, _dense_pairs, _no_launch_proof, doc[0] if doc else name, records_launches=False)

    def bind(self, block: int = BLOCK) -> reference.Kernel:
        """The kernel with the documented signature, at ``block`` when it is block-tiled."""
        return functools.partial(self.fn, block=check_block(block)) if self.blocked else self.fn

    def __call__(self, query, key, value, layout, *, scale=None, block: int = BLOCK):
        return self.bind(block)(query, key, value, layout, scale=scale)


def _one(launches: Sequence[Launch], primitive: str) -> Fact:
    kinds = [launch.primitive for launch in launches]
    return (kinds == [primitive], f"exactly one {primitive} launch", {"launches": len(launches)})


def _sdpa_proof(launches, layout, mask, block) -> list[Fact]:
    ok = bool(launches) and launches[0].mask == "bool" and launches[0].mask_shape[-2:] == (layout.q_len, layout.kv_len)
    return [_one(launches, "sdpa"), (ok, "the launch carries the dense (Q, KV) bool mask", {})]


def _decomposed_proof(launches, layout, mask, block) -> list[Fact]:
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
        (pairs == sum(b.pairs for b in blocks) and (pairs < layout.q_len * layout.kv_len or bool(mask.all())),
         "computes only its row blocks' pairs: fewer than the dense reference unless the mask is dense",
         {"pairs": pairs, "dense_pairs": layout.q_len * layout.kv_len}),
    ]


def block_coverage(block_mask, mask: torch.Tensor) -> dict[str, int]:
    """Tiles the BlockMask gets wrong against a dense mask: visible pairs in skipped tiles, and
    tiles declared full that hold a masked pair (a fused kernel would skip the mask there)."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    any_visible, all_visible = flex.tile_grids(mask, q_block, kv_block)
    q_tiles, kv_tiles = any_visible.shape
    device = mask.device

    def dense(num, idx) -> torch.Tensor:
        # only the first num[r] slots of row r name tiles; the rest are padding and may hold anything
        num, idx = num[0, 0].to(device), idx[0, 0].to(device, torch.long)
        used = torch.arange(idx.shape[-1], device=device)[None, :] < num[:, None]
        rows = torch.arange(q_tiles, device=device)[:, None].expand_as(idx)
        out = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool, device=device)
        out[rows[used], idx[used]] = True
        return out

    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return {"skipped_visible_tiles": int((any_visible & ~(partial | full)).sum()),
            "false_full_tiles": int((full & ~all_visible).sum()),
            "computed_tiles": int((partial | full).sum()), "tiles": q_tiles * kv_tiles}


def _flex_proof(launches, layout, mask, block) -> list[Fact]:
    facts = [_one(launches, "flex")]
    if launches and launches[0].block_mask is not None:
        launch = launches[0]
        tiles = tuple(launch.block_mask.BLOCK_SIZE)
        facts.append((tiles == (block, block), f"the BlockMask tiles are {block} x {block}",
                      {"block_mask_tiles": "x".join(map(str, tiles))}))
        cover = block_coverage(launch.block_mask, mask)
        facts.append((launch.mask_shape[-2:] == (layout.q_len, layout.kv_len)
                      and cover["skipped_visible_tiles"] == 0 and cover["false_full_tiles"] == 0,
                      "the BlockMask covers every visible pair and declares no masked tile full", cover))
    return facts


def _padded_proof(launches, layout, mask, block) -> list[Fact]:
    facts = [_one(launches, "sdpa")]
    if launches:
        launch = launches[0]
        q_pad = -(-layout.q_len // block) * block  # computed here, not through the kernel's own seam
        kv_pad = -(-layout.kv_len // block) * block
        facts.append(((launch.rows, launch.keys) == (q_pad, kv_pad) and launch.mask == "bool",
                      f"the launch runs block-aligned ({block}) lengths under a bool mask",
                      {"padded_q": launch.rows, "padded_kv": launch.keys, "block": block}))
    return facts


def _mask_free_proof(launches, layout, mask, block) -> list[Fact]:
    ok = bool(launches) and launches[0].mask in {"is_causal", "causal_bias"}
    return [_one(launches, "sdpa"), (ok, "the launch is causal only (no structured mask)", {})]


def _no_launch_proof(launches, layout, mask, block) -> list[Fact]:
    return []


def _flex_pairs(layout: AttentionLayout, block: int) -> int:
    block_mask = flex.block_mask_for(layout, block=block)
    tiles = int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
    return tiles * block * block


def _dense_pairs(layout: AttentionLayout, block: int) -> int:
    return layout.q_len * layout.kv_len


KERNELS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("sdpa", reference.masked_sdpa, True, _dense_pairs, _sdpa_proof,
               "masked SDPA with the dense structured mask (reference)", under_test=False),
    KernelSpec("decomposed", decomposed.decomposed, True,
               lambda lay, block: sum(b.pairs for b in decomposed.split_rows(lay)), _decomposed_proof,
               "causal rows / span rows, concatenated"),
    KernelSpec("flex", flex.flex_structured, True, _flex_pairs, _flex_proof,
               "flex_attention with mask_mod + BlockMask (block-sparse pairs; eager CPU computes all)", blocked=True),
    KernelSpec("block_padded", padded.block_padded, True,
               lambda lay, block: padded.padded_length(lay.q_len, block) * padded.padded_length(lay.kv_len, block),
               _padded_proof, "padded to multiples of the block under a consistent mask", blocked=True),
    KernelSpec("mask_free", reference.mask_free, True, _dense_pairs, _mask_free_proof,
               "is_causal only: not a valid approximation (the negative control)", under_test=False),
)}


def register(plugins_module: Any = plugins) -> None:
    """Entry point of the suite's own kernels and capture kind (idempotent: same objects every time)."""
    for name, spec in KERNELS.items():
        plugins_module.ATTENTION_KERNELS.register(name, spec, origin=ORIGIN)
    plugins_module.CHECKPOINT_KINDS.register(capture.CAPTURE_KIND.name, capture.CAPTURE_KIND, origin=ORIGIN)


def get_kernel(name: str) -> KernelSpec:
    """The registered kernel ``name`` (shipped or from an installed package; a bare callable is wrapped)."""
    register(plugins)
    try:
        entry = plugins.ATTENTION_KERNELS.get(name)
    except KeyError:
        raise ValueError(f"unknown attention kernel {name!r}; known: {plugins.ATTENTION_KERNELS.names()}. "
                         f"{plugins.ATTENTION_KERNELS.how_to_add}") from None
    if isinstance(entry, KernelSpec):
        return entry
    if callable(entry):
        return KernelSpec.from_callable(name, entry)
    raise TypeError(f"attention kernel {name!r} ({plugins.ATTENTION_KERNELS.origin(name) or 'unknown origin'}) must "
                    f"be a harness.attention.kernels.KernelSpec or a callable kernel(query, key, value, layout, *, "
                    f"scale=None), got {type(entry).__name__}")


def kernels_under_test() -> tuple[str, ...]:
    """Every registered kernel the catalogue judges (not the reference, not the negative control): the
    shipped ones in their order, then an installed package's, by name."""
    shipped = [name for name, spec in KERNELS.items() if spec.under_test]
    installed = [name for name in plugins.ATTENTION_KERNELS.names()
                 if name not in KERNELS and get_kernel(name).under_test]
    return (*shipped, *installed)


def gqa_fact(launches: Sequence[Launch], kv_heads: int) -> Fact:
    """Every launch received the compressed key/value heads (no expansion before the kernel)."""
    heads = sorted({launch.kv_shape[1] for launch in launches})
    return (heads == [kv_heads], f"every launch receives the {kv_heads} compressed key/value heads",
            {"launch_kv_heads": ",".join(map(str, heads))})

"""Seeded fake conditions in both CFG layouts, built the way each pipeline builds them.

fused cond-first (HunyuanImage-3): the CFG expansion concatenates ``[cond_B; uncond_B]`` per-branch
fields, keeps branch-independent fields at B rows, and leaves the uncond rows cached in
``fused_uncond``. uncond-first (SD3): the uncond branch rides along as ``Conditions.negative``.
Payload kinds cover what the real pipelines pass: tensors, bool masks, per-sample
``rope_cache [N, 2, L, D]``, and list/tuple payloads with ragged per-row items.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.replay.conditions import Conditions, Payload, concat_payloads

__all__ = [
    "HI3_FIELDS",
    "KINDS",
    "SD3_FIELDS",
    "FieldSpec",
    "fused_conditions",
    "labelled_conditions",
    "labelled_payload",
    "make_payload",
    "read_labels",
    "shared_fields",
    "uncond_first_conditions",
]

KINDS = ("tensor", "mask", "rope", "list", "tuple")


@dataclass(frozen=True)
class FieldSpec:
    """One conditioning field: its payload kind and, in the fused layout, whether each CFG branch has
    its own rows (2B) or both branches use the same B rows."""

    name: str
    kind: str
    per_branch: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


HI3_FIELDS = (
    FieldSpec("text_embeds", "tensor"),
    FieldSpec("attention_mask", "mask"),
    FieldSpec("rope_cache", "rope"),
    FieldSpec("cond_images", "list"),
    FieldSpec("image_tokens", "tuple", per_branch=False),
    FieldSpec("ref_latents", "tensor", per_branch=False),
)

SD3_FIELDS = (
    FieldSpec("prompt_embeds", "tensor"),
    FieldSpec("pooled_projections", "tensor"),
    FieldSpec("attention_mask", "mask"),
    FieldSpec("control_images", "list"),
)


def make_payload(kind: str, rows: int, generator: torch.Generator) -> Payload:
    """``rows`` random rows of one payload kind (list/tuple items are ragged on purpose)."""
    if kind == "tensor":
        return torch.randn(rows, 3, 8, generator=generator)
    if kind == "mask":
        return torch.rand(rows, 7, generator=generator) > 0.4
    if kind == "rope":
        angles = torch.rand(rows, 5, 4, generator=generator) * 6.0
        return torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)  # [N, 2, L, D]
    if kind == "list":
        return [torch.randn(1 + r % 3, 4, generator=generator) for r in range(rows)]
    if kind == "tuple":
        return tuple(torch.randn(2, 1 + r % 2, generator=generator) for r in range(rows))
    raise ValueError(f"unknown payload kind {kind!r}; expected one of {KINDS}")


def shared_fields(generator: torch.Generator) -> dict[str, object]:
    """Fields every row uses (a frequency table, a (cos, sin) tuple): they must pass through tiling."""
    angles = torch.rand(5, 4, generator=generator)
    return {"freqs": torch.randn(5, 4, generator=generator), "rope_table": (torch.cos(angles), torch.sin(angles))}


def fused_conditions(batch: int, fields: Sequence[FieldSpec], cfg: int, generator: torch.Generator, *,
                     with_shared: bool = True, cache_uncond: bool = True) -> Conditions:
    """HunyuanImage-3 style: cfg=2 gives ``[cond_B; uncond_B]`` per-branch rows plus the fused_uncond cache."""
    shared = shared_fields(generator) if with_shared else {}
    if cfg == 1:
        rows = {f.name: make_payload(f.kind, batch, generator) for f in fields}
        return Conditions(batch=batch, rows=rows, shared=shared)
    if cfg != 2:
        raise ValueError(f"cfg must be 1 or 2, got {cfg}")
    rows, uncond = {}, {}
    for f in fields:
        cond_rows = make_payload(f.kind, batch, generator)
        if f.per_branch:
            uncond[f.name] = make_payload(f.kind, batch, generator)
            rows[f.name] = concat_payloads([cond_rows, uncond[f.name]])
        else:
            rows[f.name] = cond_rows
    return Conditions(batch=batch, rows=rows, shared=shared, cfg_factor=2,
                      fused_uncond=uncond if cache_uncond and uncond else None)


def uncond_first_conditions(batch: int, fields: Sequence[FieldSpec], cfg: int, generator: torch.Generator, *,
                            with_shared: bool = True) -> Conditions:
    """SD3 style: the uncond branch is a separate ``negative`` Conditions with the same fields."""
    shared = shared_fields(generator) if with_shared else {}
    rows = {f.name: make_payload(f.kind, batch, generator) for f in fields}
    if cfg == 1:
        return Conditions(batch=batch, rows=rows, shared=shared)
    if cfg != 2:
        raise ValueError(f"cfg must be 1 or 2, got {cfg}")
    negative = Conditions(batch=batch, rows={f.name: make_payload(f.kind, batch, generator) for f in fields})
    return Conditions(batch=batch, rows=rows, shared=shared, negative=negative)


def labelled_payload(kind: str, labels: Sequence[int]) -> Payload:
    """A payload whose row r carries the integer ``labels[r]`` everywhere, so a tiled layout can be read back."""
    if kind in ("tensor", "mask"):
        return torch.tensor(labels, dtype=torch.float32).reshape(-1, 1, 1).expand(-1, 2, 3).contiguous()
    if kind == "rope":
        return torch.tensor(labels, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 2, 3, 4).contiguous()
    items = [torch.full((1 + i % 2, 2), float(label)) for i, label in enumerate(labels)]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    raise ValueError(f"unknown payload kind {kind!r}; expected one of {KINDS}")


def read_labels(value: Payload) -> list[int]:
    """The row labels of a ``labelled_payload`` (after any tiling)."""
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(value.shape[0], -1)[:, 0].tolist()]
    return [int(torch.as_tensor(item).reshape(-1)[0]) for item in value]


def labelled_conditions(batch: int, fields: Sequence[FieldSpec], layout_cfg: str) -> Conditions:
    """Conditions whose rows are labelled by source row: cond rows 0..B-1, uncond rows 100..100+B-1.

    ``layout_cfg``: "fused" (cfg_factor 2, ``[cond; uncond]`` + fused_uncond), "uncond_first"
    (``negative``) or "plain" (no CFG).
    """
    cond_ids, uncond_ids = list(range(batch)), [100 + b for b in range(batch)]
    shared = {"freqs": torch.arange(6.0).reshape(2, 3)}
    if layout_cfg == "plain":
        return Conditions(batch=batch, rows={f.name: labelled_payload(f.kind, cond_ids) for f in fields},
                          shared=shared)
    if layout_cfg == "uncond_first":
        negative = Conditions(batch=batch, rows={f.name: labelled_payload(f.kind, uncond_ids) for f in fields})
        return Conditions(batch=batch, rows={f.name: labelled_payload(f.kind, cond_ids) for f in fields},
                          shared=shared, negative=negative)
    if layout_cfg != "fused":
        raise ValueError(f"layout_cfg must be 'plain', 'fused' or 'uncond_first', got {layout_cfg!r}")
    rows = {f.name: labelled_payload(f.kind, cond_ids + uncond_ids if f.per_branch else cond_ids) for f in fields}
    uncond = {f.name: labelled_payload(f.kind, uncond_ids) for f in fields if f.per_branch}
    return Conditions(batch=batch, rows=rows, shared=shared, cfg_factor=2, fused_uncond=uncond or None)

"""Conditioning payloads of a denoiser forward, and the row operations every layout shares.

A payload is row-aligned: a tensor whose dim 0 is the row, or a list/tuple with one item per row
(HunyuanImage-3's conditional-image payloads are lists even where annotated as tensors). Shared
fields (a (cos, sin) table, ids every row uses) are not row-aligned and pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Conditions",
    "Payload",
    "broadcast_field",
    "broadcast_rows",
    "concat_payloads",
    "payload_rows",
    "require_rows",
    "slice_rows",
]

Payload = torch.Tensor | list[Any] | tuple[Any, ...]


def payload_rows(value: Any, name: str = "payload") -> int:
    """Number of rows of a tensor (dim 0) or list/tuple payload; anything else is a TypeError."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"{name}: a 0-d tensor has no rows; put it under `shared` if every row uses it")
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    raise TypeError(f"{name}: a row payload must be a tensor or a list/tuple of per-row items, "
                    f"got {type(value).__name__}")


def slice_rows(value: Payload, start: int, stop: int) -> Payload:
    """Rows [start, stop) of a payload, keeping its kind."""
    return value[start:stop]


def concat_payloads(parts: Sequence[Payload], name: str = "payload") -> Payload:
    """Concatenate payloads of one kind along the row axis (tensors: torch.cat; lists/tuples: +)."""
    if not parts:
        raise ValueError(f"{name}: nothing to concatenate")
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise TypeError(f"{name}: cannot concatenate a tensor payload with {[type(p).__name__ for p in parts]}")
        return torch.cat(list(parts), dim=0)
    kind = type(first)
    if kind not in (list, tuple) or not all(type(p) is kind for p in parts):
        raise TypeError(f"{name}: cannot concatenate payload kinds {[type(p).__name__ for p in parts]}")
    items: list[Any] = [item for part in parts for item in part]
    return items if kind is list else tuple(items)


@dataclass(frozen=True, eq=False)
class Conditions:
    """The conditioning of one denoiser call for ``batch`` samples.

    Two CFG layouts (docs/contracts.md, replay), chosen by the model adapter:
    - fused cond-first (HunyuanImage-3): ``cfg_factor == 2``; every row field holds either ``2*batch``
      rows ``[cond_B; uncond_B]`` (split by branch) or ``batch`` rows (branch-independent, used once per
      branch). ``fused_uncond`` is the uncond-branch cache the CFG expansion leaves behind; it is only
      valid for the batch it was built for, so tiling clears it.
    - uncond-first (SD3): ``cfg_factor == 1`` and ``negative`` holds the uncond branch's own conditions;
      the step builds ``[uncond; cond]`` itself.
    Without guidance: ``cfg_factor == 1`` and no ``negative``.
    """

    batch: int
    rows: Mapping[str, Payload]
    shared: Mapping[str, Any] = field(default_factory=dict)
    cfg_factor: int = 1
    negative: Conditions | None = None
    fused_uncond: Mapping[str, Payload] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"Conditions.batch must be a positive int, got {self.batch!r}")
        if self.cfg_factor not in (1, 2):
            raise ValueError(f"Conditions.cfg_factor must be 1 (no CFG / uncond-first) or 2 (fused "
                             f"cond-first), got {self.cfg_factor!r}")
        overlap = set(self.rows) & set(self.shared)
        if overlap:
            raise ValueError(f"fields {sorted(overlap)} are both row-aligned and shared; pick one")
        if self.negative is not None:
            self._check_negative(self.negative)

    def validate(self) -> Conditions:
        """Check every row field against the batch (called where conditions enter replay or rollout).

        Internal re-layouts (tiling) are not re-validated: the checks catch a wrong layout by its
        numbers, as they would in a pipeline whose conditions carry no such check.
        """
        allowed = {self.batch, self.batch * self.cfg_factor}
        for name, value in self.rows.items():
            n = payload_rows(value, f"field {name!r}")
            if n not in allowed:
                raise ValueError(f"field {name!r} has {n} rows; expected {' or '.join(map(str, sorted(allowed)))} "
                                 f"(batch={self.batch}, cfg_factor={self.cfg_factor})")
        if self.negative is not None:
            self.negative.validate()
        return self

    def _check_negative(self, neg: Conditions) -> None:
        if self.cfg_factor != 1:
            raise ValueError("Conditions: `negative` (uncond-first layout) cannot be combined with cfg_factor=2 "
                             "(fused cond-first layout)")
        if neg.negative is not None or neg.cfg_factor != 1:
            raise ValueError("Conditions.negative must be a plain single-branch Conditions "
                             "(cfg_factor=1, no negative of its own)")
        if neg.batch != self.batch:
            raise ValueError(f"Conditions.negative has batch {neg.batch}, expected {self.batch}")
        if set(neg.rows) != set(self.rows):
            raise ValueError(f"Conditions.negative row fields {sorted(neg.rows)} differ from the cond "
                             f"branch's {sorted(self.rows)}")

    @property
    def guided(self) -> bool:
        """Whether a forward runs two CFG branches."""
        return self.cfg_factor == 2 or self.negative is not None

    @property
    def branches(self) -> int:
        return 2 if self.guided else 1

    @property
    def forward_rows(self) -> int:
        """Rows of the transformer forward these conditions feed (branches x batch)."""
        return self.branches * self.batch


def broadcast_field(name: str, value: Payload, batch: int, cfg_factor: int) -> Payload:
    """One row field at the forward's ``cfg_factor * batch`` rows.

    A field that already has them passes through; a branch-independent field of ``batch`` rows
    in a fused two-branch forward is used once per branch (``[value; value]``). Any other count is
    a ValueError: the harness, never an adapter, decides how rows line up.
    """
    rows = payload_rows(value, f"field {name!r}")
    forward = batch * cfg_factor
    if rows == forward:
        return value
    if rows == batch:
        return concat_payloads([value] * cfg_factor, f"field {name!r}")
    raise ValueError(f"field {name!r} has {rows} rows; a forward of {forward} rows (batch={batch}, "
                     f"cfg_factor={cfg_factor}) takes {batch} (one per sample) or {forward}")


def broadcast_rows(conditions: Conditions) -> Conditions:
    """Every row field broadcast to the forward's row count (``fused_uncond`` and shared fields kept)."""
    rows = {name: broadcast_field(name, value, conditions.batch, conditions.cfg_factor)
            for name, value in conditions.rows.items()}
    return Conditions(batch=conditions.batch, rows=rows, shared=conditions.shared, cfg_factor=conditions.cfg_factor,
                      fused_uncond=conditions.fused_uncond)


def require_rows(owner: str, name: str, value: Any, rows: int) -> None:
    """Adapters call this on every row field: a forward of ``rows`` rows takes exactly ``rows`` per field.

    An adapter that repeated a short field to fit would hide a harness bug (a missing broadcast,
    an un-tiled field); refusing it turns that bug into a clear error.
    """
    have = payload_rows(value, f"{owner}: field {name!r}")
    if have != rows:
        raise ValueError(f"{owner}: field {name!r} has {have} rows but the forward has {rows}; the harness "
                         "broadcasts row fields to the forward's rows (an adapter never repeats rows)")

"""A fake-kernel denoiser for replay parity: row-wise, bitwise batch-shape invariant, sensitive to
every conditioning field of its own row, and strict about row counts.

Every output row mixes in that row's value of EVERY row field (embeddings, masks, rope_cache,
list/tuple payloads), its timestep, and every shared field, so a wrong permutation, a swapped
nesting or an un-tiled field changes the numbers. The kernel takes exactly one row per forward row
for every field and raises a ValueError naming expected vs got otherwise: it never broadcasts a
count that merely divides the batch (that forgiveness would turn a tiling bug into a pass). The
one exact exception, owned by the adapter, is the branch-independent field (docs/contracts.md, replay): ``batch`` rows
in a fused two-branch forward of ``2 * batch`` rows, used once per branch.
In the fused layout the adapter reads the uncond branch of every cached field from ``fused_uncond``
(the cache the CFG expansion leaves), so a cache that does not describe THIS batch changes the
numbers, or raises when its row count is not the uncond branch's.
All per-row arithmetic is IEEE-exact or runs on full latent-shaped tensors, so a row gives the same
bits in a batch of B or of S*B: batched replay must be bitwise equal to serial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.replay.cfg import CfgCombine
from harness.replay.conditions import Conditions, Payload, concat_payloads, payload_rows, slice_rows
from harness.replay.denoiser import FUSED_COND_FIRST, DenoiserAdapter

__all__ = ["FakeDenoiser", "FakeKernel", "row_codes"]


def row_codes(name: str, value: Any, rows: int) -> torch.Tensor:
    """One fp32 number per batch row summarising that row's payload."""
    if isinstance(value, torch.Tensor):
        per = value.float().reshape(value.shape[0], -1).mean(dim=1) if value.dim() > 1 else value.float()
    elif isinstance(value, (list, tuple)):
        per = torch.stack([torch.as_tensor(item).float().mean() for item in value]) if value else torch.zeros(0)
    else:
        raise TypeError(f"field {name!r}: unsupported payload {type(value).__name__}")
    have = per.shape[0]
    if have != rows:
        raise ValueError(f"field {name!r} has {have} rows; expected exactly {rows} (one per forward row): "
                         "the fake kernel never broadcasts rows")
    return per


def shared_code(shared: Mapping[str, Any]) -> float:
    total = 0.0
    for value in shared.values():
        items = value if isinstance(value, (list, tuple)) else [value]
        total += sum(float(torch.as_tensor(item).float().mean()) for item in items)
    return total


class FakeKernel(torch.nn.Module):
    """out[r] = tanh(0.9 x[r] + code[r] * A + t[r] * Bpat) - 0.3 x[r]; code[r] weighs every field of row r."""

    def __init__(self, latent_shape: Sequence[int], seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("pattern_code", torch.randn(tuple(latent_shape), generator=gen))
        self.register_buffer("pattern_time", torch.randn(tuple(latent_shape), generator=gen))
        self.batch_sizes: list[int] = []

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, rows: Mapping[str, Any],
                shared: Mapping[str, Any]) -> torch.Tensor:
        n = hidden_states.shape[0]
        self.batch_sizes.append(n)
        if timestep.shape != (n,):
            raise ValueError(f"timestep must be [N={n}], got {tuple(timestep.shape)}")
        code = torch.full((n,), shared_code(shared), dtype=torch.float32)
        for k, name in enumerate(sorted(rows)):
            code = code + row_codes(name, rows[name], n) * (1.0 / (k + 1.5))
        lead = (n,) + (1,) * (hidden_states.dim() - 1)
        mixed = hidden_states * 0.9 + code.reshape(lead) * self.pattern_code
        mixed = mixed + (timestep.float() / 1000.0).reshape(lead) * self.pattern_time
        return torch.tanh(mixed) - 0.3 * hidden_states


class FakeDenoiser(DenoiserAdapter):
    """The fake kernel behind either CFG layout; ``module`` is the kernel (spies hook it).

    In the fused layout the uncond half of every cached field is read from ``fused_uncond``: a cache
    with the uncond branch's row count but other rows gives other numbers; one with another row
    count (the untiled B rows left on tiled conditions) is a ValueError.
    """

    def __init__(self, layout: str = FUSED_COND_FIRST, latent_shape: Sequence[int] = (4, 4, 4), seed: int = 0,
                 combine: CfgCombine | None = None, negate: bool = False):
        self.cfg_layout = layout
        self.module = FakeKernel(latent_shape, seed)
        if combine is not None:
            self.cfg_combine = combine
        self.negate = negate  # a pipeline that negates the combined prediction (Lumina2, HiDream, Z-Image)
        self.velocity_transform = "negate" if negate else "identity"

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return -prediction if self.negate else prediction

    @property
    def batch_sizes(self) -> list[int]:
        return self.module.batch_sizes

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = self.forward_fields(hidden.shape[0], conditions)
        return self.module(hidden, timestep, rows, conditions.shared)

    def forward_fields(self, rows: int, conditions: Conditions) -> dict[str, Payload]:
        """Every row field at exactly ``rows`` rows, the uncond branch of cached fields from ``fused_uncond``."""
        two_branch = self.cfg_layout == FUSED_COND_FIRST and conditions.cfg_factor == 2
        fields = {name: self._field_rows(name, value, rows, conditions.batch, two_branch)
                  for name, value in conditions.rows.items()}
        if two_branch and conditions.fused_uncond is not None:
            half = rows // 2
            for name, cached in conditions.fused_uncond.items():
                if name not in fields:
                    raise ValueError(f"fused_uncond caches field {name!r}, which the conditions do not carry "
                                     f"(fields: {sorted(fields)})")
                have = payload_rows(cached, f"fused_uncond[{name!r}]")
                if have != half:
                    raise ValueError(f"stale fused_uncond: field {name!r} caches {have} uncond rows but this "
                                     f"batch's uncond branch has {half}")
                fields[name] = concat_payloads([slice_rows(fields[name], 0, half), cached], f"field {name!r}")
        return fields

    @staticmethod
    def _field_rows(name: str, value: Payload, rows: int, batch: int, two_branch: bool) -> Payload:
        have = payload_rows(value, f"field {name!r}")
        if have == rows:
            return value
        if two_branch and rows == 2 * batch and have == batch:
            return concat_payloads([value, value], f"field {name!r}")  # branch-independent: once per branch
        expected = f"{rows}" + (f" or {batch} (branch-independent, once per branch)" if two_branch else "")
        raise ValueError(f"field {name!r} has {have} rows; a forward of {rows} rows takes exactly {expected}")

"""A fake-kernel denoiser for replay parity: row-wise, bitwise batch-shape invariant, and sensitive
to every conditioning field of its own row.

Every output row mixes in that row's value of EVERY row field (embeddings, masks, rope_cache,
list/tuple payloads), its timestep, and every shared field, so a wrong permutation, a swapped
nesting or an un-tiled field changes the numbers. A field with fewer rows than the batch is
broadcast by block repetition (as HunyuanImage-3's concat tensors are expanded), which makes an
un-tiled field a silent wrong answer rather than a crash, exactly the failure mode to catch.
All per-row arithmetic is IEEE-exact or runs on full latent-shaped tensors, so a row gives the same
bits in a batch of B or of S*B: batched replay must be bitwise equal to serial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.replay.conditions import Conditions, payload_rows
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
    if have == rows:
        return per
    if have and rows % have == 0:
        return per.repeat(rows // have)
    raise ValueError(f"field {name!r} has {have} rows, which cannot broadcast to a batch of {rows}")


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


def _same_rows(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return False
        return all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b, strict=True))
    return False


class FakeDenoiser(DenoiserAdapter):
    """The fake kernel behind either CFG layout; ``module`` is the kernel (spies hook it).

    In the fused layout a set ``fused_uncond`` must describe the uncond half of THIS batch; a stale
    cache (the untiled B rows left on tiled conditions) is refused with a ValueError.
    """

    def __init__(self, layout: str = FUSED_COND_FIRST, latent_shape: Sequence[int] = (4, 4, 4), seed: int = 0):
        self.cfg_layout = layout
        self.module = FakeKernel(latent_shape, seed)

    @property
    def batch_sizes(self) -> list[int]:
        return self.module.batch_sizes

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        if conditions.fused_uncond is not None:
            self._check_fused_uncond(hidden.shape[0], conditions)
        return self.module(hidden, timestep, conditions.rows, conditions.shared)

    @staticmethod
    def _check_fused_uncond(rows: int, conditions: Conditions) -> None:
        half = rows // 2
        for name, cached in conditions.fused_uncond.items():
            have = payload_rows(cached, f"fused_uncond[{name!r}]")
            if have != half:
                raise ValueError(f"stale fused_uncond: field {name!r} caches {have} uncond rows but this batch's "
                                 f"uncond branch has {half}")
            field = conditions.rows.get(name)
            if field is not None and payload_rows(field) == rows and not _same_rows(field[half:], cached):
                raise ValueError(f"stale fused_uncond: field {name!r} does not match the uncond half of the batch")

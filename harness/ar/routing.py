"""Does a model's MoE give a token the same output whatever else shares its forward?

Batched decoding can only equal B=1 decoding when every token is routed on its own. Two things in real
HunyuanImage-3 code break that, neither of them padding:

- expert capacity (generation 1 with ``moe_drop_tokens``): each expert keeps a bounded number of choices per
  forward, so the other rows of a batch decide which of a token's experts it keeps;
- a separate single-token path (generation 2, commit 5848fb47): a forward of one token in a batch of one (every
  B=1 decode step) weights its experts by their raw softmax probabilities, every other forward by normalised ones.

``probe_routing`` runs each MoE layer (a module with an ``experts`` ModuleList of two or more) on seeded hidden
states ``[4, 3, H]`` and compares every token's output in that forward with its output in a forward of its row
alone and in a forward of itself alone. A token whose output moves by more than ``ULPS`` units of the model
dtype's epsilon, and at least ``MIN_MOVE``, relative to its largest output element was routed differently:
reshaping a GEMM moves an output by a few units at most (about 1e-6 in fp32), a different expert weighting by a
sizeable fraction of it (0.27 to 0.87 on the tiny real-code checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MIN_MOVE", "ROUTING_KNOBS", "ULPS", "RoutingProbe", "moe_layers", "probe_routing", "routing_bound"]

ULPS = 8  # a token moved by more than 8 eps(dtype) of its own magnitude was routed differently ...
MIN_MOVE = 2.0**-10  # ... and never by less than 2^-10 of it (fp32's 8 eps would sit within 2x of GEMM rounding)
ROWS, POSITIONS = 4, 3
#: Config fields that make an upstream MoE keep a bounded number of choices per forward (named in the verdict).
ROUTING_KNOBS = ("moe_drop_tokens", "capacity_factor")


@dataclass(frozen=True)
class RoutingProbe:
    """What ``probe_routing`` measured. ``lone_token`` / ``own_row``: the largest relative move of a token's MoE
    output between the batched forward and a forward of the token alone / of its row alone, per layer."""

    layers: int
    dtype: str
    threshold: float
    lone_token: tuple[float, ...] = ()
    own_row: tuple[float, ...] = ()
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def independent(self) -> bool:
        return all(v <= self.threshold for v in (*self.lone_token, *self.own_row))

    def describe(self) -> str:
        if not self.layers:
            return "no MoE layer with an experts ModuleList (dense, or fused experts): routing not probed"
        worst_token, worst_row = max(self.lone_token), max(self.own_row)
        head = (f"{self.layers} MoE layer(s) probed in {self.dtype}, {ROWS}x{POSITIONS} tokens; largest move of a "
                f"token's output vs the batched forward: alone {worst_token:.2e}, in its own row {worst_row:.2e} "
                f"(rounding bound {self.threshold:.1e} = max({ULPS} eps, 2^-10))")
        if self.independent:
            return head
        return (f"MoE routing depends on what shares the forward ({self.cause()}), not on padding: batched and B=1 "
                f"decoding compute different functions on this model. {head}")

    def cause(self) -> str:
        """What makes routing batch-dependent, in a few words ("" when nothing does). A row whose routing moves
        with the other rows is expert capacity (its lone tokens move with it); lone tokens moving alone is a
        separate single-token path."""
        rows = max(self.own_row, default=0.0) > self.threshold
        lone = max(self.lone_token, default=0.0) > self.threshold
        if rows:
            knobs = ", ".join(f"{k}={v}" for k, v in self.knobs.items()) or "no capacity setting in the config"
            layer = self.own_row.index(max(self.own_row))
            return f"expert capacity: a row's experts depend on the other rows of its batch, layer {layer}; {knobs}"
        if lone:
            layer = self.lone_token.index(max(self.lone_token))
            return (f"single-token path: a token alone in a forward of one, every B=1 decode step, is weighted "
                    f"differently from the same token in a batch, layer {layer}")
        return ""


def routing_bound(dtype: torch.dtype) -> float:
    """The largest relative move of a token's output that reshaping alone explains in ``dtype``."""
    return max(ULPS * float(torch.finfo(dtype).eps), MIN_MOVE)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every module routing over two or more experts (an ``experts`` ModuleList), in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.ModuleList) and
            len(m.experts) >= 2]


def _moves(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest per-token max|actual - reference| over that token's larger max magnitude of the two (fp64; a token
    that is zero in both does not move; NaN reads as inf)."""
    actual, reference = actual.double(), reference.double()
    scale = torch.maximum(reference.abs().amax(dim=-1), actual.abs().amax(dim=-1))
    scale = scale.clamp_min(torch.finfo(torch.float64).tiny)
    moved = float(((actual - reference).abs().amax(dim=-1) / scale).max())
    return math.inf if math.isnan(moved) else moved


@torch.no_grad()
def probe_routing(model: nn.Module, seed: int = 0) -> RoutingProbe:
    """Probe every MoE layer of ``model`` in its own dtype and device (module docstring)."""
    layers = moe_layers(model)
    dtype = next(model.parameters()).dtype
    threshold = routing_bound(dtype)
    config = getattr(model, "config", None)
    knobs = {k: getattr(config, k) for k in ROUTING_KNOBS if getattr(config, k, None) is not None}
    if not knobs.get("moe_drop_tokens"):
        knobs.pop("capacity_factor", None)  # read only when choices drop
    lone, rows = [], []
    gen = torch.Generator().manual_seed(seed)
    for layer in layers:
        weight = next(p for p in layer.parameters() if p.dim() == 2 and p.dtype == dtype)
        hidden = next(p.shape[-1] for p in layer.experts[0].parameters() if p.dim() == 2)
        x = torch.randn(ROWS, POSITIONS, hidden, generator=gen).to(weight.device, dtype)

        def run(part: torch.Tensor, layer: nn.Module = layer) -> torch.Tensor:
            out = layer(part)
            return out[0] if isinstance(out, tuple) else out  # some MoEs also return their router logits

        batched = run(x)
        rows.append(_moves(torch.cat([run(x[r: r + 1]) for r in range(ROWS)]), batched))
        alone = torch.stack([torch.cat([run(x[r: r + 1, p: p + 1]) for p in range(POSITIONS)], dim=1)[0]
                             for r in range(ROWS)])
        lone.append(_moves(alone, batched))
    return RoutingProbe(len(layers), str(dtype).removeprefix("torch."), threshold, tuple(lone), tuple(rows), knobs)

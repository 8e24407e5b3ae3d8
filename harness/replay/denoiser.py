"""The model adapter contract and the CFG step around one transformer forward (docs/contracts.md, replay).

An adapter runs ONE transformer forward over all rows it is given (``forward``), names its CFG
layout and declares its CFG combine (harness.replay.cfg). ``predict_velocity`` builds the CFG batch for
that layout, broadcasts every row field to the forward's row count (the harness's job, never the
adapter's), calls ``forward`` once, splits the output at the midpoint (``split_branches``) and hands both
branches and the guidance scale to the family's combine (``combine_branches``). Stock and batched replay both go
through it, so the only difference between them is the batch they hand in. The seams sit around the family's
code, on what its forward returns and its combine receives, so an ablation of them reaches an adapter that
writes its own combine as surely as one that declares it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.replay import cfg
from harness.replay.conditions import Conditions, broadcast_rows, concat_payloads
from harness.replay.sde import as_rows

__all__ = [
    "FUSED_COND_FIRST",
    "UNCOND_FIRST",
    "UNGUIDED_CFG",
    "DenoiserAdapter",
    "Guidance",
    "WrappedAdapter",
    "combine_branches",
    "concat_branches",
    "declared_combine",
    "declared_layout",
    "guidance_at",
    "model_timestep",
    "model_velocity",
    "predict_velocity",
    "split_branches",
]

FUSED_COND_FIRST = "fused_cond_first"
UNCOND_FIRST = "uncond_first"
LAYOUTS = (FUSED_COND_FIRST, UNCOND_FIRST)

Guidance = float | Sequence[float]
UNGUIDED_CFG = ("the conditions carry two CFG branches but no guidance scale was given: pass guidance (a float or a "
                "per-step schedule); it is only optional for conditions without CFG")


class DenoiserAdapter:
    """A transformer behind the replay's calling convention.

    Subclasses set ``cfg_layout`` and ``module`` (the transformer, which spies hook) and implement
    ``forward(hidden [N, *latent], timestep [N], conditions) -> velocity [N, *latent]`` as exactly one
    transformer call over the N rows; every row field they receive has N rows (check it with
    ``harness.replay.conditions.require_rows``). ``cfg_combine`` declares the family's CFG combine (a
    ``harness.replay.cfg.CfgCombine``: its pipeline's formula over cond, uncond and g, or a known combine's name)
    and ``channel_dim`` the latent dim a norm-rescaling combine reduces over. ``velocity`` is what the family's
    pipeline does to the (combined) model output before its scheduler steps on it: a negation (Lumina2,
    HiDream, Z-Image), a scale, a prediction-type conversion; ``velocity_transform`` names it for reports.
    """

    cfg_layout: str = FUSED_COND_FIRST
    cfg_combine: cfg.CfgCombine | str = cfg.STANDARD
    channel_dim: int = 1
    velocity_transform: str = "identity"
    module: torch.nn.Module

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The model's timestep for per-row sigmas (flow-matching pipelines pass sigma * 1000)."""
        return sigma * 1000.0

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor,
                conditions: Conditions) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def combine(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The family's CFG combine of the two branches' outputs (``[B, *latent]`` each, in replay's layout) at
        scale ``guidance_scale``: the declared ``cfg_combine`` evaluated, its rescale over ``channel_dim``.

        Declare the pipeline's formula rather than overriding this. An override is honoured (a combine no formula
        states: a per-step schedule inside the model, a clamp) and reports name it as the adapter's own code; it
        still receives its branches and scale through ``combine_branches``, so the suite's ablations of what
        reaches a combine (a dropped scale, swapped halves) act on it too.
        """
        return cfg.combine(self.cfg_combine, cond, uncond, guidance_scale, channel_dim=self.channel_dim)

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The scheduler's velocity from the (combined) model ``prediction`` at latents ``x`` and per-row
        ``sigma``, as the family's pipeline computes it after its combine: by default the prediction itself."""
        return prediction


class WrappedAdapter(DenoiserAdapter):
    """Another adapter behind a changed ``forward`` (a batch-shape control, a device move): its layout,
    combine, timestep and transformer are the inner adapter's, so nothing but the forward can differ."""

    def __init__(self, inner: DenoiserAdapter):
        self.inner = inner
        self.cfg_layout = inner.cfg_layout
        self.cfg_combine = inner.cfg_combine
        self.channel_dim = inner.channel_dim
        self.velocity_transform = inner.velocity_transform
        self.module = inner.module

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.inner.timestep(sigma)

    def combine(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return self.inner.combine(cond, uncond, guidance_scale)

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.inner.velocity(prediction, x, sigma)


def guidance_at(guidance: Guidance | None, step: int) -> float | None:
    """The CFG scale at ``step`` from a constant or a per-step schedule (None: conditions without CFG)."""
    if guidance is None:
        return None
    if isinstance(guidance, (int, float)) and not isinstance(guidance, bool):
        return float(guidance)
    if isinstance(guidance, Sequence) and not isinstance(guidance, (str, bytes)):
        if not 0 <= step < len(guidance):
            raise ValueError(f"guidance schedule has {len(guidance)} entries; no scale for step {step}")
        return float(guidance[step])
    raise TypeError(f"guidance must be a float or a per-step sequence of floats, got {type(guidance).__name__}")


def concat_branches(first: Conditions, second: Conditions) -> Conditions:
    """Fuse two single-branch conditions into one 2B-row batch ``[first; second]``."""
    rows = {name: concat_payloads([first.rows[name], second.rows[name]], f"field {name!r}") for name in second.rows}
    return Conditions(batch=second.batch, rows=rows, shared=second.shared, cfg_factor=2)


def _check_layout(adapter: DenoiserAdapter, conditions: Conditions) -> None:
    layout = adapter.cfg_layout
    if layout not in LAYOUTS:
        raise ValueError(f"adapter {type(adapter).__name__} has cfg_layout {layout!r}; expected one of {LAYOUTS}")
    if layout == UNCOND_FIRST and conditions.cfg_factor != 1:
        raise ValueError(f"adapter {type(adapter).__name__} is uncond-first (SD3 style): pass the uncond branch "
                         "as Conditions.negative, not fused rows (cfg_factor=2)")
    if layout == FUSED_COND_FIRST and conditions.negative is not None:
        raise ValueError(f"adapter {type(adapter).__name__} is fused cond-first (HunyuanImage-3 style): pass "
                         "[cond_B; uncond_B] rows with cfg_factor=2, not Conditions.negative")


def model_timestep(adapter: DenoiserAdapter, sigma: torch.Tensor) -> torch.Tensor:
    """The model's timestep for per-row ``sigma``: the adapter's hook, in its pipeline's units."""
    return adapter.timestep(sigma)


def model_velocity(adapter: DenoiserAdapter, prediction: torch.Tensor, x: torch.Tensor,
                   sigma: torch.Tensor) -> torch.Tensor:
    """The velocity the scheduler steps on: the adapter's ``velocity`` of the combined model output (its
    pipeline's post-processing, applied after the combine as the pipeline applies it)."""
    return adapter.velocity(prediction, x, sigma)


def declared_layout(adapter: DenoiserAdapter) -> str:
    """The CFG layout the adapter declares: which half of a two-branch forward's rows is the cond branch."""
    return adapter.cfg_layout


def declared_combine(adapter: DenoiserAdapter) -> str:
    """The CFG combine an adapter declares, in a report's words: its ``cfg_combine`` formula, or its own
    ``combine`` override named as such (a wrapping adapter answers for the adapter it wraps)."""
    while isinstance(adapter, WrappedAdapter):
        adapter = adapter.inner
    declared = cfg.resolve(adapter.cfg_combine)
    if type(adapter).combine is DenoiserAdapter.combine:
        return str(declared)
    return f"{type(adapter).__qualname__}.combine (the adapter's own code; its cfg_combine says {declared})"


def split_branches(layout: str, out: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cond, uncond) halves of a two-branch forward's output: ``[uncond; cond]`` uncond-first,
    ``[cond; uncond]`` fused cond-first."""
    first, second = out[:rows], out[rows:]
    return (second, first) if layout == UNCOND_FIRST else (first, second)


def combine_branches(adapter: DenoiserAdapter, cond: torch.Tensor, uncond: torch.Tensor,
                     guidance_scale: float) -> torch.Tensor:
    """The family's combine of its branch outputs at ``guidance_scale``: what every combine, declared or the
    adapter's own code, receives and returns."""
    return adapter.combine(cond, uncond, guidance_scale)


def predict_velocity(adapter: DenoiserAdapter, x: torch.Tensor, sigma: torch.Tensor | float,
                     conditions: Conditions, guidance_scale: float | None) -> torch.Tensor:
    """Velocity for ``x [N, *latent]`` at per-row ``sigma``, with CFG in the adapter's layout and combine.

    uncond-first: the forward sees ``[uncond; cond]``; fused cond-first: ``[cond; uncond]`` as the
    conditions arrive. Either way it is one forward over row fields broadcast to its row count,
    split at its midpoint, and the family's combine gets both halves and ``guidance_scale``
    (``combine_branches``); the family's ``velocity`` transform of the result is what the scheduler steps on.
    """
    rows = x.shape[0]
    if rows != conditions.batch:
        raise ValueError(f"latents have {rows} rows but the conditions are for batch {conditions.batch}")
    _check_layout(adapter, conditions)
    sigmas = as_rows(sigma, rows)
    timestep = model_timestep(adapter, sigmas)
    if not conditions.guided:
        return model_velocity(adapter, adapter.forward(x, timestep, broadcast_rows(conditions)), x, sigmas)
    if guidance_scale is None:
        raise ValueError(UNGUIDED_CFG)
    fused = concat_branches(conditions.negative, conditions) if conditions.negative is not None else conditions
    out = adapter.forward(torch.cat([x, x]), torch.cat([timestep, timestep]), broadcast_rows(fused))
    cond, uncond = split_branches(declared_layout(adapter), out, rows)
    return model_velocity(adapter, combine_branches(adapter, cond, uncond, guidance_scale), x, sigmas)

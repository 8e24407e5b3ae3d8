"""What a replay family is: an adapter (CFG layout and combine included), its checkpoint kind, the diffusers
pipeline it is tied to and the tiny model the CPU catalogue runs it on.

A family adapter wraps a loaded transformer. Beyond the replay contract (``DenoiserAdapter``: one
``forward(hidden, timestep, conditions)``, the ``timestep`` hook, ``cfg_layout``, ``cfg_combine``,
``channel_dim``) it knows its latent layout and speaks its pipeline's vocabulary: ``example_prompts``
draws seeded encoded prompts under the pipeline's own argument names (``prompt_embeds``,
``negative_prompt_embeds``, masks, pooled embeddings) and ``conditions_from_prompts`` turns them into
replay rows, the translation a trainer makes. The pipeline oracle feeds the same prompts to the real
pipeline, so that translation, the timestep hook and the declared CFG order are held to what the
pipeline actually hands its transformer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.plugins.entry_points import CheckpointKind
from harness.registry import load_ref
from harness.replay import conditions as replay_rows
from harness.replay import discriminating
from harness.replay.cfg import CfgCombine
from harness.replay.cfg import resolve as resolve_combine
from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter

__all__ = ["LatentShapeUnknown", "ModelAdapter", "PipelineSpec", "Prompts", "ReplayFamily", "check_cfg",
           "distinct_lengths", "padded_prompts", "padding_mask", "ragged_prompts", "uncond_first_conditions"]

Prompts = dict[str, Any]  # pipeline keyword arguments: prompt_embeds, negative_prompt_embeds, masks, ...


class LatentShapeUnknown(ValueError):
    """The default ``latent_shape`` cannot be read from the transformer's config: the adapter must state it."""


def _config_value(config: Any, name: str) -> Any:
    """``config.name`` of a diffusers config (attribute or mapping), None where it has none."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


class ModelAdapter(DenoiserAdapter):
    """A real transformer behind the replay contract; subclasses set cfg_layout / cfg_combine / channel_dim."""

    def __init__(self, transformer: torch.nn.Module):
        self.module = transformer

    def require_rows(self, conditions: Conditions, names: tuple[str, ...], rows: int) -> None:
        """Every named row field has exactly the forward's ``rows`` (the harness broadcasts, never the adapter)."""
        for name in names:
            if name not in conditions.rows:
                raise ValueError(f"{type(self).__name__}: row field {name!r} is missing; got {sorted(conditions.rows)}")
            replay_rows.require_rows(type(self).__name__, name, conditions.rows[name], rows)

    def require_shared(self, conditions: Conditions, names: tuple[str, ...]) -> None:
        """Every named shared field (one value every row of the call uses: an image size, position ids) is
        present, refused with a ValueError naming the missing ones otherwise. Call it on every shared field the
        forward reads, before the model runs: a generated test drops each shared field of the family's example
        conditions in turn and requires the velocity unchanged (the forward does not read it) or a ValueError
        before the transformer runs, never a bare KeyError from inside the model call."""
        missing = [name for name in names if name not in conditions.shared]
        if missing:
            raise ValueError(f"{type(self).__name__}: shared field(s) {missing} missing; got "
                             f"{sorted(conditions.shared)} (a value every row shares goes under Conditions.shared)")

    def require_patches(self, hidden: torch.Tensor, spatial: tuple[int, ...], patch: int) -> None:
        """Latent spatial dims that the model's patch size does not divide are refused before the model
        runs (inside it they fail as a bare reshape error)."""
        if patch < 1 or any(size % patch for size in spatial):
            raise ValueError(f"{type(self).__name__}: latents of shape {tuple(hidden.shape)} do not fit the model's "
                             f"patch size {patch}: the spatial dims {tuple(spatial)} must be multiples of {patch}")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The per-sample latent shape replay stores and steps (the pipeline's own layout): by default
        ``[C, H, W]`` at the model's ``in_channels`` and square ``sample_size``. A model whose config has neither
        (its pipeline takes the size from the call) overrides this; the default names what it lacks."""
        config = self.module.config
        channels, size = (_config_value(config, name) for name in ("in_channels", "sample_size"))
        missing = [name for name, value in (("in_channels", channels), ("sample_size", size)) if value is None]
        if missing:
            raise LatentShapeUnknown(
                f"{type(self).__name__}: the default latent_shape is [in_channels, sample_size, sample_size] from "
                f"the transformer's config, and {type(self.module).__name__}'s config has no "
                f"{' and no '.join(repr(name) for name in missing)}: override latent_shape with the per-sample latent "
                "the pipeline steps (e.g. (C, H, W) of the image size the family is judged at)")
        return (channels, size, size)

    @property
    def latent_size(self) -> tuple[int, int]:
        """(H, W) of the unpacked latent grid: the pipeline's height and width over its VAE scale factor."""
        _, height, width = self.latent_shape
        return (height, width)

    def to_pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Replay latents ``[N, *latent_shape]`` in the layout the pipeline steps its scheduler on."""
        return x

    def from_pipeline_latents(self, latents: Any) -> torch.Tensor:
        """What the pipeline holds, in replay's layout ``[N, *latent_shape]``: the inverse of
        ``to_pipeline_latents``. The pipeline oracle hands it two things: the latents the pipeline steps its
        scheduler on (and the prediction it hands the scheduler), a tensor in the pipeline's layout; and the
        transformer's outputs, rows in the adapter's order, as the transformer returns them: a tensor, or a list
        of per-row tensors when the transformer returns lists (one latent per sample). Both come back as one
        tensor; a transformer that returns lists needs this override."""
        return latents

    def example_prompts(self, batch: int, cfg: int,
                        generator: torch.Generator) -> Prompts:  # pragma: no cover - abstract
        """Seeded encoded prompts under the pipeline's argument names (cfg=2 adds the negative ones)."""
        raise NotImplementedError

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:  # pragma: no cover - abstract
        """Replay conditions in this adapter's CFG layout from the pipeline's encoded prompts."""
        raise NotImplementedError

    def example_conditions(self, batch: int, cfg: int, generator: torch.Generator) -> Conditions:
        """Seeded conditions for ``batch`` samples; ``cfg=2`` adds the uncond branch in the family's layout."""
        check_cfg(cfg)
        return self.conditions_from_prompts(self.example_prompts(batch, cfg, generator), cfg)


@dataclass(frozen=True)
class PipelineSpec:
    """The diffusers pipeline a family is tied to, and how the pipeline oracle runs it.

    ``class_name`` names a ``diffusers`` pipeline class; ``scheduler`` builds the scheduler the oracle runs it
    under (the pipeline's timesteps come from it); ``guidance_kwarg`` is the argument that carries the CFG
    scale (``true_cfg_scale`` for the pipelines that run true CFG); ``call_kwargs`` are fixed extra
    arguments. ``prompt_arg`` is the transformer argument that carries the prompt (how the oracle tells the
    pipeline's branches apart) and ``timestep_arg`` the one that carries the timestep. A pipeline that is not a
    diffusers class (a model's own loop in its remote code) brings its own ``oracle``: an object with
    ``run_pipeline``, ``align`` and ``judge_family`` of ``harness.replay.pipeline_oracle``'s signatures, which the
    pipeline oracle hands the family to instead of running a diffusers pipeline; or a ``"package.module:attr"``
    reference to one, imported when first needed (an oracle built on ``harness.replay.pipeline_oracle`` cannot be
    imported while the families are).
    """

    class_name: str
    scheduler: Callable[[], Any]
    guidance_kwarg: str = "guidance_scale"
    call_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prompt_arg: str = "encoder_hidden_states"
    timestep_arg: str = "timestep"
    oracle: Any = None

    def own_oracle(self) -> Any:
        """The family's own pipeline oracle (``oracle``, its reference resolved), or None for a diffusers pipeline."""
        if isinstance(self.oracle, str):
            return load_ref(self.oracle, "PipelineSpec.oracle", "oracle")
        return self.oracle

    def pipeline_class(self) -> type:
        import diffusers

        found = getattr(diffusers, self.class_name, None)
        if not isinstance(found, type):
            raise LookupError(f"diffusers {diffusers.__version__} has no pipeline class {self.class_name!r}")
        return found


@dataclass(frozen=True)
class ReplayFamily:
    """A registered replay family: its adapter class (layout + combine), its checkpoint kind, the diffusers
    pipeline it is tied to (``pipeline``) and a factory of a tiny random-init model built from a config
    (``tiny_model``; the suite's own families keep theirs in ``fixtures.replay_models``)."""

    name: str
    adapter_class: type[ModelAdapter]
    checkpoint_kind: CheckpointKind
    pipeline: PipelineSpec | None = None
    tiny_model: Callable[[], torch.nn.Module] | None = None

    def __post_init__(self) -> None:
        kind = self.checkpoint_kind
        if kind.feeds != "replay" or kind.family != self.name:
            raise ValueError(f"replay family {self.name!r}: its checkpoint kind {kind.name!r} must feed 'replay' "
                             f"with family={self.name!r}, got feeds={kind.feeds!r}, family={kind.family!r}")

    @property
    def cfg_layout(self) -> str:
        return self.adapter_class.cfg_layout

    @property
    def cfg_combine(self) -> CfgCombine:
        """The CFG combine the family's adapter declares."""
        return resolve_combine(self.adapter_class.cfg_combine)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.checkpoint_kind.class_names

    def adapter(self, transformer: torch.nn.Module) -> ModelAdapter:
        return self.adapter_class(transformer)

    def example_conditions(self, adapter: ModelAdapter, batch: int, cfg: int,
                           generator: torch.Generator) -> Conditions:
        """The adapter's seeded example conditions, refused unless every row field tells rows and CFG
        branches apart (harness.replay.discriminating)."""
        conditions = adapter.example_conditions(batch, cfg, generator).validate()
        return discriminating.require_discriminating(conditions, f"replay family {self.name!r}")


def check_cfg(cfg: int) -> None:
    if cfg not in (1, 2):
        raise ValueError(f"cfg must be 1 (no guidance) or 2 (two CFG branches), got {cfg!r}")


def distinct_lengths(batch: int, tokens: int, generator: torch.Generator,
                     avoid: tuple[int, ...] = ()) -> list[int]:
    """Seeded real-token counts in [1, tokens], pairwise different and different from ``avoid`` (the other
    branch's), so padding masks tell every row and branch apart; refuses a batch the tokens cannot serve."""
    choices = [n for n in range(1, tokens + 1) if n not in avoid]
    if len(choices) < batch:
        raise ValueError(f"{batch} distinct prompt lengths need more than {tokens} padded tokens "
                         f"({len(avoid)} taken by the other branch)")
    order = torch.randperm(len(choices), generator=generator).tolist()
    return [choices[i] for i in order[:batch]]


def padding_mask(lengths: list[int], tokens: int) -> torch.Tensor:
    """``[B, tokens]`` long mask, 1 on each row's first ``lengths[b]`` tokens."""
    return (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).long()


def _branch_prompts(batch: int, cfg: int, tokens: int, generator: torch.Generator,
                    draw: Callable[[str, list[int]], Prompts]) -> Prompts:
    """Prompts of each branch (the ``negative_`` ones at cfg=2) from ``draw(prefix, lengths)``, the real lengths
    drawn different per row and per branch."""
    check_cfg(cfg)
    prompts: Prompts = {}
    taken: tuple[int, ...] = ()
    for prefix in ("", "negative_")[:cfg]:
        lengths = distinct_lengths(batch, tokens, generator, avoid=taken)
        taken = (*taken, *lengths)
        prompts.update(draw(prefix, lengths))
    return prompts


def padded_prompts(batch: int, cfg: int, tokens: int, channels: int, generator: torch.Generator, mask_key: str,
                   zero_padding: bool = False) -> Prompts:
    """Seeded ``prompt_embeds [B, tokens, channels]`` and their padding masks under ``mask_key`` (cfg=2: the
    ``negative_`` ones too), the real lengths different per row and per branch; ``zero_padding`` zeroes the
    embeddings of the padded tokens, as a text encoder's masked output is."""

    def draw(prefix: str, lengths: list[int]) -> Prompts:
        mask = padding_mask(lengths, tokens)
        embeds = torch.randn(batch, tokens, channels, generator=generator)
        return {f"{prefix}prompt_embeds": embeds * mask[..., None] if zero_padding else embeds,
                f"{prefix}{mask_key}": mask}

    return _branch_prompts(batch, cfg, tokens, generator, draw)


def ragged_prompts(batch: int, cfg: int, tokens: int, channels: int, generator: torch.Generator) -> Prompts:
    """Seeded ``prompt_embeds`` as a list of ``[length, channels]`` tensors, one per sample, with no mask: a text
    encoder's output with its padding cut off, as pipelines whose transformer takes lists hand it (Z-Image). The
    lengths, at most ``tokens``, differ per row and per branch (cfg=2: the ``negative_`` ones too)."""

    def draw(prefix: str, lengths: list[int]) -> Prompts:
        return {f"{prefix}prompt_embeds": [torch.randn(n, channels, generator=generator) for n in lengths]}

    return _branch_prompts(batch, cfg, tokens, generator, draw)


def uncond_first_conditions(prompts: Prompts, cfg: int, fields: Mapping[str, str],
                            shared: Mapping[str, Any] | None = None) -> Conditions:
    """Uncond-first conditions from pipeline prompts: row field -> prompt key in ``fields`` for the cond branch,
    the ``negative_`` keys for the uncond branch under ``Conditions.negative`` (cfg=2)."""
    check_cfg(cfg)

    def branch(prefix: str) -> Conditions:
        rows = {name: prompts[f"{prefix}{key}"] for name, key in fields.items()}
        return Conditions(batch=replay_rows.payload_rows(next(iter(rows.values()))), rows=rows, shared=shared or {})

    cond = branch("")
    if cfg == 1:
        return cond
    return Conditions(batch=cond.batch, rows=cond.rows, shared=cond.shared, negative=branch("negative_"))

"""HunyuanImage-3 (``HunyuanImage3ForCausalMM``, remote code, both generations) as a replay family.

The model is a causal multimodal transformer whose image forward is ``forward(mode="gen_image", ...)``: the latents'
tokens and a timestep token are written into a text sequence and the prediction is read back from the image
tokens. Its sampling loop (upstream's ``HunyuanImage3Text2ImagePipeline``) runs the whole sequence at the first
step (``first_step=True``) and later steps over a KV cache of it; every replay forward here is a first-step
forward of the whole sequence, with no cache, so a row's inputs are complete in themselves and stack like any
other family's.

Layout: fused cond-first. Upstream builds the CFG batch ``[cond_B; uncond_B]`` itself (``cfg_factor = 2``), so every
field of one branch's sequence (``input_ids``, the bool ``[N, 1, L, L]`` mask, ``image_mask``, the timestep token's
index, the per-sample 2-D RoPE, the conditional images' masks and indices) is a 2B-row field; the conditional
images themselves (it2i: per sample its ``[n, C, h, w]`` latents, each sample's of its own size, a list payload)
are the same in both branches, so they are one B-row field the harness uses once per branch. The 2-D RoPE is per sample:
generation 1 takes ``custom_pos_emb`` tables the caller builds (a ``[N, 2, L, D]`` row field, cos and sin
stacked), generation 2 builds them inside from ``rope_image_info`` (a list payload, one ``[(slice, (h, w)), ...]``
per row). ``position_ids = arange(L)`` is every row's, a shared field. The pipeline's timestep is ``1000 sigma``
and its scheduler steps on the combined prediction as it is (``uncond + g (cond - uncond)``), in fp32: the loop casts
the prediction to fp32 before guiding, and so does the adapter's forward.

The generation is told from what the loaded model's ``forward`` takes (``custom_pos_emb``: 1; ``rope_image_info``:
2); a model with no ``gen_image`` forward, or without an input this family hands it, is refused naming it
(``require_image_forward``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions, payload_rows
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, check_cfg, distinct_lengths

__all__ = ["COND_GRIDS", "GENERATION_INPUTS", "LATENT_HW", "HunyuanImage3Adapter", "ImageForwardError",
           "RowLayout", "image_forward_generation", "require_image_forward", "row_layout"]

LATENT_HW = 4  # the example latents' grid (h = w): 16 image tokens at patch size 1
PROMPT_TOKENS = 5  # prompt text tokens of every example row
PREFIX_TOKENS = 8  # the most system-prompt tokens an example row draws (each row its own count)
#: per sample, the token grids of its conditional images (one each, of its own shape, the same token count, so the
#: rows' layouts differ only by their system prompts)
COND_GRIDS: tuple[tuple[tuple[int, int], ...], ...] = (((2, 4),), ((4, 2),), ((2, 4),), ((4, 2),))
#: what each generation's ``forward`` must take for this family: the common image inputs and its own names
COMMON_INPUTS = ("input_ids", "attention_mask", "position_ids", "mode", "first_step", "images", "image_mask",
                 "cond_vae_images", "cond_vae_image_mask")
GENERATION_INPUTS = {
    1: (*COMMON_INPUTS, "custom_pos_emb", "timestep", "gen_timestep_scatter_index", "cond_timestep",
        "cond_timestep_scatter_index"),
    2: (*COMMON_INPUTS, "rope_image_info", "timesteps", "timesteps_index", "cond_timesteps", "cond_timesteps_index"),
}
ROPE_FIELD = {1: "custom_pos_emb", 2: "rope_image_info"}
INDEX_FIELD = {1: "gen_timestep_scatter_index", 2: "timesteps_index"}
COND_INDEX_FIELD = {1: "cond_timestep_scatter_index", 2: "cond_timesteps_index"}
COND_TIMESTEP_ARG = {1: "cond_timestep", 2: "cond_timesteps"}
TIMESTEP_ARG = {1: "timestep", 2: "timesteps"}
#: upstream's fused-batch fields that carry one row per forward row ([cond_B; uncond_B])
ROW_FIELDS = ("input_ids", "attention_mask", "image_mask", "cond_vae_image_mask")
COND_IMAGES = "cond_vae_images"  # the branch-independent list payload


class ImageForwardError(ValueError):
    """The model cannot be driven as this family: no ``gen_image`` forward, or an input the family needs missing."""


def image_forward_generation(model: torch.nn.Module) -> int:
    """The HunyuanImage-3 generation whose image forward ``model`` has (1 or 2), from what its ``forward`` takes;
    an ImageForwardError naming what is missing otherwise."""
    params = inspect.signature(model.forward).parameters
    generation = 1 if "custom_pos_emb" in params else 2 if "rope_image_info" in params else None
    if generation is None:
        raise ImageForwardError(f"{type(model).__name__}.forward takes neither custom_pos_emb (HunyuanImage-3 "
                                "generation 1) nor rope_image_info (generation 2): no HunyuanImage-3 image forward "
                                "(mode='gen_image') to replay")
    return generation


def require_image_forward(model: torch.nn.Module) -> int:
    """The generation of ``model``'s image forward, once its ``forward`` takes every input this family hands it and
    its config names the latent channels (``vae["latent_channels"]``); an ImageForwardError naming each missing one.
    Models whose CFG is distilled into a guidance token (``cfg_distilled``) or that step a mean flow
    (``use_meanflow``) are refused too: their loop is not the two-branch CFG this family replays."""
    generation = image_forward_generation(model)
    params = inspect.signature(model.forward).parameters
    missing = [name for name in GENERATION_INPUTS[generation] if name not in params]
    if missing:
        raise ImageForwardError(f"{type(model).__name__}.forward (HunyuanImage-3 generation {generation}) takes no "
                                f"{', '.join(missing)}: it has no gen_image forward this family can drive")
    config = model.config
    vae = getattr(config, "vae", None)
    if not isinstance(vae, dict) or "latent_channels" not in vae:
        raise ImageForwardError(f"{type(model).__name__}'s config has no vae['latent_channels']: the latent "
                                "channels of its image forward are unknown")
    for field in ("patch_size", "attention_head_dim", "rope_theta", "vocab_size"):
        if getattr(config, field, None) is None:
            raise ImageForwardError(f"{type(model).__name__}'s config has no {field}, which its image forward needs")
    for flag in ("cfg_distilled", "use_meanflow"):
        if getattr(config, flag, False):
            raise ImageForwardError(f"{type(model).__name__}'s config sets {flag}: its sampling loop is not the "
                                    "two-branch CFG (cond and uncond forwards, one combine) this family replays")
    if not hasattr(model, "patch_embed") or not hasattr(model, "final_layer"):
        raise ImageForwardError(f"{type(model).__name__} has no patch_embed / final_layer: no image forward")
    return generation


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids of the sequence's special tokens, taken from the top of the vocabulary (their embeddings are
    overwritten where the model writes image or timestep tokens; the rest are plain embeddings)."""

    pad: int
    image: int
    timestep: int
    boi: int
    eoi: int
    size: int
    ratio: int
    text_high: int  # text tokens are drawn from [1, text_high)

    @classmethod
    def for_vocab(cls, vocab: int, pad: int) -> SpecialTokens:
        if vocab < 16:
            raise ImageForwardError(f"a vocabulary of {vocab} tokens leaves no room for the sequence's special tokens")
        top = vocab - 1
        return cls(pad, top, top - 1, top - 2, top - 3, top - 4, top - 5, top - 6)


@dataclass(frozen=True)
class RowLayout:
    """One row's token sequence, as upstream's tokenizer lays out a gen_image prompt: ``prefix`` system-prompt
    tokens, each conditional image ``<boi> <timestep> <img>*hw <eoi>``, ``prompt`` text tokens, then the generated
    image ``<boi> <size> <ratio> <timestep> <img>*hw <eoi>``, right-padded to the batch's width."""

    prefix: int
    cond_grids: tuple[tuple[int, int], ...]
    prompt: int
    grid: tuple[int, int]

    def _plan(self) -> tuple[list[slice], list[int], int, slice]:
        """Where each piece sits (a few additions per conditional image: computed on every read)."""
        at, cond_spans, cond_timesteps = self.prefix, [], []
        for h, w in self.cond_grids:
            cond_timesteps.append(at + 1)  # after <boi>
            cond_spans.append(slice(at + 2, at + 2 + h * w))
            at += 3 + h * w
        at += self.prompt
        timestep = at + 3  # <boi> <size> <ratio> <timestep>
        h, w = self.grid
        return cond_spans, cond_timesteps, timestep, slice(timestep + 1, timestep + 1 + h * w)

    @property
    def cond_spans(self) -> list[slice]:
        return self._plan()[0]

    @property
    def cond_timestep_positions(self) -> list[int]:
        return self._plan()[1]

    @property
    def timestep_position(self) -> int:
        return self._plan()[2]

    @property
    def image_span(self) -> slice:
        return self._plan()[3]

    @property
    def length(self) -> int:
        return self.image_span.stop + 1  # <eoi>

    def rope_image_info(self) -> list[tuple[slice, tuple[int, int]]]:
        """Upstream's ``rope_image_info`` entry for this row: every image span with its token grid, in order."""
        spans = [*self.cond_spans, self.image_span]
        return [(span, grid) for span, grid in zip(spans, [*self.cond_grids, self.grid], strict=True)]

    def tokens(self, width: int, special: SpecialTokens, generator: torch.Generator) -> torch.Tensor:
        """``[width]`` token ids: seeded text, the special tokens in place, pads after ``<eoi>``."""
        ids = torch.randint(1, special.text_high, (width,), generator=generator)
        for span, position in zip(self.cond_spans, self.cond_timestep_positions, strict=True):
            ids[position - 1], ids[position], ids[span], ids[span.stop] = (special.boi, special.timestep,
                                                                           special.image, special.eoi)
        t = self.timestep_position
        ids[t - 3], ids[t - 2], ids[t - 1], ids[t] = special.boi, special.size, special.ratio, special.timestep
        ids[self.image_span] = special.image
        ids[self.image_span.stop] = special.eoi
        ids[self.length:] = special.pad
        return ids

    def mask(self, width: int) -> torch.Tensor:
        """The bool ``[width, width]`` mask upstream's builder makes: causal, plus full attention inside every
        image span (the conditional images' and the generated one's)."""
        mask = torch.ones(width, width, dtype=torch.bool).tril()
        for span in [*self.cond_spans, self.image_span]:
            mask[span, span] = True
        return mask



def marked(width: int, spans: Sequence[slice]) -> torch.Tensor:
    """``[width]`` bool, True inside ``spans`` (an image mask: where a row's image tokens sit)."""
    out = torch.zeros(width, dtype=torch.bool)
    for span in spans:
        out[span] = True
    return out


def row_layout(prefix: int, cond_grids: Sequence[tuple[int, int]], prompt: int = PROMPT_TOKENS,
               grid: tuple[int, int] = (LATENT_HW, LATENT_HW)) -> RowLayout:
    return RowLayout(prefix, tuple(tuple(g) for g in cond_grids), prompt, grid)


class HunyuanImage3Adapter(ModelAdapter):
    """HunyuanImage-3's image forward behind the replay contract (module docstring)."""

    cfg_layout = FUSED_COND_FIRST
    cfg_combine = cfg_combines.STANDARD

    def __init__(self, transformer: torch.nn.Module, latent_hw: int = LATENT_HW):
        super().__init__(transformer)
        self.generation = require_image_forward(transformer)
        self.latent_hw = latent_hw
        self._module = sys.modules[type(transformer).__module__]

    # ------------------------------------------------------------------ geometry
    @property
    def patch_size(self) -> int:
        return int(self.module.config.patch_size)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (int(self.module.config.vae["latent_channels"]), self.latent_hw, self.latent_hw)

    @property
    def latent_size(self) -> tuple[int, int]:
        return (self.latent_hw, self.latent_hw)

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The 2B-row fields this generation's forward takes (the per-sample RoPE included)."""
        g = self.generation
        return (*ROW_FIELDS, ROPE_FIELD[g], INDEX_FIELD[g], COND_INDEX_FIELD[g])

    # ------------------------------------------------------------------ the forward
    def as_generate_sets(self, image_mask: torch.Tensor) -> None:
        """What upstream's ``generate`` sets on the model before its loop, since replay (and the pipeline oracle)
        drive it themselves: generation 2 reads ``num_special_tokens`` (the timestep token), ``num_image_tokens``
        and ``post_token_len`` (the tokens after row 0's last ``<img>``)."""
        if self.generation != 2:
            return
        image_rows = image_mask[0].nonzero().flatten()
        self.module.num_special_tokens = 1
        self.module.num_image_tokens = int(image_rows.numel())
        self.module.post_token_len = int(image_mask.shape[1] - 1 - int(image_rows[-1]))

    def require_image_span(self, hidden: torch.Tensor, image_mask: torch.Tensor) -> None:
        """Latents whose token grid is not what every row's image span holds are refused before the model runs
        (inside it they fail as a bare scatter or reshape error)."""
        tokens = (hidden.shape[-2] // self.patch_size) * (hidden.shape[-1] // self.patch_size)
        spans = sorted({int(n) for n in image_mask.sum(dim=1).tolist()})
        if spans != [tokens]:
            raise ValueError(f"{type(self).__name__}: latents of shape {tuple(hidden.shape)} make {tokens} image "
                             f"tokens per row at patch size {self.patch_size}, but the rows' image spans hold "
                             f"{spans} tokens")

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        n = hidden.shape[0]
        self.require_rows(conditions, (*self.row_fields, COND_IMAGES), n)
        self.require_shared(conditions, ("position_ids",))
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.patch_size)
        self.require_image_span(hidden, conditions.rows["image_mask"])
        self.as_generate_sets(conditions.rows["image_mask"])
        prediction = self.module(**self.forward_kwargs(hidden, timestep, conditions))["diffusion_prediction"]
        return prediction.float()  # upstream's loop guides and steps on the prediction in fp32

    def forward_kwargs(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> dict[str, Any]:
        """The first-step ``forward(mode="gen_image")`` arguments of this generation for the rows of
        ``conditions`` (already at the forward's row count): the whole sequence, no cache."""
        n, rows, g = hidden.shape[0], conditions.rows, self.generation
        cond_images = list(rows[COND_IMAGES])
        cond_t = torch.zeros(n, len(cond_images[0]) if cond_images else 0, dtype=timestep.dtype,
                             device=timestep.device)  # clean conditional images: timestep 0, as upstream encodes them
        kwargs: dict[str, Any] = {
            "input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"],
            "position_ids": conditions.shared["position_ids"].reshape(1, -1).expand(n, -1).to(hidden.device),
            "past_key_values": None, "use_cache": False, "mode": "gen_image", "first_step": True,
            "images": hidden, "image_mask": rows["image_mask"], TIMESTEP_ARG[g]: timestep,
            INDEX_FIELD[g]: rows[INDEX_FIELD[g]], COND_IMAGES: cond_images,
            "cond_vae_image_mask": rows["cond_vae_image_mask"], COND_TIMESTEP_ARG[g]: cond_t,
            COND_INDEX_FIELD[g]: rows[COND_INDEX_FIELD[g]], "gen_timestep_scatter_index": rows[INDEX_FIELD[g]],
        }
        if g == 1:
            rope = rows["custom_pos_emb"]
            kwargs["custom_pos_emb"] = (rope[:, 0], rope[:, 1])
        else:
            kwargs["rope_image_info"] = list(rows["rope_image_info"])
        return kwargs

    # ------------------------------------------------------------------ the pipeline's inputs
    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """The model kwargs upstream's ``prepare_model_inputs`` builds for ``batch`` gen_image prompts (cfg=2: the
        fused ``[cond_B; uncond_B]`` batch): seeded token sequences whose system-prompt lengths differ on every row
        of both branches (so every row's image span, mask and RoPE differ), a conditional image per sample (a list
        with one ``[1, C, h, w]`` tensor per row, each sample's of its own shape), the generated image on a
        ``LATENT_HW`` grid. ``tokenizer_output`` carries the image slices
        upstream's mask builder reads; ``past_key_values`` is a fresh cache of the sequence's length (upstream's
        loop writes the first step into it)."""
        check_cfg(cfg)
        if batch > len(COND_GRIDS):
            raise ValueError(f"the example conditions hold {len(COND_GRIDS)} samples' conditional images; asked for "
                             f"{batch}")
        config = self.module.config
        special = SpecialTokens.for_vocab(int(config.vocab_size), int(getattr(config, "pad_id", 0) or 0))
        prefixes = distinct_lengths(cfg * batch, PREFIX_TOKENS, generator)
        layouts = [row_layout(prefixes[r], COND_GRIDS[r % batch]) for r in range(cfg * batch)]
        width = max(layout.length for layout in layouts)
        channels = self.latent_shape[0]
        cond_images = [_cond_images(channels, COND_GRIDS[b], generator) for b in range(batch)]
        return self._model_kwargs(layouts, width, special, cond_images * cfg, generator)

    def _model_kwargs(self, layouts: list[RowLayout], width: int, special: SpecialTokens,
                      cond_images: list[torch.Tensor], generator: torch.Generator) -> Prompts:
        g, rows = self.generation, len(layouts)
        kwargs: Prompts = {
            "input_ids": torch.stack([layout.tokens(width, special, generator) for layout in layouts]),
            "attention_mask": torch.stack([layout.mask(width) for layout in layouts])[:, None],
            "image_mask": torch.stack([marked(width, [layout.image_span]) for layout in layouts]),
            "position_ids": torch.arange(width)[None].expand(rows, -1),
            "mode": "gen_image",
            INDEX_FIELD[g]: torch.tensor([[layout.timestep_position] for layout in layouts]),
            COND_IMAGES: cond_images,
            COND_TIMESTEP_ARG[g]: torch.zeros(rows, len(cond_images[0])),
            "cond_vae_image_mask": torch.stack([marked(width, layout.cond_spans)
                                                for layout in layouts]),
            COND_INDEX_FIELD[g]: torch.tensor([layout.cond_timestep_positions for layout in layouts]),
            "tokenizer_output": SimpleNamespace(
                joint_image_slices=[layout.cond_spans for layout in layouts],
                vae_image_slices=[layout.cond_spans for layout in layouts],
                vit_image_slices=[[] for _ in layouts],
                gen_image_slices=[[layout.image_span] for layout in layouts]),
            "past_key_values": self.new_cache(rows, width),
        }
        infos = [layout.rope_image_info() for layout in layouts]
        if g == 1:
            kwargs["custom_pos_emb"] = self._module.build_batch_2d_rope(
                seq_len=width, n_elem=int(self.module.config.attention_head_dim), image_infos=infos,
                base=self.module.config.rope_theta)
            kwargs["gen_timestep_scatter_index"] = kwargs[INDEX_FIELD[1]]
        else:
            kwargs["rope_image_info"] = infos
            kwargs["gen_timestep_scatter_index"] = kwargs[INDEX_FIELD[2]]
        return kwargs

    def new_cache(self, rows: int, width: int) -> Any:
        """A static cache of the model's own class for ``rows`` rows of ``width`` slots (upstream's loop writes the
        first step's keys into it and reads them at every later step)."""
        cache_cls = getattr(self._module, "HunyuanStaticCache", None)
        if cache_cls is None:
            raise ImageForwardError(f"{type(self.module).__name__}'s module defines no HunyuanStaticCache")
        return cache_cls(config=self.module.config, max_batch_size=rows, max_cache_len=width,
                         dtype=self.module.dtype, dynamic=False)

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """The model kwargs as replay rows: each fused field as its rows, the conditional images once (upstream
        repeats the same list for the uncond branch), the RoPE per row (generation 1's (cos, sin) stacked to
        ``[N, 2, L, D]``), ``position_ids`` shared."""
        check_cfg(cfg)
        g = self.generation
        rows_in = payload_rows(prompts["input_ids"])
        if rows_in % cfg:
            raise ValueError(f"{rows_in} prompt rows do not split into {cfg} CFG branches")
        batch = rows_in // cfg
        images = list(prompts[COND_IMAGES])
        if len(images) != rows_in or any(images[b] is not images[b % batch] and not _same_images(
                images[b], images[b % batch]) for b in range(rows_in)):
            raise ValueError(f"{COND_IMAGES} must hold one list per row, the uncond branch repeating the cond "
                             "branch's (upstream's cfg_factor repetition)")
        rows: dict[str, Any] = {name: prompts[name] for name in (*ROW_FIELDS, INDEX_FIELD[g], COND_INDEX_FIELD[g])}
        rope = prompts[ROPE_FIELD[g]]
        rows[ROPE_FIELD[g]] = torch.stack(list(rope), dim=1) if g == 1 else list(rope)
        rows[COND_IMAGES] = images[:batch]
        width = prompts["input_ids"].shape[1]
        return Conditions(batch=batch, rows=rows, shared={"position_ids": torch.arange(width)}, cfg_factor=cfg)


def _cond_images(channels: int, grids: Sequence[tuple[int, int]], generator: torch.Generator) -> torch.Tensor:
    """One sample's conditional images as upstream's encoder hands a row of them over: ``[n, C, h, w]`` (a row's
    images share a size; rows differ). Generation 1 embeds a row only in this form: its per-row list-of-images path
    builds its token list as a tuple and fails on the first append."""
    if len({tuple(grid) for grid in grids}) != 1:
        raise ValueError(f"a row's conditional images share one size, got {list(grids)}")
    h, w = grids[0]
    return torch.randn(len(grids), channels, h, w, generator=generator)


def _same_images(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))

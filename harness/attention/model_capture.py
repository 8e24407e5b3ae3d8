"""Attention captures recorded from HunyuanImage-3's own image forward (``scripts/capture-attention`` runs it).

The attention path judges its kernels on captures of the model's SDPA calls (``--capture-dir``). This records them
from a loaded checkpoint, both generations, the way upstream's sampling loop calls the model: one first step
(``first_step=True``: the whole sequence, text and images: the prefill capture) and one later step (the timestep and
image tokens over the first step's KV cache: the denoise capture), with the mask upstream's own mask builder makes
and upstream's own kwargs update between them. The batch holds ``BATCH`` samples laid out differently (each row its
own system-prompt length and conditional image, right-padded to one width), so a mask or a position built from one
row's layout for every row shows. At every SDPA call of the chosen layers it records the query, key, value and mask
in the capture format (``harness.attention.capture``): ``(B, S, H, D)`` float32, key and value at their key/value
heads (the GQA repeat undone after checking it is one), the mask ``(B, 1, Q, KV)`` bool, and beside them the layout
the model laid each row out with: its query rows' positions (the later step's from the model's own kwargs update)
and its image spans (the tokenizer output's slices). A later step's keys are the whole cache; the capture keeps keys
up to the last query position of the longest row, each row's own being ``[0, its last position + 1)``.

Every recorded mask is checked row by row against the contract's formula (``mask[i, j] = j <= i`` or both in one
image span: the conditional images' and the generated one's) at the spans that row was laid out with, not at spans
read back from the mask (harness.attention.rows); a disagreement is named by row, query row, its position and the
key.

``scripts/capture-attention`` (``fixtures.capture_attention``) loads the checkpoint: nothing from its directory runs
without ``--trust-remote-code``; a checkpoint whose code has no image forward, or lacks an input the sequence needs,
is a usage error naming what is missing (``ImageForwardError``, ``CaptureError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.attention.capture import Capture, capture_name
from harness.attention.rows import capture_rows, formula_problems
from harness.inputs import compat

__all__ = ["BATCH", "CaptureError", "Recorded", "capture_model", "check_formula"]

BATCH = 2  # samples per capture: rows laid out differently, so a row judged at another row's layout fails


class CaptureError(ValueError):
    """What was asked cannot be captured (bad input, or a model this command cannot drive): a usage error."""


@dataclass(frozen=True)
class Recorded:
    """One SDPA call: its capture (each row's layout recorded in it) and the step and layer it came from."""

    capture: Capture
    step: int
    layer: int

    @property
    def phase(self) -> str:
        return self.capture.phase


@contextlib.contextmanager
def _recording(layers: Sequence[int]) -> Iterator[list[tuple[int, tuple[Any, ...]]]]:
    """torch's SDPA wrapped while the block runs: every call's (index, (query, key, value, mask)) for the calls whose
    index (the layer, within one forward) is in ``layers``. Looked up by attribute at call time, as upstream calls
    it."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    seen: list[tuple[int, tuple[Any, ...]]] = []
    counter = [0]

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        index = counter[0]
        counter[0] += 1
        if index in layers:
            seen.append((index, (query.detach().clone(), key.detach().clone(), value.detach().clone(),
                                 None if attn_mask is None else attn_mask.detach().clone())))
        return original(query, key, value, attn_mask, *args, **kwargs)

    functional.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        functional.scaled_dot_product_attention = original


def _kv_heads(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H, S, D)`` keys or values repeated per query-head group back to their ``kv_heads`` heads, after
    checking the repeat is one (each group's heads equal); unchanged when they are not a repeat."""
    heads = tensor.shape[1]
    if kv_heads >= heads or heads % kv_heads:
        return tensor
    grouped = tensor.reshape(tensor.shape[0], kv_heads, heads // kv_heads, *tensor.shape[2:])
    if not bool((grouped == grouped[:, :, :1]).all()):
        return tensor
    return grouped[:, :, 0]


def _to_capture(call: tuple[Any, ...], kv_heads: int, keys: int, name: str, positions: torch.Tensor | None = None,
                spans: torch.Tensor | None = None) -> Capture:
    query, key, value, mask = call
    if mask is None or mask.dtype != torch.bool:
        raise CaptureError(f"{name}: SDPA got {'no mask' if mask is None else f'a {mask.dtype} mask'}; the capture "
                           "format holds the bool mask the model hands it")
    key, value = _kv_heads(key, kv_heads)[:, :, :keys], _kv_heads(value, kv_heads)[:, :, :keys]
    mask = mask.expand(query.shape[0], 1, query.shape[2], mask.shape[-1])[..., :keys]
    return Capture(query.transpose(1, 2).float().contiguous(), key.transpose(1, 2).float().contiguous(),
                   value.transpose(1, 2).float().contiguous(), mask.contiguous(), scale=query.shape[-1] ** -0.5,
                   name=name, positions=positions, spans=spans)


def _on_model(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """An input on the model's device, a floating one in its dtype, list payloads (the conditional images) too,
    as upstream's pipeline hands them over."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_model(v, device, dtype) for v in value)
    return value


@torch.no_grad()
def capture_model(model: Any, layers: Sequence[int] | None = None, seed: int = 0, batch: int = BATCH) -> list[Recorded]:
    """The prefill and denoise SDPA calls of ``model``'s image forward at ``layers`` (default: every layer), ``batch``
    samples laid out differently, each with a conditional image, through upstream's own mask builder, hooks and
    cache, each row's layout recorded beside it (module docstring)."""
    from harness.replay.families import get_family
    from harness.replay.families.hunyuan_image3 import TIMESTEP_ARG

    family = get_family("hunyuan_image3")
    adapter = family.adapter(model)  # an ImageForwardError names what the model lacks
    count = int(model.config.num_hidden_layers)
    chosen = tuple(range(count)) if layers is None else tuple(layers)
    bad = [layer for layer in chosen if not 0 <= layer < count]
    if bad or not chosen:
        raise CaptureError(f"--layers {list(chosen)}: the model has layers 0..{count - 1}")
    prompts = adapter.example_prompts(batch, 1, torch.Generator().manual_seed(seed))
    output = prompts["tokenizer_output"]
    spans = torch.tensor([[(s.start, s.stop) for s in (*output.vae_image_slices[b], output.gen_image_slices[b][0])]
                          for b in range(batch)])
    g = adapter.generation
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    kwargs = {k: _on_model(v, device, dtype) for k, v in prompts.items()}
    kwargs["past_key_values"] = adapter.new_cache(batch, prompts["input_ids"].shape[1])
    ids = kwargs.pop("input_ids")
    kwargs["attention_mask"] = model._prepare_attention_mask_for_generation(
        ids, model.generation_config, kwargs).to(device)
    adapter.as_generate_sets(prompts["image_mask"])
    gen = torch.Generator().manual_seed(seed + 1)
    latents = torch.randn(batch, *adapter.latent_shape, generator=gen).to(device, dtype)
    kv_heads = int(getattr(model.config, "num_key_value_heads", 0) or model.config.num_attention_heads)
    width = int(ids.shape[1])
    recorded: list[Recorded] = []
    with _recording(chosen) as first_calls:
        first = model(**model.prepare_inputs_for_generation(
            ids, images=latents, **{TIMESTEP_ARG[g]: torch.full((batch,), 1000.0, device=device)}, **kwargs),
            first_step=True)
    carried = compat.remote_code_kwargs(model._update_model_kwargs_for_generation(first, kwargs))
    later_positions = carried["position_ids"].cpu().to(torch.int64)  # integer positions carry no autograd history
    later_ids = torch.gather(ids, 1, carried["position_ids"]) if g == 1 else None
    with _recording(chosen) as later_calls:
        model(**model.prepare_inputs_for_generation(
            later_ids, images=latents * 0.5, **{TIMESTEP_ARG[g]: torch.full((batch,), 500.0, device=device)},
            **carried), first_step=False)
    for step, calls, positions in ((0, first_calls, torch.arange(width)[None].expand(batch, -1)),
                                   (1, later_calls, later_positions)):
        keys = int(positions.max()) + 1  # the longest row's; each row's own end is recorded in its positions
        for layer, call in calls:
            name = capture_name(step * count + layer)
            capture = _to_capture(call, kv_heads, keys, name, positions.contiguous(), spans)
            recorded.append(Recorded(capture, step, layer))
    return recorded


def check_formula(recorded: Recorded) -> str | None:
    """None when every row's mask is the contract's formula at the layout recorded for it; else where it is not
    (``harness.attention.rows.formula_problems``, each prefixed by its row)."""
    found = [f"row {row.row}: {problem}" for row in capture_rows(recorded.capture) for problem in formula_problems(row)]
    return "; ".join(found) or None

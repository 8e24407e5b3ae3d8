"""Attention kernels written the way a team's own framework would, for ``--impl attention=zoo_attention:NAME``.

Signature: ``kernel(query, key, value, layout, *, scale=None)`` with query ``(B, H, Q, D)``, key/value
``(B, Hkv, KV, D)`` (Hkv divides H: GQA, query head h uses key/value head h // (H / Hkv)), and a
``harness.attention.layout.AttentionLayout``: ``spans`` (every bidirectional image span, the prompt's
earlier images first, the generated image last), ``special_positions``, ``q_offset`` (query row r sits at
absolute position ``q_offset + r``). ``scale=None`` means 1 / sqrt(D).

``attend`` is right: it builds HunyuanImage-3's mask from the layout itself (causal, each image span
bidirectional, special rows causal only) and runs one masked SDPA in the inputs' dtype. Every other
callable carries one realistic bug (see ``BUGS``); each must fail the attention checks it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

__all__ = ["BUGS", "CORRECT", "attend", "causal_only", "drops_the_scale", "earlier_images_causal",
           "flattens_heads_apart", "gqa_group_two", "gqa_tiled", "pads_a_block_when_aligned", "returns_fp32_for_bf16",
           "scale_none_is_one", "special_rows_see_the_image", "structured_mask"]

BLOCK = 128


@dataclass(frozen=True)
class Flaws:
    """Which bug the kernel carries (all False: the right one).

    The fields no ``BUGS`` entry sets re-create publicly reported bugs (``corpus/attention.py``)."""

    causal_only: bool = False  # is_causal alone: no image block
    tiled_gqa: bool = False  # key/value heads repeated as a tile (h % Hkv), not interleaved (h // group)
    pad_when_aligned: bool = False  # pads the keys to the next block even when aligned, pad unmasked then
    scale_none_one: bool = False  # scale=None read as 1.0
    fp32_output: bool = False  # computes in fp32 for accuracy and returns fp32 for low-precision inputs
    last_image_only: bool = False  # only the generated image is bidirectional
    specials_in_span: bool = False  # the special rows see the image span too
    images_one_block: bool = False  # every image token sees every other image's tokens, later images included
    pad_tail_unmasked: bool = False  # KV padded up to the block when not aligned, the pad keys left unmasked
    scale_none_zero: bool = False  # scale=None read as 0 (a "use the default" sentinel applied literally)
    scale_dropped: bool = False  # a passed scale ignored: always 1 / sqrt(D)
    flattened_apart: bool = False  # query flattened (H, B), key/value (B, H), for one batched 3-D launch
    group_two: bool = False  # key/value heads widened by 2, the group it was written for, then tiled up to H


def structured_mask(layout, device, flaws: Flaws = Flaws()) -> torch.Tensor:
    """(Q, KV) bool, True = may attend."""
    q_pos = torch.arange(layout.q_offset, layout.kv_len, device=device)[:, None]
    kv_pos = torch.arange(layout.kv_len, device=device)[None, :]
    mask = kv_pos <= q_pos
    if flaws.causal_only:
        return mask
    spans = layout.spans[-1:] if flaws.last_image_only else layout.spans
    for start, end in spans:
        mask = mask | ((q_pos >= start) & (q_pos < end) & (kv_pos >= start) & (kv_pos < end))
    if flaws.images_one_block:
        q_image, kv_image = _in_spans(q_pos, layout.spans), _in_spans(kv_pos, layout.spans)
        mask = mask | (q_image & kv_image)
    lo, hi = layout.special_positions
    if not flaws.specials_in_span:
        mask = torch.where((q_pos >= lo) & (q_pos < hi), kv_pos <= q_pos, mask)
    else:
        start, end = layout.span
        mask = mask | ((q_pos >= lo) & (q_pos < hi) & (kv_pos >= start) & (kv_pos < end))
    return mask


def _in_spans(pos: torch.Tensor, spans) -> torch.Tensor:
    """True where a position lies in any of ``spans``."""
    inside = torch.zeros_like(pos, dtype=torch.bool)
    for start, end in spans:
        inside = inside | ((pos >= start) & (pos < end))
    return inside


def _expand(tensor: torch.Tensor, heads: int, flaws: Flaws) -> torch.Tensor:
    group = heads // tensor.shape[1]
    if flaws.group_two and group > 1:
        wide = tensor.repeat_interleave(2, dim=1)
        return wide.repeat(1, heads // wide.shape[1], 1, 1)
    return tensor.repeat(1, group, 1, 1) if flaws.tiled_gqa else tensor.repeat_interleave(group, dim=1)


def _flattened_apart(query, key, value, mask, scale) -> torch.Tensor:
    """One 3-D launch over every (batch, head): the query flattened head-major, key/value batch-major."""
    batch, heads, q_len, dim = query.shape
    rows = query.transpose(0, 1).reshape(heads * batch, q_len, dim)
    key, value = (t.reshape(batch * heads, t.shape[2], dim) for t in (key, value))
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return out.reshape(heads, batch, q_len, dim).transpose(0, 1)


def _attend(query, key, value, layout, scale, flaws: Flaws) -> torch.Tensor:
    heads, dim = query.shape[1], query.shape[-1]
    if scale is None or flaws.scale_dropped:
        scale = 1.0 if flaws.scale_none_one else 0.0 if flaws.scale_none_zero else 1.0 / math.sqrt(dim)
    key, value = _expand(key, heads, flaws), _expand(value, heads, flaws)
    mask = structured_mask(layout, query.device, flaws)
    if flaws.pad_when_aligned:
        pad = BLOCK - layout.kv_len % BLOCK  # a whole block when already aligned
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=layout.kv_len % BLOCK == 0)  # pad masked only when it was needed
    if flaws.pad_tail_unmasked and layout.kv_len % BLOCK:
        pad = BLOCK - layout.kv_len % BLOCK  # zero keys up to the block, every one of them visible
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=True)
    if flaws.flattened_apart:
        return _flattened_apart(query, key, value, mask, scale)
    if flaws.fp32_output:  # the upcast for accuracy is fine; forgetting to cast back doubles every consumer's memory
        return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def _kernel(flaws: Flaws, doc: str):
    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout, *,
               scale: float | None = None) -> torch.Tensor:
        return _attend(query, key, value, layout, scale, flaws)

    kernel.__doc__ = doc
    return kernel


CORRECT = Flaws()
attend = _kernel(CORRECT, "Right: the layout's mask (every image span, special rows causal), one masked SDPA.")
BUGS = {
    "causal_only": (replace(CORRECT, causal_only=True), "is_causal only: the image spans are not bidirectional"),
    "gqa_tiled": (replace(CORRECT, tiled_gqa=True), "GQA heads expanded with repeat (tile), not repeat_interleave"),
    "pads_a_block_when_aligned": (replace(CORRECT, pad_when_aligned=True),
                                  "pads a whole block of zero keys when KV is already a block multiple, unmasked"),
    "scale_none_is_one": (replace(CORRECT, scale_none_one=True), "scale=None read as 1.0, not 1 / sqrt(D)"),
    "returns_fp32_for_bf16": (replace(CORRECT, fp32_output=True),
                              "computes bf16 inputs in fp32 and returns the fp32 output, never cast back"),
    "earlier_images_causal": (replace(CORRECT, last_image_only=True),
                              "only the generated image is bidirectional; the prompt's earlier images stay causal"),
    "special_rows_see_the_image": (replace(CORRECT, specials_in_span=True),
                                   "the special rows see the image span (at denoise they precede it)"),
    "drops_the_scale": (replace(CORRECT, scale_dropped=True), "a passed scale ignored: always 1 / sqrt(D)"),
    "flattens_heads_apart": (replace(CORRECT, flattened_apart=True),
                             "one 3-D launch: the query flattened (H, B), key/value (B, H); right at B = 1"),
    "gqa_group_two": (replace(CORRECT, group_two=True),
                      "key/value heads widened by a hard-coded 2, then tiled up to H: right for groups 1 and 2"),
}
causal_only = _kernel(*BUGS["causal_only"])
gqa_tiled = _kernel(*BUGS["gqa_tiled"])
pads_a_block_when_aligned = _kernel(*BUGS["pads_a_block_when_aligned"])
scale_none_is_one = _kernel(*BUGS["scale_none_is_one"])
returns_fp32_for_bf16 = _kernel(*BUGS["returns_fp32_for_bf16"])
earlier_images_causal = _kernel(*BUGS["earlier_images_causal"])
special_rows_see_the_image = _kernel(*BUGS["special_rows_see_the_image"])
drops_the_scale = _kernel(*BUGS["drops_the_scale"])
flattens_heads_apart = _kernel(*BUGS["flattens_heads_apart"])
gqa_group_two = _kernel(*BUGS["gqa_group_two"])

"""Batched AR rollouts written the way a team's own framework would, for ``--impl ar=zoo_ar:NAME``.

Signature: ``fast_rollout(backend, batch, max_new_tokens, eos)`` returning a ``harness.ar.loop.Rollout``:
B right-padded prompts decoded in one batch, greedy, each row stopping at its first EOS id (it then emits
the pad id, records log-prob 0 and writes no more KV), the KV of every row read back in logical order. The
model is driven through the backend's hooks (``harness.ar.backends``): ``new_cache``, ``begin``, ``prefill`` /
``decode`` (one forward each, given a bool mask), ``prefill_key_length`` / ``decode_key_length``,
``key_valid``, ``decode_write_slots``, ``token_columns``, ``logical_slots``; those hooks read the state a
``harness.ar.loop.ARState`` carries, which the loop takes from ``harness.ar.loop.init_state`` (the cache and
the empty outputs, nothing of the loop itself).

``fast_rollout`` is right, with its own loop, masks, sampling, EOS bookkeeping and KV freeze for finished rows.
``fast_left_rollout`` is right too, in the other layout: it declares ``padding_side = "left"``, so the conformance
run hands it a ``harness.ar.left_padded.LeftPaddedBatch`` (pads first, a 2-D attention mask) and judges it with the
left-padded checks. Its positions come from the mask, every row's first token from the last column, and where each
token's KV goes is the backend's cache contract: one shared column per step on a transformers model, each row's own
slots on the HunyuanImage-3 fake (whose ``position_ids`` are also its write slots: real token t at slot t, pads past
the prompt). Every other callable carries one realistic bug (see ``BUGS``); each must fail the ar checks it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.ar.backends import UpstreamBackend
from harness.ar.batch import ARBatch, right_padded_batch
from harness.ar.loop import Rollout, init_state

__all__ = ["BUGS", "CORRECT", "LEFT", "MORE_CORRECT", "block_aligned_cache", "fast_left_rollout", "fast_rollout",
           "finished_rows_keep_sampling", "finished_rows_keep_writing_kv", "first_logits_at_the_padded_tail",
           "infers_lengths_from_pads", "left_decode_mask_dropped", "left_pad_keys_visible",
           "left_pad_queries_admit_nothing", "left_padding_undeclared", "left_positions_from_shared_cache_position",
           "left_positions_not_shifted", "log_softmax_in_model_dtype", "no_decode_mask", "right_padding_declared_left",
           "tokens_appended_at_the_tail"]


@dataclass(frozen=True)
class Flaws:
    """Which bug the loop carries (all False: the right one).

    The fields no ``BUGS`` entry sets re-create publicly reported bugs (``corpus/ar.py``)."""

    ignore_eos: bool = False  # rows keep sampling after their EOS
    write_after_eos: bool = False  # finished rows stop sampling but their KV slot is still written
    tail_logits: bool = False  # first token read from the last column, not each row's last real token
    append_tokens: bool = False  # the next input token appended at the buffer's tail (rows fed their own pads)
    no_decode_mask: bool = False  # decode steps run unmasked ("full attention of 1 x seqlen")
    lengths_from_pads: bool = False  # no real_pos: each row's length taken from its first pad id
    shared_positions: bool = False  # decode positions from the shared cache slot, not each row's own length
    pads_visible: bool = False  # the padding is lost: every prompt column counts as a real key
    left: bool = False  # the loop left-pads its prefill rows (and declares padding_side = "left")
    unshifted_positions: bool = False  # left: prefill positions are the column index, not shifted by the pad count
    declares_other_side: bool = False  # the callable declares the padding side it does not pad on
    logp_in_model_dtype: bool = False  # the recorded log-prob's log-softmax taken in the logits' (model's) dtype
    pad_queries_see_nothing: bool = False  # left: a pad's prefill query row admits no key (NaN under an eager softmax)
    block_slots: int = 0  # not a flaw: a static cache allocated in whole blocks of this many slots (block kernels)


def _real_pos(batch: Any, flaws: Flaws) -> torch.Tensor:
    if batch.real_pos is None:
        if flaws.lengths_from_pads:
            is_pad = batch.input_ids == batch.pad_id
            first = torch.where(is_pad.any(dim=1), is_pad.int().argmax(dim=1), batch.input_ids.shape[1])
            return first.long()
        raise ValueError("fast_rollout needs tokenizer_output.real_pos (each row's unpadded length)")
    return batch.real_pos.reshape(-1).long()


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _emit(state: Any, logits: torch.Tensor, step: int, flaws: Flaws, stop_ids: torch.Tensor,
          pad_id: int) -> torch.Tensor:
    """Record one step's greedy pick from the rows' logits ``[B, V]`` as the model returned them (recorded and
    scored in fp32; a finished row emits the pad id) and return the tokens."""
    emitting = torch.ones_like(state.finished) if flaws.ignore_eos else ~state.finished
    picked = logits.float()
    token = picked.argmax(dim=-1)
    scored = logits if flaws.logp_in_model_dtype else picked
    logp = torch.log_softmax(scored, dim=-1).float().gather(-1, token[:, None])[:, 0]
    token = torch.where(emitting, token, pad_id)
    state.tokens[:, step] = token
    state.logp[:, step] = torch.where(emitting, logp, 0.0)
    state.logits[:, step] = picked
    state.lengths = torch.where(emitting, step + 1, state.lengths)
    if not flaws.ignore_eos:
        state.finished = state.finished | (emitting & torch.isin(token, stop_ids))
    return token


def _kept(cache: Any, rows: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What finished rows hold at the slots this step will write (put back after the forward)."""
    return [(k[rows, :, slots[rows]].clone(), v[rows, :, slots[rows]].clone()) for k, v in _layers(cache)]


def _put_back(cache: Any, rows: torch.Tensor, slots: torch.Tensor, kept: list[tuple[torch.Tensor, torch.Tensor]]):
    for (k, v), (k_old, v_old) in zip(_layers(cache), kept, strict=True):
        k[rows, :, slots[rows]] = k_old
        v[rows, :, slots[rows]] = v_old


def _causal(width: int, device: torch.device) -> torch.Tensor:
    """A plain causal prefill mask over every column, pads included."""
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def _decode(backend: Any, state: Any, mask: torch.Tensor | None, flaws: Flaws) -> torch.Tensor:
    """One decode forward; with ``shared_positions`` every row is placed at the shared cache slot (width + step,
    what a batch-wide cache_position counter holds) rather than its own ``real_pos + step``. The transformers
    backend derives decode RoPE positions from ``state.real_pos``; upstream's layout ties positions to its own
    per-row write indices, so there the flaw has no effect."""
    if not flaws.shared_positions:
        return backend.decode(state, mask)
    own = state.real_pos
    state.real_pos = torch.full_like(own, state.batch.width)
    try:
        return backend.decode(state, mask)
    finally:
        state.real_pos = own


def _rollout(backend: Any, batch: Any, max_new_tokens: int, eos: Sequence[int], flaws: Flaws) -> Rollout:
    if getattr(batch, "padding_side", "right") == "left":  # this loop pads on the right, whatever it was handed
        batch = right_padded_batch(batch.prompts(), batch.pad_id)
    real_pos = _real_pos(batch, flaws)
    rows, width = batch.batch_size, batch.width
    device = batch.input_ids.device
    # the state the backend's hooks read (its cache, buffers and empty outputs), for the lengths decided above
    state = init_state(backend, replace(batch, real_pos=real_pos[:, None]), max_new_tokens, eos)
    if flaws.block_slots and rows > 1:  # a static cache of whole blocks: more slots than width + new tokens
        blocks = -(-(width + max_new_tokens) // flaws.block_slots)
        state.max_cache_len = blocks * flaws.block_slots
        state.cache = backend.new_cache(rows, state.max_cache_len, dynamic=False)
        backend.begin(state)
    cache = state.cache
    stop_ids = torch.tensor(tuple(eos), dtype=torch.long, device=device)
    everyone = torch.arange(rows, device=device)
    with torch.no_grad():
        for step in range(max_new_tokens):
            if step == 0:
                keys = backend.prefill_key_length(state)
                mask = torch.zeros(rows, 1, width, keys, dtype=torch.bool, device=device)
                mask[..., :width] = _causal(width, device) if flaws.pads_visible else batch.attention_mask
                logits = backend.prefill(state, mask)
                column = torch.full_like(real_pos, width - 1) if flaws.tail_logits else real_pos - 1
                picked = logits[everyone, column.to(device)]
            else:
                live = ~state.finished
                writes = torch.ones_like(live) if flaws.write_after_eos else live
                generated = state.generated + writes.long()
                keys = backend.decode_key_length(state)
                valid = backend.key_valid(state, generated, keys)
                if flaws.pads_visible:  # the prefill wrote every prompt column, pads included
                    valid = valid | (torch.arange(keys, device=device) < width)[None]
                mask = None if flaws.no_decode_mask else valid[:, None, None, :]
                frozen = ~writes
                slots = backend.decode_write_slots(state)
                kept = _kept(cache, frozen, slots) if bool(frozen.any()) else None
                logits = _decode(backend, state, mask, flaws)
                if kept is not None:
                    _put_back(cache, frozen, slots, kept)
                state.generated = generated
                picked = logits[:, -1]
            token = _emit(state, picked, step, flaws, stop_ids, backend.pad_id)
            if flaws.append_tokens:
                columns = torch.full_like(real_pos, state.input_ids.shape[1]).to(device)
            else:
                columns = backend.token_columns(state)
            grown = torch.cat([state.input_ids, torch.zeros_like(state.input_ids[:, :1])], dim=1)
            state.input_ids = grown.scatter(1, columns[:, None], token[:, None])
            state.step_idx += 1
            if bool(state.finished.all()):
                break
    kv = []
    for i in range(rows):
        slots = backend.logical_slots(int(real_pos[i]), width, int(state.generated[i]))
        kv.append(torch.stack([torch.stack([k[i][:, slots.to(k.device)], v[i][:, slots.to(v.device)]])
                               for k, v in _layers(cache)]).float().cpu())
    return Rollout(state.tokens.cpu(), state.logp.cpu(), state.logits.cpu(), state.lengths.cpu(), real_pos.cpu(),
                   tuple(kv))


# ------------------------------------------------------------------------------------------------ left-padded


def _left_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, W] with each row's pads first, bool mask [B, W] of its real tokens): the batch's own when it is
    left-padded, else its prompts left-padded here."""
    if getattr(batch, "padding_side", "right") == "left":
        return batch.input_ids, batch.attention_mask
    prompts = batch.prompts()
    width = max(int(p.numel()) for p in prompts)
    ids = torch.full((len(prompts), width), batch.pad_id, dtype=torch.long, device=batch.input_ids.device)
    real = torch.zeros(len(prompts), width, dtype=torch.bool, device=batch.input_ids.device)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel():] = prompt
        real[row, width - prompt.numel():] = True
    return ids, real


def _left_positions(real: torch.Tensor, flaws: Flaws) -> torch.Tensor:
    """Each row's prompt at positions 0..n-1 and its pads after them (n..W-1: the slots its decode fills first, on a
    backend whose positions are its write slots); with ``unshifted_positions``, the column index."""
    rows, width = real.shape
    columns = torch.arange(width, device=real.device)
    if flaws.unshifted_positions:
        return columns.expand(rows, -1)
    pads = (width - real.sum(dim=1)).tolist()
    return torch.stack([columns.roll(p) for p in pads])


def _left_prefill_mask(real: torch.Tensor, positions: torch.Tensor, per_row: bool, keys: int,
                       flaws: Flaws) -> torch.Tensor:
    """[B, 1, W, keys]: a real query sees the real keys at or before it; a pad's query sees the row's real keys (its
    output is never read, and a query that sees nothing comes out of SDPA as NaN). Keys are indexed by cache slot:
    the column on a shared-column backend, the position on a per-row-slot one."""
    rows, width = real.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()
    if flaws.pads_visible:
        by_column = causal.expand(rows, -1, -1)
    elif flaws.pad_queries_see_nothing:  # a key must be real and the query too
        by_column = causal & real[:, None, :] & real[:, :, None]
    else:
        by_column = torch.where(real[:, :, None], causal & real[:, None, :], real[:, None, :])
    mask = torch.zeros(rows, width, max(keys, width), dtype=torch.bool, device=real.device)
    slots = positions if per_row else torch.arange(width, device=real.device).expand(rows, -1)
    for row in range(rows):
        mask[row][:, slots[row]] = by_column[row]
    return mask[..., :keys][:, None]


def _left_decode_mask(backend: Any, state: Any, generated: torch.Tensor, keys: int, pads: torch.Tensor,
                      per_row: bool, flaws: Flaws) -> torch.Tensor | None:
    """Each row's prompt keys and its own generated ones, never its pads' (kept in a static cache)."""
    if flaws.no_decode_mask:
        return None
    width = state.batch.width
    slots = torch.arange(keys, device=generated.device)[None]
    if per_row:
        valid = backend.key_valid(state, generated, keys)  # slots [0, n_i + generated_i)
        written_pads = slots < width
    else:
        valid = ((slots >= pads[:, None]) & (slots < width)) | ((slots >= width) & (slots < width + generated[:, None]))
        written_pads = slots < pads[:, None]
    if flaws.pads_visible:
        valid = valid | written_pads
    return valid[:, None, None, :]


def _left_rollout(backend: Any, batch: Any, max_new_tokens: int, eos: Sequence[int], flaws: Flaws) -> Rollout:
    ids, real = _left_inputs(batch)
    rows, width = ids.shape
    device = ids.device
    lengths = real.sum(dim=1)
    pads = width - lengths
    per_row = isinstance(backend, UpstreamBackend)
    positions = _left_positions(real, flaws)
    view = ARBatch(ids, positions, real[:, None, None, :].expand(rows, 1, width, width).contiguous(), lengths[:, None],
                   batch.pad_id)
    state = init_state(backend, view, max_new_tokens, eos)  # the backend's cache and hooks over the prefill's view
    cache = state.cache
    stop_ids = torch.tensor(tuple(eos), dtype=torch.long, device=device)
    with torch.no_grad():
        for step in range(max_new_tokens):
            if step == 0:
                keys = backend.prefill_key_length(state)
                logits = backend.prefill(state, _left_prefill_mask(real, positions, per_row, keys, flaws))
                if per_row and not flaws.unshifted_positions:  # the next inputs are re-read at their slots
                    state.input_ids = torch.stack([row.roll(-int(p)) for row, p in zip(ids, pads, strict=True)])
                picked = logits[:, -1]  # every row's prompt ends in the last column
            else:
                live = ~state.finished
                writes = torch.ones_like(live) if flaws.write_after_eos else live
                generated = state.generated + writes.long()
                mask = _left_decode_mask(backend, state, generated, backend.decode_key_length(state), pads, per_row,
                                         flaws)
                frozen = ~writes
                slots = backend.decode_write_slots(state)
                kept = _kept(cache, frozen, slots) if bool(frozen.any()) else None
                logits = _decode(backend, state, mask, flaws)
                if kept is not None:
                    _put_back(cache, frozen, slots, kept)
                state.generated = generated
                picked = logits[:, -1]
            token = _emit(state, picked, step, flaws, stop_ids, backend.pad_id)
            grown = torch.cat([state.input_ids, torch.zeros_like(state.input_ids[:, :1])], dim=1)
            state.input_ids = grown.scatter(1, backend.token_columns(state)[:, None], token[:, None])
            state.step_idx += 1
            if bool(state.finished.all()):
                break
    kv = []
    for i in range(rows):
        n, done = int(lengths[i]), int(state.generated[i])
        slots = torch.arange(n + done) if per_row else torch.arange(width - n, width + done)
        kv.append(torch.stack([torch.stack([k[i][:, slots.to(k.device)], v[i][:, slots.to(v.device)]])
                               for k, v in _layers(cache)]).float().cpu())
    return Rollout(state.tokens.cpu(), state.logp.cpu(), state.logits.cpu(), state.lengths.cpu(), lengths.cpu(),
                   tuple(kv))


def _implementation(flaws: Flaws, doc: str):
    loop = _left_rollout if flaws.left else _rollout

    def fast_rollout(backend: Any, batch: Any, max_new_tokens: int, eos: Sequence[int] = ()) -> Rollout:
        return loop(backend, batch, max_new_tokens, eos, flaws)

    fast_rollout.__doc__ = doc
    if flaws.left != flaws.declares_other_side:
        fast_rollout.padding_side = "left"
    return fast_rollout


CORRECT = Flaws()
fast_rollout = _implementation(CORRECT, "Right: per-row first logits, token columns, decode masks, EOS, KV freeze.")
LEFT = replace(CORRECT, left=True)
# right implementations of the other layout (zoo.py judges each like ``CORRECT``: every check judged or not judged)
MORE_CORRECT = {"fast_left_rollout": (LEFT, "right, left-padded (declares padding_side = 'left')"),
                "block_aligned_cache": (replace(CORRECT, block_slots=64),
                                        "right, its static cache allocated in whole blocks of 64 slots")}
fast_left_rollout = _implementation(LEFT, "Right, left-padded: positions from the mask, first logits at the last "
                                          "column, pads masked at every step, EOS, KV freeze.")
block_aligned_cache = _implementation(*MORE_CORRECT["block_aligned_cache"])
BUGS = {
    "finished_rows_keep_sampling": (replace(CORRECT, ignore_eos=True), "rows keep sampling after their EOS"),
    "finished_rows_keep_writing_kv": (replace(CORRECT, write_after_eos=True),
                                      "finished rows stop sampling but keep writing their KV slot"),
    "first_logits_at_the_padded_tail": (replace(CORRECT, tail_logits=True),
                                        "the first token read at the last column, a pad for shorter rows"),
    "tokens_appended_at_the_tail": (replace(CORRECT, append_tokens=True),
                                    "sampled tokens appended at the buffer's tail: short rows are fed their pads"),
    "no_decode_mask": (replace(CORRECT, no_decode_mask=True),
                       "decode steps unmasked over the static cache (pads and unwritten slots read)"),
    "infers_lengths_from_pads": (replace(CORRECT, lengths_from_pads=True),
                                 "without real_pos each row's length is guessed from its first pad id"),
    "left_positions_from_shared_cache_position": (
        replace(LEFT, shared_positions=True),
        "left-padded: decode positions from the shared cache slot, not each row's length (transformers models)"),
    "left_pad_keys_visible": (replace(LEFT, pads_visible=True),
                              "left-padded: the pads are ordinary keys, at the prefill and at every decode step"),
    "left_decode_mask_dropped": (replace(LEFT, no_decode_mask=True),
                                 "left-padded: the pad mask applied at the prefill only, decode steps unmasked"),
    "left_positions_not_shifted": (replace(LEFT, unshifted_positions=True),
                                   "left-padded: prefill positions the column index, not shifted by the pad count"),
    "left_padding_undeclared": (replace(LEFT, declares_other_side=True),
                                "a right left-padded rollout without padding_side: judged as right-padded, it must "
                                "fail naming the layout mismatch"),
    "right_padding_declared_left": (replace(CORRECT, declares_other_side=True),
                                    "a right right-padded rollout declaring padding_side = 'left': it must fail "
                                    "naming the layout mismatch"),
    "log_softmax_in_model_dtype": (replace(CORRECT, logp_in_model_dtype=True),
                                   "the recorded log-prob's log-softmax taken in the model's dtype, upcast after"),
    "left_pad_queries_admit_nothing": (replace(LEFT, pad_queries_see_nothing=True),
                                       "left-padded: a pad's prefill query row admits no key, NaN under an eager "
                                       "-inf softmax"),
}
finished_rows_keep_sampling = _implementation(*BUGS["finished_rows_keep_sampling"])
finished_rows_keep_writing_kv = _implementation(*BUGS["finished_rows_keep_writing_kv"])
first_logits_at_the_padded_tail = _implementation(*BUGS["first_logits_at_the_padded_tail"])
tokens_appended_at_the_tail = _implementation(*BUGS["tokens_appended_at_the_tail"])
no_decode_mask = _implementation(*BUGS["no_decode_mask"])
infers_lengths_from_pads = _implementation(*BUGS["infers_lengths_from_pads"])
left_positions_from_shared_cache_position = _implementation(*BUGS["left_positions_from_shared_cache_position"])
left_pad_keys_visible = _implementation(*BUGS["left_pad_keys_visible"])
left_decode_mask_dropped = _implementation(*BUGS["left_decode_mask_dropped"])
left_positions_not_shifted = _implementation(*BUGS["left_positions_not_shifted"])
left_padding_undeclared = _implementation(*BUGS["left_padding_undeclared"])
right_padding_declared_left = _implementation(*BUGS["right_padding_declared_left"])
log_softmax_in_model_dtype = _implementation(*BUGS["log_softmax_in_model_dtype"])
left_pad_queries_admit_nothing = _implementation(*BUGS["left_pad_queries_admit_nothing"])

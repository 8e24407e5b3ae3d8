"""The ar fast path in the other batch layout: B prompts LEFT-padded into one batch over a static KV cache, as
transformers' ``generate`` and most serving stacks batch, judged against the same B=1 runs as the right-padded one.

Every row's pads come first and its prompt ends in the last column, so every row's first token is read from the
last prefill column, and RoPE positions come from the attention mask (real tokens: cumsum - 1), not from the
column. Where each token's KV goes is the backend's cache contract:

- a transformers causal LM (its cache writes one shared slot per forward): the prefill fills columns ``[0, W)``,
  row i's ``p_i`` pads first; decode step k writes column ``W + k - 1`` for every row at RoPE position
  ``n_i + k - 1`` (``n_i`` its real tokens); every decode mask admits the row's prompt ``[p_i, W)`` and its own
  generated columns, never its pads, whose KV the static cache keeps.
- HunyuanImage-3 remote code (``position_ids`` is both the RoPE index and the per-row write slot): real token t
  is written at slot t and each pad at a slot past its row's prompt (``[n_i, W)``), which the row's own decode
  steps overwrite before any mask admits it; decode goes on at ``n_i + k`` through upstream's own hooks.

The loop keeps per-step work to what the next step needs, as the right-padded loop does: the per-rollout tensors
(decode positions, write slots, key ranks, pad slots) are built once in ``begin``.

Seams (module-level, replaced from outside by the ablations): ``left_positions``, ``decode_start``,
``first_logits_column``, ``decode_key_mask``. Shared with the right-padded loop: ``harness.ar.cache.cache_is_dynamic``
(B=1 keeps the dynamic cache), ``harness.ar.loop.should_write_kv`` (finished rows stop writing KV),
``harness.ar.loop.place_token`` and ``harness.ar.loop.token_logprob`` (the recorded fp32 log-prob).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from harness.ar import cache as ar_cache
from harness.ar import loop
from harness.ar.backends import UpstreamBackend, model_mask, shared_column_inputs, shared_token_columns
from harness.ar.batch import ARBatch
from harness.inputs import compat

__all__ = [
    "LeftPaddedBatch",
    "RowSlots",
    "SharedColumns",
    "decode_key_mask",
    "decode_start",
    "fast_left_rollout",
    "first_logits_column",
    "layout_for",
    "left_padded_batch",
    "left_positions",
    "padding_side",
    "prefill_mask",
]


# --------------------------------------------------------------------------------------------- the batch


@dataclass(frozen=True)
class LeftPaddedBatch:
    """A left-padded batch as a tokenizer with ``padding_side="left"`` returns it: ids and a 2-D mask."""

    input_ids: torch.Tensor  # [B, W] long, each row's pads first
    attention_mask: torch.Tensor  # [B, W] bool, True on real tokens
    pad_id: int
    padding_side: ClassVar[str] = "left"

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's real-token count ``[B]`` (long)."""
        return self.attention_mask.sum(dim=-1)

    @property
    def real_pos(self) -> torch.Tensor:
        """``[B, 1]``: each row's unpadded length, what the right-padded batch calls ``real_pos`` (the judges and
        probes read both layouts' rows through it)."""
        return self.lengths[:, None]

    def prompts(self) -> list[torch.Tensor]:
        """Each row's unpadded prompt (what a B=1 run is given)."""
        return [self.input_ids[i, self.width - int(n):] for i, n in enumerate(self.lengths.tolist())]


def left_padded_batch(prompts: Sequence[Sequence[int] | torch.Tensor], pad_id: int,
                      width: int | None = None) -> LeftPaddedBatch:
    """Rows left-padded to ``width`` (default the longest prompt) with ``pad_id``; a width above the longest pads
    every row."""
    if not prompts:
        raise ValueError("left_padded_batch needs at least one prompt")
    rows = []
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        rows.append(ids)
    longest = max(r.numel() for r in rows)
    width = longest if width is None else int(width)
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, width - row.numel():] = row
        mask[i, width - row.numel():] = True
    return LeftPaddedBatch(input_ids, mask, int(pad_id))


def padding_side(batch: Any) -> str:
    """``"left"`` for a left-padded batch, else ``"right"`` (the right-padded ``ARBatch``)."""
    return getattr(batch, "padding_side", "right")


def _validate(batch: LeftPaddedBatch) -> torch.Tensor:
    """The rows' lengths ``[B]``; a ValueError naming the rows that are not left-padded."""
    ids, mask = batch.input_ids, batch.attention_mask
    if ids.dim() != 2 or tuple(mask.shape) != tuple(ids.shape) or mask.dtype != torch.bool:
        raise ValueError(f"a left-padded batch needs input_ids [B, W] and a bool attention_mask of the same shape, "
                         f"got {tuple(ids.shape)} and {mask.dtype} {tuple(mask.shape)}")
    lengths = mask.sum(dim=-1)
    empty = lengths == 0
    if bool(empty.any()):
        raise ValueError(f"rows {empty.nonzero().flatten().tolist()} of the left-padded batch have no real token")
    # left-padded: the mask never falls back to False once a row's prompt began
    stray = (mask[:, :-1] & ~mask[:, 1:]).any(dim=-1)
    if bool(stray.any()):
        raise ValueError(f"rows {stray.nonzero().flatten().tolist()} are not left-padded: a pad follows a real token")
    return lengths.long()


# --------------------------------------------------------------------------------------------- seams


def left_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The prefill ``position_ids [B, W]``: each real token the count of real tokens before it (cumsum - 1), so every
    prompt starts at 0 as it does alone; each pad the next position past its row's prompt (``n_i``, ``n_i + 1``,
    ...), which is where a per-row-slot cache writes it and the row's first decode steps overwrite it."""
    real = attention_mask.long()
    before = real.cumsum(dim=-1) - 1
    pads_before = (1 - real).cumsum(dim=-1) - 1
    return torch.where(attention_mask, before, real.sum(dim=-1, keepdim=True) + pads_before)


def decode_start(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's first decode position ``[B]``: its own length, where its prompt's positions end; never the shared
    cache column ``width`` every row writes at that step (the transformers layout)."""
    return lengths


def first_logits_column(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """The prefill column of each row's last real token: the last column for every row of a left-padded batch."""
    return torch.full_like(lengths, width - 1)


def decode_key_mask(written: torch.Tensor, pad_keys: torch.Tensor) -> torch.Tensor | None:
    """The decode mask ``[..., B, 1, 1, K]``: every slot a row has written except those holding its pads' KV, which
    a static cache keeps from the prefill (``written [..., B, K]``, ``pad_keys`` broadcast to it; leading
    dimensions: several steps' masks at once)."""
    return (written & ~pad_keys).reshape(*written.shape[:-1], 1, 1, written.shape[-1])


# --------------------------------------------------------------------------------------------- masks


def prefill_mask(attention_mask: torch.Tensor, slots: torch.Tensor, key_length: int) -> torch.Tensor:
    """The bool prefill mask ``[B, 1, W, key_length]`` over cache slots: a real query admits the real keys at or
    before its column (at the slot ``slots [B, W]`` each column writes); a pad's query admits slot 0 only, written
    in this very forward (its output is never read, and an all-False row would turn it NaN in SDPA, which the
    next layer would write into the pad's KV)."""
    bsz, width = attention_mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    by_column = causal[None] & attention_mask[:, None, :] & attention_mask[:, :, None]  # [B, query, key column]
    span = max(key_length, width)
    out = torch.zeros(bsz, width, span, dtype=torch.bool, device=attention_mask.device)
    out.scatter_(2, slots[:, None, :].expand(bsz, width, width), by_column)
    out[..., 0] |= ~attention_mask
    return out[..., :key_length][:, None]


# --------------------------------------------------------------------------------------------- layouts


@dataclass
class _Plan:
    """What one rollout's steps read, built once in ``begin``."""

    lengths: torch.Tensor  # [B] real tokens per row
    start: torch.Tensor  # [B] first decode position per row (``decode_start``)
    mask: torch.Tensor  # [B, 1, W, K] the prefill mask
    ranks: torch.Tensor | None = None  # [B, max_cache_len] per slot, what ``key_masks`` compares with generated counts
    pads: torch.Tensor | None = None  # [B, max_cache_len] bool, the slots the prefill wrote the row's pads to
    slots: torch.Tensor | None = None  # [W + N] write slots of the prefill and the decode steps (shared columns)


class _Layout:
    """The left-padded layout over one backend: the hooks ``harness.ar.loop`` reads (``new_cache``, ``pad_id``,
    ``vocab_size``, ``begin``, ``logical_slots``) with everything else delegated to the backend, so the probes of
    ``harness.ar.probes`` read the left layout's slots through it too."""

    layout = ""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        if name == "backend":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.backend, name)

    def prefill_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The cache slot each prefill column writes ``[B, W]``."""
        raise NotImplementedError

    def begin(self, state: loop.ARState) -> None:
        """Build the rollout's plan (``state.extra["left_padded"]``) from the prefill's view of the batch."""
        batch = state.batch
        real = batch.attention_mask[:, 0, -1]  # [B, W]: the last query row of the view is the 2-D mask
        lengths = state.real_pos
        mask = prefill_mask(real, self.prefill_slots(batch.position_ids), self.prefill_key_length(state))
        plan = _Plan(lengths=lengths, start=decode_start(lengths, batch.width), mask=mask)
        self.plan(state, plan)
        state.extra["left_padded"] = plan

    def plan(self, state: loop.ARState, plan: _Plan) -> None:
        raise NotImplementedError


class SharedColumns(_Layout):
    """A transformers causal LM: the prefill writes columns ``[0, W)``; decode step k writes column ``W + k - 1`` for
    every row."""

    layout = "left-padded, shared columns (row i's pads at [0, p_i), token k at W + k)"

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.cache_kwarg = compat.forward_cache_kwarg(backend.model.forward)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: Any,
             slots: torch.Tensor) -> torch.Tensor:
        kwargs = {self.cache_kwarg: cache, **compat.write_slot_kwargs(self.backend.model.forward, slots)}
        return self.backend.model(input_ids=ids, attention_mask=model_mask(self.backend.model, mask),
                                  position_ids=positions, use_cache=True, **kwargs).logits

    def prefill_slots(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.arange(positions.shape[1], device=positions.device)[None].expand(positions.shape[0], -1)

    def plan(self, state: loop.ARState, plan: _Plan) -> None:
        width, steps = state.batch.width, state.max_new_tokens
        device = plan.lengths.device
        plan.slots = torch.arange(width + steps, device=device)
        slots = torch.arange(state.key_slots(), device=device)[None]  # every slot, a longer cache's tail included
        # a prompt column (pads included) is written by the prefill; column W + j once j + 1 tokens were fed
        plan.ranks = torch.where(slots < width, -1, slots - width).expand(state.batch.batch_size, -1)
        plan.pads = slots < (width - plan.lengths)[:, None]

    def prefill_key_length(self, state: loop.ARState) -> int:
        return state.batch.width if ar_cache.is_dynamic(state.cache) else state.key_slots()

    def prefill(self, state: loop.ARState, plan: _Plan) -> torch.Tensor:
        batch = state.batch
        return self._run(batch.input_ids, plan.mask, batch.position_ids, state.cache, plan.slots[: batch.width])

    def decode_key_length(self, state: loop.ARState) -> int:
        if ar_cache.is_dynamic(state.cache):
            return state.batch.width + state.step_idx
        return state.key_slots()

    def decode_write_slots(self, state: loop.ARState) -> torch.Tensor:
        slot = state.batch.width + state.step_idx - 1
        return torch.full((state.batch.batch_size,), slot, dtype=torch.long, device=state.real_pos.device)

    def decode(self, state: loop.ARState, mask: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
        """Decode step k feeds column ``W + k - 1`` at RoPE position ``n_i + k - 1``, writing slot ``W + k - 1``."""
        ids, positions, slots = shared_column_inputs(state, lambda: plan.start, True)
        return self._run(ids, mask, positions, state.cache, slots)

    def key_masks(self, plan: _Plan, generated: torch.Tensor, key_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(every column the row has written ``[..., B, key_length]``, its pads' columns ``[B, key_length]``);
        leading dimensions of ``generated``: several steps' counts at once."""
        return plan.ranks[:, :key_length] < generated[..., None], plan.pads[:, :key_length]

    def token_columns(self, state: loop.ARState) -> torch.Tensor:
        return shared_token_columns(state)

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        """The prompt's columns ``[W - n, W)``, then the generated tokens' ``[W, W + generated)``."""
        return torch.arange(width - real_pos, width + generated)


class RowSlots(_Layout):
    """HunyuanImage-3 remote code: ``position_ids`` is each row's write slot, so real token t lands at slot t and the
    pads past the prompt; the backend's own hooks run every forward and carry upstream's per-row decode state."""

    layout = "left-padded, per-row slots (real token t at slot t, row i's pads at [n_i, W))"

    def prefill_slots(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def plan(self, state: loop.ARState, plan: _Plan) -> None:
        kwargs = self.backend.model_kwargs(plan.start, state.batch.width, state.cache, state.max_cache_len)
        state.extra["model_kwargs"] = {**kwargs, "position_ids": state.batch.position_ids, "attention_mask": plan.mask}
        slots = torch.arange(state.key_slots(), device=plan.lengths.device)[None]
        plan.ranks = slots - plan.lengths[:, None]  # a slot's offset past its row's prompt
        plan.pads = (plan.ranks >= 0) & (slots < state.batch.width)

    def prefill_key_length(self, state: loop.ARState) -> int:
        return self.backend.prefill_key_length(state)

    def prefill(self, state: loop.ARState, plan: _Plan) -> torch.Tensor:
        logits = self.backend.prefill(state, plan.mask)
        # from here on upstream re-reads each input at its position_ids: hold the token buffer in slot order
        state.input_ids.copy_(state.input_ids.gather(1, state.batch.position_ids.argsort(dim=-1)))
        return logits

    def decode_key_length(self, state: loop.ARState) -> int:
        return self.backend.decode_key_length(state)

    def decode_write_slots(self, state: loop.ARState) -> torch.Tensor:
        return self.backend.decode_write_slots(state)

    def decode(self, state: loop.ARState, mask: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
        return self.backend.decode(state, mask)

    def key_masks(self, plan: _Plan, generated: torch.Tensor, key_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(every slot the row has written, the slots still holding its pads' KV), ``[..., B, key_length]`` each: a
        pad slot its own decode overwrote holds one of its tokens."""
        own = plan.ranks[:, :key_length] < generated[..., None]  # the prompt and the tokens fed so far
        pads = plan.pads[:, :key_length] & ~own
        return own | pads, pads

    def token_columns(self, state: loop.ARState) -> torch.Tensor:
        return self.backend.token_columns(state)

    def logical_slots(self, real_pos: int, width: int, generated: int) -> torch.Tensor:
        return self.backend.logical_slots(real_pos, width, generated)


def layout_for(backend: Any) -> SharedColumns | RowSlots:
    """The left-padded layout of ``backend``'s cache contract: per-row slots for HunyuanImage-3 remote code, shared
    columns for a transformers causal LM (and any backend of that contract)."""
    if isinstance(backend, _Layout):
        return backend
    return RowSlots(backend) if isinstance(backend, UpstreamBackend) else SharedColumns(backend)


# --------------------------------------------------------------------------------------------- the loop


def init_state(backend: Any, batch: LeftPaddedBatch, max_new_tokens: int, eos: Sequence[int] = (), *,
               cache_slots: int | None = None) -> loop.ARState:
    """Validate the batch and run ``harness.ar.loop.init_state`` over the prefill's view of it (left-padded ids,
    ``left_positions``, the 2-D mask in every query row, each row's length as ``real_pos``): the cache (dynamic
    only at B == 1), the empty outputs and the layout's plan."""
    if padding_side(batch) != "left":
        raise ValueError(f"fast_left_rollout needs a left-padded batch (harness.ar.left_padded.LeftPaddedBatch), got "
                         f"a {padding_side(batch)}-padded {type(batch).__name__}")
    lengths = _validate(batch)
    width = batch.width
    view = ARBatch(batch.input_ids, left_positions(batch.attention_mask),
                   batch.attention_mask[:, None, None, :].expand(-1, 1, width, -1), lengths[:, None], batch.pad_id)
    return loop.init_state(layout_for(backend), view, max_new_tokens, eos, cache_slots=cache_slots)


def _sample(state: loop.ARState, views: loop.StepViews, row_logits: torch.Tensor, some_finished: bool) -> bool:
    """Greedy pick of every unfinished row into ``state.tokens``; finished rows emit the pad. Returns whether some
    row has finished now (one host read per step). Log-probs are recorded once, in ``harness.ar.loop.collect``."""
    k = state.step_idx
    views.logit_columns[k].copy_(row_logits)  # fp32, which takes bf16 and fp16 exactly
    emitted = torch.argmax(views.logit_columns[k], dim=-1, out=views.token_columns[k])
    if some_finished:
        emitted.masked_fill_(state.finished, state.backend.pad_id)
        state.lengths = state.lengths.masked_fill(~state.finished, k + 1)
    else:
        state.lengths = views.counts[k + 1]
    if state.eos:
        stops = state.extra.get("stops")
        if stops is None:
            stops = state.extra["stops"] = torch.tensor(state.eos, dtype=torch.long, device=emitted.device)
        state.finished = state.finished | torch.isin(emitted, stops)  # a finished row's pad changes nothing
        some_finished = bool(state.finished.any())
    state.input_ids = loop.place_token(state.grown_input_ids(), emitted, state.backend.token_columns(state))
    return some_finished


def _uniform_masks(state: loop.ARState, layout: Any, plan: _Plan, views: loop.StepViews) -> list[Any] | None:
    """Every decode step's mask while all rows generate (index k: step k, every row's count k), built at once before
    the first decode step; None over a dynamic cache, whose key axis grows with the steps."""
    if ar_cache.is_dynamic(state.cache):
        return None
    counts, keys = views.count_table[1: state.max_new_tokens], layout.decode_key_length(state)
    written, pads = layout.key_masks(plan, counts, keys)
    written = loop.stepwise(written, layout, "key_masks", counts, keys)
    return loop.per_step(decode_key_mask(written, pads), counts.shape[0])


@torch.no_grad()
def _rollout(state: loop.ARState) -> loop.ARState:
    layout, plan = state.backend, state.extra["left_padded"]
    views = loop.StepViews.of(state)
    rows = torch.arange(state.batch.batch_size, device=plan.lengths.device)
    logits = layout.prefill(state, plan)
    row_logits = logits[rows, first_logits_column(plan.lengths, state.batch.width)]
    some_finished = _sample(state, views, row_logits, False)
    state.step_idx = 1
    uniform = None if some_finished else _uniform_masks(state, layout, plan, views)
    while state.step_idx < state.max_new_tokens:
        if some_finished and bool(state.finished.all()):
            break
        frozen = None
        if some_finished:  # only the rows still generating write KV
            writes = loop.should_write_kv(state.finished)
            generated = state.generated + writes
            frozen = None if bool(writes.all()) else ~writes
        else:  # every row generates: every row writes this step's KV
            generated = views.counts[state.step_idx]
        if some_finished or uniform is None:
            mask = decode_key_mask(*layout.key_masks(plan, generated, layout.decode_key_length(state)))
        else:
            mask = uniform[state.step_idx]
        kept = None if frozen is None else loop.save_finished_rows(state, layout, frozen)
        logits = layout.decode(state, mask, plan)
        if kept is not None:
            ar_cache.restore_slots(state.cache, frozen, *kept)
        state.generated = generated
        some_finished = _sample(state, views, logits.select(1, -1), some_finished)
        state.step_idx += 1
    return state


def fast_left_rollout(backend: Any, batch: LeftPaddedBatch, max_new_tokens: int,
                      eos: Sequence[int] = (), *, cache_slots: int | None = None) -> loop.Rollout:
    """Decode the whole left-padded batch at once over one cache (``cache_slots`` as ``harness.ar.loop.init_state``
    reads it); the ``Rollout`` the right-padded ``harness.ar.loop.fast_rollout`` returns (``real_pos``: each row's
    length; KV in logical order)."""
    return loop.collect(_rollout(init_state(backend, batch, max_new_tokens, eos, cache_slots=cache_slots)))


fast_left_rollout.padding_side = "left"  # what a conformance run reads off an implementation (docs/extending.md)

"""The batched right-padded AR loop over a static KV cache, and the stock B=1 loop beside it.

``fast_rollout`` decodes B prompts in one batch; ``stock_rollout`` decodes each prompt alone at B=1 with the
backend's stock generation. Both return a ``Rollout`` so a check reads ``compare(fast(x), stock(x))``.

The batched loop keeps per-step work to what the next step needs (the sampled token, its logits, the masks and
the token buffer): a tiny model's forward costs well under a millisecond, so every small op per step shows in the
rollout's time next to the model's own forwards. Everything a step writes is allocated once per rollout (the
token buffer at its final width, the outputs, the per-step views of both in ``StepViews``), and while no row has
finished the per-row bookkeeping (who writes KV, who emitted) is skipped: every row does the same. The recorded
log-probs are computed once over every step in ``collect``, through the same ``token_logprob`` the stock loop uses.

Seams (module-level, replaced from outside by the ablations): ``real_positions``, ``place_token``,
``first_logits_column``, ``should_write_kv``; plus ``harness.ar.cache.cache_is_dynamic``,
``harness.ar.masks.decode_mask`` and ``harness.ar.batch.pad_positions``. Sampling is greedy (top_k = 1); the
recorded log-prob is the fp32 full-softmax T=1 log-prob of the sampled token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.ar import cache as ar_cache
from harness.ar import masks
from harness.ar.batch import ARBatch

__all__ = [
    "ARState",
    "LogicalKV",
    "Rollout",
    "StepViews",
    "collect",
    "fast_rollout",
    "finished_rows",
    "first_logits_column",
    "init_state",
    "per_step",
    "place_token",
    "real_positions",
    "recorded_logp",
    "save_finished_rows",
    "should_write_kv",
    "step",
    "stepwise",
    "stock_rollout",
]


# --------------------------------------------------------------------------------------------- seams


def real_positions(batch: ARBatch) -> torch.Tensor:
    """Each row's first pad index ``[B]`` from ``tokenizer_output.real_pos``; required at every batch size.

    Upstream's ``_update_model_kwargs_for_generation`` reads it as the first decode position, so without it
    even B=1 would silently re-feed the shifted prompt.
    """
    if batch.real_pos is None:
        raise ValueError(
            f"batched AR needs tokenizer_output.real_pos [B, 1] (each row's unpadded length) at every batch size; "
            f"it is missing for a batch of {batch.batch_size} row(s) of width {batch.width}")
    real_pos = torch.as_tensor(batch.real_pos).reshape(-1).long()
    if real_pos.numel() != batch.batch_size:
        raise ValueError(f"real_pos has {real_pos.numel()} entries for a batch of {batch.batch_size} rows")
    lengths = real_pos.tolist()  # one read, checked on the host
    if not all(1 <= length <= batch.width for length in lengths):
        raise ValueError(f"real_pos must lie in [1, {batch.width}] (1 <= unpadded length <= width), got {lengths}")
    return real_pos


def place_token(input_ids: torch.Tensor, tokens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Write row i's token to column ``columns[i]`` of the token buffer ``input_ids`` (already grown by this
    step's column; written in place and returned).

    Upstream re-reads the next input with ``input_ids.gather(1, position_ids)``; writing every row's token to the
    last column would feed every shorter row its own pad token.
    """
    return input_ids.scatter_(1, columns.unsqueeze(1), tokens.unsqueeze(1))


def first_logits_column(real_pos: torch.Tensor, width: int) -> torch.Tensor:
    """Column of each row's last real token in the prefill logits (``real_pos_i - 1``), not the padded tail."""
    return real_pos - 1


def should_write_kv(finished: torch.Tensor) -> torch.Tensor:
    """Rows whose KV writes of this step are kept: only rows still generating."""
    return ~finished


# --------------------------------------------------------------------------------------------- state


@dataclass
class ARState:
    """Everything one batched rollout carries between steps."""

    backend: Any
    batch: ARBatch
    real_pos: torch.Tensor  # [B]
    cache: Any
    max_new_tokens: int
    max_cache_len: int
    eos: tuple[int, ...]
    input_ids: torch.Tensor  # the tokens placed so far [B, W + placed], column == cache slot of that token's KV
    token_buffer: torch.Tensor  # [B, W + N] every column a token can land in (pad until placed); input_ids views it
    tokens: torch.Tensor  # [B, N] long, pad after a row finished
    logp: torch.Tensor  # [B, N] float32, 0 after a row finished; filled by ``collect`` from ``logits``
    logits: torch.Tensor  # [B, N, V] float32, the row logits each token was sampled from
    lengths: torch.Tensor  # [B] tokens emitted so far (EOS included)
    generated: torch.Tensor  # [B] generated tokens whose KV the row holds
    finished: torch.Tensor  # [B] bool
    step_idx: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.step_idx >= self.max_new_tokens or finished_rows(self)[1]

    def key_slots(self) -> int:
        """The key axis of a forward over the static cache: every slot it holds, those past the rollout's last
        token included (a cache sized in whole blocks, or at a maximum length, holds more than width + new
        tokens)."""
        return self.max_cache_len

    def grown_input_ids(self) -> torch.Tensor:
        """The token buffer one column wider than ``input_ids``: where this step's tokens are placed."""
        return self.token_buffer[:, : self.input_ids.shape[1] + 1]


@dataclass(frozen=True)
class StepViews:
    """Per-step views of one rollout's outputs, made once: picking a view from a tuple costs nothing, a tensor slice
    costs an op, and each op per step shows beside a tiny model's forward. Valid while the state still holds the
    tensors they view (``of``)."""

    tokens: torch.Tensor  # the state's ``tokens`` the views were made from
    logits: torch.Tensor  # the state's ``logits`` the views were made from
    token_columns: tuple[torch.Tensor, ...]  # k -> tokens[:, k]
    logit_columns: tuple[torch.Tensor, ...]  # k -> logits[:, k]
    count_table: torch.Tensor  # [N + 1, B], row k filled with k
    counts: tuple[torch.Tensor, ...]  # k -> count_table[k] (generated KV after decode step k; emitted after k - 1)

    @classmethod
    def of(cls, state: ARState) -> StepViews | None:
        """The state's views, made on first use; None once the state holds other output tensors (views of the old
        ones would write where nobody reads)."""
        views = state.extra.get("step_views")
        if views is None:
            steps, rows = state.max_new_tokens, state.batch.batch_size
            counts = torch.arange(steps + 1, device=state.lengths.device)[:, None].repeat(1, rows)
            views = state.extra["step_views"] = cls(state.tokens, state.logits, state.tokens.unbind(1),
                                                    state.logits.unbind(1), counts, counts.unbind(0))
        if views.tokens is not state.tokens or views.logits is not state.logits:
            return None
        return views


def finished_rows(state: ARState) -> tuple[bool, bool]:
    """(some row finished, every row finished), read once per ``finished`` tensor and version: the loop asks at
    every step, and ``finished`` only changes when a row emits a stop id (or someone writes to it)."""
    finished = state.finished
    if finished.is_inference():  # no version counter to tell an in-place write
        count = int(finished.sum())
        return count > 0, count == finished.numel()
    cached = state.extra.get("finished_rows")
    if cached is None or cached[0] is not finished or cached[1] != finished._version:
        count = int(finished.sum())
        cached = state.extra["finished_rows"] = (finished, finished._version, (count > 0, count == finished.numel()))
    return cached[2]


def cache_length(width: int, max_new_tokens: int, cache_slots: int | None) -> int:
    """The static cache's slots per row: ``cache_slots`` when given (at least width + new tokens, else a ValueError
    naming both), else exactly width + new tokens."""
    needed = width + max_new_tokens
    if cache_slots is None:
        return needed
    if cache_slots < needed:
        raise ValueError(f"cache_slots={cache_slots} is too few: a batch of width {width} with {max_new_tokens} new "
                         f"tokens needs at least {needed} slots per row")
    return int(cache_slots)


def init_state(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = (), *,
               cache_slots: int | None = None) -> ARState:
    """Validate the batch, build the cache (dynamic only at B == 1) and the empty outputs.

    ``cache_slots``: the static cache's slots per row when the caller sizes it (whole blocks for a block kernel, or
    once at a maximum length to be reused); None sizes it at exactly the batch's width plus its new tokens. Every
    forward's key axis is the cache's length, so slots past the rollout's last token stay masked."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    real_pos = real_positions(batch)
    bsz, width = batch.batch_size, batch.width
    if tuple(batch.position_ids.shape) != (bsz, width):
        raise ValueError(f"position_ids must be [B, L] = {(bsz, width)}, got {tuple(batch.position_ids.shape)}")
    if tuple(batch.attention_mask.shape) != (bsz, 1, width, width):
        raise ValueError(f"attention_mask must be bool [B, 1, L, L] = {(bsz, 1, width, width)}, "
                         f"got {tuple(batch.attention_mask.shape)}")
    max_cache_len = cache_length(width, max_new_tokens, cache_slots)
    cache = backend.new_cache(bsz, max_cache_len, dynamic=ar_cache.cache_is_dynamic(bsz))
    device = batch.input_ids.device
    token_buffer = torch.full((bsz, max_cache_len), backend.pad_id, dtype=torch.long, device=device)
    token_buffer[:, :width] = batch.input_ids
    state = ARState(
        backend=backend, batch=batch, real_pos=real_pos.to(device), cache=cache, max_new_tokens=int(max_new_tokens),
        max_cache_len=max_cache_len, eos=tuple(int(e) for e in eos), input_ids=token_buffer[:, :width],
        token_buffer=token_buffer,
        tokens=torch.full((bsz, max_new_tokens), backend.pad_id, dtype=torch.long, device=device),
        logp=torch.zeros(bsz, max_new_tokens, device=device),
        logits=torch.zeros(bsz, max_new_tokens, backend.vocab_size, device=device),
        lengths=torch.zeros(bsz, dtype=torch.long, device=device),
        generated=torch.zeros(bsz, dtype=torch.long, device=device),
        finished=torch.zeros(bsz, dtype=torch.bool, device=device))
    backend.begin(state)
    return state


def step(state: ARState) -> None:
    """One forward: the prefill (step 0) or one decode step; samples one token per unfinished row. Runs without
    autograd (entered here only when the caller has not: ``fast_rollout`` enters it once for every step)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            _step(state)
    else:
        _step(state)


def _step(state: ARState) -> None:
    some_finished, every_finished = finished_rows(state)
    if every_finished or state.step_idx >= state.max_new_tokens:
        raise ValueError(f"rollout is done (step {state.step_idx} of {state.max_new_tokens}, "
                         f"finished rows {state.finished.tolist()})")
    backend = state.backend
    if state.step_idx == 0:
        mask = masks.prefill_mask(state.batch.attention_mask, backend.prefill_key_length(state))
        logits = backend.prefill(state, mask)
        rows = torch.arange(state.batch.batch_size, device=state.real_pos.device)
        row_logits = logits[rows, first_logits_column(state.real_pos, state.batch.width)]
    else:
        views = None if some_finished else StepViews.of(state)
        if views is None:  # some row finished: only the rows still generating write KV
            writes = should_write_kv(state.finished)
            generated = state.generated + writes  # bool promotes to long
            frozen = None if bool(writes.all()) else ~writes
        else:  # every row generates: every row writes this step's KV
            generated, frozen = views.counts[state.step_idx], None
        uniform = None if views is None else _uniform_masks(state, views)
        if uniform is None:
            mask = masks.decode_mask(backend.key_valid(state, generated, backend.decode_key_length(state)))
        else:
            mask = uniform[state.step_idx]
        kept = None if frozen is None else save_finished_rows(state, backend, frozen)
        logits = backend.decode(state, mask)
        if kept is not None:
            ar_cache.restore_slots(state.cache, frozen, *kept)
        state.generated = generated
        row_logits = logits.select(1, -1)
    _sample(state, row_logits)
    state.step_idx += 1


def stepwise(masks_over_steps: torch.Tensor, owner: Any, method: str, counts: torch.Tensor,
             keys: int) -> torch.Tensor:
    """``masks_over_steps``, what ``owner.method`` returned for several decode steps' counts at once (``counts
    [S, B]`` -> ``[S, B, keys]``), or a TypeError naming the method: the backend contract has the key masks
    broadcast over leading dimensions of the counts."""
    expected = (*counts.shape, keys)
    if tuple(masks_over_steps.shape) != expected:
        raise TypeError(f"{type(owner).__name__}.{method} must broadcast over the leading dimensions of generated: "
                        f"counts {tuple(counts.shape)} gave {tuple(masks_over_steps.shape)}, not {expected}")
    return masks_over_steps


def per_step(stacked: torch.Tensor | None, steps: int) -> list[torch.Tensor | None]:
    """Index k: decode step k's mask from the masks of steps ``1..steps`` stacked (index 0, the prefill, None);
    a mask seam that gave None gives None at every step."""
    return [None, *([None] * steps if stacked is None else stacked.unbind(0))]


def _uniform_masks(state: ARState, views: StepViews) -> list[torch.Tensor | None] | None:
    """Every decode step's mask while all rows generate (index k: step k, every row's count k), built at once at
    the first decode step; None over a dynamic cache, whose key axis grows with the steps."""
    built = state.extra.get("uniform_masks")
    if built is None:
        built = state.extra["uniform_masks"] = ()
        if not ar_cache.is_dynamic(state.cache):
            backend, counts = state.backend, views.count_table[1: state.max_new_tokens]
            keys = backend.decode_key_length(state)
            valid = stepwise(backend.key_valid(state, counts, keys), backend, "key_valid", counts, keys)
            built = state.extra["uniform_masks"] = per_step(masks.decode_mask(valid), counts.shape[0])
    return built or None


def save_finished_rows(state: ARState, backend: Any, frozen: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(this step's write slots, what the ``frozen`` rows hold there), read before the forward moves the positions
    on, for ``ar_cache.restore_slots`` after it: a finished row writes no KV. A dynamic cache cannot leave a row's
    slot unwritten, so a batch with finished rows needs a static one."""
    if ar_cache.is_dynamic(state.cache):
        raise ValueError(f"rows {frozen.nonzero().flatten().tolist()} finished in a batch of "
                         f"{state.batch.batch_size}, but a dynamic cache cannot leave a row's slot "
                         "unwritten; batched AR needs a static cache")
    slots = backend.decode_write_slots(state)
    return slots, ar_cache.snapshot_slots(state.cache, frozen, slots)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The recorded log-prob: full-softmax, T=1 log-prob of ``tokens [...]`` under ``logits [..., V]``.

    Stock and fast both record through this one function, so parity cannot see a bug in it; the fp64 oracle
    check (``ar.<model>.oracle.greedy_logp``) can."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


def _sample(state: ARState, row_logits: torch.Tensor) -> None:
    """Greedy pick of every unfinished row, written straight into ``state.tokens``: the argmax of the row logits
    as recorded in ``state.logits`` (fp32, which takes bf16 and fp16 exactly); finished rows emit the pad. The
    log-prob is recorded from ``state.logits`` in ``collect``."""
    k = state.step_idx
    some_finished, _ = finished_rows(state)
    views = StepViews.of(state)
    recorded, picks = (state.logits[:, k], state.tokens[:, k]) if views is None else \
        (views.logit_columns[k], views.token_columns[k])
    recorded.copy_(row_logits)
    emitted = torch.argmax(recorded, dim=-1, out=picks)
    emitting = None
    if some_finished:
        emitting = ~state.finished
        emitted.masked_fill_(state.finished, state.backend.pad_id)
        state.lengths = state.lengths.masked_fill(emitting, k + 1)
    else:
        state.lengths = torch.full_like(state.lengths, k + 1) if views is None else views.counts[k + 1]
    if state.eos:  # without stop ids no row can finish
        stops = state.extra.get("stops")
        if stops is None:
            stops = state.extra["stops"] = torch.tensor(state.eos, dtype=torch.long, device=emitted.device)
        stopped = torch.isin(emitted, stops)  # a finished row's pad is masked out by ``emitting``
        state.finished = state.finished | (stopped if emitting is None else emitting & stopped)
    state.input_ids = place_token(state.grown_input_ids(), emitted, state.backend.token_columns(state))


def recorded_logp(state: ARState) -> torch.Tensor:
    """Every emitted token's log-prob ``[B, N]`` (0 where a row emitted nothing), in one ``token_logprob`` call over
    all steps: the same per-row softmax the stock loop records through, without one small call per step."""
    logp = token_logprob(state.logits, state.tokens)
    if state.step_idx == state.max_new_tokens and not finished_rows(state)[0]:
        return logp  # every row emitted at every step
    unemitted = torch.arange(state.max_new_tokens, device=state.lengths.device) >= state.lengths[:, None]
    return logp.masked_fill(unemitted, 0.0)


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Rollout:
    """Per-row outputs in a layout-free form.

    ``kv[i]`` is row i's KV ``[layers, 2, H, T_i, hd]`` in logical order (prompt then generated tokens),
    whatever slots the layout used.
    """

    tokens: torch.Tensor  # [B, N]
    logp: torch.Tensor  # [B, N]
    logits: torch.Tensor  # [B, N, V]
    lengths: torch.Tensor  # [B]
    real_pos: torch.Tensor  # [B]
    kv: Sequence[torch.Tensor]  # a tuple, or a fast rollout's ``LogicalKV``

    def prefill_kv(self, row: int) -> torch.Tensor:
        return self.kv[row][..., : int(self.real_pos[row]), :]


class LogicalKV(Sequence[torch.Tensor]):
    """Each row's KV ``[layers, 2, H, T_i, hd]`` in logical order (fp32, on the CPU), gathered from a finished
    rollout's cache when first read: the checks read it, while a rollout's own outputs end with its tokens,
    log-probs and logits, so a rollout nobody inspects (a benchmark's) never pays for the gather. The cache is
    not written after the rollout, so reading late reads what it held at the end."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], slots: Callable[[], list[torch.Tensor]],
                 rows: int) -> None:
        self._buffers, self._slots, self._rows = buffers, slots, rows
        self._kv: tuple[torch.Tensor, ...] | None = None

    def _read(self) -> tuple[torch.Tensor, ...]:
        if self._kv is None:
            self._kv = tuple(row.float().cpu() for row in _rows_kv(self._buffers, self._slots()))
            self._buffers = []  # the cache is no longer needed
        return self._kv

    def __getitem__(self, row: Any) -> Any:
        return self._read()[row]

    def __len__(self) -> int:
        return self._rows

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._read())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (sent to another process, copied) as the plain tuple it reads as."""
        return tuple, (self._read(),)

    def __repr__(self) -> str:
        return f"LogicalKV({self._rows} rows{'' if self._kv is None else ', read'})"


def _rows_kv(buffers: list[tuple[torch.Tensor, torch.Tensor]], slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's KV at its ``slots`` -> ``[layers, 2, H, T_i, hd]``. Buffers of one shape and device are stacked
    and gathered once for every row (row i a view of the first ``T_i`` gathered slots); else row by row."""
    tensors = [t for pair in buffers for t in pair]
    if len({(tuple(t.shape), t.device) for t in tensors}) != 1:
        return [torch.stack([torch.stack([k[i][:, index.to(k.device)], v[i][:, index.to(v.device)]])
                             for k, v in buffers]) for i, index in enumerate(slots)]
    stacked = torch.stack([torch.stack(pair) for pair in buffers])  # [layers, 2, B, H, slots, hd]
    layers, _, rows, heads, _, head_dim = stacked.shape
    index = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True).to(stacked.device)  # [B, T_max], 0-padded
    index = index[None, None, :, None, :, None].expand(layers, 2, rows, heads, index.shape[1], head_dim)
    gathered = stacked.gather(4, index)
    return [gathered[:, :, i, :, : len(row)] for i, row in enumerate(slots)]


def collect(state: ARState) -> Rollout:
    """Read a (finished) state into a CPU ``Rollout``, mapping the layout's slots back to logical order; records
    the log-probs (``recorded_logp``) into ``state.logp`` first."""
    state.logp = recorded_logp(state)
    backend, width, real_pos, generated = state.backend, state.batch.width, state.real_pos, state.generated

    def slots() -> list[torch.Tensor]:
        return [backend.logical_slots(row_pos, width, row_generated)
                for row_pos, row_generated in zip(real_pos.tolist(), generated.tolist(), strict=True)]

    kv = LogicalKV(ar_cache.layer_buffers(state.cache), slots, state.batch.batch_size)
    return Rollout(state.tokens.cpu(), state.logp.cpu(), state.logits.cpu(), state.lengths.cpu(),
                   state.real_pos.cpu(), kv)


def fast_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = (), *,
                 cache_slots: int | None = None) -> Rollout:
    """Decode the whole right-padded batch at once over one cache (of ``cache_slots`` slots per row when the caller
    sizes it: ``init_state``): at most ``max_new_tokens`` steps, so a step that fails to advance the state stops the
    rollout instead of spinning."""
    state = init_state(backend, batch, max_new_tokens, eos, cache_slots=cache_slots)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if state.done:
                break
            step(state)
    if not state.done:
        raise RuntimeError(f"the rollout is not done after {max_new_tokens} steps (step {state.step_idx}): a step "
                           "did not advance it")
    return collect(state)


@torch.no_grad()
def stock_rollout(backend: Any, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  eos: Sequence[int] = ()) -> Rollout:
    """Decode each unpadded prompt alone at B=1 with the backend's stock generation; stack the rows."""
    if not prompts:
        raise ValueError("stock_rollout needs at least one prompt")
    eos = tuple(int(e) for e in eos)
    bsz = len(prompts)
    tokens = torch.full((bsz, max_new_tokens), backend.pad_id, dtype=torch.long)
    logp = torch.zeros(bsz, max_new_tokens)
    logits = torch.zeros(bsz, max_new_tokens, backend.vocab_size)
    lengths = torch.zeros(bsz, dtype=torch.long)
    kv = []
    for i, prompt in enumerate(prompts):
        run = backend.stock_generate(prompt, max_new_tokens, eos)
        n = int(run.tokens.numel())
        tokens[i, :n] = run.tokens  # the copies land on the host, logits in fp32 (the buffers' dtype)
        logits[i, :n] = run.logits
        logp[i, :n] = token_logprob(logits[i, :n], tokens[i, :n])
        lengths[i] = n
        kv.append(run.kv.float().cpu())
    real_pos = torch.tensor([int(p.numel()) for p in prompts], dtype=torch.long)
    return Rollout(tokens, logp, logits, lengths, real_pos, tuple(kv))

"""The batched right-padded AR loop over a static KV cache, and the stock B=1 loop beside it.

``fast_rollout`` decodes B prompts in one batch; ``stock_rollout`` decodes each prompt alone at B=1 with the
backend's stock generation. Both return a ``Rollout`` so a check reads ``compare(fast(x), stock(x))``.

Seams (module-level, replaced from outside by the ablations): ``real_positions``, ``place_token``,
``first_logits_column``, ``should_write_kv``; plus ``harness.ar.cache.cache_is_dynamic``,
``harness.ar.masks.decode_mask`` and ``harness.ar.batch.pad_positions``. Sampling is greedy (top_k = 1); the
recorded log-prob is the fp32 full-softmax T=1 log-prob of the sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.ar import cache as ar_cache
from harness.ar import masks
from harness.ar.batch import ARBatch

__all__ = [
    "ARState",
    "Rollout",
    "collect",
    "fast_rollout",
    "first_logits_column",
    "init_state",
    "place_token",
    "real_positions",
    "should_write_kv",
    "step",
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
    if bool((real_pos < 1).any()) or bool((real_pos > batch.width).any()):
        raise ValueError(f"real_pos must lie in [1, {batch.width}] (1 <= unpadded length <= width), "
                         f"got {real_pos.tolist()}")
    return real_pos


def place_token(input_ids: torch.Tensor, tokens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Grow the token buffer by one column and scatter row i's token to ``columns[i]``.

    Upstream re-reads the next input with ``input_ids.gather(1, position_ids)``; appending at the tail would
    feed every shorter row its own pad token.
    """
    grown = torch.cat([input_ids, torch.zeros_like(input_ids[:, :1])], dim=1)
    return grown.scatter(1, columns[:, None], tokens[:, None])


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
    input_ids: torch.Tensor  # token buffer, column == cache slot of that token's KV
    tokens: torch.Tensor  # [B, N] long, pad after a row finished
    logp: torch.Tensor  # [B, N] float32, 0 after a row finished
    logits: torch.Tensor  # [B, N, V] float32, the row logits each token was sampled from
    lengths: torch.Tensor  # [B] tokens emitted so far (EOS included)
    generated: torch.Tensor  # [B] generated tokens whose KV the row holds
    finished: torch.Tensor  # [B] bool
    step_idx: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.step_idx >= self.max_new_tokens or bool(self.finished.all())


def init_state(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = ()) -> ARState:
    """Validate the batch, build the cache (dynamic only at B == 1) and the empty outputs."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    real_pos = real_positions(batch)
    bsz, width = batch.batch_size, batch.width
    if tuple(batch.position_ids.shape) != (bsz, width):
        raise ValueError(f"position_ids must be [B, L] = {(bsz, width)}, got {tuple(batch.position_ids.shape)}")
    if tuple(batch.attention_mask.shape) != (bsz, 1, width, width):
        raise ValueError(f"attention_mask must be bool [B, 1, L, L] = {(bsz, 1, width, width)}, "
                         f"got {tuple(batch.attention_mask.shape)}")
    max_cache_len = width + max_new_tokens
    cache = backend.new_cache(bsz, max_cache_len, dynamic=ar_cache.cache_is_dynamic(bsz))
    device = batch.input_ids.device
    state = ARState(
        backend=backend, batch=batch, real_pos=real_pos.to(device), cache=cache, max_new_tokens=int(max_new_tokens),
        max_cache_len=max_cache_len, eos=tuple(int(e) for e in eos), input_ids=batch.input_ids.clone(),
        tokens=torch.full((bsz, max_new_tokens), backend.pad_id, dtype=torch.long, device=device),
        logp=torch.zeros(bsz, max_new_tokens, device=device),
        logits=torch.zeros(bsz, max_new_tokens, backend.vocab_size, device=device),
        lengths=torch.zeros(bsz, dtype=torch.long, device=device),
        generated=torch.zeros(bsz, dtype=torch.long, device=device),
        finished=torch.zeros(bsz, dtype=torch.bool, device=device))
    backend.begin(state)
    return state


@torch.no_grad()
def step(state: ARState) -> None:
    """One forward: the prefill (step 0) or one decode step; samples one token per unfinished row."""
    if state.done:
        raise ValueError(f"rollout is done (step {state.step_idx} of {state.max_new_tokens}, "
                         f"finished rows {state.finished.tolist()})")
    backend, bsz = state.backend, state.batch.batch_size
    rows = torch.arange(bsz, device=state.real_pos.device)
    if state.step_idx == 0:
        mask = masks.prefill_mask(state.batch.attention_mask, backend.prefill_key_length(state))
        logits = backend.prefill(state, mask)
        row_logits = logits[rows, first_logits_column(state.real_pos, state.batch.width)]
    else:
        writes = should_write_kv(state.finished)
        generated = state.generated + writes.long()
        key_valid = backend.key_valid(state, generated, backend.decode_key_length(state))
        slots = backend.decode_write_slots(state)
        frozen = ~writes
        if bool(frozen.any()) and ar_cache.is_dynamic(state.cache):
            raise ValueError(f"rows {frozen.nonzero().flatten().tolist()} finished in a batch of {bsz}, but a dynamic "
                             "cache cannot leave a row's slot unwritten; batched AR needs a static cache")
        saved = ar_cache.snapshot_slots(state.cache, frozen, slots) if bool(frozen.any()) else None
        logits = backend.decode(state, masks.decode_mask(key_valid))
        if saved is not None:
            ar_cache.restore_slots(state.cache, frozen, slots, saved)
        state.generated = generated
        row_logits = logits[:, -1]
    _sample(state, row_logits.float())
    state.step_idx += 1


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The recorded log-prob: full-softmax, T=1 log-prob of ``tokens [...]`` under ``logits [..., V]``.

    Stock and fast both record through this one function, so parity cannot see a bug in it; the fp64 oracle
    check (``ar.<model>.oracle.greedy_logp``) can."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


def _sample(state: ARState, row_logits: torch.Tensor) -> None:
    k = state.step_idx
    emitting = ~state.finished
    token = row_logits.argmax(dim=-1)
    token_logp = token_logprob(row_logits, token)
    emitted = torch.where(emitting, token, state.backend.pad_id)
    state.tokens[:, k] = emitted
    state.logp[:, k] = torch.where(emitting, token_logp, 0.0)
    state.logits[:, k] = row_logits
    state.lengths = torch.where(emitting, k + 1, state.lengths)
    stops = torch.tensor(state.eos, dtype=torch.long, device=token.device)
    state.finished = state.finished | (emitting & torch.isin(token, stops))
    state.input_ids = place_token(state.input_ids, emitted, state.backend.token_columns(state))


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
    kv: tuple[torch.Tensor, ...]

    def prefill_kv(self, row: int) -> torch.Tensor:
        return self.kv[row][..., : int(self.real_pos[row]), :]


def collect(state: ARState) -> Rollout:
    """Read a (finished) state into a CPU ``Rollout``, mapping the layout's slots back to logical order."""
    kv = []
    for i in range(state.batch.batch_size):
        slots = state.backend.logical_slots(int(state.real_pos[i]), state.batch.width, int(state.generated[i]))
        kv.append(torch.stack([torch.stack([k[i][:, slots.to(k.device)], v[i][:, slots.to(v.device)]])
                               for k, v in ar_cache.layer_buffers(state.cache)]).float().cpu())
    return Rollout(state.tokens.cpu(), state.logp.cpu(), state.logits.cpu(), state.lengths.cpu(),
                   state.real_pos.cpu(), tuple(kv))


def fast_rollout(backend: Any, batch: ARBatch, max_new_tokens: int, eos: Sequence[int] = ()) -> Rollout:
    """Decode the whole right-padded batch at once over one cache: at most ``max_new_tokens`` steps, so a step that
    fails to advance the state stops the rollout instead of spinning."""
    state = init_state(backend, batch, max_new_tokens, eos)
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
